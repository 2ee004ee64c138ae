//! Opening the drives: one large file per `--disk` path (made and preallocated on first use)
//! or a raw block device, with `O_DIRECT` where the filesystem takes it. tmpfs and some
//! network filesystems refuse `O_DIRECT`; with `--disk-direct auto` kvd then says so in the log
//! and goes through the page cache on that path, so the tier works (at page-cache speed)
//! everywhere and bypasses the cache where it can.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::config::DirectMode;

/// A drive of the tier.
#[derive(Debug)]
pub struct Drive {
    /// The file or device.
    pub path: PathBuf,
    /// Open for reading and writing.
    pub file: File,
    /// Bytes kvd uses of it (a multiple of [`kvd_uring::ALIGN`]).
    pub capacity: u64,
    /// Whether the page cache is bypassed.
    pub direct: bool,
    /// Why it cannot be used from the start (its filesystem is full), if so.
    pub unusable: Option<String>,
}

/// Why the tier could not open a drive; each is one line naming the flag and the fix.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DriveError(pub String);

fn open_with(path: &Path, direct: bool, create: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(create);
    if direct {
        o.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
    }
    o.open(path)
}

/// Opens `path` (a directory means `path/kvd.disk`) with `bytes` of room, or its own size.
pub fn open(path: &Path, bytes: Option<u64>, mode: DirectMode) -> Result<Drive, DriveError> {
    let path = if path.is_dir() {
        path.join("kvd.disk")
    } else {
        path.to_path_buf()
    };
    let shown = path.display();
    let meta = std::fs::metadata(&path).ok();
    let block_device = meta
        .as_ref()
        .is_some_and(|m| m.file_type().is_block_device());
    if let Some(m) = &meta {
        if !m.is_file() && !block_device {
            return Err(DriveError(format!(
                "--disk {shown}: not a file, directory or block device; name a file on the drive"
            )));
        }
    }
    if meta.is_none() && bytes.is_none() {
        return Err(DriveError(format!(
            "--disk {shown} does not exist yet: give --disk-size-gb so kvd can make it"
        )));
    }
    let want_direct = mode != DirectMode::Off;
    let (file, direct) = match open_with(&path, want_direct, !block_device) {
        Ok(f) => (f, want_direct),
        Err(e)
            if want_direct && e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) =>
        {
            if mode == DirectMode::On {
                return Err(DriveError(format!(
                    "--disk {shown}: the filesystem refuses O_DIRECT; put the file on a local \
                     filesystem (ext4, xfs) or use --disk-direct auto"
                )));
            }
            tracing::warn!(
                "--disk {shown}: the filesystem refuses O_DIRECT (tmpfs?); using the page cache \
                 for this drive"
            );
            let f = open_with(&path, false, true).map_err(|e| open_error(&path, &e))?;
            (f, false)
        }
        Err(e) => return Err(open_error(&path, &e)),
    };
    let mut file = file;
    let have = file
        .seek(SeekFrom::End(0))
        .map_err(|e| open_error(&path, &e))?;
    let align = kvd_uring::ALIGN as u64;
    let mut unusable = None;
    let capacity = match bytes {
        _ if block_device => bytes.unwrap_or(have).min(have),
        None => have,
        Some(b) if b <= have => b,
        Some(b) => {
            // Preallocate, so a full filesystem shows now rather than as a failed write later.
            match rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, b) {
                Ok(()) => b,
                Err(rustix::io::Errno::NOSPC) => {
                    unusable = Some(format!(
                        "--disk {shown}: no space for {} GiB on its filesystem; free space there or lower --disk-size-gb",
                        b as f64 / (1u64 << 30) as f64
                    ));
                    // Keep what is there: nothing is written until the drive is usable.
                    have
                }
                // Filesystems without fallocate get a sparse file.
                Err(_) => {
                    file.set_len(b).map_err(|e| open_error(&path, &e))?;
                    b
                }
            }
        }
    } / align
        * align;
    if capacity == 0 && unusable.is_none() {
        return Err(DriveError(format!(
            "--disk {shown} is empty: give --disk-size-gb so kvd can size it"
        )));
    }
    Ok(Drive {
        path,
        file,
        capacity,
        direct,
        unusable,
    })
}

fn open_error(path: &Path, e: &io::Error) -> DriveError {
    let fix = match e.kind() {
        io::ErrorKind::NotFound => "create its directory",
        io::ErrorKind::PermissionDenied => "give kvd's user read and write access to it",
        _ => "check the drive",
    };
    DriveError(format!("--disk {}: {e}; {fix}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_file_is_made_at_its_size_and_a_missing_directory_is_named() {
        let dir = std::env::temp_dir().join(format!("kvd-drive-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = open(&dir, Some(1 << 20), DirectMode::Auto).unwrap();
        assert_eq!(d.path, dir.join("kvd.disk"));
        assert_eq!(d.capacity, 1 << 20);
        assert_eq!(std::fs::metadata(&d.path).unwrap().len(), 1 << 20);
        // Reopened without a size, it keeps its own.
        assert_eq!(
            open(&d.path, None, DirectMode::Off).unwrap().capacity,
            1 << 20
        );
        let e = open(&dir.join("no/such/file"), Some(1 << 20), DirectMode::Auto).unwrap_err();
        assert!(e.0.contains("create its directory"), "{}", e.0);
        let e = open(&dir.join("new"), None, DirectMode::Auto).unwrap_err();
        assert!(e.0.contains("give --disk-size-gb"), "{}", e.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
