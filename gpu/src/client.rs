//! The client side of a GPU backend, as the Python connector and the GPU tests use it: one API
//! over CUDA and HIP, chosen by [`GpuApi`]. The two differ only in which runtime they call; what
//! they produce — IPC handles, VMM chunk descriptors, event handles — goes into the same wire
//! messages, since kvd matches GPUs by UUID and imports with whichever backend it found.
//!
//! The calls are written once, generic over the runtime, in [`crate::runtime::client`] and
//! [`crate::runtime::buffers`]; this module turns a [`GpuApi`] into that code for one runtime
//! (`ClientApi`, a trait object chosen in one `match`), so that callers hold one type whichever
//! runtime their PyTorch was built for.

use std::fmt;

use crate::error::GpuError;
use crate::types::IPC_HANDLE_BYTES;

#[cfg(any(feature = "cuda", feature = "hip"))]
pub use crate::runtime::client::{ExportedChunk, Pointer};

/// Which GPU runtime a client uses: the one its PyTorch was built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuApi {
    /// NVIDIA's CUDA driver API.
    Cuda,
    /// AMD's HIP runtime (ROCm), or HIP's NVIDIA platform in kvd's tests.
    Hip,
}

impl GpuApi {
    /// `cuda` or `hip`, as the connector names devices.
    pub fn name(self) -> &'static str {
        match self {
            GpuApi::Cuda => "cuda",
            GpuApi::Hip => "hip",
        }
    }

    /// The API named `cuda` or `hip`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "cuda" => Some(GpuApi::Cuda),
            "hip" => Some(GpuApi::Hip),
            _ => None,
        }
    }
}

#[cfg(any(feature = "cuda", feature = "hip"))]
mod dispatch {
    //! [`ClientApi`], the client calls of one runtime as an object, and its one implementation.

    use std::marker::PhantomData;

    use super::*;
    use crate::runtime::{buffers, client, Runtime};

    /// Client events of one runtime.
    pub(super) trait ClientEventOps: Send + Sync + fmt::Debug {
        fn handles(&self) -> &[[u8; IPC_HANDLE_BYTES]];
        fn record(&self, slot: usize, stream: u64) -> Result<(), GpuError>;
    }

    /// kvd's events, opened by a client of one runtime.
    pub(super) trait ServerEventOps: Send + Sync + fmt::Debug {
        fn query(&self, slot: u16) -> Result<bool, GpuError>;
        fn stream_wait(&self, slot: u16, stream: u64) -> Result<(), GpuError>;
        fn synchronize(&self, slot: u16) -> Result<(), GpuError>;
    }

    /// A test buffer of one runtime.
    pub(super) trait BufferOps: Send + fmt::Debug {
        fn ptr(&self) -> u64;
        fn size_bytes(&self) -> u64;
        fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuError>;
        fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError>;
        fn fill_async(&self, offset: u64, len: u64, value: u8, stream: u64)
            -> Result<(), GpuError>;
        fn synchronize(&self) -> Result<(), GpuError>;
    }

    /// The client calls of one runtime.
    pub(super) trait ClientApi: Sync {
        fn available(&self) -> Result<(), GpuError>;
        fn format_uuid(&self, uuid: &[u8; 16]) -> String;
        fn describe(&self, ptr: u64) -> Result<Pointer, GpuError>;
        fn ipc_handle(&self, p: &Pointer) -> Result<[u8; IPC_HANDLE_BYTES], GpuError>;
        fn vmm_chunks(
            &self,
            ordinal: i32,
            ptr: u64,
            size: u64,
        ) -> Result<Vec<(u64, u64)>, GpuError>;
        fn export_chunks(
            &self,
            ordinal: i32,
            chunks: &[(u64, u64)],
            first_base: u64,
        ) -> Result<Vec<ExportedChunk>, GpuError>;
        fn mem_info(&self, ordinal: i32) -> Result<(u64, u64), GpuError>;
        fn client_events(
            &self,
            ordinal: i32,
            n: usize,
        ) -> Result<Box<dyn ClientEventOps>, GpuError>;
        fn server_events(
            &self,
            ordinal: i32,
            handles: &[[u8; IPC_HANDLE_BYTES]],
        ) -> Result<Box<dyn ServerEventOps>, GpuError>;
        fn device_buffer(&self, ordinal: i32, size: u64) -> Result<Box<dyn BufferOps>, GpuError>;
        fn vmm_buffer(
            &self,
            ordinal: i32,
            size: u64,
            chunk: u64,
        ) -> Result<Box<dyn BufferOps>, GpuError>;
    }

    /// The client calls of runtime `R`.
    pub(super) struct On<R>(PhantomData<R>);

    /// The CUDA client.
    #[cfg(feature = "cuda")]
    pub(super) static CUDA: On<crate::cuda::Cuda> = On(PhantomData);
    /// The HIP client.
    #[cfg(feature = "hip")]
    pub(super) static HIP: On<crate::hip::Hip> = On(PhantomData);

    impl<R: Runtime> ClientEventOps for client::ClientEvents<R> {
        fn handles(&self) -> &[[u8; IPC_HANDLE_BYTES]] {
            client::ClientEvents::handles(self)
        }
        fn record(&self, slot: usize, stream: u64) -> Result<(), GpuError> {
            client::ClientEvents::record(self, slot, stream)
        }
    }

    impl<R: Runtime> ServerEventOps for client::ServerEvents<R> {
        fn query(&self, slot: u16) -> Result<bool, GpuError> {
            client::ServerEvents::query(self, slot)
        }
        fn stream_wait(&self, slot: u16, stream: u64) -> Result<(), GpuError> {
            client::ServerEvents::stream_wait(self, slot, stream)
        }
        fn synchronize(&self, slot: u16) -> Result<(), GpuError> {
            client::ServerEvents::synchronize(self, slot)
        }
    }

    impl<R: Runtime> BufferOps for buffers::DeviceBuffer<R> {
        fn ptr(&self) -> u64 {
            buffers::DeviceBuffer::ptr(self)
        }
        fn size_bytes(&self) -> u64 {
            buffers::DeviceBuffer::size_bytes(self)
        }
        fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
            buffers::DeviceBuffer::write(self, offset, src)
        }
        fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
            buffers::DeviceBuffer::read(self, offset, dst)
        }
        fn fill_async(
            &self,
            offset: u64,
            len: u64,
            value: u8,
            stream: u64,
        ) -> Result<(), GpuError> {
            buffers::DeviceBuffer::fill_async(self, offset, len, value, stream)
        }
        fn synchronize(&self) -> Result<(), GpuError> {
            buffers::DeviceBuffer::synchronize(self)
        }
    }

    impl<R: Runtime> BufferOps for buffers::VmmBuffer<R> {
        fn ptr(&self) -> u64 {
            buffers::VmmBuffer::ptr(self)
        }
        fn size_bytes(&self) -> u64 {
            buffers::VmmBuffer::size_bytes(self)
        }
        fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
            buffers::VmmBuffer::write(self, offset, src)
        }
        fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
            buffers::VmmBuffer::read(self, offset, dst)
        }
        fn fill_async(&self, _: u64, _: u64, _: u8, _: u64) -> Result<(), GpuError> {
            Err(GpuError::Invalid(
                "VMM test buffers are filled by write".into(),
            ))
        }
        fn synchronize(&self) -> Result<(), GpuError> {
            Err(GpuError::Invalid(
                "VMM test buffers copy synchronously".into(),
            ))
        }
    }

    impl<R: Runtime> ClientApi for On<R> {
        fn available(&self) -> Result<(), GpuError> {
            R::available()
        }
        fn format_uuid(&self, uuid: &[u8; 16]) -> String {
            R::format_uuid(uuid)
        }
        fn describe(&self, ptr: u64) -> Result<Pointer, GpuError> {
            client::describe::<R>(ptr)
        }
        fn ipc_handle(&self, p: &Pointer) -> Result<[u8; IPC_HANDLE_BYTES], GpuError> {
            client::ipc_handle::<R>(p)
        }
        fn vmm_chunks(
            &self,
            ordinal: i32,
            ptr: u64,
            size: u64,
        ) -> Result<Vec<(u64, u64)>, GpuError> {
            client::vmm_chunks::<R>(ordinal, ptr, size)
        }
        fn export_chunks(
            &self,
            ordinal: i32,
            chunks: &[(u64, u64)],
            first_base: u64,
        ) -> Result<Vec<ExportedChunk>, GpuError> {
            client::export_chunks::<R>(ordinal, chunks, first_base)
        }
        fn mem_info(&self, ordinal: i32) -> Result<(u64, u64), GpuError> {
            client::mem_info::<R>(ordinal)
        }
        fn client_events(
            &self,
            ordinal: i32,
            n: usize,
        ) -> Result<Box<dyn ClientEventOps>, GpuError> {
            Ok(Box::new(client::ClientEvents::<R>::new(ordinal, n)?))
        }
        fn server_events(
            &self,
            ordinal: i32,
            handles: &[[u8; IPC_HANDLE_BYTES]],
        ) -> Result<Box<dyn ServerEventOps>, GpuError> {
            Ok(Box::new(client::ServerEvents::<R>::open(ordinal, handles)?))
        }
        fn device_buffer(&self, ordinal: i32, size: u64) -> Result<Box<dyn BufferOps>, GpuError> {
            Ok(Box::new(buffers::DeviceBuffer::<R>::alloc(ordinal, size)?))
        }
        fn vmm_buffer(
            &self,
            ordinal: i32,
            size: u64,
            chunk: u64,
        ) -> Result<Box<dyn BufferOps>, GpuError> {
            Ok(Box::new(buffers::VmmBuffer::<R>::alloc_chunked(
                ordinal, size, chunk,
            )?))
        }
    }
}

#[cfg(any(feature = "cuda", feature = "hip"))]
use dispatch::{BufferOps, ClientApi, ClientEventOps, ServerEventOps};

/// The client calls of `api`'s runtime, or why this build has none.
#[cfg(any(feature = "cuda", feature = "hip"))]
fn runtime(api: GpuApi) -> Result<&'static dyn ClientApi, GpuError> {
    match api {
        #[cfg(feature = "cuda")]
        GpuApi::Cuda => Ok(&dispatch::CUDA),
        #[cfg(feature = "hip")]
        GpuApi::Hip => Ok(&dispatch::HIP),
        #[allow(unreachable_patterns)]
        other => Err(GpuError::Unavailable(format!(
            "this build of kvd has no {} backend (cargo feature {})",
            other.name(),
            other.name()
        ))),
    }
}

/// Whether the runtime can be loaded here, and if not, why.
#[cfg(any(feature = "cuda", feature = "hip"))]
pub fn available(api: GpuApi) -> Result<(), GpuError> {
    runtime(api)?.available()
}

/// A device UUID as `api`'s runtime shows it in logs and errors.
#[cfg(any(feature = "cuda", feature = "hip"))]
pub fn format_uuid(api: GpuApi, uuid: &[u8; 16]) -> String {
    match runtime(api) {
        Ok(r) => r.format_uuid(uuid),
        Err(_) => crate::types::format_nvidia_uuid(uuid),
    }
}

/// Describes the allocation holding `ptr`.
#[cfg(any(feature = "cuda", feature = "hip"))]
pub fn describe(api: GpuApi, ptr: u64) -> Result<Pointer, GpuError> {
    runtime(api)?.describe(ptr)
}

/// Exports the legacy IPC handle of an allocation base ([`GpuError::VmmMemory`] for VMM memory).
#[cfg(any(feature = "cuda", feature = "hip"))]
pub fn ipc_handle(api: GpuApi, p: &Pointer) -> Result<[u8; IPC_HANDLE_BYTES], GpuError> {
    runtime(api)?.ipc_handle(p)
}

/// The physical chunks behind a VMM range, as (chunk base, chunk size).
#[cfg(any(feature = "cuda", feature = "hip"))]
pub fn vmm_chunks(
    api: GpuApi,
    ordinal: i32,
    ptr: u64,
    size: u64,
) -> Result<Vec<(u64, u64)>, GpuError> {
    runtime(api)?.vmm_chunks(ordinal, ptr, size)
}

/// Exports VMM chunks as POSIX descriptors.
#[cfg(any(feature = "cuda", feature = "hip"))]
pub fn export_chunks(
    api: GpuApi,
    ordinal: i32,
    chunks: &[(u64, u64)],
    first_base: u64,
) -> Result<Vec<ExportedChunk>, GpuError> {
    runtime(api)?.export_chunks(ordinal, chunks, first_base)
}

/// Free and total memory of a device, in bytes.
#[cfg(any(feature = "cuda", feature = "hip"))]
pub fn mem_info(api: GpuApi, ordinal: i32) -> Result<(u64, u64), GpuError> {
    runtime(api)?.mem_info(ordinal)
}

/// The client's interprocess events, of one runtime: one is recorded on the model's stream
/// after a forward pass, and its slot sent with the store or retrieve.
#[cfg(any(feature = "cuda", feature = "hip"))]
#[derive(Debug)]
pub struct ClientEvents(Box<dyn ClientEventOps>);

#[cfg(any(feature = "cuda", feature = "hip"))]
impl ClientEvents {
    /// Creates `n` interprocess events on device `ordinal`.
    pub fn new(api: GpuApi, ordinal: i32, n: usize) -> Result<Self, GpuError> {
        runtime(api)?.client_events(ordinal, n).map(Self)
    }

    /// IPC handles, in slot order, for the registration.
    pub fn handles(&self) -> &[[u8; IPC_HANDLE_BYTES]] {
        self.0.handles()
    }

    /// Records event `slot` on `stream` (PyTorch's current stream handle).
    pub fn record(&self, slot: usize, stream: u64) -> Result<(), GpuError> {
        self.0.record(slot, stream)
    }
}

/// kvd's events as the client sees them, of one runtime.
#[cfg(any(feature = "cuda", feature = "hip"))]
#[derive(Debug)]
pub struct ServerEvents(Box<dyn ServerEventOps>);

#[cfg(any(feature = "cuda", feature = "hip"))]
impl ServerEvents {
    /// Opens kvd's events on device `ordinal`.
    pub fn open(
        api: GpuApi,
        ordinal: i32,
        handles: &[[u8; IPC_HANDLE_BYTES]],
    ) -> Result<Self, GpuError> {
        runtime(api)?.server_events(ordinal, handles).map(Self)
    }

    /// Whether the copy announced on `slot` has completed (never blocks).
    pub fn query(&self, slot: u16) -> Result<bool, GpuError> {
        self.0.query(slot)
    }

    /// Makes `stream` wait for the copy announced on `slot`, without blocking the host.
    pub fn stream_wait(&self, slot: u16, stream: u64) -> Result<(), GpuError> {
        self.0.stream_wait(slot, stream)
    }

    /// Blocks until the copy announced on `slot` has completed.
    pub fn synchronize(&self, slot: u16) -> Result<(), GpuError> {
        self.0.synchronize(slot)
    }
}

/// GPU memory standing in for a KV cache in tests and benchmarks, of one runtime: a plain
/// allocation ([`DeviceBuffer::alloc`]) or VMM chunks ([`DeviceBuffer::alloc_vmm`]) the way
/// PyTorch's expandable segments build them.
#[cfg(any(feature = "cuda", feature = "hip"))]
#[derive(Debug)]
pub struct DeviceBuffer(Box<dyn BufferOps>);

#[cfg(any(feature = "cuda", feature = "hip"))]
impl DeviceBuffer {
    /// Allocates `size_bytes` of plain device memory on device `ordinal`.
    pub fn alloc(api: GpuApi, ordinal: i32, size_bytes: u64) -> Result<Self, GpuError> {
        runtime(api)?.device_buffer(ordinal, size_bytes).map(Self)
    }

    /// Allocates `size_bytes` of VMM memory as physical chunks of `chunk_bytes` (both rounded up
    /// to the runtime's granularity), exportable as POSIX descriptors.
    pub fn alloc_vmm(
        api: GpuApi,
        ordinal: i32,
        size_bytes: u64,
        chunk_bytes: u64,
    ) -> Result<Self, GpuError> {
        runtime(api)?
            .vmm_buffer(ordinal, size_bytes, chunk_bytes)
            .map(Self)
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.0.ptr()
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }

    /// Copies `src` to the device at `offset` (synchronous).
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        self.0.write(offset, src)
    }

    /// Copies device bytes at `offset` into `dst` (synchronous).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        self.0.read(offset, dst)
    }

    /// Fills `len` bytes at `offset` with `value` on `stream` (0: the default stream), without
    /// waiting (plain allocations only).
    pub fn fill_async(
        &self,
        offset: u64,
        len: u64,
        value: u8,
        stream: u64,
    ) -> Result<(), GpuError> {
        self.0.fill_async(offset, len, value, stream)
    }

    /// Waits for all work on the device (plain allocations only).
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.0.synchronize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_names_round_trip_and_unknown_names_are_refused() {
        for api in [GpuApi::Cuda, GpuApi::Hip] {
            assert_eq!(GpuApi::from_name(api.name()), Some(api));
        }
        assert_eq!(GpuApi::from_name("rocm"), None);
    }
}
