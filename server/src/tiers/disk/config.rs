//! `kvd serve`'s disk-tier flags, their defaults, and the checks that turn bad values into one
//! line naming the flag and the fix.

use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::config::{check_flag, ConfigError};

/// Flags of the disk tier.
#[derive(Debug, Clone, Default, Args)]
pub struct DiskArgs {
    /// Local disk tier below L1: files (or raw block devices) on one or more drives,
    /// comma-separated; chunks are striped over them. A directory means a file `kvd.disk` in
    /// it. Chunks evicted from L1 are written here and read back on an L1 miss. Off when not
    /// given.
    #[arg(long, value_name = "PATH[,PATH...]")]
    pub disk: Option<String>,
    /// Size of the disk tier in GiB, split evenly over the --disk paths. Default: the size of
    /// existing files or devices (required for files that do not exist yet).
    // Negative numbers reach resolve(), whose error names the valid range, rather than clap's
    // "unexpected argument '-1'".
    #[arg(long, value_name = "GIB", allow_negative_numbers = true)]
    pub disk_size_gb: Option<f64>,
    /// Paths (of --disk or --disk-index) whose existing data kvd may destroy: a file or device
    /// that holds data kvd did not write (a filesystem, a partition table, anything without
    /// kvd's label) is refused unless named here, comma-separated.
    #[arg(long, value_name = "PATH[,PATH...]")]
    pub disk_overwrite: Option<String>,
    /// Where the disk tier's index is kept across restarts. Default: the first --disk file
    /// with `.index` appended.
    #[arg(long, value_name = "FILE")]
    pub disk_index: Option<PathBuf>,
    /// I/Os in flight per drive.
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub disk_queue_depth: usize,
    /// Size of one I/O in KiB: a chunk is read and written in pieces of this size, all in
    /// flight together.
    #[arg(long, default_value_t = 1024, value_name = "KIB")]
    pub disk_io_kb: u64,
    /// How long a retrieve waits for the disk reads its lookup started (the lookup answers at
    /// once); chunks not read by then are answered missing.
    #[arg(long, default_value_t = 250, value_name = "MS")]
    pub disk_deadline_ms: u64,
    /// Pool bytes kept for the pages of evicted chunks being written to disk (free, or being
    /// written), in MiB; L1 holds chunks in the rest (at most an eighth of the pool is kept). A
    /// victim met while the writes hold all of it is evicted unwritten, counted. Default: paced
    /// to the drive, from what keeps every drive's queue full twice over (2 × --disk-queue-depth
    /// × --disk-io-kb per drive) up to a 64th of the pool (--disk-write-reserve-max-mb): it
    /// grows to hold a burst of evictions the drive then caught up with and shrinks while the
    /// drive stays behind (kvd_l1_disk_reserve_bytes). Given, it is that size always.
    #[arg(long, value_name = "MIB")]
    pub disk_write_queue_mb: Option<u64>,
    /// The most the paced write reserve grows to, in MiB (default: a 64th of the pool; never
    /// under the paced reserve's floor nor over an eighth of the pool).
    /// Every byte of it is a byte L1 does not cache in: a smaller one holds more hits in L1
    /// and drops more of a burst's victims unwritten. Ignored with --disk-write-queue-mb.
    #[arg(long, value_name = "MIB")]
    pub disk_write_reserve_max_mb: Option<u64>,
    /// Most bytes one lookup reads from disk.
    #[arg(long, default_value_t = 4096, value_name = "MIB")]
    pub disk_fetch_max_mb: u64,
    /// O_DIRECT (no page cache): auto uses it where the filesystem allows and says so in the
    /// log where it does not; on refuses to start without it; off uses the page cache.
    #[arg(long, default_value = "auto", value_name = "auto|on|off")]
    pub disk_direct: String,
    /// Test hook: every disk read batch first sleeps this long (a slow drive).
    #[arg(long, default_value_t = 0, hide = true)]
    pub disk_inject_delay_ms: u64,
    /// Test hook: the write thread sleeps this long before it starts on chunks handed to it
    /// (a drive behind).
    #[arg(long, default_value_t = 0, hide = true)]
    pub disk_inject_write_delay_ms: u64,
}

/// Whether to bypass the page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectMode {
    /// O_DIRECT where the filesystem allows it.
    Auto,
    /// O_DIRECT or fail.
    On,
    /// Through the page cache.
    Off,
}

/// Validated disk-tier settings.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskConfig {
    /// The paths as given.
    pub paths: Vec<PathBuf>,
    /// Bytes per path, when given.
    pub bytes_per_path: Option<u64>,
    /// The index file.
    pub index: PathBuf,
    /// Paths whose data kvd may overwrite (`--disk-overwrite`).
    pub overwrite: Vec<PathBuf>,
    /// I/Os in flight per drive.
    pub queue_depth: usize,
    /// Bytes per I/O.
    pub io_bytes: usize,
    /// How long a retrieve waits for its fills (and what one lookup may read: the drives'
    /// reads in this time).
    pub deadline: Duration,
    /// Pool bytes kept for the pages being written (free or being written): the least when
    /// paced, and what the write thread holds in flight at most.
    pub write_queue_bytes: u64,
    /// Whether the reserve is paced to the drive (no `--disk-write-queue-mb`).
    pub paced: bool,
    /// The most the paced reserve grows to (`--disk-write-reserve-max-mb`); `None`: a 64th
    /// of the pool.
    pub reserve_max_bytes: Option<u64>,
    /// Most bytes one lookup reads.
    pub fetch_max_bytes: u64,
    /// O_DIRECT mode.
    pub direct: DirectMode,
    /// Test hook: delay before every read batch.
    pub inject_delay: Duration,
    /// Test hook: delay before the write thread starts on chunks handed to it.
    pub inject_write_delay: Duration,
}

impl DiskArgs {
    /// Checks the flags; `None` when no disk tier is configured.
    pub fn resolve(&self) -> Result<Option<DiskConfig>, ConfigError> {
        // Checked with or without --disk: a bad value is a mistake either way.
        if let Some(g) = self.disk_size_gb.filter(|g| !(g.is_finite() && *g > 0.0)) {
            return Err(ConfigError(format!(
                "--disk-size-gb {g}: the disk tier's size must be more than 0 GiB (at least \
                 0.001 per --disk path), e.g. --disk-size-gb 512"
            )));
        }
        let Some(list) = &self.disk else {
            return Ok(None);
        };
        let paths: Vec<PathBuf> = list
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .collect();
        if paths.is_empty() {
            return Err(ConfigError(format!(
                "--disk {list:?}: no path; use --disk /mnt/nvme0/kvd,/mnt/nvme1/kvd"
            )));
        }
        for (i, p) in paths.iter().enumerate() {
            // Under /dev a name that is not there is a device mistyped or not attached: kvd
            // would make it a file in the kernel's device filesystem, in memory. /dev/shm is an
            // ordinary tmpfs, where files are files.
            if p.starts_with("/dev/") && !p.starts_with("/dev/shm/") && !p.exists() {
                return Err(ConfigError(format!(
                    "--disk {}: no such device; name a block device that exists (lsblk lists \
                     them) or a file on a filesystem",
                    p.display()
                )));
            }
            if paths[..i].contains(p) {
                return Err(ConfigError(format!(
                    "--disk {list}: {} is given twice; name each file once",
                    p.display()
                )));
            }
        }
        let bytes_per_path = match self.disk_size_gb {
            None => None,
            Some(g) => {
                let per = (g * (1u64 << 30) as f64 / paths.len() as f64) as u64;
                let per = per / kvd_uring::ALIGN as u64 * kvd_uring::ALIGN as u64;
                if per < 1 << 20 {
                    return Err(ConfigError(format!(
                        "--disk-size-gb {g}: under 1 MiB per drive; give at least 0.001 GiB per --disk path"
                    )));
                }
                Some(per)
            }
        };
        check_flag(
            "--disk-queue-depth",
            self.disk_queue_depth,
            1..=1024,
            "use 1 to 1024, e.g. 32 (NVMe drives want 16 or more)",
        )?;
        if self.disk_io_kb < 4 || !self.disk_io_kb.is_multiple_of(4) || self.disk_io_kb > 65536 {
            return Err(ConfigError(format!(
                "--disk-io-kb {}: use a multiple of 4 from 4 to 65536, e.g. 1024",
                self.disk_io_kb
            )));
        }
        check_flag(
            "--disk-deadline-ms",
            self.disk_deadline_ms,
            1..=60_000,
            "use 1 to 60000, e.g. 250",
        )?;
        if let Some(mb) = self.disk_write_queue_mb {
            check_flag(
                "--disk-write-queue-mb",
                mb,
                1..,
                "L1 needs room to write its victims to disk; use e.g. 64, or leave it out",
            )?;
        }
        if let Some(mb) = self.disk_write_reserve_max_mb {
            check_flag(
                "--disk-write-reserve-max-mb",
                mb,
                1..,
                "the paced reserve needs room to grow; use e.g. 256, or leave it out",
            )?;
        }
        check_flag(
            "--disk-fetch-max-mb",
            self.disk_fetch_max_mb,
            1..,
            "a lookup could read nothing; use e.g. 4096",
        )?;
        let direct = match self.disk_direct.as_str() {
            "auto" => DirectMode::Auto,
            "on" => DirectMode::On,
            "off" => DirectMode::Off,
            other => {
                return Err(ConfigError(format!(
                    "--disk-direct {other}: use auto, on or off"
                )))
            }
        };
        let index = match &self.disk_index {
            Some(p) => p.clone(),
            None => {
                let first = &paths[0];
                let base = if first.is_dir() {
                    first.join("kvd.disk")
                } else {
                    first.clone()
                };
                let block_device =
                    std::fs::metadata(&base).is_ok_and(|m| m.file_type().is_block_device());
                if block_device {
                    return Err(ConfigError(format!(
                        "--disk {}: a block device has no room for the index; give --disk-index FILE on a filesystem",
                        first.display()
                    )));
                }
                let mut s = base.into_os_string();
                s.push(".index");
                PathBuf::from(s)
            }
        };
        let overwrite = self
            .disk_overwrite
            .iter()
            .flat_map(|list| list.split(','))
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .collect();
        let write_queue_bytes = self.disk_write_queue_mb.map_or(
            2 * self.disk_queue_depth as u64 * (self.disk_io_kb << 10) * paths.len() as u64,
            |mb| mb << 20,
        );
        Ok(Some(DiskConfig {
            paths,
            bytes_per_path,
            index,
            overwrite,
            queue_depth: self.disk_queue_depth,
            io_bytes: (self.disk_io_kb << 10) as usize,
            deadline: Duration::from_millis(self.disk_deadline_ms),
            write_queue_bytes,
            paced: self.disk_write_queue_mb.is_none(),
            reserve_max_bytes: self.disk_write_reserve_max_mb.map(|mb| mb << 20),
            fetch_max_bytes: self.disk_fetch_max_mb << 20,
            direct,
            inject_delay: Duration::from_millis(self.disk_inject_delay_ms),
            inject_write_delay: Duration::from_millis(self.disk_inject_write_delay_ms),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(disk: &str) -> DiskArgs {
        DiskArgs {
            disk: Some(disk.into()),
            disk_size_gb: Some(1.0),
            disk_queue_depth: 32,
            disk_io_kb: 1024,
            disk_deadline_ms: 250,
            disk_write_queue_mb: None,
            disk_fetch_max_mb: 4096,
            disk_direct: "auto".into(),
            ..DiskArgs::default()
        }
    }

    #[test]
    fn a_file_under_dev_shm_is_a_file_and_a_block_device_needs_an_index() {
        // /dev/shm is a tmpfs: a file there keeps its index beside it, as on any filesystem.
        let c = args("/dev/shm/kvd-test.disk").resolve().unwrap().unwrap();
        assert_eq!(c.index, PathBuf::from("/dev/shm/kvd-test.disk.index"));
        let block = std::fs::read_dir("/dev").ok().and_then(|d| {
            d.flatten()
                .find(|e| e.file_type().is_ok_and(|t| t.is_block_device()))
        });
        match block {
            Some(dev) => {
                let err = args(&dev.path().display().to_string())
                    .resolve()
                    .unwrap_err()
                    .0;
                assert!(err.contains("give --disk-index FILE"), "{err}");
            }
            None => eprintln!("no block device in /dev here: its case did not run"),
        }
    }

    #[test]
    fn paths_split_the_size_and_name_the_index() {
        assert_eq!(DiskArgs::default().resolve().unwrap(), None);
        let c = args("/tmp/a.bin, /tmp/b.bin").resolve().unwrap().unwrap();
        assert_eq!(c.paths.len(), 2);
        assert_eq!(c.bytes_per_path, Some(1 << 29));
        assert_eq!(c.index, PathBuf::from("/tmp/a.bin.index"));
        assert_eq!(c.io_bytes, 1 << 20);
        // Left out, the writes' reserve is paced, from what keeps both drives' queues full
        // twice over; given, it is fixed.
        assert_eq!(c.write_queue_bytes, 2 * 32 * (1 << 20) * 2);
        assert!(c.paced);
        let mut given = args("/tmp/a.bin");
        given.disk_write_queue_mb = Some(8);
        let given = given.resolve().unwrap().unwrap();
        assert_eq!((given.write_queue_bytes, given.paced), (8 << 20, false));
        assert_eq!(c.reserve_max_bytes, None);
        let mut capped = args("/tmp/a.bin");
        capped.disk_write_reserve_max_mb = Some(128);
        let capped = capped.resolve().unwrap().unwrap();
        assert_eq!(
            (capped.reserve_max_bytes, capped.paced),
            (Some(128 << 20), true)
        );
    }

    #[test]
    fn bad_values_name_the_flag_and_the_fix() {
        for (a, want) in [
            (args("/tmp/a,/tmp/a"), "is given twice"),
            (args(","), "no path"),
            (
                DiskArgs {
                    disk_size_gb: Some(0.0),
                    ..args("/tmp/a")
                },
                "--disk-size-gb 0",
            ),
            (
                DiskArgs {
                    disk_size_gb: Some(-1.0),
                    ..DiskArgs::default()
                },
                "--disk-size-gb -1: the disk tier's size must be more than 0 GiB",
            ),
            (
                DiskArgs {
                    disk_io_kb: 6,
                    ..args("/tmp/a")
                },
                "--disk-io-kb 6",
            ),
            (
                DiskArgs {
                    disk_queue_depth: 0,
                    ..args("/tmp/a")
                },
                "--disk-queue-depth 0",
            ),
            (
                DiskArgs {
                    disk_direct: "yes".into(),
                    ..args("/tmp/a")
                },
                "--disk-direct yes",
            ),
            (
                DiskArgs {
                    disk_write_reserve_max_mb: Some(0),
                    ..args("/tmp/a")
                },
                "--disk-write-reserve-max-mb 0",
            ),
            (args("/dev/nvme9n1"), "/dev/nvme9n1: no such device"),
            (
                DiskArgs {
                    disk_index: Some("/var/lib/kvd/index".into()),
                    ..args("/dev/nvme9n1")
                },
                "/dev/nvme9n1: no such device",
            ),
        ] {
            let err = a.resolve().unwrap_err().0;
            assert!(err.contains(want), "{err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }
}
