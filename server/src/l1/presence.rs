//! The presence filter's file (`kvd_proto::presence`): created in `--presence-dir` when kvd
//! starts with no tier below L1, counted by the cache as keys enter and leave its index,
//! retired and removed when kvd exits. Files that a kvd killed before it could remove them left
//! behind are removed by the next one to start in the same folder.

use std::path::{Path, PathBuf};

use kvd_gpu::shared::SharedBytes;
use kvd_proto::presence::{self, Counter, HEADER_BYTES, RETIRED, STATE_OFFSET};

use super::Key;

const PREFIX: &str = "kvd-presence-";
/// A filter file is judged an orphan only once it is this old.
const ORPHAN_AGE: std::time::Duration = std::time::Duration::from_secs(60);

/// kvd's presence filter.
#[derive(Debug)]
pub struct Presence {
    file: SharedBytes,
    path: PathBuf,
    slots_log2: u32,
}

impl Presence {
    /// A new, empty filter sized for a pool of `pool_bytes`, in `dir`.
    pub fn create(dir: &Path, pool_bytes: u64) -> std::io::Result<Self> {
        remove_orphans(dir);
        // A random name: a client that finds this name in its own /dev/shm (kvd on another
        // host, or in a container) finds nothing, never another kvd's filter.
        let token = std::hash::BuildHasher::hash_one(
            &std::collections::hash_map::RandomState::new(),
            (std::process::id(), std::time::SystemTime::now()),
        );
        let path = dir.join(format!("{PREFIX}{}-{token:016x}", std::process::id()));
        let slots_log2 = presence::slots_log2_for(pool_bytes);
        let file = SharedBytes::create(
            &path,
            &presence::header(slots_log2),
            HEADER_BYTES + (1 << slots_log2),
        )?;
        Ok(Presence {
            file,
            path,
            slots_log2,
        })
    }

    /// The file, as clients are told it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of the file.
    pub fn bytes(&self) -> usize {
        self.file.len()
    }

    fn counter(&self) -> Counter<'_> {
        let slots = self
            .file
            .writable()
            .expect("kvd created its filter writable");
        Counter {
            slots: &slots[HEADER_BYTES..],
            slots_log2: self.slots_log2,
        }
    }

    /// `key` entered the index.
    pub fn add(&self, key: &Key) {
        self.counter()
            .add(key.fingerprint, key.salt, key.shard, key.hash);
    }

    /// `key` left the index.
    pub fn remove(&self, key: &Key) {
        self.counter()
            .remove(key.fingerprint, key.salt, key.shard, key.hash);
    }
}

impl Drop for Presence {
    fn drop(&mut self) {
        // Readers that keep the file mapped stop trusting it before it goes.
        self.file.store_u32(STATE_OFFSET, RETIRED);
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!("removing the presence filter {}: {e}", self.path.display());
        }
    }
}

/// Removes the filters in `dir` whose kvd is gone: a live kvd holds a lock on its own (in
/// whatever PID namespace it runs). A file younger than a minute is left alone: another kvd
/// starting beside this one may not have taken its lock yet.
fn remove_orphans(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let named = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(PREFIX));
        if !named {
            continue; // /dev/shm holds every program's files: only ours are looked at
        }
        let settled = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= ORPHAN_AGE);
        if settled && SharedBytes::is_orphan(&e.path()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_proto::presence::{may_hold, Slots, LIVE};

    struct Reader(SharedBytes, u32);

    impl Slots for Reader {
        fn slot(&self, i: usize) -> u8 {
            self.0.load(HEADER_BYTES + i)
        }
        fn state(&self) -> u32 {
            self.0.load_u32(STATE_OFFSET)
        }
        fn slots_log2(&self) -> u32 {
            self.1
        }
    }

    #[test]
    fn a_reader_sees_keys_come_and_go_and_the_file_retired_and_removed() {
        let dir = std::env::temp_dir().join(format!("kvd-presence-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // An orphan of a kvd gone (nobody holds its lock), one as young as a kvd starting
        // beside this one that has not locked it yet, a live kvd's (this test holds its lock),
        // and a file that is not a filter.
        let old = std::time::SystemTime::now() - 2 * ORPHAN_AGE;
        let aged = |path: &Path| {
            std::fs::File::options()
                .write(true)
                .open(path)
                .unwrap()
                .set_modified(old)
                .unwrap()
        };
        let orphan = dir.join(format!("{PREFIX}1-0"));
        drop(SharedBytes::create(&orphan, b"", 64).unwrap());
        aged(&orphan);
        let young = dir.join(format!("{PREFIX}3-0"));
        drop(SharedBytes::create(&young, b"", 64).unwrap());
        let live_path = dir.join(format!("{PREFIX}2-0"));
        let live = SharedBytes::create(&live_path, b"", 64).unwrap();
        aged(&live_path);
        std::fs::write(dir.join("other"), b"x").unwrap();
        let p = Presence::create(&dir, 1 << 30).unwrap();
        assert!(!orphan.exists(), "the orphan is removed");
        assert!(young.exists() && live_path.exists() && dir.join("other").exists());
        drop(live);
        let file = SharedBytes::open(p.path()).unwrap();
        let log2 = presence::check_header(
            &(0..HEADER_BYTES).map(|i| file.load(i)).collect::<Vec<_>>(),
            file.len(),
        )
        .unwrap();
        let r = Reader(file, log2);
        assert_eq!(r.state(), LIVE);
        let key = Key {
            fingerprint: 1,
            salt: 2,
            shard: 3,
            hash: 4,
        };
        assert!(!may_hold(&r, 1, 2, 3, 4));
        p.add(&key);
        assert!(may_hold(&r, 1, 2, 3, 4));
        p.remove(&key);
        assert!(!may_hold(&r, 1, 2, 3, 4));
        let path = p.path().to_path_buf();
        drop(p);
        assert_eq!(
            r.state(),
            RETIRED,
            "a mapped reader sees the filter retired"
        );
        assert!(may_hold(&r, 1, 2, 3, 4), "and then trusts it no more");
        assert!(!path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
