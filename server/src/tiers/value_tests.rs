use super::*;
use proptest::prelude::*;

fn sealed(c: &Codec, payload: &[u8], digest: u64, name: &str) -> Vec<u8> {
    let mut b = c.buffer(payload.len());
    b[c.header_bytes()..].copy_from_slice(payload);
    c.seal(&mut b, digest, name);
    b
}

fn keyed(byte: u8) -> Codec {
    Codec::new(Some(MacKey([byte; 32])))
}

#[test]
fn an_intact_value_opens_to_its_payload() {
    let payload: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    for c in [Codec::default(), keyed(1)] {
        let v = sealed(&c, &payload, 11, "k");
        assert_eq!(c.open(&v, 11, "k", 4096).unwrap(), &payload[..]);
    }
    assert_eq!(Codec::default().header_bytes(), 40);
    assert_eq!(keyed(1).header_bytes(), 64);
}

#[test]
fn each_defect_is_rejected_with_its_reason() {
    let c = Codec::default();
    let payload = vec![5u8; 1000];
    let v = sealed(&c, &payload, 3, "a");
    assert_eq!(c.open(&v[..999], 3, "a", 1000), Err(Rejected::Truncated));
    assert_eq!(c.open(&v[..20], 3, "a", 1000), Err(Rejected::Truncated));
    assert_eq!(c.open(&v[..36], 3, "a", 1000), Err(Rejected::Truncated));
    assert_eq!(c.open(b"hello world", 3, "a", 1000), Err(Rejected::Version));
    assert_eq!(c.open(&v, 4, "a", 1000), Err(Rejected::Foreign));
    assert_eq!(c.open(&v, 3, "b", 1000), Err(Rejected::Foreign));
    assert_eq!(c.open(&v, 3, "a", 2000), Err(Rejected::Length));
    let mut longer = v.clone();
    longer.push(0);
    assert_eq!(c.open(&longer, 3, "a", 1000), Err(Rejected::Length));
    let mut flipped = v.clone();
    flipped[HEADER_V1_BYTES + 500] ^= 1;
    assert_eq!(c.open(&flipped, 3, "a", 1000), Err(Rejected::Corrupt));
    let mut newer = v;
    newer[4] = 3;
    assert_eq!(c.open(&newer, 3, "a", 1000), Err(Rejected::Version));
}

#[test]
fn with_a_key_only_values_macd_with_it_open() {
    let (k, other, plain) = (keyed(7), keyed(8), Codec::default());
    let payload = vec![9u8; 512];
    let good = sealed(&k, &payload, 1, "kvd:1:a");
    assert!(k.open(&good, 1, "kvd:1:a", 512).is_ok());
    // A kvd without the key, or a writer with no key at all.
    assert_eq!(
        k.open(&sealed(&plain, &payload, 1, "kvd:1:a"), 1, "kvd:1:a", 512),
        Err(Rejected::Unauthenticated)
    );
    assert_eq!(
        k.open(&sealed(&other, &payload, 1, "kvd:1:a"), 1, "kvd:1:a", 512),
        Err(Rejected::Forged)
    );
    assert_eq!(
        plain.open(&good, 1, "kvd:1:a", 512),
        Err(Rejected::NeedsSecret)
    );
    // Someone with write access changes the payload and fixes up everything unkeyed.
    let mut forged = good.clone();
    forged[HEADER_V2_BYTES] ^= 0xff;
    assert_eq!(k.open(&forged, 1, "kvd:1:a", 512), Err(Rejected::Forged));
    // ... or copies a genuine value under another key and rewrites its tag to match.
    let mut moved = good.clone();
    moved[16..24].copy_from_slice(&key_tag("kvd:1:b").to_le_bytes());
    assert_eq!(k.open(&moved, 1, "kvd:1:b", 512), Err(Rejected::Forged));
    // ... or claims another layout.
    let mut relabelled = good;
    relabelled[8..16].copy_from_slice(&2u64.to_le_bytes());
    assert_eq!(
        k.open(&relabelled, 2, "kvd:1:a", 512),
        Err(Rejected::Forged)
    );
}

#[test]
fn every_reason_has_a_label() {
    let labels: Vec<&str> = Rejected::ALL.iter().map(|r| r.label()).collect();
    for r in Rejected::ALL {
        assert_eq!(r.label(), r.to_string());
    }
    let mut unique = labels.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), labels.len());
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_open_or_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        prop_assert!(Codec::default().open(&bytes, 1, "x", 64).is_err());
        prop_assert!(keyed(3).open(&bytes, 1, "x", 64).is_err());
    }

    #[test]
    fn any_single_bit_flip_is_rejected(len in 1usize..300, bit in any::<usize>(), with_key in any::<bool>()) {
        let c = if with_key { keyed(5) } else { Codec::default() };
        let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let mut v = sealed(&c, &payload, 9, "n");
        let bit = bit % (v.len() * 8);
        v[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(c.open(&v, 9, "n", len as u64).is_err());
    }
}

/// The checks' cost per core at a 32 MiB value (256 tokens of Llama-3.1-8B); figures in
/// benches/RESULTS.md: `cargo test --release -p kvd-server --lib value_cost -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, not a check"]
fn value_cost() {
    let payload: Vec<u8> = (0..32u32 << 20)
        .map(|i| (i * 2_654_435_761) as u8)
        .collect();
    for (what, c) in [("xxh3", Codec::default()), ("MAC (keyed BLAKE3)", keyed(9))] {
        let v = sealed(&c, &payload, 1, "kvd:1:bench");
        let reps = 20;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            assert!(c.open(&v, 1, "kvd:1:bench", payload.len() as u64).is_ok());
        }
        let open_s = t.elapsed().as_secs_f64() / reps as f64;
        let mut buf = c.buffer(payload.len());
        let t = std::time::Instant::now();
        for _ in 0..reps {
            c.seal(&mut buf, 1, "kvd:1:bench");
        }
        let seal_s = t.elapsed().as_secs_f64() / reps as f64;
        let gbps = |s: f64| payload.len() as f64 / s / 1e9;
        println!(
            "{what}: seal {:.2} ms ({:.1} GB/s), open {:.2} ms ({:.1} GB/s) per 32 MiB value, one core",
            seal_s * 1e3,
            gbps(seal_s),
            open_s * 1e3,
            gbps(open_s)
        );
    }
}
