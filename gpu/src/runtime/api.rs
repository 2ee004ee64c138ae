//! The [`Runtime`] trait: the driver operations kvd uses, once for CUDA and once for HIP. An
//! implementation is the `result` layer of cudarc's shape — each method makes one raw call (or
//! a few that belong together) and turns its status into a [`GpuError`] naming the call — and
//! holds no state: the owning types of [`crate::runtime`] keep the handles and release them.
//!
//! Methods that take a handle, a device address or a host pointer are `unsafe`: the runtime
//! cannot check that the handle is live or the range mapped, so the caller promises it. The
//! others only create objects or answer questions, and the runtime checks their arguments.
//! Unless a method says otherwise, the device the call concerns must be current on the calling
//! thread ([`Runtime::make_current`]).

use std::fmt::Debug;
use std::os::fd::{BorrowedFd, OwnedFd};

use crate::copy::Direction;
use crate::error::GpuError;
use crate::types::{format_nvidia_uuid, IPC_HANDLE_BYTES};

/// One GPU runtime: NVIDIA's CUDA driver API or AMD's HIP runtime.
pub trait Runtime: Sized + Send + Sync + Debug + 'static {
    /// `CUDA` or `HIP`, for logs and errors.
    const NAME: &'static str;
    /// The prefix of device labels: `cuda` or `hip`.
    const LABEL: &'static str;
    /// The runtime as an error names it: `the CUDA driver`, `the HIP runtime`.
    const DRIVER: &'static str;
    /// How to make every GPU visible to kvd, for the error when it cannot see one.
    const VISIBILITY_FIX: &'static str;
    /// The per-run async copy call, for logs.
    const COPY_CALL: &'static str;
    /// The fix when a VMM chunk cannot be exported by descriptor.
    const EXPORT_FIX: &'static str;

    /// What keeps a device usable by this process: CUDA's retained primary context, HIP's
    /// device ordinal. Dropping it releases what `retain` took.
    type Context: Send + Sync + Debug;
    /// A stream handle of kvd's own or of a client.
    type Stream: Copy + Send + Sync + Debug;
    /// An event handle: completions and both sides' interprocess events.
    type Event: Copy + Send + Sync + Debug;
    /// A VMM physical allocation handle.
    type AllocHandle: Copy;

    /// Whether the runtime could be loaded and initialised; decided once.
    fn available() -> Result<(), GpuError>;
    /// Number of devices the runtime sees.
    fn device_count() -> Result<i32, GpuError>;
    /// UUID and name of device `ordinal`.
    fn device_identity(ordinal: i32) -> Result<([u8; 16], String), GpuError>;
    /// The PCI bus id of device `ordinal` (`0000:1B:00.0`), where the runtime gives one.
    fn pci_bus_id(ordinal: i32) -> Option<Result<String, GpuError>>;
    /// A UUID as logs and errors show it (as nvidia-smi does, unless the runtime says otherwise).
    fn format_uuid(uuid: &[u8; 16]) -> String {
        format_nvidia_uuid(uuid)
    }

    /// Takes what the process needs to use device `ordinal` (no device need be current).
    fn retain(ordinal: i32) -> Result<Self::Context, GpuError>;
    /// Like [`Runtime::retain`], for kvd's own use of a device: trims what a process that runs
    /// no kernels does not need. Never call it in a client, whose context is shared with the
    /// model.
    fn retain_for_copies(ordinal: i32) -> Result<Self::Context, GpuError> {
        Self::retain(ordinal)
    }
    /// Makes the device of `ctx` current on the calling thread.
    fn make_current(ctx: &Self::Context) -> Result<(), GpuError>;

    /// Registers host memory for DMA (portable, device-mapped).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be a live mapping of this process, registered with no other
    /// range, that outlives the registration.
    unsafe fn host_register(ptr: *mut std::ffi::c_void, len: usize) -> Result<(), GpuError>;
    /// Unregisters host memory.
    ///
    /// # Safety
    /// `ptr` must have been registered by [`Runtime::host_register`] and not unregistered since.
    unsafe fn host_unregister(ptr: *mut std::ffi::c_void) -> Result<(), GpuError>;

    /// Creates a non-blocking stream (never synchronises with the default stream).
    fn stream_create() -> Result<Self::Stream, GpuError>;
    /// Destroys a stream; queued work still completes.
    ///
    /// # Safety
    /// `s` must have come from [`Runtime::stream_create`] and not be used again.
    unsafe fn stream_destroy(s: Self::Stream) -> Result<(), GpuError>;
    /// A stream handle as a client passes it (PyTorch's `cuda_stream`; 0 for the default one).
    fn stream_from_raw(raw: u64) -> Self::Stream;

    /// Creates an interprocess event (timing off) and exports its IPC handle. The caller owns
    /// the event.
    fn ipc_event_create() -> Result<(Self::Event, [u8; IPC_HANDLE_BYTES]), GpuError>;
    /// Opens another process's interprocess event; the caller owns the result.
    fn ipc_event_open(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<Self::Event, GpuError>;
    /// Creates a completion event: blocking sync (a waiting thread sleeps), timing off.
    fn done_event_create() -> Result<Self::Event, GpuError>;
    /// Destroys (or, for an opened one, closes) an event.
    ///
    /// # Safety
    /// The caller owns `e` and never uses it again.
    unsafe fn event_destroy(e: Self::Event) -> Result<(), GpuError>;
    /// Records `e` on `s`.
    ///
    /// # Safety
    /// `e` and `s` must be live handles of the current device.
    unsafe fn event_record(e: Self::Event, s: Self::Stream) -> Result<(), GpuError>;
    /// Whether the work before `e` has completed; never blocks.
    ///
    /// # Safety
    /// `e` must be a live event.
    unsafe fn event_query(e: Self::Event) -> Result<bool, GpuError>;
    /// Blocks until the work before `e` has completed.
    ///
    /// # Safety
    /// `e` must be a live event.
    unsafe fn event_synchronize(e: Self::Event) -> Result<(), GpuError>;
    /// Makes `s` wait for `e`, without blocking the host.
    ///
    /// # Safety
    /// `e` and `s` must be live handles usable on the current device.
    unsafe fn stream_wait_event(s: Self::Stream, e: Self::Event) -> Result<(), GpuError>;

    /// Enqueues one copy of `len` bytes between unified addresses.
    ///
    /// # Safety
    /// Both ranges must lie in memory the runtime can reach (device memory, or host memory it
    /// registered) and stay mapped until the copy completes; `s` must be live.
    unsafe fn memcpy_async(dst: u64, src: u64, len: usize, s: Self::Stream)
        -> Result<(), GpuError>;
    /// How the engine copies, for its start-up log line, with batches or without.
    fn copy_path(batch: bool) -> &'static str;
    /// Whether [`Runtime::memcpy_batch_async`] may be used (the runtime has it and the operator
    /// did not turn it off).
    fn batch_copy_available() -> bool {
        false
    }
    /// Enqueues `dsts.len()` copies in one call; the three slices have the same length. A
    /// refused batch enqueues nothing.
    ///
    /// # Safety
    /// As for [`Runtime::memcpy_async`], for every descriptor.
    unsafe fn memcpy_batch_async(
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        direction: Direction,
        ordinal: i32,
        s: Self::Stream,
    ) -> Result<(), GpuError>;
    /// Warns about settings that would make this runtime's copies slow down the model.
    fn warn_about_copy_settings(_label: &str) {}

    /// Opens another process's allocation from the IPC handle of its base; returns the base.
    fn ipc_open_mem(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64, GpuError>;
    /// Closes an allocation opened by [`Runtime::ipc_open_mem`].
    ///
    /// # Safety
    /// `base` came from `ipc_open_mem`, is closed once, and no copy uses it any more.
    unsafe fn ipc_close_mem(base: u64) -> Result<(), GpuError>;
    /// Exports the legacy IPC handle of an allocation base.
    fn ipc_get_mem_handle(base: u64) -> Result<[u8; IPC_HANDLE_BYTES], GpuError>;
    /// Base and size of the allocation (or mapped VMM chunk) that holds `ptr`.
    fn address_range(ptr: u64) -> Result<(u64, u64), GpuError>;

    /// The granularity VMM chunks imported on `ordinal` must be multiples of, where kvd checks
    /// one (`None`: the runtime's default alignment, chunks taken as the exporter made them).
    fn import_granularity(ordinal: i32) -> Result<Option<u64>, GpuError>;
    /// The granularity of VMM test buffers on `ordinal`.
    fn buffer_granularity(ordinal: i32) -> Result<u64, GpuError>;
    /// Reserves `size` bytes of device address space aligned to `align` (0: the default).
    fn address_reserve(size: u64, align: u64) -> Result<u64, GpuError>;
    /// Frees a reservation.
    ///
    /// # Safety
    /// `[ptr, ptr + size)` came from [`Runtime::address_reserve`] and nothing is mapped in it.
    unsafe fn address_free(ptr: u64, size: u64) -> Result<(), GpuError>;
    /// Maps the physical allocation `h` (of `size` bytes) at `ptr`.
    ///
    /// # Safety
    /// `[ptr, ptr + size)` lies inside a reservation and nothing else is mapped there.
    unsafe fn mem_map(ptr: u64, size: u64, h: Self::AllocHandle) -> Result<(), GpuError>;
    /// Unmaps a range mapped by [`Runtime::mem_map`].
    ///
    /// # Safety
    /// The range was mapped by `mem_map`, is unmapped once, and no copy uses it any more.
    unsafe fn mem_unmap(ptr: u64, size: u64) -> Result<(), GpuError>;
    /// Gives read-write access to `[ptr, ptr + size)` to device `ordinal`.
    ///
    /// # Safety
    /// Every granule of the range is mapped.
    unsafe fn set_access(ptr: u64, size: u64, ordinal: i32) -> Result<(), GpuError>;
    /// Releases a physical allocation handle (a mapping keeps the memory alive).
    ///
    /// # Safety
    /// `h` came from this runtime and is released once.
    unsafe fn mem_release(h: Self::AllocHandle) -> Result<(), GpuError>;
    /// Creates a physical allocation of `size` bytes on `ordinal`, exportable by descriptor.
    fn mem_create(size: u64, ordinal: i32) -> Result<Self::AllocHandle, GpuError>;
    /// Imports a physical allocation from a POSIX descriptor (the descriptor may be closed
    /// afterwards).
    fn mem_import_fd(fd: BorrowedFd<'_>) -> Result<Self::AllocHandle, GpuError>;
    /// The handle of the mapped VMM chunk that starts at `ptr` (release it when done).
    fn mem_retain_handle(ptr: u64) -> Result<Self::AllocHandle, GpuError>;
    /// Exports a physical allocation as a new POSIX descriptor.
    ///
    /// # Safety
    /// `h` is a live handle from this runtime.
    unsafe fn mem_export_fd(h: Self::AllocHandle) -> Result<OwnedFd, GpuError>;
    /// Whether the runtime can share VMM memory by descriptor here.
    fn fd_export_supported() -> bool;

    /// The device ordinal of the allocation that holds `ptr` (no device need be current).
    fn pointer_ordinal(ptr: u64) -> Result<i32, GpuError>;
    /// Whether legacy IPC can export the allocation that holds `ptr` (base `base`).
    fn legacy_ipc_capable(ptr: u64, base: u64) -> Result<bool, GpuError>;
    /// Free and total memory of the current device, in bytes.
    fn mem_info() -> Result<(u64, u64), GpuError>;
    /// Allocates `size` bytes of plain device memory.
    fn mem_alloc(size: u64) -> Result<u64, GpuError>;
    /// Frees memory from [`Runtime::mem_alloc`].
    ///
    /// # Safety
    /// `ptr` came from `mem_alloc`, is freed once, and no work uses it any more.
    unsafe fn mem_free(ptr: u64) -> Result<(), GpuError>;
    /// Copies `src` to device address `dst`, synchronously.
    ///
    /// # Safety
    /// `[dst, dst + src.len())` is mapped device memory.
    unsafe fn copy_to_device(dst: u64, src: &[u8]) -> Result<(), GpuError>;
    /// Copies device bytes at `src` into `dst`, synchronously.
    ///
    /// # Safety
    /// `[src, src + dst.len())` is mapped device memory.
    unsafe fn copy_from_device(dst: &mut [u8], src: u64) -> Result<(), GpuError>;
    /// Fills `len` bytes at `ptr` with `value` on `s`, without waiting.
    ///
    /// # Safety
    /// The range is mapped device memory and `s` a live stream of the current device.
    unsafe fn memset_async(ptr: u64, value: u8, len: u64, s: Self::Stream) -> Result<(), GpuError>;
    /// Waits for all work on the current device.
    fn synchronize() -> Result<(), GpuError>;
}
