//! A registration's interprocess events. The client's events are opened from its handles; kvd
//! waits on them (on its copy stream) before a copy. kvd's own events are created here as
//! interprocess events; one is recorded after each copy and its slot sent in the reply, so the
//! client can poll or stream-wait on it. Neither side blocks a thread on the hot path.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::{release_failed, GpuError};
use crate::runtime::api::Runtime;
use crate::runtime::ctx::{destroy_event, DeviceCtx};
use crate::types::IPC_HANDLE_BYTES;

/// Both sides' events for one registration.
#[derive(Debug)]
pub struct EventRing<R: Runtime> {
    device: Arc<DeviceCtx<R>>,
    client: Vec<R::Event>,
    server: Vec<R::Event>,
    server_handles: Vec<[u8; IPC_HANDLE_BYTES]>,
    next: AtomicUsize,
}

impl<R: Runtime> EventRing<R> {
    /// Opens the client's events and creates `server_slots` of kvd's.
    pub(crate) fn open(
        device: Arc<DeviceCtx<R>>,
        client_handles: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<Self, GpuError> {
        device.make_current()?;
        let mut ev = EventRing {
            device,
            client: Vec::new(),
            server: Vec::new(),
            server_handles: Vec::new(),
            next: AtomicUsize::new(0),
        };
        // On an error, dropping `ev` destroys what was made so far.
        for h in client_handles {
            ev.client.push(R::ipc_event_open(h)?);
        }
        for _ in 0..server_slots {
            let (e, handle) = R::ipc_event_create()?;
            ev.server.push(e);
            ev.server_handles.push(handle);
        }
        Ok(ev)
    }

    /// The client's event in `slot`.
    pub(crate) fn client(&self, slot: u16) -> Result<R::Event, GpuError> {
        self.client.get(slot as usize).copied().ok_or_else(|| {
            GpuError::Invalid(format!(
                "wait_slot {slot} is not one of the {} registered client events",
                self.client.len()
            ))
        })
    }

    /// The next of kvd's events to record, round robin.
    pub(crate) fn next_server(&self) -> Option<(u16, R::Event)> {
        if self.server.is_empty() {
            return None;
        }
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.server.len();
        Some((slot as u16, self.server[slot]))
    }

    pub(crate) fn device(&self) -> &Arc<DeviceCtx<R>> {
        &self.device
    }

    /// IPC handles of kvd's own events, in slot order, for the registration reply.
    pub fn server_handles(&self) -> &[[u8; IPC_HANDLE_BYTES]] {
        &self.server_handles
    }
}

impl<R: Runtime> Drop for EventRing<R> {
    fn drop(&mut self) {
        if let Err(e) = self.device.make_current() {
            release_failed("registration events", e);
            return;
        }
        // Each event was created or opened here and is destroyed once, after the copies that
        // used it (jobs hold the ring until they complete).
        for &e in self.client.iter().chain(&self.server) {
            destroy_event::<R>(e, "an event");
        }
    }
}
