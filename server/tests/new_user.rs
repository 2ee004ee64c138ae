//! Start-up and operation defects found trying kvd as a new user would (issue #35), against the
//! real binary: a negative `--disk-size-gb`, an unknown subcommand, an fd socket already in
//! use, start-up errors under `--log-format json`, the warning without a GPU, and a stale L2
//! error on `/healthz`.

mod common;

use std::time::{Duration, Instant};

use common::l2::*;
use common::redis_servers::RedisServer;
use common::*;

#[test]
fn a_negative_disk_size_names_the_valid_range() {
    let dir = TempDir::new("disk-size");
    let disk = dir.0.join("kvd.disk").display().to_string();
    for args in [
        serve(&["--disk", &disk, "--disk-size-gb", "-1"]),
        serve(&["--disk-size-gb", "-1"]),
    ] {
        let (code, err) = run(&args);
        assert_eq!(code, 2, "{err}");
        let line = fatal(&err);
        assert!(
            line.contains("--disk-size-gb -1") && line.contains("more than 0 GiB"),
            "{line}"
        );
    }
    assert!(!dir.0.join("kvd.disk").exists());
}

#[test]
fn an_unknown_subcommand_points_at_kvd_help_and_lists_the_subcommands() {
    let (code, err) = run(&["bogus"]);
    assert_eq!(code, 2, "{err}");
    let line = fatal(&err);
    assert!(
        line.contains("'bogus'")
            && line.contains("serve (run the server)")
            && line.contains("see kvd --help")
            && !line.contains("kvd serve --help"),
        "{line}"
    );
    // A flag of serve's still points at serve's help.
    let (code, err) = run(&["serve", "--no-such-flag"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        fatal(&err).contains("see kvd serve --help"),
        "{}",
        fatal(&err)
    );
}

/// Asserts that a refused start's line names `flag path` and gives its advice once.
fn advice_once(err: &str, flag: &str, path: &str) {
    let line = fatal(err);
    assert!(
        line.contains(&format!("{flag} {path}: another process")),
        "{line}"
    );
    assert_eq!(
        line.matches("stop").count(),
        1,
        "advice given twice: {line}"
    );
    assert_eq!(line.matches("another path").count(), 1, "{line}");
    assert!(
        !line.contains("ipc://"),
        "the flag and path say where: {line}"
    );
}

#[test]
fn a_socket_path_in_use_gives_its_advice_once() {
    let first = Kvd::start(&[]);
    let fd = first.fd_socket.display().to_string();
    let (code, err) = run(&serve(&["--fd-socket", &fd]));
    assert_ne!(code, 0);
    advice_once(&err, "--fd-socket", &fd);

    let dir = TempDir::new("ipc-clash");
    let ipc = dir.0.join("kvd.ipc").display().to_string();
    let _second = Kvd::start(&["--ipc", &ipc]);
    let other_fd = dir.0.join("fd.sock").display().to_string();
    let (code, err) = run(&serve(&["--ipc", &ipc, "--fd-socket", &other_fd]));
    assert_ne!(code, 0);
    advice_once(&err, "--ipc", &ipc);
}

#[test]
fn start_up_errors_are_json_under_log_format_json() {
    let dir = TempDir::new("json-errors");
    let missing = dir.0.join("no").join("fd.sock").display().to_string();
    for (args, names) in [
        // A bad value, found before logging starts.
        (
            serve(&["--log-format", "json", "--l1-size-gb", "0"]),
            "--l1-size-gb 0",
        ),
        // An argument clap refuses.
        (
            serve(&["--log-format", "json", "--no-such-flag"]),
            "--no-such-flag",
        ),
        // A socket that cannot be bound, found once logging has started.
        (
            serve(&["--log-format", "json", "--fd-socket", &missing]),
            "--fd-socket",
        ),
    ] {
        let (code, err) = run(&args);
        assert_ne!(code, 0, "{args:?}: {err}");
        let records: Vec<serde_json::Value> = err
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l)
                    .unwrap_or_else(|e| panic!("{args:?}: not a JSON line ({e}): {l}\n{err}"))
            })
            .collect();
        let last = records.last().expect("a line saying why");
        assert_eq!(last["level"], "ERROR", "{last}");
        let message = last["fields"]["message"].as_str().unwrap();
        assert!(message.contains(names), "{args:?}: {message}");
        assert_eq!(
            records.iter().filter(|r| r["level"] == "ERROR").count(),
            1,
            "said once: {err}"
        );
    }
}

/// The one log line without a GPU, checked to say each thing once: no word of 8 or more
/// characters (an error's name, a library's path) appears in it twice.
fn warned_once(kvd: &Kvd) {
    kvd.wait_healthy(Duration::from_secs(30));
    let log = kvd.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("no GPU driver found"))
        .collect();
    assert_eq!(lines.len(), 1, "one warning: {log}");
    let mut seen = std::collections::HashSet::new();
    for word in lines[0].split_whitespace() {
        let word = word.trim_matches(|c: char| "()[]:;,.\"'".contains(c));
        if word.len() >= 8 {
            assert!(seen.insert(word), "{word:?} said twice: {}", lines[0]);
        }
    }
}

#[test]
fn without_a_gpu_the_warning_says_it_once() {
    // A HIP runtime that is not there, on any machine.
    let kvd = Kvd::start_env(
        &[],
        &[
            ("KVD_GPU_BACKEND", "hip"),
            ("KVD_HIP_LIBRARY", "/nonexistent/libamdhip64.so"),
        ],
    );
    warned_once(&kvd);
    // This machine as it is: with ROCm's runtime installed but no AMD GPU (CI), or with neither.
    let kvd = Kvd::start(&[]);
    kvd.wait_healthy(Duration::from_secs(30));
    if kvd.log().contains("GPU backend:") {
        eprintln!("skipped the second half: this machine has a GPU");
        return;
    }
    warned_once(&kvd);
}

#[test]
fn healthz_says_when_the_l2_error_happened_and_whether_it_is_current() {
    let mut redis = RedisServer::start(&[]);
    let kvd = kvd_l2(&redis.url(), &[]);
    let h = wait_l2_state(&kvd, "up");
    assert_eq!(
        h["last_error"].is_null(),
        h["last_error_age_s"].is_null(),
        "an error comes with its age: {h}"
    );
    assert_eq!(h["last_error_current"], false, "{h}");

    redis.kill();
    let h = wait_l2_state(&kvd, "down");
    assert_eq!(h["last_error_current"], true, "{h}");
    assert!(h["last_error_age_s"].as_f64().unwrap() < 5.0, "{h}");

    redis.restart();
    let h = wait_l2_state(&kvd, "up");
    assert!(h["last_error"].is_string(), "the error is kept: {h}");
    assert_eq!(h["last_error_current"], false, "but is history: {h}");
    let before = h["last_error_age_s"].as_f64().unwrap();
    let waited = Instant::now();
    std::thread::sleep(Duration::from_millis(1200));
    let h = l2_health(&kvd);
    assert_eq!(h["state"], "up", "{h}");
    let after = h["last_error_age_s"].as_f64().unwrap();
    assert!(
        after >= before + waited.elapsed().as_secs_f64() - 0.2,
        "its age grows: {before} then {after}"
    );
}
