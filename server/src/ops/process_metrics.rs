//! What an operator asks of any service before its own metrics: which build is running
//! (`kvd_build_info`) and what the process uses — resident memory, CPU seconds, open files
//! against their limit, threads — under the names every Prometheus client library uses
//! (`process_*`), so stock dashboards and alerts read kvd unchanged.

use prometheus::{IntGaugeVec, Opts, Registry};

/// The commit kvd was built from (`server/build.rs`), or `unknown`.
pub const COMMIT: &str = match option_env!("KVD_GIT_COMMIT") {
    Some(c) => c,
    None => "unknown",
};

/// Registers `kvd_build_info` and the process collector in `registry`.
pub(crate) fn register(registry: &Registry) {
    let info = IntGaugeVec::new(
        Opts::new(
            "kvd_build_info",
            "Always 1; the labels say which kvd this is: version, commit, wire protocol and build profile.",
        ),
        &["version", "commit", "protocol", "profile"],
    )
    .expect("valid metric");
    info.with_label_values(&[
        env!("CARGO_PKG_VERSION"),
        COMMIT,
        &crate::wire::PROTOCOL_VERSION.to_string(),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    ])
    .set(1);
    registry.register(Box::new(info)).expect("unique metric");
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("unique metric");
}
