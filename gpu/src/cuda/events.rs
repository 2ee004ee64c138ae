//! A registration's interprocess events. The client's events are opened from its handles; kvd
//! waits on them (on its copy stream) before a copy. kvd's own events are created here as
//! interprocess events; one is recorded after each copy and its slot sent in the reply, so the
//! client can poll or stream-wait on it. Neither side blocks a thread on the hot path.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::sys;

use super::device::DeviceInner;
use super::driver::{check, create_ipc_event, open_ipc_event, release_failed};
use crate::device::{EventRing, IPC_HANDLE_BYTES};
use crate::error::GpuError;

/// Both sides' events for one registration.
#[derive(Debug)]
pub(crate) struct CudaEvents {
    device: Arc<DeviceInner>,
    client: Vec<usize>,
    server: Vec<usize>,
    server_handles: Vec<[u8; IPC_HANDLE_BYTES]>,
    next: AtomicUsize,
}

impl CudaEvents {
    pub(crate) fn open(
        device: Arc<DeviceInner>,
        client_handles: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<Self, GpuError> {
        device.ctx.make_current()?;
        let mut ev = CudaEvents {
            device,
            client: Vec::new(),
            server: Vec::new(),
            server_handles: Vec::new(),
            next: AtomicUsize::new(0),
        };
        // On an error, dropping `ev` destroys what was made so far.
        for h in client_handles {
            ev.client.push(open_ipc_event(h)? as usize);
        }
        for _ in 0..server_slots {
            let (e, handle) = create_ipc_event()?;
            ev.server.push(e as usize);
            ev.server_handles.push(handle);
        }
        Ok(ev)
    }

    /// The client's event in `slot`.
    pub(crate) fn client(&self, slot: u16) -> Result<sys::CUevent, GpuError> {
        self.client
            .get(slot as usize)
            .map(|&e| e as sys::CUevent)
            .ok_or_else(|| {
                GpuError::Invalid(format!(
                    "wait_slot {slot} is not one of the {} registered client events",
                    self.client.len()
                ))
            })
    }

    /// The next of kvd's events to record, round robin.
    pub(crate) fn next_server(&self) -> Option<(u16, sys::CUevent)> {
        if self.server.is_empty() {
            return None;
        }
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.server.len();
        Some((slot as u16, self.server[slot] as sys::CUevent))
    }

    pub(crate) fn device(&self) -> &Arc<DeviceInner> {
        &self.device
    }
}

impl EventRing for CudaEvents {
    fn server_handles(&self) -> Vec<[u8; IPC_HANDLE_BYTES]> {
        self.server_handles.clone()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaEvents {
    fn drop(&mut self) {
        if let Err(e) = self.device.ctx.make_current() {
            release_failed("registration events", e);
            return;
        }
        for &e in self.client.iter().chain(&self.server) {
            // SAFETY: each event was created or opened here and is destroyed once, after the
            // copies that used it (jobs hold the ring until they complete).
            let r = unsafe { sys::cuEventDestroy_v2(e as sys::CUevent) };
            if let Err(err) = check("cuEventDestroy_v2", r) {
                release_failed("an event", err);
            }
        }
    }
}
