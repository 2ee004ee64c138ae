use super::*;

fn args(url: &str) -> L2Args {
    L2Args {
        l2: Some(url.into()),
        l2_deadline_ms: 250,
        l2_queue: 4096,
        l2_connections: 4,
        l2_fetch_max_mb: 4096,
        ..L2Args::default()
    }
}

fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvd-l2cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn urls_name_one_server_or_a_cluster() {
    assert_eq!(L2Args::default().resolve(None).unwrap(), None);
    let c = args("redis://127.0.0.1:6379")
        .resolve(None)
        .unwrap()
        .unwrap();
    assert_eq!(
        c.target,
        L2Target::Single {
            addr: "127.0.0.1:6379".into(),
            db: 0
        }
    );
    assert!(!c.tls);
    assert_eq!(c.ttl, None);
    let c = args("rediss+cluster://10.0.0.1:7000, 10.0.0.2:7001")
        .resolve(None)
        .unwrap()
        .unwrap();
    assert!(c.tls);
    assert_eq!(
        c.target,
        L2Target::Cluster(vec!["10.0.0.1:7000".into(), "10.0.0.2:7001".into()])
    );
    let c = args("rediss://h:1/3").resolve(None).unwrap().unwrap();
    assert!(c.tls);
    assert_eq!(
        c.target,
        L2Target::Single {
            addr: "h:1".into(),
            db: 3
        }
    );
}

#[test]
fn a_password_in_the_url_is_used_and_never_shown() {
    let c = args("redis://kvd:s3cr%40t@h:1")
        .resolve(None)
        .unwrap()
        .unwrap();
    assert_eq!(c.username.as_deref(), Some("kvd"));
    assert_eq!(c.password, Some(Secret::new("s3cr@t")));
    assert!(c.password_in_url);
    assert_eq!(c.url, "redis://kvd:***@h:1");
    let c = args("redis+cluster://:p@ss@a:1,b:2")
        .resolve(None)
        .unwrap()
        .unwrap();
    assert_eq!(c.password, Some(Secret::new("p@ss")));
    assert_eq!(c.url, "redis+cluster://:***@a:1,b:2");
    assert!(!format!("{c:?}").contains("p@ss"), "{c:?}");
    let err = args("valkey://:hunter2@h:1").resolve(None).unwrap_err().0;
    assert!(!err.contains("hunter2"), "{err}");
}

#[test]
fn the_password_comes_from_a_file_or_the_environment() {
    let f = temp_file("pw", b"from-file\n");
    let c = L2Args {
        l2_password_file: Some(f.clone()),
        ..args("redis://kvd@h:1")
    }
    .resolve(None)
    .unwrap()
    .unwrap();
    assert_eq!(c.password, Some(Secret::new("from-file")));
    assert!(!c.password_in_url);
    assert_eq!(c.url, "redis://kvd:***@h:1");
    let env = Secret::new("from-env");
    let c = args("redis://h:1").resolve(Some(&env)).unwrap().unwrap();
    assert_eq!(c.password, Some(env.clone()));
    assert_eq!(c.url, "redis://:***@h:1");
    let err = L2Args {
        l2_password_file: Some(f),
        ..args("redis://h:1")
    }
    .resolve(Some(&env))
    .unwrap_err()
    .0;
    assert!(err.contains("one way only"), "{err}");
    let err = args("redis://:x@h:1").resolve(Some(&env)).unwrap_err().0;
    assert!(
        err.contains("a password in --l2 and KVD_L2_PASSWORD"),
        "{err}"
    );
}

#[test]
fn the_secret_file_gives_a_key_and_short_ones_are_refused() {
    let long = temp_file("key", b"0123456789abcdef0123\n");
    let same = temp_file("key2", b"0123456789abcdef0123");
    let k1 = read_mac_key(&long).unwrap();
    assert_eq!(
        k1,
        read_mac_key(&same).unwrap(),
        "a trailing newline is ignored"
    );
    assert_eq!(format!("{k1:?}"), "<redacted>");
    let short = temp_file("short", b"tiny\n");
    let err = read_mac_key(&short).unwrap_err().0;
    assert!(
        err.contains("fewer than 16") && err.contains("openssl rand"),
        "{err}"
    );
}

#[test]
fn bad_values_name_the_flag_and_the_fix() {
    let ca = temp_file(
        "ca.pem",
        b"-----BEGIN CERTIFICATE-----\nMII\n-----END CERTIFICATE-----\n",
    );
    let not_pem = temp_file("ca.txt", b"hello");
    let empty = temp_file("empty", b"\n");
    for (a, want) in [
        (args("valkey://h:1"), "unknown scheme; use redis://"),
        (args("redis://nohost"), "is not HOST:PORT"),
        (args("redis+cluster://a:1,b:x"), "\"b:x\" is not HOST:PORT"),
        (args("redis+cluster://a:1/2"), "only database 0"),
        (args("redis://h:1/x"), "use redis://HOST:PORT/0"),
        (args("redis://:%zz@h:1"), "bad %-escape"),
        (
            L2Args {
                l2_ca_file: Some(ca.clone()),
                ..args("redis://h:1")
            },
            "--l2-ca-file",
        ),
        (
            L2Args {
                l2_ca_file: Some(not_pem),
                ..args("rediss://h:1")
            },
            "no PEM certificate",
        ),
        (
            L2Args {
                l2_ca_file: Some("/nonexistent/ca.pem".into()),
                ..args("rediss://h:1")
            },
            "--l2-ca-file /nonexistent/ca.pem: cannot read it",
        ),
        (
            L2Args {
                l2_password_file: Some(empty),
                ..args("redis://h:1")
            },
            "the file is empty",
        ),
        (
            L2Args {
                l2_secret_file: Some(ca),
                l2: None,
                ..args("redis://h:1")
            },
            "--l2-secret-file without --l2",
        ),
        (
            L2Args {
                l2_queue: 0,
                ..args("redis://h:1")
            },
            "--l2-queue 0",
        ),
        (
            L2Args {
                l2_deadline_ms: 0,
                ..args("redis://h:1")
            },
            "--l2-deadline-ms 0",
        ),
    ] {
        let err = a.resolve(None).unwrap_err().0;
        assert!(err.contains(want), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }
}
