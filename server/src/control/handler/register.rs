//! Registering a worker's KV cache: check the layout, claim the descriptors the client sent,
//! import its allocations and events on the device (off the tokio workers), and record the
//! region in the session. Refusals are counted by reason.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use kvd_gpu::{GpuError, ImportSource};

use crate::control::error::RequestError;
use crate::control::router::PeerId;
use crate::control::session::Region;
use crate::control::state::State;
use crate::l1::geometry::Geometry;
use crate::wire::*;

use super::not_ready;

/// kvd events per CUDA registration.
pub const SERVER_EVENT_SLOTS: usize = 256;

/// A refused registration: the metric label (none for refusals that are not the client's
/// doing: kvd still starting, the session gone meanwhile) and the error.
struct Refusal {
    reason: Option<&'static str>,
    error: RequestError,
}

fn refuse(reason: &'static str, error: RequestError) -> Refusal {
    Refusal {
        reason: Some(reason),
        error,
    }
}

fn uncounted(error: RequestError) -> Refusal {
    Refusal {
        reason: None,
        error,
    }
}

fn invalid(msg: impl Into<String>) -> Refusal {
    refuse("invalid", RequestError::Invalid(msg.into()))
}

fn device(e: GpuError) -> Refusal {
    let reason = if matches!(e, GpuError::VmmMemory) {
        "vmm_memory"
    } else {
        "device"
    };
    refuse(reason, RequestError::Gpu(e))
}

/// Registers a KV cache; a refusal is counted under its reason and logged.
pub async fn register(
    state: &Arc<State>,
    peer: PeerId,
    r: Register,
) -> Result<Reply, RequestError> {
    import(state, peer, r).await.map_err(|refusal| {
        if let Some(reason) = refusal.reason {
            state
                .metrics
                .registration_refusals
                .with_label_values(&[reason])
                .inc();
            tracing::warn!(reason, "registration refused: {}", refusal.error);
        }
        refusal.error
    })
}

/// The descriptors a registration names, each taken once.
struct SentFds(Vec<Option<OwnedFd>>);

impl SentFds {
    fn take(&mut self, allocation: usize, index: u32) -> Result<OwnedFd, Refusal> {
        self.0
            .get_mut(index as usize)
            .and_then(Option::take)
            .ok_or_else(|| {
                invalid(format!(
                    "allocation {allocation} names descriptor {index}, which was not sent or is used twice"
                ))
            })
    }
}

async fn import(state: &Arc<State>, peer: PeerId, r: Register) -> Result<Reply, Refusal> {
    let Some(devices) = state.devices.get() else {
        return Err(uncounted(not_ready(state)));
    };
    if r.allocations.is_empty() || r.allocations.len() > crate::l1::geometry::MAX_ALLOCATIONS {
        return Err(invalid(format!(
            "a registration needs 1 to {} allocations",
            crate::l1::geometry::MAX_ALLOCATIONS
        )));
    }
    let sizes: Vec<u64> = r
        .allocations
        .iter()
        .map(|a| match a {
            AllocationSpec::HostFd { size_bytes, .. }
            | AllocationSpec::CudaIpc { size_bytes, .. }
            | AllocationSpec::CudaVmm { size_bytes, .. } => *size_bytes,
        })
        .collect();
    let geometry = Geometry::new(&r.layout, &r.layers, &sizes, state.settings.chunk_tokens)
        .map_err(|e| invalid(format!("bad KV layout: {e}")))?;
    state
        .sessions
        .lock()
        .check_digest(r.fingerprint, geometry.digest())
        .map_err(invalid)?;
    let class = state
        .l1
        .cache()
        .class_for(geometry.page_bytes())
        .map_err(|e| invalid(e.to_string()))?;
    let needs_fds = r
        .allocations
        .iter()
        .any(|a| !matches!(a, AllocationSpec::CudaIpc { .. }));
    let has_vmm = r
        .allocations
        .iter()
        .any(|a| matches!(a, AllocationSpec::CudaVmm { .. }));
    if has_vmm && r.fd_token == 0 {
        return Err(refuse(
            "vmm_memory",
            RequestError::VmmMemory(format!(
                "{} — the client sent VMM memory without its descriptors; they go over the fd \
                 socket {} (check that the client can reach it)",
                GpuError::VmmMemory,
                state.settings.fd_socket.display()
            )),
        ));
    }
    let mut fds = SentFds(if needs_fds {
        match state.fds.take(r.fd_token) {
            Some(f) if r.fd_token != 0 => f.into_iter().map(Some).collect(),
            _ => {
                return Err(refuse(
                    "fd_missing",
                    RequestError::FdMissing(format!(
                        "no descriptors arrived under fd token {:#x}; send them to {} before registering",
                        r.fd_token,
                        state.settings.fd_socket.display()
                    )),
                ))
            }
        }
    } else {
        Vec::new()
    });
    let mut sources = Vec::with_capacity(r.allocations.len());
    for (i, a) in r.allocations.iter().enumerate() {
        sources.push(match a {
            AllocationSpec::HostFd {
                fd_index,
                size_bytes,
            } => ImportSource::HostFd {
                fd: fds.take(i, *fd_index)?,
                size_bytes: *size_bytes,
            },
            AllocationSpec::CudaIpc {
                handle,
                offset_bytes,
                size_bytes,
            } => ImportSource::CudaIpc {
                handle: handle.0,
                offset_bytes: *offset_bytes,
                size_bytes: *size_bytes,
            },
            AllocationSpec::CudaVmm {
                chunks,
                offset_bytes,
                size_bytes,
            } => ImportSource::CudaVmm {
                chunks: chunks
                    .iter()
                    .map(|c| Ok((fds.take(i, c.fd_index)?, c.offset_bytes, c.size_bytes)))
                    .collect::<Result<_, Refusal>>()?,
                offset_bytes: *offset_bytes,
                size_bytes: *size_bytes,
            },
        });
    }
    // Descriptors sent but not named are closed here.
    drop(fds);

    let (dev, worker) = devices.device_for(&r.device).map_err(device)?;
    let client_events: Vec<[u8; 64]> = r.client_events.iter().map(|h| h.0).collect();
    let importer = dev.clone();
    let imports = tokio::task::spawn_blocking(move || {
        importer
            .import(sources, &client_events, SERVER_EVENT_SLOTS)
            .map(Arc::new)
    })
    .await
    .map_err(|e| {
        refuse(
            "device",
            RequestError::Internal(format!("import task failed: {e}")),
        )
    })?
    .map_err(device)?;
    let page_bytes = geometry.page_bytes();
    let chunk_blocks = geometry.chunk_blocks();
    // What a chunk's copy is: one descriptor a block of every layer (block-outermost), or many.
    let (copy_runs_per_chunk, copy_run_bytes) =
        (geometry.copy_runs_per_chunk(), geometry.copy_run_bytes());
    let server_events = imports
        .server_handles()
        .into_iter()
        .map(IpcHandle)
        .collect();
    let digest = geometry.digest();
    let region = state
        .sessions
        .lock()
        .add_region(peer, digest, |id, session| Region {
            id,
            session,
            fingerprint: r.fingerprint,
            shard: r.shard,
            geometry,
            class,
            device: r.device,
            imports,
            worker,
            home: devices.home_of(&r.device),
        })
        .ok_or_else(|| {
            uncounted(RequestError::Internal(
                "the session ended during registration".into(),
            ))
        })?;
    state.refresh_metrics();
    tracing::info!(
        region = region.id,
        device = %dev.label(),
        fingerprint = format_args!("{:#018x}", r.fingerprint),
        shard = r.shard,
        layers = r.layers.len(),
        blocks = r.layout.num_blocks,
        page_bytes,
        copy_runs_per_chunk,
        copy_run_bytes,
        "registered KV cache"
    );
    Ok(Reply::Registered(Registered {
        region: region.id,
        page_bytes,
        chunk_blocks,
        server_events,
    }))
}
