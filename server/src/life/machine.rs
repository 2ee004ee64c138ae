//! What the machine offers kvd — memory (or the cgroup's limit), CPUs, the open-file limit, NUMA
//! nodes, the environment — read once at start and injected in tests, so that every default
//! that depends on the machine is tested on machines the tests make up.

use std::path::{Path, PathBuf};

use crate::l1::numa::Topology;
use crate::ops::cgroup::memory_limit;
use crate::tiers::l2::secret::{Secret, PASSWORD_ENV};

/// What the machine offers; read once at start, injected in tests.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Physical memory, or the cgroup limit if lower.
    pub memory_bytes: u64,
    /// The cgroup limit's file, when `memory_bytes` came from one.
    pub cgroup_limit: Option<PathBuf>,
    /// `KVD_L2_PASSWORD`, if set.
    pub l2_password_env: Option<Secret>,
    /// `TOTAL_CPU_DRAM_GB`, if set.
    pub total_cpu_dram_gb: Option<String>,
    /// CPUs available.
    pub cpus: usize,
    /// `XDG_RUNTIME_DIR`, if set.
    pub runtime_dir: Option<PathBuf>,
    /// The open-file limit kvd runs under (it raises its soft limit to the hard one first).
    pub open_files: usize,
    /// kvd's effective user id.
    pub euid: u32,
    /// NUMA nodes and their CPUs, from sysfs.
    pub topology: Topology,
}

impl Machine {
    /// Reads /proc/meminfo, the cgroup limit and the environment.
    pub fn probe() -> Machine {
        let physical = read_meminfo_total().unwrap_or(0);
        let (memory_bytes, cgroup_limit) = match memory_limit(Path::new("/")) {
            Some(limit) if limit.bytes < physical || physical == 0 => {
                (limit.bytes, Some(limit.file))
            }
            _ => (physical, None),
        };
        Machine {
            memory_bytes,
            cgroup_limit,
            l2_password_env: std::env::var(PASSWORD_ENV)
                .ok()
                .filter(|p| !p.is_empty())
                .map(Secret::new),
            total_cpu_dram_gb: std::env::var("TOTAL_CPU_DRAM_GB").ok(),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            runtime_dir: std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from),
            open_files: rustix::process::getrlimit(rustix::process::Resource::Nofile)
                .current
                .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX)),
            euid: rustix::process::geteuid().as_raw(),
            topology: Topology::read(std::path::Path::new("/sys")),
        }
    }
}

fn read_meminfo_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
