//! The threat model's "must not"s (docs/reliability.md, issue #13 item 4), each against a real
//! kvd with two local clients, A and B: B must not make kvd write into memory B did not register
//! or read memory B does not own, must not reach past what it shared, must not drop A's pins,
//! and must not read chunks stored under another cache salt.

mod common;

use common::*;
use kvd_proto::client::{Client, ClientError};
use kvd_proto::wire::*;

const FP: u64 = 0x5ec;

fn checksum(kv: &HostKv) -> Vec<u8> {
    kv.allocations
        .iter()
        .flat_map(|a| a.read_vec(0, a.size_bytes() as usize).unwrap())
        .collect()
}

fn code<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (ErrorCode, String) {
    match r {
        Err(ClientError::Server { code, message }) => (code, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn registered(kvd: &InProcess, name: &str, seed: u64) -> (Client, HostKv, Registered) {
    let client = kvd.client(name).await;
    let kv = HostKv::vllm("BLNHC", 2, 64, 2, 16, 16, 2);
    kv.fill_random(&mut Rng(seed));
    let reg = kv.register(&client, FP, 0).await.unwrap();
    (client, kv, reg)
}

fn blocks(reg: &Registered, first: u32) -> Vec<u32> {
    (first..first + reg.chunk_blocks).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_make_kvd_touch_memory_it_does_not_own() {
    let kvd = InProcess::ready(&["--chunk-tokens", "32"]);
    let (a, kv_a, reg_a) = registered(&kvd, "a", 1).await;
    let (b, kv_b, reg_b) = registered(&kvd, "b", 2).await;
    let h = chain(&(0..64).collect::<Vec<_>>(), 32);
    let stored = a
        .store(Store {
            region: reg_a.region,
            salt: 0,
            chunks: vec![chunk(h[0], blocks(&reg_a, 0))],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(stored.outcomes, vec![StoreOutcome::Stored]);
    let a_before = checksum(&kv_a);

    // B names A's region: kvd must not write into it (retrieve) or read from it (store).
    let (c, _) = code(
        b.retrieve(Retrieve {
            region: reg_a.region,
            salt: 0,
            pin_id: 0,
            chunks: vec![chunk(h[0], blocks(&reg_a, 10))],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await,
    );
    assert_eq!(c, ErrorCode::UnknownRegion);
    let (c, _) = code(
        b.store(Store {
            region: reg_a.region,
            salt: 0,
            chunks: vec![chunk(h[1], blocks(&reg_a, 20))],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await,
    );
    assert_eq!(c, ErrorCode::UnknownRegion);
    let (c, _) = code(b.unregister(reg_a.region).await);
    assert_eq!(c, ErrorCode::UnknownRegion);

    // Block ids past B's own cache: refused before any copy, in both directions.
    let b_before = checksum(&kv_b);
    let past = 64 + reg_b.chunk_blocks;
    for store in [true, false] {
        let bad = vec![chunk(h[0], (64..past).collect())];
        let r = if store {
            b.store(Store {
                region: reg_b.region,
                salt: 0,
                chunks: bad,
                wait_slot: None,
                deadline_ns: 0,
            })
            .await
            .map(|_| ())
        } else {
            b.retrieve(Retrieve {
                region: reg_b.region,
                salt: 0,
                pin_id: 0,
                chunks: bad,
                wait_slot: None,
                deadline_ns: 0,
            })
            .await
            .map(|_| ())
        };
        let (c, m) = code(r);
        assert_eq!(c, ErrorCode::InvalidArgument);
        assert!(m.contains("out of range"), "{m}");
    }
    assert_eq!(checksum(&kv_b), b_before, "B's memory untouched");
    assert_eq!(checksum(&kv_a), a_before, "A's memory untouched");

    // A registration that reaches past the memory it shares is refused: a layout with more
    // blocks than the buffer holds, and a buffer declared larger than the one sent.
    let mut long = HostKv::vllm("BLNHC", 2, 64, 2, 16, 16, 2);
    long.layout.num_blocks = 65;
    let (c, m) = code(long.register(&b, FP + 1, 0).await);
    assert_eq!(c, ErrorCode::InvalidArgument, "{m}");
    let small = HostKv::vllm("BLNHC", 2, 64, 2, 16, 16, 2);
    let real = small.allocations[0].size_bytes();
    let fds = vec![rustix::io::fcntl_dupfd_cloexec(small.allocations[0].fd(), 0).unwrap()];
    let token = b.share_fds(fds).await.unwrap();
    let (c, m) = code(
        b.register(Register {
            fingerprint: FP + 2,
            shard: 0,
            device: DeviceSpec::Host,
            fd_token: token,
            allocations: vec![AllocationSpec::HostFd {
                fd_index: 0,
                size_bytes: real * 2,
            }],
            layout: {
                let mut l = small.layout.clone();
                l.num_blocks = 128;
                l
            },
            layers: small.layers.clone(),
            client_events: vec![],
        })
        .await,
    );
    assert_ne!(c, ErrorCode::Internal, "{m}");
    assert!(m.contains("holds"), "{m}");
    assert_eq!(kvd.get("/healthz").0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_drop_another_clients_pins_or_read_another_salt() {
    let kvd = InProcess::ready(&["--chunk-tokens", "32"]);
    let (a, _kv_a, reg_a) = registered(&kvd, "a", 3).await;
    let (b, kv_b, reg_b) = registered(&kvd, "b", 4).await;
    let h = chain(&(0..64).collect::<Vec<_>>(), 32);
    const SALT_A: u64 = 0xa;
    a.store(Store {
        region: reg_a.region,
        salt: SALT_A,
        chunks: vec![chunk(h[0], blocks(&reg_a, 0))],
        wait_slot: None,
        deadline_ns: 0,
    })
    .await
    .unwrap();
    let lookup = |salt| Lookup {
        fingerprint: FP,
        salt,
        shards: vec![0],
        hashes: vec![h[0]],
        pin: true,
        readers: 1,
        held: 0,
    };
    let pin = a.lookup(lookup(SALT_A)).await.unwrap();
    assert_eq!(pin.hit_chunks, 1);
    // Pin ids are sequential: B guesses A's and cannot release it.
    let released = b.release(Release { pin_id: pin.pin_id }).await.unwrap();
    assert_eq!(released.chunks, 0);
    assert_eq!(kvd.metric("kvd_lookup_pins"), 1.0);
    // Another salt: no hit, and a retrieve by hash leaves B's blocks as they were.
    assert_eq!(b.lookup(lookup(0)).await.unwrap().hit_chunks, 0);
    let before = checksum(&kv_b);
    let r = b
        .retrieve(Retrieve {
            region: reg_b.region,
            salt: 0,
            pin_id: 0,
            chunks: vec![chunk(h[0], blocks(&reg_b, 0))],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(r.outcomes, vec![RetrieveOutcome::Missing]);
    assert_eq!(checksum(&kv_b), before);
    // A releases its own pin.
    assert_eq!(
        a.release(Release { pin_id: pin.pin_id })
            .await
            .unwrap()
            .chunks,
        1
    );
    assert_eq!(kvd.metric("kvd_lookup_pins"), 0.0);
}
