//! The L1 pool's size: `--l1-size-gb`, else 75% of `TOTAL_CPU_DRAM_GB`, else 75% of the memory
//! kvd may use (physical memory, or the cgroup limit it runs under when lower), in whole slabs
//! of `--slab-mb` (smaller for small pools).

use std::path::PathBuf;

use kvd_gpu::PoolLayout;

use super::flags::ServeArgs;
use super::machine::Machine;
use crate::config::{check_flag, ConfigError};

const GIB: f64 = (1u64 << 30) as f64;
const MIB: u64 = 1 << 20;

/// How the pool size was chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum SizeRule {
    /// `--l1-size-gb`.
    Flag,
    /// 75% of `TOTAL_CPU_DRAM_GB`.
    TotalCpuDramGb(f64),
    /// 75% of physical memory.
    Physical(u64),
    /// 75% of the cgroup memory limit in the file named, below physical memory.
    Cgroup(u64, PathBuf),
}

impl std::fmt::Display for SizeRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SizeRule::Flag => write!(f, "--l1-size-gb"),
            SizeRule::TotalCpuDramGb(gb) => write!(f, "75% of TOTAL_CPU_DRAM_GB={gb}"),
            SizeRule::Physical(b) => write!(f, "75% of {:.1} GiB of memory", *b as f64 / GIB),
            SizeRule::Cgroup(b, file) => write!(
                f,
                "75% of the cgroup memory limit of {:.1} GiB in {}",
                *b as f64 / GIB,
                file.display()
            ),
        }
    }
}

/// The pool's size and slabs from `--l1-size-gb` (or `TOTAL_CPU_DRAM_GB`, or the machine's
/// memory) and `--slab-mb`, and the rule that chose the size.
pub fn pool_layout(
    a: &ServeArgs,
    machine: &Machine,
) -> Result<(PoolLayout, SizeRule), ConfigError> {
    let memory_what = if machine.cgroup_limit.is_some() {
        format!("the cgroup memory limit of {}", gib(machine.memory_bytes))
    } else {
        format!("this machine's {} of memory", gib(machine.memory_bytes))
    };
    let (pool_bytes, size_rule) = match (a.l1_size_gb, &machine.total_cpu_dram_gb) {
        (Some(gb), _) => {
            if !gb.is_finite() || gb <= 0.0 {
                return Err(ConfigError(format!(
                        "--l1-size-gb {gb}: the pool size must be a positive number of GiB, e.g. --l1-size-gb 64"
                    )));
            }
            let bytes = (gb * GIB) as u64;
            if machine.memory_bytes > 0 && bytes > machine.memory_bytes {
                return Err(ConfigError(format!(
                    "--l1-size-gb {gb}: above {memory_what}; pass at most {:.1}",
                    machine.memory_bytes as f64 / GIB
                )));
            }
            (bytes, SizeRule::Flag)
        }
        (None, Some(total)) => {
            let gb: f64 = total.trim().parse().ok().filter(|g: &f64| g.is_finite() && *g > 0.0).ok_or_else(|| {
                    ConfigError(format!(
                        "TOTAL_CPU_DRAM_GB={total:?} is not a positive number of GiB; fix or unset it, or pass --l1-size-gb"
                    ))
                })?;
            let bytes = (gb * 0.75 * GIB) as u64;
            if machine.memory_bytes > 0 && bytes > machine.memory_bytes {
                return Err(ConfigError(format!(
                        "TOTAL_CPU_DRAM_GB={total}: 75% of it is above {memory_what}; fix the variable or pass --l1-size-gb"
                    )));
            }
            (bytes, SizeRule::TotalCpuDramGb(gb))
        }
        (None, None) => {
            if machine.memory_bytes == 0 {
                return Err(ConfigError(
                    "cannot read this machine's memory size from /proc/meminfo; pass --l1-size-gb"
                        .into(),
                ));
            }
            (
                machine.memory_bytes / 4 * 3,
                match &machine.cgroup_limit {
                    Some(file) => SizeRule::Cgroup(machine.memory_bytes, file.clone()),
                    None => SizeRule::Physical(machine.memory_bytes),
                },
            )
        }
    };

    check_flag(
        "--slab-mb",
        a.slab_mb,
        2..,
        "slabs must be at least 2 MiB, e.g. --slab-mb 256",
    )?;
    // Small pools get smaller slabs, so that a test pool of a few hundred MiB still holds
    // several page sizes; never below 2 MiB, the huge page size.
    let wanted = a.slab_mb * MIB;
    let auto = (pool_bytes / 16) / (2 * MIB) * (2 * MIB);
    let slab_bytes = wanted.min(auto.max(2 * MIB));
    if pool_bytes < slab_bytes {
        return Err(ConfigError(format!(
                "pool of {pool_bytes} bytes is smaller than one {slab_bytes}-byte slab; pass a larger --l1-size-gb (at least 0.002)"
            )));
    }
    // The tail that does not fill a slab is never mapped.
    let layout = PoolLayout::new(pool_bytes, slab_bytes)
        .map_err(|e| ConfigError(format!("--l1-size-gb/--slab-mb: {e}")))?;
    Ok((layout, size_rule))
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB)
}
