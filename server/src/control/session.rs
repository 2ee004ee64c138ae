//! Who is connected and what they registered. A session is one client connection (one vLLM
//! scheduler or worker); it owns its registrations and its lookup pins, and both end with it —
//! on disconnect, on silence past the session timeout, or at shutdown — so kvd never holds a
//! dead client's GPU memory.

use std::collections::HashMap;
use std::sync::Arc;

use kvd_gpu::Imports;
use tokio::time::Instant;

use crate::control::router::PeerId;
use crate::data::copier::CopyWorker;
use crate::l1::cache::SessionId;
use crate::l1::geometry::Geometry;
use crate::l1::pool::{ClassId, Home};
use crate::wire::{DeviceSpec, Role};

/// What a client said in its hello.
#[derive(Debug, Clone)]
pub struct ClientInfo {
    /// Client name.
    pub name: String,
    /// Client pid.
    pub pid: u32,
    /// Client role.
    pub role: Role,
}

/// One connection.
#[derive(Debug)]
pub struct Session {
    /// Session id (also the pin owner).
    pub id: SessionId,
    /// Set by hello.
    pub client: Option<ClientInfo>,
    /// Last time anything arrived.
    pub last_seen: Instant,
    /// Registrations it owns.
    pub regions: Vec<u32>,
}

/// One registered KV cache.
#[derive(Debug)]
pub struct Region {
    /// Region id.
    pub id: u32,
    /// Owning session.
    pub session: SessionId,
    /// Model and layout fingerprint.
    pub fingerprint: u64,
    /// KV shard.
    pub shard: u32,
    /// Block geometry.
    pub geometry: Geometry,
    /// Page class.
    pub class: ClassId,
    /// The device.
    pub device: DeviceSpec,
    /// Imported allocations (in registration order) and interprocess events (GPU backends).
    /// Dropping the last reference releases them; copy jobs hold references until the device
    /// is done with them.
    pub imports: Arc<Imports>,
    /// The device's copy worker.
    pub worker: Arc<CopyWorker>,
    /// The pool home (NUMA node's slabs) nearest the device, where there are several.
    pub home: Option<Home>,
}

/// All sessions and regions.
#[derive(Debug, Default)]
pub struct Sessions {
    by_peer: HashMap<PeerId, Session>,
    regions: HashMap<u32, Arc<Region>>,
    /// Fingerprint → layout digest: a fingerprint may not change meaning while kvd runs.
    digests: HashMap<u64, u64>,
    next_session: SessionId,
    next_region: u32,
}

/// What ended with a session, for logs.
#[derive(Debug, Default)]
pub struct Ended {
    /// The session id.
    pub id: Option<SessionId>,
    /// Regions dropped.
    pub regions: usize,
}

impl Sessions {
    /// Opens a session for a new connection.
    pub fn open(&mut self, peer: PeerId, now: Instant) -> SessionId {
        self.next_session += 1;
        let id = self.next_session;
        self.by_peer.insert(
            peer,
            Session {
                id,
                client: None,
                last_seen: now,
                regions: Vec::new(),
            },
        );
        id
    }

    /// The session of a peer.
    pub fn get(&self, peer: PeerId) -> Option<&Session> {
        self.by_peer.get(&peer)
    }

    /// The session of a peer, mutably.
    pub fn get_mut(&mut self, peer: PeerId) -> Option<&mut Session> {
        self.by_peer.get_mut(&peer)
    }

    /// Ends a peer's session, dropping its regions. The caller releases its pins.
    pub fn close(&mut self, peer: PeerId) -> Ended {
        let Some(session) = self.by_peer.remove(&peer) else {
            return Ended::default();
        };
        let n = session.regions.len();
        for r in session.regions {
            self.regions.remove(&r);
        }
        Ended {
            id: Some(session.id),
            regions: n,
        }
    }

    /// Peers silent since before `cutoff`.
    pub fn silent_since(&self, cutoff: Instant) -> Vec<PeerId> {
        self.by_peer
            .iter()
            .filter(|(_, s)| s.last_seen < cutoff)
            .map(|(&p, _)| p)
            .collect()
    }

    /// Checks that `fingerprint` keeps the layout digest it was first registered with.
    pub fn check_digest(&self, fingerprint: u64, digest: u64) -> Result<(), String> {
        match self.digests.get(&fingerprint) {
            Some(&d) if d != digest => Err(format!(
                "fingerprint {fingerprint:#018x} was registered before with another KV layout; \
                 stored chunks would be read back scrambled. Include the layout (dtype, block \
                 size, layout order, heads per shard) in the fingerprint"
            )),
            _ => Ok(()),
        }
    }

    /// Adds a region for a session's peer.
    pub fn add_region(
        &mut self,
        peer: PeerId,
        digest: u64,
        make: impl FnOnce(u32, SessionId) -> Region,
    ) -> Option<Arc<Region>> {
        let session = self.by_peer.get_mut(&peer)?;
        self.next_region += 1;
        let id = self.next_region;
        let region = Arc::new(make(id, session.id));
        self.digests.insert(region.fingerprint, digest);
        session.regions.push(id);
        self.regions.insert(id, region.clone());
        Some(region)
    }

    /// A region, if it belongs to this peer's session.
    pub fn region(&self, peer: PeerId, id: u32) -> Option<Arc<Region>> {
        let session = self.by_peer.get(&peer)?;
        let r = self.regions.get(&id)?;
        (r.session == session.id).then(|| r.clone())
    }

    /// The page class and layout digest of some registration of `fingerprint` and `shard`:
    /// where a chunk of that shard fetched from L2 goes. (Every registration of one fingerprint
    /// has one digest, so any of them will do.)
    pub fn placement(&self, fingerprint: u64, shard: u32) -> Option<(ClassId, u64)> {
        self.regions
            .values()
            .find(|r| r.fingerprint == fingerprint && r.shard == shard)
            .map(|r| (r.class, r.geometry.digest()))
    }

    /// Drops a region of this peer's session.
    pub fn remove_region(&mut self, peer: PeerId, id: u32) -> bool {
        let Some(session) = self.by_peer.get_mut(&peer) else {
            return false;
        };
        let Some(pos) = session.regions.iter().position(|&r| r == id) else {
            return false;
        };
        session.regions.swap_remove(pos);
        self.regions.remove(&id).is_some()
    }

    /// Open sessions.
    pub fn session_count(&self) -> usize {
        self.by_peer.len()
    }

    /// Registered regions.
    pub fn region_count(&self) -> usize {
        self.regions.len()
    }

    /// Ends every session; returns their ids.
    pub fn close_all(&mut self) -> Vec<SessionId> {
        self.regions.clear();
        self.by_peer.drain().map(|(_, s)| s.id).collect()
    }
}
