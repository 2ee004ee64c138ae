//! A GPU's copy engine: two streams (device→pool and pool→device; the server runs one engine per
//! direction, each on its own thread, and uses one stream of each, so stores and retrieves are
//! submitted apart and run on separate DMA engines at once), copies straight between the
//! client's KV blocks and the pinned pool — no staging buffer, nothing allocated on the GPU —
//! ordered against the client's forward pass by its interprocess event and announced by one of
//! kvd's.
//!
//! Copies go through the runtime's batched copy where it has one (`cuMemcpyBatchAsync`: one
//! call for up to [`MAX_BATCH`] descriptors; 40 GB/s at 32 KiB blocks on an H200 against
//! 11.5 GB/s for one `cuMemcpyAsync` per block, measured before kvd was written), else one
//! async copy per run. HIP has none in the ROCm headers kvd is checked against; with the
//! block-outermost layout kvd asks vLLM for, a run is a whole block of all layers (2 MiB for
//! Llama-8B), where one call per run already keeps the engine busy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::copy::{Direction, SubmitTimes, Transfer};
use crate::error::{release_failed, GpuError};
use crate::memory::PoolMemory;
use crate::runtime::api::Runtime;
use crate::runtime::ctx::{destroy_event, DeviceCtx};
use crate::runtime::imports::GpuImports;

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

static BATCH_FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// Copy jobs whose batch call was refused and that were copied run by run instead.
pub fn batch_fallbacks() -> u64 {
    BATCH_FALLBACKS.load(Ordering::Relaxed)
}

/// A copy engine of one GPU; lives on the copy thread that submits to it.
#[derive(Debug)]
pub struct GpuEngine<R: Runtime> {
    device: Arc<DeviceCtx<R>>,
    pool: Arc<PoolMemory>,
    d2h: R::Stream,
    h2d: R::Stream,
    batch: bool,
    dsts: Vec<u64>,
    srcs: Vec<u64>,
    sizes: Vec<usize>,
    batch_fallback_logged: bool,
    last: SubmitTimes,
}

impl<R: Runtime> GpuEngine<R> {
    /// Makes the device current on the calling (copy) thread and creates the streams.
    pub(crate) fn new(device: Arc<DeviceCtx<R>>, pool: Arc<PoolMemory>) -> Result<Self, GpuError> {
        device.make_current()?;
        let d2h = R::stream_create()?;
        let h2d = match R::stream_create() {
            Ok(s) => s,
            Err(e) => {
                destroy_stream::<R>(d2h);
                return Err(e);
            }
        };
        R::warn_about_copy_settings(&device.label);
        let batch = R::batch_copy_available();
        tracing::info!(device = %device.label, "copy engine ready: {}", R::copy_path(batch));
        Ok(GpuEngine {
            device,
            pool,
            d2h,
            h2d,
            batch,
            dsts: Vec::new(),
            srcs: Vec::new(),
            sizes: Vec::new(),
            batch_fallback_logged: false,
            last: SubmitTimes::default(),
        })
    }

    /// Where the last [`GpuEngine::submit`] spent its time.
    pub fn last_submit(&self) -> SubmitTimes {
        self.last
    }

    /// Enqueues `job` over `imports` (the job's own, matched by [`crate::CopyEngine`]): waits for
    /// the client's event on the copy stream, copies, records one of kvd's events.
    pub fn submit(
        &mut self,
        job: Transfer<'_>,
        imports: &GpuImports<R>,
    ) -> Result<GpuCompletion<R>, GpuError> {
        self.last = SubmitTimes::default();
        let started = Instant::now();
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
        // Check every run before enqueueing one, so a bad job copies nothing.
        self.dsts.clear();
        self.srcs.clear();
        self.sizes.clear();
        for run in job.runs {
            let mem = imports.memories.get(run.memory as usize).ok_or_else(|| {
                GpuError::Invalid(format!("copy run names allocation {}", run.memory))
            })?;
            let dev = mem.device_ptr(run.device_offset_bytes, run.len_bytes)?;
            let host = self.pool.ptr_at(run.pool_offset_bytes, run.len_bytes)? as u64;
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
        let checked = Instant::now();
        self.last.checks = checked - started;
        if let Some(slot) = job.wait_slot {
            let ev = events
                .ok_or_else(|| GpuError::Invalid("wait_slot without registered events".into()))?
                .client(slot)?;
            // A stream wait on another process's event left the copy engine idle for about
            // 200 µs per copy on an H200 even when the event had long completed (stores ran
            // 0.85 of the ceiling against 0.92 for retrieves; benches/RESULTS.md), so the wait
            // is queued only while the client's work is still running.
            // SAFETY: `ev` is an opened IPC event kept alive by the job's imports.
            if !unsafe { R::event_query(ev) }? {
                // SAFETY: as above; the stream is ours.
                unsafe { R::stream_wait_event(stream, ev) }?;
            }
        }
        self.last.event_wait = checked.elapsed();
        self.enqueue(stream, job.direction)?;
        let slot = match events.and_then(|e| e.next_server()) {
            Some((slot, ev)) => {
                // SAFETY: one of kvd's interprocess events, alive while the job holds the ring.
                unsafe { R::event_record(ev, stream) }?;
                Some(slot)
            }
            None => None,
        };
        let completion = GpuCompletion {
            device: self.device.clone(),
            event: R::done_event_create()?,
            slot,
        };
        // SAFETY: the event was just created on this device; the stream is ours.
        unsafe { R::event_record(completion.event, stream) }?;
        Ok(completion)
    }

    /// Enqueues the descriptors gathered by `submit` on `stream`.
    fn enqueue(&mut self, stream: R::Stream, direction: Direction) -> Result<(), GpuError> {
        if self.batch {
            match self.enqueue_batches(stream, direction) {
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
                            "{e}; copying these runs with {} instead",
                            R::COPY_CALL
                        );
                        self.batch_fallback_logged = true;
                    }
                    BATCH_FALLBACKS.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.last.one_call_a_run = true;
        for i in 0..self.sizes.len() {
            let t = Instant::now();
            // SAFETY: both ranges were bounds-checked against mappings the job and the engine
            // keep alive; the pool is registered with the runtime, so under unified addressing
            // its host addresses are valid copy endpoints.
            let copied =
                unsafe { R::memcpy_async(self.dsts[i], self.srcs[i], self.sizes[i], stream) };
            self.last.call(t.elapsed());
            copied?;
        }
        Ok(())
    }

    fn enqueue_batches(&mut self, stream: R::Stream, direction: Direction) -> Result<(), GpuError> {
        let mut start = 0;
        while start < self.sizes.len() {
            let end = batch_end(&self.sizes, start);
            let t = Instant::now();
            // SAFETY: the three slices hold `end - start` entries each; every address was
            // bounds-checked against its mapping, as for one copy.
            let copied = unsafe {
                R::memcpy_batch_async(
                    &mut self.dsts[start..end],
                    &mut self.srcs[start..end],
                    &mut self.sizes[start..end],
                    direction,
                    self.device.ordinal,
                    stream,
                )
            };
            // A refused call's time counts too: it may have blocked before refusing.
            self.last.call(t.elapsed());
            copied?;
            start = end;
        }
        Ok(())
    }
}

fn destroy_stream<R: Runtime>(s: R::Stream) {
    // SAFETY: created by the engine, destroyed once; queued work still completes.
    if let Err(e) = unsafe { R::stream_destroy(s) } {
        release_failed("a copy stream", e);
    }
}

impl<R: Runtime> Drop for GpuEngine<R> {
    fn drop(&mut self) {
        if let Err(e) = self.device.make_current() {
            release_failed("copy streams", e);
            return;
        }
        destroy_stream::<R>(self.d2h);
        destroy_stream::<R>(self.h2d);
    }
}

/// A submitted GPU copy: an event recorded after its last descriptor.
#[derive(Debug)]
pub struct GpuCompletion<R: Runtime> {
    device: Arc<DeviceCtx<R>>,
    event: R::Event,
    slot: Option<u16>,
}

impl<R: Runtime> GpuCompletion<R> {
    /// kvd's event slot the client can poll, if the registration has events.
    pub fn event_slot(&self) -> Option<u16> {
        self.slot
    }

    /// Blocks until the copy is complete.
    pub fn wait(self) -> Result<(), GpuError> {
        self.device.make_current()?;
        // SAFETY: the event is alive until `self` drops; blocking-sync events sleep, not spin.
        unsafe { R::event_synchronize(self.event) }
    }
}

impl<R: Runtime> Drop for GpuCompletion<R> {
    fn drop(&mut self) {
        if let Err(e) = self.device.make_current() {
            release_failed("a completion event", e);
            return;
        }
        // Created in `submit`, destroyed once here.
        destroy_event::<R>(self.event, "a completion event");
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
