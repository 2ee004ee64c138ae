//! kvd's presence filter as a client on kvd's host sees it (`kvd_proto::presence`): the file
//! kvd named in its hello, mapped read-only.

use std::path::Path;

use kvd_gpu::shared::SharedBytes;
use kvd_proto::presence::{self, Slots, HEADER_BYTES, STATE_OFFSET};

/// A mapped filter.
#[derive(Debug)]
pub(crate) struct Filter {
    file: SharedBytes,
    slots_log2: u32,
    path: String,
}

impl Filter {
    /// Maps `path` and checks its header.
    pub(crate) fn open(path: &str) -> Result<Filter, String> {
        let file = SharedBytes::open(Path::new(path)).map_err(|e| format!("{path}: {e}"))?;
        if file.len() < HEADER_BYTES {
            return Err(format!(
                "{path}: {} bytes, shorter than a header",
                file.len()
            ));
        }
        let head: Vec<u8> = (0..HEADER_BYTES).map(|i| file.load(i)).collect();
        let slots_log2 =
            presence::check_header(&head, file.len()).map_err(|e| format!("{path}: {e}"))?;
        Ok(Filter {
            file,
            slots_log2,
            path: path.to_string(),
        })
    }

    /// The file.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// See [`presence::first_absent`].
    pub(crate) fn first_absent(
        &self,
        fingerprint: u64,
        salt: u64,
        shard: u32,
        hashes: &[u128],
    ) -> usize {
        presence::first_absent(self, fingerprint, salt, shard, hashes)
    }
}

impl Slots for Filter {
    fn slot(&self, i: usize) -> u8 {
        self.file.load(HEADER_BYTES + i)
    }

    fn state(&self) -> u32 {
        self.file.load_u32(STATE_OFFSET)
    }

    fn slots_log2(&self) -> u32 {
        self.slots_log2
    }
}
