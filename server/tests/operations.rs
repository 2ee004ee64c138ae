//! What an operator reads off a real kvd besides its own counters: `kvd_build_info`, the process
//! metrics, JSON logs, and flags that a unit's extra arguments can override.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn sample(text: &str, name: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            if !rest.starts_with([' ', '{']) {
                return None;
            }
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn build_info_and_process_metrics_describe_the_running_kvd() {
    let kvd = Kvd::ready(&[]);
    let (code, text) = kvd.get("/metrics");
    assert_eq!(code, 200);
    let info = sample(&text, "kvd_build_info");
    assert_eq!(info.len(), 1, "{info:?}");
    let (series, value) = &info[0];
    assert_eq!(*value, 1.0);
    assert!(
        series.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{series}"
    );
    let protocol = format!("protocol=\"{}\"", kvd_proto::wire::PROTOCOL_VERSION);
    assert!(series.contains(&protocol), "{series}");
    let commit = series
        .split("commit=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap();
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "commit label {commit:?}"
    );

    let pid = kvd.child.id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    let rss = sample(&text, "process_resident_memory_bytes")[0].1;
    // Both read /proc a moment apart; a pool of 256 MiB has been touched, so RSS is large.
    assert!(rss > 200.0 * 1024.0 * 1024.0, "rss {rss}");
    assert!(
        (rss - rss_kib * 1024.0).abs() < 64.0 * 1024.0 * 1024.0,
        "rss {rss} vs /proc {rss_kib} KiB"
    );
    let fds = sample(&text, "process_open_fds")[0].1;
    assert!(
        fds >= 5.0 && (fds - open_fds(pid) as f64).abs() < 16.0,
        "open fds {fds}"
    );
    // kvd raises its soft open-file limit to the hard one, which this process shares.
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    let max_fds = sample(&text, "process_max_fds")[0].1;
    assert_eq!(max_fds, hard.map_or(f64::INFINITY, |h| h as f64));
    // The collector counts whole seconds of user + system time (prometheus' process module).
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    let cpu = sample(&text, "process_cpu_seconds_total")[0].1;
    assert!(
        (cpu - (ticks / 100.0).floor()).abs() <= 1.0,
        "cpu {cpu} s vs {ticks} ticks"
    );
    assert!(sample(&text, "process_start_time_seconds")[0].1 > 1.6e9);
}

#[test]
fn json_logs_are_one_object_per_line_with_level_target_and_message() {
    let dir = TempDir::new("json");
    let mut child = Command::new(kvd_bin())
        .args([
            "serve",
            "--port",
            "0",
            "--http-port",
            "0",
            "--l1-size-gb",
            "0.05",
        ])
        .args(["--log-format", "json"])
        .arg("--fd-socket")
        .arg(dir.0.join("fd.sock"))
        .env_remove("TOTAL_CPU_DRAM_GB")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    for line in lines.map_while(Result::ok) {
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["timestamp"].is_string(), "{line}");
        assert!(v["level"].is_string(), "{line}");
        assert!(
            v["target"].as_str().is_some_and(|t| t.starts_with("kvd")),
            "{line}"
        );
        let msg = v["fields"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        seen.push(msg.clone());
        if msg.starts_with("serving /healthz and /metrics on http://") || Instant::now() > deadline
        {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        seen.iter()
            .any(|m| m.starts_with("kvd ") && m.ends_with(" starting")),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|m| m.starts_with("serving /healthz and /metrics on http://")),
        "{seen:?}"
    );
}

#[test]
fn a_bad_log_format_names_the_flag() {
    let out = Command::new(kvd_bin())
        .args(["serve", "--log-format", "xml", "--l1-size-gb", "0.05"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--log-format xml") && err.contains("json"),
        "{err}"
    );
}

#[test]
fn a_flag_given_twice_takes_its_last_value() {
    // The systemd unit and the container pass defaults first and the operator's flags after.
    let kvd = Kvd::ready(&[
        "--chunk-tokens",
        "64",
        "--chunk-tokens",
        "32",
        "--pin-timeout-ms",
        "1000",
        "--pin-timeout-ms",
        "2000",
    ]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let chunk = rt.block_on(async { kvd.client("twice").await.server().chunk_tokens });
    assert_eq!(chunk, 32);
}
