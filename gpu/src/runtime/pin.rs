//! Pinning the L1 pool: each piece of the pool's layout registered for DMA (portable,
//! device-mapped), one registration per piece so that no page (a slab is a piece) spans two, on
//! a few threads at once. A failure part way unwinds: the guard unregisters what was registered.

use std::ops::Range;
use std::sync::Arc;

use crate::error::{release_failed, GpuError};
use crate::memory::PoolMemory;
use crate::runtime::api::Runtime;
use crate::types::{PinnedPool, PoolPin};

/// Keeps the pool registered with the runtime.
#[derive(Debug)]
struct PinnedPoolGuard<R: Runtime> {
    ctx: R::Context,
    pieces: Vec<(usize, usize)>,
    _pool: Arc<PoolMemory>,
}

impl<R: Runtime> PinnedPool for PinnedPoolGuard<R> {}

impl<R: Runtime> Drop for PinnedPoolGuard<R> {
    fn drop(&mut self) {
        if let Err(e) = R::make_current(&self.ctx) {
            release_failed("the pinned pool", e);
            return;
        }
        for &(ptr, _) in &self.pieces {
            // SAFETY: each piece was registered by `pin_pool` and is unregistered once; the pool
            // mapping outlives this guard (it holds an Arc to it).
            if let Err(e) = unsafe { R::host_unregister(ptr as *mut std::ffi::c_void) } {
                release_failed("a pinned pool piece", e);
            }
        }
    }
}

/// Registers pieces `pieces` of the pool's layout with device `ordinal`'s runtime.
pub(crate) fn pin_pool<R: Runtime>(
    ordinal: i32,
    pool: &Arc<PoolMemory>,
    pieces: Range<u32>,
) -> Result<PoolPin, GpuError> {
    let layout = *pool.layout();
    if pieces.end > layout.pieces() {
        return Err(GpuError::Invalid(format!(
            "pinning pieces {pieces:?} of a pool of {} pieces",
            layout.pieces()
        )));
    }
    let ctx = R::retain_for_copies(ordinal)?;
    let base = pool.base_ptr() as usize;
    let pieces: Vec<(usize, usize)> = pieces
        .map(|p| {
            let r = layout.piece_range(p);
            (base + r.start as usize, (r.end - r.start) as usize)
        })
        .collect();
    // Register pieces on a few threads: a page never spans two pieces (pieces are whole
    // slabs), so no copy crosses a registration.
    let threads = pieces.len().clamp(1, 8);
    let per = pieces.len().div_ceil(threads);
    let shared = &ctx;
    let results: Vec<Registered> = std::thread::scope(|s| {
        let handles: Vec<_> = pieces
            .chunks(per)
            .map(|mine| s.spawn(move || register_pieces::<R>(shared, mine)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| Registered {
                    pieces: Vec::new(),
                    error: Some(GpuError::Invalid("a pinning thread panicked".into())),
                })
            })
            .collect()
    });
    let mut registered = Vec::new();
    let mut failure = None;
    for r in results {
        registered.extend(r.pieces);
        if let Some(e) = r.error {
            failure.get_or_insert(e);
        }
    }
    let guard = PinnedPoolGuard::<R> {
        ctx,
        pieces: registered,
        _pool: pool.clone(),
    };
    match failure {
        // Dropping the guard unregisters what was registered: failure unwinds.
        Some(e) => Err(e),
        None => Ok(Box::new(guard)),
    }
}

/// The pieces one pinning thread registered, and the error that stopped it, if any.
struct Registered {
    pieces: Vec<(usize, usize)>,
    error: Option<GpuError>,
}

fn register_pieces<R: Runtime>(ctx: &R::Context, mine: &[(usize, usize)]) -> Registered {
    let mut out = Registered {
        pieces: Vec::new(),
        error: None,
    };
    if let Err(e) = R::make_current(ctx) {
        out.error = Some(e);
        return out;
    }
    for &(ptr, len) in mine {
        // SAFETY: [ptr, ptr+len) lies inside the pool's mapping, which the caller keeps alive;
        // pieces are disjoint.
        if let Err(e) = unsafe { R::host_register(ptr as *mut std::ffi::c_void, len) } {
            out.error = Some(e);
            return out;
        }
        out.pieces.push((ptr, len));
    }
    out
}
