//! A file mapped shared between the processes of one host and seen only through atomic loads
//! and stores: its creator writes it while others read it (kvd's presence filter,
//! `kvd_proto::presence`). A reader maps it read-only and gets loads alone, so no reader can
//! fault on a store.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};

use memmap2::{MmapOptions, MmapRaw};

/// A shared mapping of a whole file.
#[derive(Debug)]
pub struct SharedBytes {
    map: MmapRaw,
    writable: bool,
    /// The creator's descriptor, holding an exclusive `flock` for as long as it lives, so that
    /// [`SharedBytes::is_orphan`] can tell a live creator's file (in any PID namespace) from
    /// one left by a creator that died.
    _lock: Option<File>,
}

impl SharedBytes {
    /// Creates `path` (it must not exist yet) of `len` bytes, readable by every local user
    /// (mode 0644), starting with `head`; mapped read-write. Every byte is allocated here
    /// (`fallocate`): on a full memory file system a sparse file would fault (SIGBUS) on a
    /// later first touch, in the writer or in a reader, where this fails at once instead. On
    /// failure nothing is left behind.
    pub fn create(path: &Path, head: &[u8], len: usize) -> io::Result<Self> {
        if head.len() > len || len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "head longer than the file",
            ));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(path)?;
        let made = Self::fill(file, head, len);
        if made.is_err() {
            let _ = std::fs::remove_file(path);
        }
        made
    }

    fn fill(file: File, head: &[u8], len: usize) -> io::Result<Self> {
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, len as u64)?;
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        let me = SharedBytes {
            map,
            writable: true,
            _lock: Some(file),
        };
        for (b, &v) in me.cells().iter().zip(head) {
            b.store(v, Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::Release);
        Ok(me)
    }

    /// Maps `path`, all of it, read-only.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        if file.metadata()?.len() == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "empty file"));
        }
        let map = MmapOptions::new().map_raw_read_only(&file)?;
        Ok(SharedBytes {
            map,
            writable: false,
            _lock: None,
        })
    }

    /// Whether `path` was made by [`SharedBytes::create`] of a process that has exited (its
    /// `flock` is free); false when it cannot be told.
    pub fn is_orphan(path: &Path) -> bool {
        File::open(path).is_ok_and(|f| {
            rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockShared).is_ok()
        })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is mapped (never: both constructors refuse an empty file).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn cells(&self) -> &[AtomicU8] {
        // SAFETY: the mapping is `len()` bytes and lives as long as `self`; `AtomicU8` has
        // `u8`'s size and alignment; every access through the slice is atomic, as other
        // processes change the bytes at any time.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<AtomicU8>(), self.map.len()) }
    }

    /// The bytes as atomics to store into: `None` for a read-only mapping.
    pub fn writable(&self) -> Option<&[AtomicU8]> {
        self.writable.then(|| self.cells())
    }

    /// The byte at `i` (relaxed).
    pub fn load(&self, i: usize) -> u8 {
        self.cells()[i].load(Ordering::Relaxed)
    }

    /// The aligned little-endian u32 at `offset` (acquire).
    pub fn load_u32(&self, offset: usize) -> u32 {
        self.word(offset).load(Ordering::Acquire)
    }

    /// Stores the aligned u32 at `offset` (release); false for a read-only mapping.
    pub fn store_u32(&self, offset: usize, v: u32) -> bool {
        if self.writable {
            self.word(offset).store(v, Ordering::Release);
        }
        self.writable
    }

    fn word(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len(),
            "u32 at {offset} of {}",
            self.len()
        );
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned); `AtomicU32` has
        // `u32`'s layout; all access is atomic.
        unsafe { &*self.map.as_ptr().add(offset).cast::<AtomicU32>() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_sees_the_writers_stores_and_cannot_store() {
        let dir = std::env::temp_dir().join(format!("kvd-shared-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        let _ = std::fs::remove_file(&path);
        let w = SharedBytes::create(&path, b"head", 4096).unwrap();
        assert!(!SharedBytes::is_orphan(&path), "its creator lives");
        assert!(
            SharedBytes::create(&path, b"", 4096).is_err(),
            "create_new: an existing file is refused"
        );
        assert!(path.exists(), "and left alone");
        let r = SharedBytes::open(&path).unwrap();
        assert_eq!((0..4).map(|i| r.load(i)).collect::<Vec<_>>(), b"head");
        w.writable().unwrap()[100].store(7, Ordering::Relaxed);
        assert!(w.store_u32(8, 0xdead_beef));
        assert_eq!(r.load(100), 7);
        assert_eq!(r.load_u32(8), 0xdead_beef);
        assert!(r.writable().is_none());
        assert!(!r.store_u32(8, 1));
        assert_eq!(r.load_u32(8), 0xdead_beef);
        drop(w);
        assert!(SharedBytes::is_orphan(&path), "its creator is gone");
        assert!(!SharedBytes::is_orphan(&dir.join("none")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
