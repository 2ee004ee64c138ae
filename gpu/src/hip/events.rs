//! A registration's interprocess events (`hipEventInterprocess`). The client's events are
//! opened from its handles and kvd's stream waits on them before a copy; kvd's own are created
//! here, one recorded after each copy, its slot sent in the reply for the client to poll or
//! stream-wait on. Neither side blocks a thread on the hot path.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::device::DeviceInner;
use super::driver::{create_ipc_event, destroy_event, open_ipc_event, release_failed, Event};
use crate::device::IPC_HANDLE_BYTES;
use crate::error::GpuError;

/// Both sides' events for one registration.
#[derive(Debug)]
pub struct HipEvents {
    device: Arc<DeviceInner>,
    client: Vec<Event>,
    server: Vec<Event>,
    server_handles: Vec<[u8; IPC_HANDLE_BYTES]>,
    next: AtomicUsize,
}

impl HipEvents {
    pub(crate) fn open(
        device: Arc<DeviceInner>,
        client_handles: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<Self, GpuError> {
        device.make_current()?;
        let mut ev = HipEvents {
            device,
            client: Vec::new(),
            server: Vec::new(),
            server_handles: Vec::new(),
            next: AtomicUsize::new(0),
        };
        // On an error, dropping `ev` destroys what was made so far.
        for h in client_handles {
            ev.client.push(open_ipc_event(h)?);
        }
        for _ in 0..server_slots {
            let (e, handle) = create_ipc_event()?;
            ev.server.push(e);
            ev.server_handles.push(handle);
        }
        Ok(ev)
    }

    /// The client's event in `slot`.
    pub(crate) fn client(&self, slot: u16) -> Result<Event, GpuError> {
        self.client.get(slot as usize).copied().ok_or_else(|| {
            GpuError::Invalid(format!(
                "wait_slot {slot} is not one of the {} registered client events",
                self.client.len()
            ))
        })
    }

    /// The next of kvd's events to record, round robin.
    pub(crate) fn next_server(&self) -> Option<(u16, Event)> {
        if self.server.is_empty() {
            return None;
        }
        let slot = self.next.fetch_add(1, Ordering::Relaxed) % self.server.len();
        Some((slot as u16, self.server[slot]))
    }

    pub(crate) fn device(&self) -> &Arc<DeviceInner> {
        &self.device
    }

    /// IPC handles of kvd's own events, in slot order, for the registration reply.
    pub(crate) fn server_handles(&self) -> &[[u8; IPC_HANDLE_BYTES]] {
        &self.server_handles
    }
}

impl Drop for HipEvents {
    fn drop(&mut self) {
        if let Err(e) = self.device.make_current() {
            release_failed("registration events", e);
            return;
        }
        // Each event was created or opened here and is destroyed once, after the copies that
        // used it (jobs hold the ring until they complete).
        for &e in self.client.iter().chain(&self.server) {
            destroy_event(e, "an event");
        }
    }
}
