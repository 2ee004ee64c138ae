use super::*;
use crate::life::flags::{Cli, Command};
use clap::Parser;

fn args(extra: &[&str]) -> ServeArgs {
    let mut argv = vec!["kvd", "serve"];
    argv.extend_from_slice(extra);
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Serve(a) => a,
    }
}

fn machine(gib: u64, total: Option<&str>) -> Machine {
    Machine {
        memory_bytes: gib << 30,
        cgroup_limit: None,
        l2_password_env: None,
        total_cpu_dram_gb: total.map(str::to_owned),
        cpus: 8,
        runtime_dir: None,
        open_files: 20_000,
        euid: 1000,
        topology: Topology::read(std::path::Path::new("/nonexistent-sysfs")),
    }
}

#[test]
fn size_rules() {
    let c = args(&[]).resolve(&machine(64, None)).unwrap();
    assert_eq!(c.layout.size_bytes(), 48 << 30);
    assert_eq!(c.size_rule, SizeRule::Physical(64 << 30));
    let c = args(&[]).resolve(&machine(64, Some("40"))).unwrap();
    assert_eq!(c.layout.size_bytes(), 30 << 30);
    assert_eq!(c.size_rule, SizeRule::TotalCpuDramGb(40.0));
    let c = args(&["--l1-size-gb", "1.5"])
        .resolve(&machine(64, Some("40")))
        .unwrap();
    assert_eq!(c.layout.size_bytes(), 3 << 29);
    assert_eq!(c.size_rule, SizeRule::Flag);
    assert_eq!(
        c.layout.piece_bytes(),
        96 << 20,
        "1.5 GiB / 16, in 2 MiB steps"
    );
    let c = args(&["--l1-size-gb", "64"])
        .resolve(&machine(128, None))
        .unwrap();
    assert_eq!(c.layout.piece_bytes(), 256 << 20);
    assert_eq!(c.fd_socket, PathBuf::from("/tmp/kvd-5555.fd.sock"));
}

#[test]
fn connection_and_descriptor_limits_fit_the_open_file_limit() {
    let mut m = machine(64, None);
    let c = args(&[]).resolve(&m).unwrap();
    assert_eq!(c.max_connections, 4096);
    assert_eq!(c.fd_limits.max_connections, 256);
    assert_eq!(c.fd_limits.max_stashed, 20_000 - 4096 - 256 - SPARE_FDS);
    assert_eq!(c.fd_limits.max_stashed_per_uid, c.fd_limits.max_stashed / 2);
    assert_eq!(c.fd_socket_mode, 0o660);
    m.open_files = 1024;
    let c = args(&[]).resolve(&m).unwrap();
    let f = c.fd_limits;
    assert_eq!((c.max_connections, f.max_connections), (256, 64));
    assert_eq!(
        c.max_connections + f.max_connections + f.max_stashed + SPARE_FDS,
        1024
    );
    m.open_files = 1 << 20;
    let c = args(&[]).resolve(&m).unwrap();
    assert_eq!(c.fd_limits.max_stashed, 262_144);
}

#[test]
fn bad_values_name_the_flag_and_the_fix() {
    let m = machine(16, None);
    for (argv, want) in [
        (vec!["--l1-size-gb", "0"], "--l1-size-gb 0"),
        (vec!["--l1-size-gb", "-2"], "--l1-size-gb -2"),
        (vec!["--l1-size-gb", "17"], "pass at most 16.0"),
        (
            vec!["--eviction", "random"],
            "use one of: lru, fifo, s3fifo",
        ),
        (vec!["--chunk-tokens", "0"], "--chunk-tokens 0"),
        (vec!["--log-level", "lo=ud=ly"], "--log-level"),
        (vec!["--session-timeout-ms", "10"], "at least 1000"),
        (
            vec!["--populate-threads", "100000"],
            "--populate-threads 100000: use 1 to 1024",
        ),
        (vec!["--log-level", "verbose"], "--log-level verbose"),
        (
            vec!["--slab-mb", "1"],
            "--slab-mb 1: slabs must be at least 2 MiB",
        ),
        (vec!["--fd-socket-mode", "0999"], "--fd-socket-mode 0999"),
        (vec!["--fd-socket-mode", "0066"], "include 0600"),
        (vec!["--max-in-flight", "0"], "--max-in-flight 0"),
        (vec!["--max-buffered-mb", "2"], "must hold one whole frame"),
        (vec!["--hello-timeout-ms", "5"], "at least 100"),
        (
            vec!["--max-connections", "19000", "--fd-max-stashed", "5000"],
            "raise the limit (ulimit -n",
        ),
        (vec!["--numa", "near"], "use auto, off or remote"),
        (
            vec!["--port", "7000", "--http-port", "7000"],
            "--port 7000 and --http-port 7000: kvd cannot listen on one port twice",
        ),
        (
            vec![
                "--port",
                "7000",
                "--http-port",
                "7000",
                "--http-host",
                "0.0.0.0",
            ],
            "--http-port 7000",
        ),
        (
            vec!["--ipc", "/tmp/k.sock", "--fd-socket", "/tmp/k.sock"],
            "--ipc /tmp/k.sock and --fd-socket /tmp/k.sock",
        ),
    ] {
        let err = args(&argv).resolve(&m).unwrap_err().0;
        assert!(err.contains(want), "{argv:?}: {err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }
    for good in ["kvd_server=debug", "info,kvd_server=trace", "WARN", "off"] {
        assert!(
            args(&["--log-level", good]).resolve(&m).is_ok(),
            "{good} is a filter"
        );
    }
    let err = args(&[]).resolve(&machine(16, Some("lots"))).unwrap_err().0;
    assert!(err.contains("TOTAL_CPU_DRAM_GB=\"lots\""), "{err}");
    let err = args(&[]).resolve(&machine(16, Some("64"))).unwrap_err().0;
    assert!(err.contains("75% of it is above"), "{err}");
}
