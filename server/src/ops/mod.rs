//! Operations: what an operator and the machine see of kvd, apart from its clients.
//!
//! - [`metrics`] and [`process_metrics`]: every Prometheus series kvd exports, in one registry;
//! - [`http`]: the small HTTP responder behind `/healthz` and `/metrics`;
//! - [`accept`]: the accept loop every listener shares (HTTP here; the ZMQ router and the fd
//!   socket in [`crate::control`]);
//! - [`cgroup`]: the memory limit kvd runs under, for the default pool size.

pub mod accept;
pub mod cgroup;
pub mod http;
pub mod metrics;
pub mod process_metrics;
