//! The accept loop every listener of kvd's shares: stop on cancellation, hand each connection
//! to its own tracked task, and back off instead of spinning when accept fails (out of
//! descriptors, for instance).

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Accepts with `accept` until `stop`, running `serve(connection)` on `tracker`.
pub(crate) async fn accept_until<C, A, AF, S, SF>(
    what: &str,
    stop: CancellationToken,
    tracker: TaskTracker,
    mut accept: A,
    serve: S,
) where
    A: FnMut() -> AF,
    AF: Future<Output = std::io::Result<C>>,
    S: Fn(C) -> SF,
    SF: Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = accept() => a,
        };
        match accepted {
            Ok(conn) => {
                tracker.spawn(serve(conn));
            }
            Err(e) => {
                tracing::warn!("{what} accept failed: {e}; retrying in 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
