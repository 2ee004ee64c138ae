//! The disk index across restarts: an append-only journal of committed values, replayed at
//! start and compacted into a snapshot (written beside it and renamed over it, so a crash
//! mid-compaction leaves the old one) at start, at a clean stop, and when it has grown to
//! several times the index.
//!
//! A record is appended once a value's write has completed, so a kvd killed at any moment
//! loses at most the values whose writes were in flight: every committed value is in the
//! journal (its records reach the page cache, which outlives the process, after every batch;
//! they are synced to the drive at each compaction — the values themselves are not flushed
//! per write either, so syncing the journal more often would not make a power loss cost
//! less). What a crash can leave is a journal that names a place the head had already
//! started to overwrite; the value there then fails its header check and is counted as
//! rejected, never delivered.
//!
//! Layout, little-endian. Header: magic `kvdJ`, version u16, drive count u16, then per drive
//! its capacity u64 and an xxh3 of its path u64, then an xxh3 of all that u64. A journal
//! written for other drives or sizes is set aside and the tier starts empty. Records, 64 bytes:
//! fingerprint u64 · salt u64 · shard u32 · drive u16 · kind u16 (1 value, 2 head) · hash u128
//! · position u64 · value bytes u64 · xxh3 of the first 56 bytes u64. Replay stops at the first
//! record that fails its checksum (a torn tail).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use super::index::{DiskIndex, Loc};
use crate::l1::cache::Key;

const MAGIC: [u8; 4] = *b"kvdJ";
const VERSION: u16 = 1;
const RECORD: usize = 64;
const KIND_VALUE: u16 = 1;
const KIND_HEAD: u16 = 2;

/// The journal file, open for appending.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    header: Vec<u8>,
    file: File,
    records: u64,
}

/// What opening the journal found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Values back in the index.
    pub values: usize,
    /// Why the journal was not used, when it was not.
    pub discarded: Option<String>,
}

fn header_for(drives: &[(u64, &Path)]) -> Vec<u8> {
    let mut h = Vec::with_capacity(16 + drives.len() * 16);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(drives.len() as u16).to_le_bytes());
    for (capacity, path) in drives {
        h.extend_from_slice(&capacity.to_le_bytes());
        h.extend_from_slice(&xxh3_64(path.as_os_str().as_encoded_bytes()).to_le_bytes());
    }
    let sum = xxh3_64(&h);
    h.extend_from_slice(&sum.to_le_bytes());
    h
}

fn record(key: &Key, kind: u16, drive: u16, pos: u64, value_bytes: u64) -> [u8; RECORD] {
    let mut r = [0u8; RECORD];
    r[0..8].copy_from_slice(&key.fingerprint.to_le_bytes());
    r[8..16].copy_from_slice(&key.salt.to_le_bytes());
    r[16..20].copy_from_slice(&key.shard.to_le_bytes());
    r[20..22].copy_from_slice(&drive.to_le_bytes());
    r[22..24].copy_from_slice(&kind.to_le_bytes());
    r[24..40].copy_from_slice(&key.hash.to_le_bytes());
    r[40..48].copy_from_slice(&pos.to_le_bytes());
    r[48..56].copy_from_slice(&value_bytes.to_le_bytes());
    let sum = xxh3_64(&r[..56]);
    r[56..64].copy_from_slice(&sum.to_le_bytes());
    r
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// A parsed record: (kind, key, loc); `None` for a torn or damaged one.
fn parse(r: &[u8]) -> Option<(u16, Key, Loc)> {
    if r.len() < RECORD || xxh3_64(&r[..56]) != u64_at(r, 56) {
        return None;
    }
    let key = Key {
        fingerprint: u64_at(r, 0),
        salt: u64_at(r, 8),
        shard: u32::from_le_bytes(r[16..20].try_into().expect("4 bytes")),
        hash: u128::from_le_bytes(r[24..40].try_into().expect("16 bytes")),
    };
    let drive = u16::from_le_bytes([r[20], r[21]]);
    let kind = u16::from_le_bytes([r[22], r[23]]);
    Some((
        kind,
        key,
        Loc {
            drive,
            pos: u64_at(r, 40),
            value_bytes: u64_at(r, 48),
        },
    ))
}

impl Journal {
    /// Opens (or creates) the journal at `path` for these drives, replays it into `index`,
    /// and rewrites it compacted. A file there that is not a kvd journal is kvd's to replace
    /// only when `may_overwrite` (`--disk-overwrite` names it): otherwise an
    /// [`io::ErrorKind::AlreadyExists`] error.
    pub fn open(
        path: &Path,
        drives: &[(u64, &Path)],
        index: &mut DiskIndex,
        may_overwrite: bool,
    ) -> io::Result<(Journal, Replayed)> {
        let header = header_for(drives);
        let mut found = Replayed::default();
        match File::open(path) {
            Ok(mut f) => {
                let mut bytes = Vec::new();
                f.read_to_end(&mut bytes)?;
                if !bytes.is_empty() && !bytes.starts_with(&MAGIC) && !may_overwrite {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "it holds data that is not a kvd index, which kvd will not overwrite",
                    ));
                }
                if bytes.len() < header.len() || bytes[..header.len()] != header[..] {
                    found.discarded = Some(format!(
                        "{} was written for other --disk paths or sizes (or is damaged); the disk tier starts empty",
                        path.display()
                    ));
                } else {
                    found.values = replay(&bytes[header.len()..], drives.len(), index);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let mut j = Journal {
            path: path.to_path_buf(),
            header,
            file: File::open("/dev/null")?,
            records: 0,
        };
        j.compact(index)?;
        found.values = index.len().min(found.values);
        Ok((j, found))
    }

    /// Appends records for values just committed, and flushes them.
    pub fn append(&mut self, values: &[(Key, Loc)], heads: &[u64]) -> io::Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::with_capacity((values.len() + heads.len()) * RECORD);
        for (key, loc) in values {
            buf.extend_from_slice(&record(
                key,
                KIND_VALUE,
                loc.drive,
                loc.pos,
                loc.value_bytes,
            ));
        }
        for (d, &head) in heads.iter().enumerate() {
            buf.extend_from_slice(&record(&NO_KEY, KIND_HEAD, d as u16, head, 0));
        }
        self.file.write_all(&buf)?;
        self.records += (values.len() + heads.len()) as u64;
        Ok(())
    }

    /// Whether the journal has grown enough, next to the index, to be worth compacting.
    pub fn wants_compaction(&self, index: &DiskIndex) -> bool {
        self.records > 4 * index.len() as u64 + 65536
    }

    /// Rewrites the journal as a snapshot of `index`.
    pub fn compact(&mut self, index: &DiskIndex) -> io::Result<()> {
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        let entries = index.entries();
        let heads = index.heads();
        let mut buf =
            Vec::with_capacity(self.header.len() + (entries.len() + heads.len()) * RECORD);
        buf.extend_from_slice(&self.header);
        for (d, &head) in heads.iter().enumerate() {
            buf.extend_from_slice(&record(&NO_KEY, KIND_HEAD, d as u16, head, 0));
        }
        for (key, loc) in &entries {
            buf.extend_from_slice(&record(
                key,
                KIND_VALUE,
                loc.drive,
                loc.pos,
                loc.value_bytes,
            ));
        }
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&buf)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)?;
        self.file = OpenOptions::new().append(true).open(&self.path)?;
        self.records = (entries.len() + heads.len()) as u64;
        Ok(())
    }
}

const NO_KEY: Key = Key {
    fingerprint: 0,
    salt: 0,
    shard: 0,
    hash: 0,
};

/// Replays records into `index`; returns the values replayed.
fn replay(mut bytes: &[u8], drives: usize, index: &mut DiskIndex) -> usize {
    let mut values = Vec::new();
    while bytes.len() >= RECORD {
        let Some((kind, key, loc)) = parse(&bytes[..RECORD]) else {
            tracing::warn!(
                "the disk index ends in a damaged record (a crash mid-write); the rest is ignored"
            );
            break;
        };
        bytes = &bytes[RECORD..];
        if loc.drive as usize >= drives {
            continue;
        }
        match kind {
            KIND_HEAD => index.advance_head(loc.drive as usize, loc.pos),
            KIND_VALUE => {
                index.advance_head(loc.drive as usize, loc.pos + index.read_len(&loc));
                values.push((key, loc));
            }
            _ => {}
        }
    }
    let n = values.len();
    for (key, loc) in values {
        index.commit(key, loc);
    }
    index.prune_all();
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(hash: u128) -> Key {
        Key {
            fingerprint: 7,
            salt: 3,
            shard: 1,
            hash,
        }
    }

    fn temp(name: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("kvd-journal-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        p
    }

    #[test]
    fn a_reopened_journal_gives_back_the_index_and_heads() {
        let path = temp("reopen");
        let drives = [(16384u64, Path::new("/d0")), (16384, Path::new("/d1"))];
        let mut ix = DiskIndex::new(&[16384, 16384], 4096, 0);
        let (mut j, r) = Journal::open(&path, &drives, &mut ix, false).unwrap();
        assert_eq!(r, Replayed::default());
        let mut done = Vec::new();
        for h in 0..6u128 {
            let a = ix.allocate(5000).unwrap();
            assert!(ix.commit(key(h), a.loc));
            done.push((key(h), a.loc));
        }
        j.append(&done, &ix.heads()).unwrap();
        drop(j);
        let mut again = DiskIndex::new(&[16384, 16384], 4096, 0);
        let (_, r) = Journal::open(&path, &drives, &mut again, false).unwrap();
        assert_eq!(again.entries(), ix.entries());
        assert_eq!(again.heads(), ix.heads());
        assert_eq!(r.values, ix.len());
        // A torn tail is ignored, the rest kept.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[1, 2, 3]);
        let n = bytes.len();
        bytes[n - 20] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let mut torn = DiskIndex::new(&[16384, 16384], 4096, 0);
        Journal::open(&path, &drives, &mut torn, false).unwrap();
        assert_eq!(torn.len(), ix.len() - 1);
        // Other drives: set aside.
        let mut other = DiskIndex::new(&[8192], 4096, 0);
        let (_, r) = Journal::open(&path, &[(8192, Path::new("/d0"))], &mut other, false).unwrap();
        assert!(r.discarded.unwrap().contains("other --disk paths"));
        assert!(other.is_empty());
        let _ = std::fs::remove_file(&path);
    }
}
