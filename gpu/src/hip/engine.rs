//! A HIP GPU's copy engine: two non-blocking streams (device→pool and pool→device, so stores
//! and retrieves run on separate DMA engines at once) and one `hipMemcpyAsync` per coalesced
//! run, straight between the client's KV blocks and the pinned pool — no staging buffer,
//! nothing allocated on the GPU. On AMD GPUs the runtime runs such host↔device copies on the
//! SDMA engines (the default; `HSA_ENABLE_SDMA=0` would move them to shader blits, which take
//! compute units from the model, so kvd warns when it sees that setting).
//!
//! There is no batched copy here: the ROCm headers kvd is checked against have none, and with
//! the block-outermost layout kvd asks vLLM for, a run is a whole block of all layers (2 MiB for
//! Llama-8B), where one call per run already keeps the engine busy. Ordering against the model
//! is the CUDA backend's: the client's interprocess event, waited on by kvd's stream only while
//! it is still pending, and one of kvd's events recorded after the copy.

use std::sync::Arc;

use super::device::{DeviceInner, HipImports};
use super::driver::{api, check, destroy_event, release_failed, void_ptr, Event, Stream};
use super::sys;
use crate::copy::{CopyJob, Direction};
use crate::error::GpuError;
use crate::memory::PoolMemory;

/// The copy engine of one GPU; lives on that GPU's copy thread.
#[derive(Debug)]
pub struct HipEngine {
    device: Arc<DeviceInner>,
    pool: Arc<PoolMemory>,
    d2h: Stream,
    h2d: Stream,
}

impl HipEngine {
    /// Makes the device current on the calling (copy) thread and creates the streams.
    pub(crate) fn new(device: Arc<DeviceInner>, pool: Arc<PoolMemory>) -> Result<Self, GpuError> {
        device.make_current()?;
        let api = api()?;
        let mut streams = [Stream(std::ptr::null_mut()); 2];
        for s in &mut streams {
            let mut st: sys::hipStream_t = std::ptr::null_mut();
            // SAFETY: out-pointer to a local; the device is current. Non-blocking: never
            // synchronises with the null stream.
            check("hipStreamCreateWithFlags", unsafe {
                (api.hipStreamCreateWithFlags)(&mut st, sys::hipStreamNonBlocking)
            })?;
            *s = Stream(st);
        }
        if std::env::var("HSA_ENABLE_SDMA").is_ok_and(|v| v == "0") {
            tracing::warn!(
                device = %device.label,
                "HSA_ENABLE_SDMA=0: copies run as shader blits on the GPU's compute units and \
                 slow the model; unset it for kvd"
            );
        }
        tracing::info!(device = %device.label, "copy engine ready: hipMemcpyAsync per run");
        Ok(HipEngine {
            device,
            pool,
            d2h: streams[0],
            h2d: streams[1],
        })
    }

    /// Enqueues `job` over `imports` (the job's own, matched by [`crate::CopyEngine`]): waits for
    /// the client's event on the copy stream, copies, records one of kvd's events.
    pub fn submit(
        &mut self,
        job: &CopyJob,
        imports: &HipImports,
    ) -> Result<HipCompletion, GpuError> {
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
        let mut copies = Vec::with_capacity(job.runs.len());
        for run in &job.runs {
            let mem = imports.memories.get(run.memory as usize).ok_or_else(|| {
                GpuError::Invalid(format!("copy run names allocation {}", run.memory))
            })?;
            let dev = mem.device_ptr(run.device_offset_bytes, run.len_bytes)?;
            let host = self.pool.ptr_at(run.pool_offset_bytes, run.len_bytes)? as u64;
            let (dst, src) = match job.direction {
                Direction::D2h => (host, dev),
                Direction::H2d => (dev, host),
            };
            copies.push((dst, src, run.len_bytes as usize));
        }
        let stream = match job.direction {
            Direction::D2h => self.d2h,
            Direction::H2d => self.h2d,
        };
        let api = api()?;
        if let Some(slot) = job.wait_slot {
            let ev = events
                .ok_or_else(|| GpuError::Invalid("wait_slot without registered events".into()))?
                .client(slot)?;
            // As on CUDA, a stream wait on an event that has long completed still costs the
            // engine time, so it is queued only while the client's work is running.
            // SAFETY: `ev` is an opened IPC event kept alive by the job's imports.
            match unsafe { (api.hipEventQuery)(ev.0) } {
                sys::hipSuccess => {}
                sys::hipErrorNotReady => {
                    // SAFETY: as above; the stream is ours.
                    check("hipStreamWaitEvent", unsafe {
                        (api.hipStreamWaitEvent)(stream.0, ev.0, 0)
                    })?
                }
                r => check("hipEventQuery", r)?,
            }
        }
        for (dst, src, len) in copies {
            // SAFETY: both ranges were bounds-checked against mappings the job and the engine
            // keep alive; the pool is registered with the runtime, so its host addresses are
            // valid copy endpoints under unified addressing (hipMemcpyDefault).
            check("hipMemcpyAsync", unsafe {
                (api.hipMemcpyAsync)(
                    void_ptr(dst),
                    void_ptr(src),
                    len,
                    sys::hipMemcpyDefault,
                    stream.0,
                )
            })?;
        }
        let slot = match events.and_then(|e| e.next_server()) {
            Some((slot, ev)) => {
                // SAFETY: one of kvd's interprocess events, alive while the job holds the ring.
                check("hipEventRecord", unsafe {
                    (api.hipEventRecord)(ev.0, stream.0)
                })?;
                Some(slot)
            }
            None => None,
        };
        let mut done: sys::hipEvent_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device is current on this thread.
        check("hipEventCreateWithFlags", unsafe {
            (api.hipEventCreateWithFlags)(
                &mut done,
                sys::hipEventBlockingSync | sys::hipEventDisableTiming,
            )
        })?;
        let completion = HipCompletion {
            device: self.device.clone(),
            event: Event(done),
            slot,
        };
        // SAFETY: `done` was just created on this device; the stream is ours.
        check("hipEventRecord", unsafe {
            (api.hipEventRecord)(done, stream.0)
        })?;
        Ok(completion)
    }
}

impl Drop for HipEngine {
    fn drop(&mut self) {
        let api = match self.device.make_current().and_then(|()| api()) {
            Ok(a) => a,
            Err(e) => return release_failed("copy streams", e),
        };
        for s in [self.d2h, self.h2d] {
            // SAFETY: created in `new`, destroyed once; queued work still completes.
            if let Err(e) = check("hipStreamDestroy", unsafe { (api.hipStreamDestroy)(s.0) }) {
                release_failed("a copy stream", e);
            }
        }
    }
}

/// A submitted GPU copy: an event recorded after its last run.
#[derive(Debug)]
pub struct HipCompletion {
    device: Arc<DeviceInner>,
    event: Event,
    slot: Option<u16>,
}

impl HipCompletion {
    /// kvd's event slot the client can poll, if the registration has events.
    pub fn event_slot(&self) -> Option<u16> {
        self.slot
    }

    /// Blocks until the copy is complete.
    pub fn wait(self) -> Result<(), GpuError> {
        self.device.make_current()?;
        let api = api()?;
        // SAFETY: the event is alive until `self` drops; blocking-sync events sleep, not spin.
        check("hipEventSynchronize", unsafe {
            (api.hipEventSynchronize)(self.event.0)
        })
    }
}

impl Drop for HipCompletion {
    fn drop(&mut self) {
        if let Err(e) = self.device.make_current() {
            return release_failed("a completion event", e);
        }
        // Created in `submit`, destroyed once here.
        destroy_event(self.event, "a completion event");
    }
}
