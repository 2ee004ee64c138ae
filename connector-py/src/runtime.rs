//! The tokio runtime every client of this process shares, for the client's requests and the
//! registrations' driver work alike.

use std::sync::OnceLock;

/// The runtime all clients of this process share; made on first use, so a process that forks
/// before using kvd is unaffected.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvd-client")
            .enable_all()
            .build()
            .expect("starting kvd's client runtime")
    })
}
