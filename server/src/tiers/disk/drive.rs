//! Opening the drives: one large file per `--disk` path (made and preallocated on first use)
//! or a raw block device, with `O_DIRECT` where the filesystem takes it. tmpfs and some
//! network filesystems refuse `O_DIRECT`; with `--disk-direct auto` kvd then says so in the log
//! and goes through the page cache on that path, so the tier works (at page-cache speed)
//! everywhere and bypasses the cache where it can.
//!
//! A drive is kvd's only when it says so. Its first [`LABEL_BYTES`] are kvd's: a label in the
//! first 4 KiB (magic, version, the data area's size, a checksum), written when kvd makes the
//! file or takes the drive over, and nothing else (partition tables and filesystem superblocks
//! live there; values start after it). An existing file or device that holds data and no label
//! is refused, one line naming what kvd recognised (a filesystem, a partition table, a kvd
//! index) and the fix, unless `--disk-overwrite` names that very path: kvd never destroys data
//! it did not write because a path was mistyped. Block devices are opened exclusively (`O_EXCL`:
//! the kernel refuses a mounted one, or one held by RAID, LVM or another kvd), and every drive
//! is locked (`flock`) for kvd's life, so two kvds never share one. A file's room is checked
//! against its filesystem's free space before anything is allocated, and an allocation that
//! fails gives back what it took, so a `--disk-size-gb` too large never leaves a filesystem full.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use super::config::DirectMode;

/// Bytes at the start of every drive that are kvd's label and nothing else: values start here.
pub const LABEL_BYTES: u64 = 1 << 20;
const MAGIC: [u8; 8] = *b"kvd-disk";
const LABEL_VERSION: u16 = 1;
/// How much of an unlabelled drive is read to say what it holds (btrfs's superblock is at
/// 64 KiB, ISO 9660's at 32 KiB).
const PROBE_BYTES: usize = 68 << 10;

/// A drive of the tier.
#[derive(Debug)]
pub struct Drive {
    /// The file or device.
    pub path: PathBuf,
    /// Open for reading and writing; `None` for a drive that could not be given its room (then
    /// `unusable` says why, and the tier never reads or writes it).
    file: Option<File>,
    /// Bytes of values kvd keeps on it, from [`LABEL_BYTES`] on (a multiple of
    /// [`kvd_uring::ALIGN`]).
    pub capacity: u64,
    /// Whether the page cache is bypassed.
    pub direct: bool,
    /// Why it cannot be used from the start (its filesystem has no room), if so.
    pub unusable: Option<String>,
    /// Holds the drive's `flock` (taken on this descriptor) for kvd's life.
    _lock: Option<File>,
}

impl Drive {
    /// The descriptor values are read and written through. Only usable drives are: a drive
    /// without a file is marked unusable when the tier opens.
    pub fn io_fd(&self) -> BorrowedFd<'_> {
        self.file
            .as_ref()
            .expect("the disk tier reads and writes only drives it could open")
            .as_fd()
    }
}

/// Why the tier could not open a drive; each is one line naming the flag and the fix.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DriveError(pub String);

fn open_with(path: &Path, direct: bool, create_new: bool, exclusive: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create_new(create_new);
    let mut flags = rustix::fs::OFlags::empty();
    if direct {
        flags |= rustix::fs::OFlags::DIRECT;
    }
    if exclusive {
        // On a block device: refused (EBUSY) while it is mounted or held by RAID, LVM or another
        // exclusive opener.
        flags |= rustix::fs::OFlags::EXCL;
    }
    o.custom_flags(flags.bits() as i32);
    o.open(path)
}

/// Opens `path` (a directory means `path/kvd.disk`) with `bytes` of room for values, or what
/// it holds. `overwrite`: the `--disk-overwrite` paths, whose data kvd may destroy.
pub fn open(
    path: &Path,
    bytes: Option<u64>,
    mode: DirectMode,
    overwrite: &[PathBuf],
) -> Result<Drive, DriveError> {
    let given = path;
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
    let align = kvd_uring::ALIGN as u64;
    let new = meta.is_none();
    if new {
        let Some(b) = bytes else {
            return Err(DriveError(format!(
                "--disk {shown} does not exist yet: give --disk-size-gb so kvd can make it"
            )));
        };
        // Nothing is made where it cannot fit.
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if let Some(free) = free_bytes(&dir) {
            if LABEL_BYTES + b > free {
                return Ok(Drive::without_room(path.clone(), no_room(&path, b, free)));
            }
        }
    }
    // The lock and the label go through a plain descriptor; values through `file`.
    let lock = open_with(&path, false, new, block_device).map_err(|e| open_error(&path, &e))?;
    if let Err(e) = rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        return Err(DriveError(format!(
            "--disk {shown} is in use by another process (another kvd?): {e}; give each kvd its own drive"
        )));
    }
    let have = (&lock)
        .seek(SeekFrom::End(0))
        .map_err(|e| open_error(&path, &e))?;
    if !new {
        let named = overwrite.iter().any(|o| o == given || *o == path);
        match read_label(&lock, have) {
            Ok(Label::Kvd { .. }) => {}
            Ok(Label::Empty) if !block_device => {}
            Ok(found) if named => tracing::warn!(
                "--disk {shown} holds {}; kvd overwrites it, as --disk-overwrite says",
                found.describe()
            ),
            Ok(found) => {
                return Err(DriveError(format!(
                    "--disk {shown} holds {}, which kvd did not write; kvd will not overwrite it. Name \
                     a new file, or add --disk-overwrite {shown} to let kvd destroy what is there",
                    found.describe()
                )))
            }
            Err(e) => return Err(open_error(&path, &e)),
        }
    }
    let mut unusable = None;
    let capacity = if block_device {
        bytes.unwrap_or(have).min(have.saturating_sub(LABEL_BYTES))
    } else {
        let total = bytes.map(|b| LABEL_BYTES + b).unwrap_or(have);
        if total > have {
            // Preallocated, so a full filesystem shows now rather than as a failed write later;
            // checked first, and given back on failure, so it never leaves the filesystem full.
            match grow(&lock, &path, have, total) {
                Ok(()) => {}
                Err(why) => unusable = Some(why),
            }
        }
        if unusable.is_some() {
            0
        } else {
            total.saturating_sub(LABEL_BYTES)
        }
    } / align
        * align;
    if let Some(why) = unusable {
        if new {
            let _ = std::fs::remove_file(&path);
        }
        return Ok(Drive::without_room(path, why));
    }
    if capacity == 0 {
        if new {
            let _ = std::fs::remove_file(&path);
        }
        return Err(DriveError(format!(
            "--disk {shown} has no room for values (kvd keeps its first MiB for its label): give \
             --disk-size-gb so kvd can size it"
        )));
    }
    write_label(&lock, capacity).map_err(|e| open_error(&path, &e))?;
    let want_direct = mode != DirectMode::Off;
    let (file, direct) = match open_with(&path, want_direct, false, false) {
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
            let f = open_with(&path, false, false, false).map_err(|e| open_error(&path, &e))?;
            (f, false)
        }
        Err(e) => return Err(open_error(&path, &e)),
    };
    Ok(Drive {
        path,
        file: Some(file),
        capacity,
        direct,
        unusable: None,
        _lock: Some(lock),
    })
}

impl Drive {
    fn without_room(path: PathBuf, why: String) -> Drive {
        Drive {
            path,
            file: None,
            capacity: 0,
            direct: false,
            unusable: Some(why),
            _lock: None,
        }
    }
}

/// Bytes an unprivileged writer may still allocate on the filesystem holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let s = rustix::fs::statvfs(dir).ok()?;
    Some(s.f_bavail.saturating_mul(s.f_frsize))
}

/// A size for an operator: GiB, or MiB below one GiB.
fn shown_size(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

fn no_room(path: &Path, bytes: u64, free: u64) -> String {
    format!(
        "--disk {}: {} asked (and kvd's 1 MiB label), {} free on its filesystem; free space there \
         or lower --disk-size-gb (nothing was allocated)",
        path.display(),
        shown_size(bytes),
        shown_size(free)
    )
}

/// Grows a file from `have` to `total` bytes, all allocated; on failure gives back what it
/// took (the file is cut back to `have`) and says why, naming the flag.
fn grow(file: &File, path: &Path, have: u64, total: u64) -> Result<(), String> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if let Some(free) = free_bytes(&dir) {
        if total - have > free {
            return Err(no_room(path, total - LABEL_BYTES, free));
        }
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, total) {
        Ok(()) => Ok(()),
        // Filesystems without fallocate get a sparse file.
        Err(rustix::io::Errno::OPNOTSUPP) => file.set_len(total).map_err(|e| e.to_string()),
        Err(e) => {
            // A filesystem may keep part of a failed allocation: give it back.
            let _ = file.set_len(have);
            Err(format!(
                "--disk {}: could not allocate {}: {e}; free space there or lower --disk-size-gb \
                 (what was allocated was given back)",
                path.display(),
                shown_size(total - LABEL_BYTES)
            ))
        }
    }
}

/// What the start of an existing drive holds.
#[derive(Debug, PartialEq, Eq)]
enum Label {
    /// kvd's label, for a data area of this size.
    Kvd { capacity: u64 },
    /// Nothing: a 0-byte file, or a file with no data at all (holes only).
    Empty,
    /// Something kvd recognises, named.
    Known(&'static str),
    /// Data kvd does not recognise.
    Unknown,
}

impl Label {
    fn describe(&self) -> String {
        match self {
            Label::Kvd { .. } => "kvd's disk tier".into(),
            Label::Empty => "nothing".into(),
            Label::Known(what) => (*what).into(),
            Label::Unknown => "data with no kvd label".into(),
        }
    }
}

fn label_bytes(capacity: u64) -> [u8; 32] {
    let mut l = [0u8; 32];
    l[..8].copy_from_slice(&MAGIC);
    l[8..10].copy_from_slice(&LABEL_VERSION.to_le_bytes());
    l[16..24].copy_from_slice(&capacity.to_le_bytes());
    let sum = xxh3_64(&l[..24]);
    l[24..32].copy_from_slice(&sum.to_le_bytes());
    l
}

fn write_label(file: &File, capacity: u64) -> io::Result<()> {
    let mut block = vec![0u8; kvd_uring::ALIGN];
    block[..32].copy_from_slice(&label_bytes(capacity));
    file.write_all_at(&block, 0)?;
    file.sync_data()
}

fn read_label(file: &File, size: u64) -> io::Result<Label> {
    if size == 0 {
        return Ok(Label::Empty);
    }
    // A file with no data at all (created with `truncate -s`): nothing to destroy.
    if let Err(rustix::io::Errno::NXIO) = rustix::fs::seek(file, rustix::fs::SeekFrom::Data(0)) {
        return Ok(Label::Empty);
    }
    let mut head = vec![0u8; PROBE_BYTES.min(size as usize)];
    file.read_exact_at(&mut head, 0)?;
    Ok(classify(&head))
}

/// Names what a drive's first bytes hold (the signatures `blkid` and `wipefs` look for).
fn classify(head: &[u8]) -> Label {
    let at = |off: usize, sig: &[u8]| head.get(off..off + sig.len()) == Some(sig);
    if at(0, &MAGIC) && head.len() >= 32 {
        let capacity = u64::from_le_bytes(head[16..24].try_into().expect("8 bytes"));
        if head[..32] == label_bytes(capacity) {
            return Label::Kvd { capacity };
        }
    }
    let known: &[(usize, &[u8], &'static str)] = &[
        (1080, &[0x53, 0xEF], "an ext2/3/4 filesystem"),
        (0, b"XFSB", "an XFS filesystem"),
        (65600, b"_BHRfS_M", "a btrfs filesystem"),
        (512, b"EFI PART", "a GPT partition table"),
        (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
        (512, b"LABELONE", "an LVM physical volume"),
        (4086, b"SWAPSPACE2", "a swap area"),
        (32769, b"CD001", "an ISO 9660 filesystem"),
        (0, b"hsqs", "a squashfs filesystem"),
        (3, b"NTFS    ", "an NTFS filesystem"),
        (
            0,
            b"kvdJ",
            "a kvd disk index (give --disk the drive, --disk-index the index)",
        ),
        (510, &[0x55, 0xAA], "a DOS partition table or boot sector"),
    ];
    for (off, sig, what) in known {
        if at(*off, sig) {
            return Label::Known(what);
        }
    }
    // Zeros here and data further on are not kvd's to take either.
    Label::Unknown
}

/// The fix for EROFS. A systemd unit with `ProtectSystem=strict` (kvd's own) mounts every
/// path read-only in kvd's view unless `ReadWritePaths=` names it, so a drive that is writable
/// from a shell is read-only to the service.
pub(crate) const READ_ONLY_FIX: &str = "under systemd's ProtectSystem=strict (as in \
    deploy/systemd/kvd.service) add the path to ReadWritePaths= in the unit; in a container, \
    mount it read-write; else remount its filesystem read-write";

fn open_error(path: &Path, e: &io::Error) -> DriveError {
    let fix = match e.kind() {
        io::ErrorKind::NotFound => "create its directory".to_string(),
        io::ErrorKind::PermissionDenied => "give kvd's user read and write access to it".into(),
        _ if e.raw_os_error() == Some(rustix::io::Errno::ROFS.raw_os_error()) => {
            READ_ONLY_FIX.into()
        }
        _ if e.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) => {
            "the device is mounted or held by RAID, LVM or another kvd; kvd never writes a \
             device in use: unmount it or name another"
                .into()
        }
        _ => "check the drive".into(),
    };
    DriveError(format!("--disk {}: {e}; {fix}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvd-drive-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_new_file_is_made_at_its_size_and_a_missing_directory_is_named() {
        let dir = temp("new");
        let d = open(&dir, Some(1 << 20), DirectMode::Auto, &[]).unwrap();
        assert_eq!(d.path, dir.join("kvd.disk"));
        assert_eq!(d.capacity, 1 << 20);
        assert_eq!(
            std::fs::metadata(&d.path).unwrap().len(),
            LABEL_BYTES + (1 << 20)
        );
        drop(d);
        // Reopened without a size, it keeps its own: its label says it is kvd's.
        assert_eq!(
            open(&dir.join("kvd.disk"), None, DirectMode::Off, &[])
                .unwrap()
                .capacity,
            1 << 20
        );
        let e = open(
            &dir.join("no/such/file"),
            Some(1 << 20),
            DirectMode::Auto,
            &[],
        )
        .unwrap_err();
        assert!(e.0.contains("create its directory"), "{}", e.0);
        let e = open(&dir.join("new"), None, DirectMode::Auto, &[]).unwrap_err();
        assert!(e.0.contains("give --disk-size-gb"), "{}", e.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_kvd_did_not_write_is_refused_unless_named_to_overwrite() {
        let dir = temp("foreign");
        let f = dir.join("photos.bin");
        let data: Vec<u8> = (0..(3u32 << 20)).map(|i| (i * 7 + 1) as u8).collect();
        std::fs::write(&f, &data).unwrap();
        let e = open(&f, None, DirectMode::Off, &[]).unwrap_err();
        assert!(
            e.0.contains("data with no kvd label") && e.0.contains("--disk-overwrite"),
            "{}",
            e.0
        );
        assert_eq!(std::fs::read(&f).unwrap(), data, "not a byte changed");
        let d = open(&f, None, DirectMode::Off, std::slice::from_ref(&f)).unwrap();
        assert_eq!(d.capacity, 2 << 20);
        drop(d);
        // Taken over, it is kvd's from then on.
        assert!(open(&f, None, DirectMode::Off, &[]).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn filesystems_and_partition_tables_are_named() {
        let mut ext4 = vec![0u8; PROBE_BYTES];
        ext4[1080..1082].copy_from_slice(&[0x53, 0xEF]);
        assert_eq!(classify(&ext4), Label::Known("an ext2/3/4 filesystem"));
        let mut gpt = vec![0u8; PROBE_BYTES];
        gpt[510..512].copy_from_slice(&[0x55, 0xAA]);
        gpt[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(classify(&gpt), Label::Known("a GPT partition table"));
        let mut kvd = vec![0u8; PROBE_BYTES];
        kvd[..32].copy_from_slice(&label_bytes(4096));
        assert_eq!(classify(&kvd), Label::Kvd { capacity: 4096 });
        // A label with a bad checksum is not kvd's.
        kvd[20] ^= 1;
        assert_eq!(classify(&kvd), Label::Unknown);
    }

    #[test]
    fn a_second_opener_of_a_drive_is_refused() {
        let dir = temp("lock");
        let a = open(&dir, Some(1 << 20), DirectMode::Off, &[]).unwrap();
        let e = open(&dir, Some(1 << 20), DirectMode::Off, &[]).unwrap_err();
        assert!(e.0.contains("in use by another process"), "{}", e.0);
        drop(a);
        assert!(open(&dir, Some(1 << 20), DirectMode::Off, &[]).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_size_beyond_the_free_space_allocates_nothing() {
        let dir = temp("room");
        let d = open(&dir, Some(1 << 60), DirectMode::Off, &[]).unwrap();
        let why = d.unusable.as_deref().unwrap();
        assert!(
            why.contains("--disk-size-gb") && why.contains("nothing was allocated"),
            "{why}"
        );
        assert!(!dir.join("kvd.disk").exists(), "no file is left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
