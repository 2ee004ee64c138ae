//! The types that the dispatch layer ([`crate::device`]) and every backend share: what a client
//! shares for import ([`ImportSource`]), the size of an IPC handle, the pinned-pool guard, and
//! UUIDs as logs show them. They live below both so that no backend imports the module that
//! dispatches to it.

use std::fmt;
use std::os::fd::OwnedFd;

/// Size of an IPC memory or event handle (CUDA and HIP alike).
pub const IPC_HANDLE_BYTES: usize = 64;

/// Client memory to import, as the client described it.
#[derive(Debug)]
pub enum ImportSource {
    /// A sealed memfd holding the client's "device" memory (host backend).
    HostFd {
        /// The descriptor, received over kvd's fd socket.
        fd: OwnedFd,
        /// Bytes the client uses, from offset 0.
        size_bytes: u64,
    },
    /// GPU VMM memory (CUDA or HIP) shared as one descriptor per physical chunk.
    CudaVmm {
        /// (descriptor, offset of the chunk from the first chunk, chunk size), in address order.
        chunks: Vec<(OwnedFd, u64, u64)>,
        /// Offset of the KV range from the first chunk.
        offset_bytes: u64,
        /// Bytes of the KV range.
        size_bytes: u64,
    },
    /// A legacy IPC handle (CUDA or HIP) of an allocation's base, and the range of it that
    /// holds the KV cache.
    CudaIpc {
        /// `cuIpcGetMemHandle`/`hipIpcGetMemHandle` of the allocation base.
        handle: [u8; IPC_HANDLE_BYTES],
        /// Offset of the KV range from the allocation base.
        offset_bytes: u64,
        /// Bytes of the KV range.
        size_bytes: u64,
    },
}

/// Keeps the pool registered (pinned) with a GPU driver; dropping it unregisters.
pub trait PinnedPool: Send + Sync + fmt::Debug {}

/// A registration of the pool with a GPU driver.
pub type PoolPin = Box<dyn PinnedPool>;

/// Formats a UUID the way nvidia-smi does.
pub fn format_nvidia_uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_print_like_nvidia_smi() {
        let u = [
            0x3f, 0x2a, 0x1b, 0x0c, 0xde, 0xad, 0xbe, 0xef, 0, 1, 2, 3, 4, 5, 6, 7,
        ];
        assert_eq!(
            format_nvidia_uuid(&u),
            "GPU-3f2a1b0c-dead-beef-0001-020304050607"
        );
    }
}
