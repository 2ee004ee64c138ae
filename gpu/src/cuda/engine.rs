//! A GPU's copy engine: two streams (device→pool and pool→device, so stores and retrieves run on
//! separate DMA engines at once), batched copies straight between the client's KV blocks and the
//! pinned pool — no staging buffer, nothing allocated on the GPU — ordered against the client's
//! forward pass by its interprocess event and announced by one of kvd's.
//!
//! Copies go through `cuMemcpyBatchAsync` where the driver has it (one call for up to
//! [`MAX_BATCH`] descriptors; 40 GB/s at 32 KiB blocks on an H200 against 11.5 GB/s for one
//! `cuMemcpyAsync` per block — DESIGN.md §4), else one `cuMemcpyAsync` per run.

use std::sync::Arc;

use cudarc::driver::sys;

use super::device::{CudaImports, DeviceInner};
use super::driver::{check, destroy_event, has_symbol, release_failed, Event, Stream};
use crate::copy::{CopyJob, Direction};
use crate::error::GpuError;
use crate::memory::PoolMemory;

/// Descriptors per batch call; large batches have been reported to hang some drivers.
pub const MAX_BATCH: usize = 4096;

/// Bytes after which a batch call is cut. The copy engine starts on a batch only once its call
/// returns, and a call spends about a microsecond of CPU per descriptor; cutting a request into
/// batches of a few MiB lets the engine copy one while the next is submitted, instead of
/// idling while a request of thousands of descriptors is submitted whole.
pub const PIPELINE_BYTES: usize = 8 << 20;

/// The end of the batch that starts at `start`: at most [`MAX_BATCH`] descriptors, cut once it
/// holds [`PIPELINE_BYTES`] (a single larger descriptor is a batch of its own).
fn batch_end(sizes: &[usize], start: usize) -> usize {
    let mut bytes = 0usize;
    let limit = (start + MAX_BATCH).min(sizes.len());
    for (i, &len) in sizes.iter().enumerate().take(limit).skip(start) {
        bytes += len;
        if bytes >= PIPELINE_BYTES {
            return i + 1;
        }
    }
    limit
}

const DONE_EVENT_FLAGS: u32 = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
    | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;

/// The copy engine of one GPU; lives on that GPU's copy thread.
#[derive(Debug)]
pub struct CudaEngine {
    device: Arc<DeviceInner>,
    pool: Arc<PoolMemory>,
    d2h: Stream,
    h2d: Stream,
    batch: bool,
    dsts: Vec<sys::CUdeviceptr>,
    srcs: Vec<sys::CUdeviceptr>,
    sizes: Vec<usize>,
    batch_fallback_logged: bool,
}

static BATCH_FALLBACKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Copy jobs whose batch call was refused and that were copied run by run instead.
pub fn batch_fallbacks() -> u64 {
    BATCH_FALLBACKS.load(std::sync::atomic::Ordering::Relaxed)
}

fn location(device: Option<i32>) -> sys::CUmemLocation {
    match device {
        Some(ordinal) => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        None => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
    }
}

impl CudaEngine {
    /// Makes the device's context current on the calling (copy) thread and creates the streams.
    pub(crate) fn new(device: Arc<DeviceInner>, pool: Arc<PoolMemory>) -> Result<Self, GpuError> {
        device.ctx.make_current()?;
        let mut streams = [Stream(std::ptr::null_mut()); 2];
        for s in &mut streams {
            let mut st: sys::CUstream = std::ptr::null_mut();
            // SAFETY: out-pointer to a local; the context is current. Non-blocking: never
            // synchronises with the legacy default stream.
            let r = unsafe {
                sys::cuStreamCreate(&mut st, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            };
            check("cuStreamCreate", r)?;
            *s = Stream(st);
        }
        let batch =
            has_symbol("cuMemcpyBatchAsync_v2") && std::env::var_os("KVD_NO_BATCH_COPY").is_none();
        tracing::info!(
            device = %device.label,
            "copy engine ready: {}",
            if batch { "cuMemcpyBatchAsync" } else { "cuMemcpyAsync per run (no batch copy in this driver)" }
        );
        Ok(CudaEngine {
            device,
            pool,
            d2h: streams[0],
            h2d: streams[1],
            batch,
            dsts: Vec::new(),
            srcs: Vec::new(),
            sizes: Vec::new(),
            batch_fallback_logged: false,
        })
    }

    fn enqueue(&mut self, stream: Stream, direction: Direction) -> Result<(), GpuError> {
        if self.batch {
            match self.enqueue_batch(stream, direction) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    // The batch API refused these copies (seen on driver 580 for some batches
                    // with CUDA_ERROR_INVALID_VALUE). A refused batch enqueues nothing, and the
                    // copies are idempotent, so they go again one by one.
                    let bytes: usize = self.sizes.iter().sum();
                    if !self.batch_fallback_logged {
                        tracing::warn!(
                            device = %self.device.label,
                            descriptors = self.sizes.len(),
                            bytes,
                            "{e}; copying these runs with cuMemcpyAsync instead"
                        );
                        self.batch_fallback_logged = true;
                    }
                    BATCH_FALLBACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        for i in 0..self.sizes.len() {
            // SAFETY: unified addressing makes the pinned pool's host addresses valid
            // CUdeviceptrs; both ranges were bounds-checked.
            let r =
                unsafe { sys::cuMemcpyAsync(self.dsts[i], self.srcs[i], self.sizes[i], stream.0) };
            check("cuMemcpyAsync", r)?;
        }
        Ok(())
    }

    fn enqueue_batch(&mut self, stream: Stream, direction: Direction) -> Result<(), GpuError> {
        {
            let (src_dev, dst_dev) = match direction {
                Direction::D2h => (Some(self.device.ordinal), None),
                Direction::H2d => (None, Some(self.device.ordinal)),
            };
            let mut attr = sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: location(src_dev),
                dstLocHint: location(dst_dev),
                flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
            };
            let mut idx = 0usize;
            let mut start = 0;
            while start < self.sizes.len() {
                let end = batch_end(&self.sizes, start);
                // SAFETY: the three arrays hold `end - start` valid entries from `start`; every
                // address was bounds-checked against its mapping; one attribute applies to all.
                let r = unsafe {
                    sys::cuMemcpyBatchAsync_v2(
                        self.dsts[start..end].as_mut_ptr(),
                        self.srcs[start..end].as_mut_ptr(),
                        self.sizes[start..end].as_mut_ptr(),
                        end - start,
                        &mut attr,
                        &mut idx,
                        1,
                        stream.0,
                    )
                };
                check("cuMemcpyBatchAsync_v2", r)?;
                start = end;
            }
        }
        Ok(())
    }
}

impl CudaEngine {
    /// Enqueues `job` over `imports` (the job's own, matched by [`crate::CopyEngine`]): waits for
    /// the client's event on the copy stream, copies, records one of kvd's events.
    pub fn submit(
        &mut self,
        job: &CopyJob,
        imports: &CudaImports,
    ) -> Result<CudaCompletion, GpuError> {
        if (imports.memories.iter()).any(|m| !Arc::ptr_eq(m.device(), &self.device)) {
            return Err(GpuError::Invalid(
                "memory of another GPU given to this GPU's engine".into(),
            ));
        }
        let events = match &imports.events {
            Some(e) if !Arc::ptr_eq(e.device(), &self.device) => {
                return Err(GpuError::Invalid("events of another device".into()))
            }
            e => e.as_ref(),
        };
        let memories = &imports.memories;
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
        for run in &job.runs {
            let mem = memories.get(run.memory as usize).ok_or_else(|| {
                GpuError::Invalid(format!("copy run names allocation {}", run.memory))
            })?;
            let dev = mem.device_ptr(run.device_offset_bytes, run.len_bytes)?;
            let host = self.pool.ptr_at(run.pool_offset_bytes, run.len_bytes)? as sys::CUdeviceptr;
            let (dst, src) = match job.direction {
                Direction::D2h => (host, dev),
                Direction::H2d => (dev, host),
            };
            self.dsts.push(dst);
            self.srcs.push(src);
            self.sizes.push(run.len_bytes as usize);
        }
        let stream = match job.direction {
            Direction::D2h => self.d2h,
            Direction::H2d => self.h2d,
        };
        if let Some(slot) = job.wait_slot {
            let ev = events
                .ok_or_else(|| GpuError::Invalid("wait_slot without registered events".into()))?
                .client(slot)?;
            // A stream wait on another process's event left the copy engine idle for about
            // 200 µs per copy on an H200 even when the event had long completed (stores ran
            // 0.85 of the ceiling against 0.92 for retrieves; benches/RESULTS.md), so the wait
            // is queued only while the client's work is still running.
            // SAFETY: `ev` is an opened IPC event kept alive by the job.
            match unsafe { sys::cuEventQuery(ev.0) } {
                sys::CUresult::CUDA_SUCCESS => {}
                sys::CUresult::CUDA_ERROR_NOT_READY => {
                    // SAFETY: as above; the stream is ours.
                    check("cuStreamWaitEvent", unsafe {
                        sys::cuStreamWaitEvent(stream.0, ev.0, 0)
                    })?
                }
                r => check("cuEventQuery", r)?,
            }
        }
        self.enqueue(stream, job.direction)?;
        let slot = match events.and_then(|e| e.next_server()) {
            Some((slot, ev)) => {
                // SAFETY: `ev` is one of kvd's interprocess events, alive while the job holds the
                // ring.
                check("cuEventRecord", unsafe {
                    sys::cuEventRecord(ev.0, stream.0)
                })?;
                Some(slot)
            }
            None => None,
        };
        let mut done: sys::CUevent = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the context is current on this thread.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut done, DONE_EVENT_FLAGS)
        })?;
        let completion = CudaCompletion {
            device: self.device.clone(),
            event: Event(done),
            slot,
        };
        // SAFETY: `done` was just created in this context; the stream is ours.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(done, stream.0)
        })?;
        Ok(completion)
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        if let Err(e) = self.device.ctx.make_current() {
            release_failed("copy streams", e);
            return;
        }
        for s in [self.d2h, self.h2d] {
            // SAFETY: created in `new`, destroyed once; queued work still completes.
            if let Err(e) = check("cuStreamDestroy_v2", unsafe {
                sys::cuStreamDestroy_v2(s.0)
            }) {
                release_failed("a copy stream", e);
            }
        }
    }
}

/// A submitted GPU copy: an event recorded after its last descriptor.
#[derive(Debug)]
pub struct CudaCompletion {
    device: Arc<DeviceInner>,
    event: Event,
    slot: Option<u16>,
}

impl CudaCompletion {
    /// kvd's event slot the client can poll, if the registration has events.
    pub fn event_slot(&self) -> Option<u16> {
        self.slot
    }

    /// Blocks until the copy is complete.
    pub fn wait(self) -> Result<(), GpuError> {
        self.device.ctx.make_current()?;
        // SAFETY: the event is alive until `self` drops; blocking-sync events sleep, not spin.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.event.0)
        })
    }
}

impl Drop for CudaCompletion {
    fn drop(&mut self) {
        if let Err(e) = self.device.ctx.make_current() {
            release_failed("a completion event", e);
            return;
        }
        // Created in `submit`, destroyed once here.
        destroy_event(self.event, "a completion event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cuts every batch of `sizes` as the engine would.
    fn batches(sizes: &[usize]) -> Vec<std::ops::Range<usize>> {
        let mut out = Vec::new();
        let mut start = 0;
        while start < sizes.len() {
            let end = batch_end(sizes, start);
            assert!(end > start, "a batch must make progress");
            out.push(start..end);
            start = end;
        }
        out
    }

    #[test]
    fn batches_are_cut_by_bytes_and_count_and_cover_every_descriptor() {
        const MIB: usize = 1 << 20;
        // Small descriptors: cut once a batch reaches PIPELINE_BYTES.
        let small = vec![128 << 10; 200];
        let b = batches(&small);
        assert_eq!(b[0], 0..PIPELINE_BYTES / (128 << 10));
        assert!(b.iter().all(|r| r.len() <= PIPELINE_BYTES / (128 << 10)));
        // A descriptor larger than the cut is a batch of its own.
        assert_eq!(batches(&[32 * MIB, 32 * MIB, MIB]), vec![0..1, 1..2, 2..3]);
        // Tiny descriptors: the count limit applies.
        let tiny = vec![16; MAX_BATCH * 2 + 3];
        assert_eq!(
            batches(&tiny),
            vec![
                0..MAX_BATCH,
                MAX_BATCH..2 * MAX_BATCH,
                2 * MAX_BATCH..2 * MAX_BATCH + 3
            ]
        );
        // Every descriptor is in exactly one batch, in order.
        for sizes in [small, tiny, vec![7 * MIB, 2 * MIB, 1, 9 * MIB, 3]] {
            let b = batches(&sizes);
            assert_eq!(b.first().unwrap().start, 0);
            assert_eq!(b.last().unwrap().end, sizes.len());
            assert!(b.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}
