//! Prefix-lookup semantics and pins, against a real kvd.

mod common;

use std::time::Duration;

use common::*;
use kvd_proto::client::ClientError;
use kvd_proto::wire::*;

const FP: u64 = 0xabc;

async fn setup(kvd: &InProcess) -> (kvd_proto::client::Client, HostKv, Registered) {
    let client = kvd.client("lookup").await;
    let kv = HostKv::vllm("BLNHC", 2, 64, 2, 16, 16, 2);
    kv.fill_random(&mut Rng(1));
    let reg = kv.register(&client, FP, 0).await.unwrap();
    (client, kv, reg)
}

fn lookup(hashes: &[u128], pin: bool) -> Lookup {
    Lookup {
        fingerprint: FP,
        salt: 0,
        shards: vec![0],
        hashes: hashes.to_vec(),
        pin,
        readers: 1,
        held: 0,
    }
}

async fn store(
    client: &kvd_proto::client::Client,
    reg: &Registered,
    salt: u64,
    hashes: &[u128],
    first_block: u32,
) -> StoreReply {
    let per = reg.chunk_blocks;
    client
        .store(Store {
            region: reg.region,
            salt,
            chunks: hashes
                .iter()
                .enumerate()
                .map(|(i, &h)| {
                    chunk(
                        h,
                        (0..per).map(|b| first_block + i as u32 * per + b).collect(),
                    )
                })
                .collect(),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_answers_the_stored_prefix() {
    let kvd = InProcess::ready(&["--chunk-tokens", "32"]);
    let (client, _kv, reg) = setup(&kvd).await;
    let tokens: Vec<u32> = (0..32 * 6).collect();
    let h = chain(&tokens, 32);
    // Chunks 0, 1, 2 and 4 stored; 3 missing.
    store(&client, &reg, 0, &h[..3], 0).await;
    store(&client, &reg, 0, &h[4..5], 20).await;
    assert_eq!(
        client.lookup(lookup(&h, false)).await.unwrap().hit_chunks,
        3
    );
    assert_eq!(
        client
            .lookup(lookup(&h[..2], false))
            .await
            .unwrap()
            .hit_chunks,
        2
    );
    // A different first token changes every chained hash: a miss, never a wrong hit.
    let mut other = tokens.clone();
    other[0] = 999_999;
    assert_eq!(
        client
            .lookup(lookup(&chain(&other, 32), false))
            .await
            .unwrap()
            .hit_chunks,
        0
    );
    // Salt and fingerprint and shard separate caches.
    let mut salted = lookup(&h, false);
    salted.salt = 77;
    assert_eq!(client.lookup(salted).await.unwrap().hit_chunks, 0);
    let mut other_model = lookup(&h, false);
    other_model.fingerprint = FP + 1;
    assert_eq!(client.lookup(other_model).await.unwrap().hit_chunks, 0);
    let mut two_shards = lookup(&h, false);
    two_shards.shards = vec![0, 1];
    assert_eq!(
        client.lookup(two_shards).await.unwrap().hit_chunks,
        0,
        "shard 1 stored nothing"
    );
    // Storing again is reported, not duplicated.
    let again = store(&client, &reg, 0, &h[..2], 40).await;
    assert_eq!(again.outcomes, vec![StoreOutcome::AlreadyStored; 2]);
    assert_eq!(kvd.metric("kvd_lookups_total{result=\"hit\""), 2.0);
    assert_eq!(kvd.metric("kvd_lookups_total{result=\"miss\""), 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_hold_until_retrieve_release_timeout_or_disconnect() {
    let kvd = InProcess::ready(&["--chunk-tokens", "32", "--pin-timeout-ms", "1500"]);
    let (client, _kv, reg) = setup(&kvd).await;
    let h = chain(&(0..32 * 3).collect::<Vec<_>>(), 32);
    store(&client, &reg, 0, &h, 0).await;

    // Released by a retrieve that names the pin.
    let l = client.lookup(lookup(&h, true)).await.unwrap();
    assert_eq!(l.hit_chunks, 3);
    assert_ne!(l.pin_id, 0);
    assert_eq!(kvd.metric("kvd_lookup_pins"), 1.0);
    let r = client
        .retrieve(Retrieve {
            region: reg.region,
            salt: 0,
            pin_id: l.pin_id,
            chunks: vec![chunk(h[0], (30..32).collect())],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(r.outcomes, vec![RetrieveOutcome::Loaded]);
    assert_eq!(kvd.metric("kvd_lookup_pins"), 0.0);
    assert_eq!(kvd.metric("kvd_pool_pinned_pages"), 0.0);

    // Released explicitly.
    let l = client.lookup(lookup(&h, true)).await.unwrap();
    assert_eq!(kvd.metric("kvd_pool_pinned_pages"), 3.0);
    assert_eq!(
        client
            .release(Release { pin_id: l.pin_id })
            .await
            .unwrap()
            .chunks,
        3
    );
    assert_eq!(
        client
            .release(Release { pin_id: l.pin_id })
            .await
            .unwrap()
            .chunks,
        0
    );

    // Released by the timeout.
    client.lookup(lookup(&h, true)).await.unwrap();
    assert_eq!(kvd.metric("kvd_pool_pinned_pages"), 3.0);
    tokio::time::sleep(Duration::from_millis(2800)).await;
    assert_eq!(kvd.metric("kvd_pool_pinned_pages"), 0.0);
    assert_eq!(kvd.metric("kvd_pins_expired_total"), 1.0);

    // Released when the client goes away, with its registration.
    let other = kvd.client("other").await;
    other.lookup(lookup(&h, true)).await.unwrap();
    assert_eq!(kvd.metric("kvd_pool_pinned_pages"), 3.0);
    assert_eq!(kvd.metric("kvd_registered_workers"), 1.0);
    drop(other);
    drop(client);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while kvd.metric("kvd_pool_pinned_pages") != 0.0 || kvd.metric("kvd_registered_workers") != 0.0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "pins or registrations outlived their sessions"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The data stays for the next client.
    let c = kvd.client("later").await;
    assert_eq!(c.lookup(lookup(&h, false)).await.unwrap().hit_chunks, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mla_pin_is_released_after_every_reader() {
    let kvd = InProcess::ready(&["--chunk-tokens", "32"]);
    let (client, _kv, reg) = setup(&kvd).await;
    let h = chain(&(0..64).collect::<Vec<_>>(), 32);
    store(&client, &reg, 0, &h, 0).await;
    let mut l = lookup(&h, true);
    l.readers = 2;
    let pin = client.lookup(l).await.unwrap().pin_id;
    for expect_left in [1.0, 0.0] {
        client
            .retrieve(Retrieve {
                region: reg.region,
                salt: 0,
                pin_id: pin,
                chunks: vec![chunk(h[0], vec![50, 51])],
                wait_slot: None,
                deadline_ns: 0,
            })
            .await
            .unwrap();
        assert_eq!(kvd.metric("kvd_lookup_pins"), expect_left);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_about_unknown_things_get_typed_errors() {
    let kvd = InProcess::ready(&["--chunk-tokens", "32"]);
    let (client, kv, reg) = setup(&kvd).await;
    let err = |r: Result<StoreReply, ClientError>| match r {
        Err(ClientError::Server { code, message }) => (code, message),
        other => panic!("{other:?}"),
    };
    let (code, msg) = err(client
        .store(Store {
            region: 999,
            salt: 0,
            chunks: vec![],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await);
    assert_eq!(code, ErrorCode::UnknownRegion);
    assert!(msg.contains("register again"), "{msg}");
    let (code, msg) = err(client
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks: vec![chunk(1, vec![0, 64])],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await);
    assert_eq!(code, ErrorCode::InvalidArgument);
    assert!(msg.contains("block id 64 is out of range"), "{msg}");
    let (code, _) = err(client
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks: vec![chunk(1, vec![0])],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await);
    assert_eq!(code, ErrorCode::InvalidArgument);
    // Another session cannot use this session's region.
    let other = kvd.client("other").await;
    let (code, _) = err(other
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks: vec![],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await);
    assert_eq!(code, ErrorCode::UnknownRegion);
    // Every error reply is counted, by op and code.
    assert_eq!(
        kvd.metric("kvd_request_errors_total{code=\"UnknownRegion\",op=\"store\""),
        2.0
    );
    assert_eq!(
        kvd.metric("kvd_request_errors_total{code=\"InvalidArgument\",op=\"store\""),
        2.0
    );
    // Registering without sending descriptors.
    let r = other
        .register(Register {
            fingerprint: FP,
            shard: 0,
            device: DeviceSpec::Host,
            fd_token: 12345,
            allocations: vec![AllocationSpec::HostFd {
                fd_index: 0,
                size_bytes: kv.allocations[0].size_bytes(),
            }],
            layout: kv.layout.clone(),
            layers: kv.layers.clone(),
            client_events: vec![],
        })
        .await;
    assert!(
        matches!(
            r,
            Err(ClientError::Server {
                code: ErrorCode::FdMissing,
                ..
            })
        ),
        "{r:?}"
    );
    // A fingerprint may not change layout meaning.
    let other_layout = HostKv::vllm("LBHNC", 2, 64, 2, 16, 16, 2);
    let r = other_layout.register(&other, FP, 0).await;
    assert!(
        matches!(&r, Err(ClientError::Server { code: ErrorCode::InvalidArgument, message }) if message.contains("another KV layout")),
        "{r:?}"
    );
    // A chunk size that is not a whole number of blocks.
    let odd = HostKv::vllm("LBNHC", 2, 8, 2, 24, 16, 2);
    let r = odd.register(&other, FP + 5, 0).await;
    assert!(
        matches!(&r, Err(ClientError::Server { code: ErrorCode::InvalidArgument, message }) if message.contains("--chunk-tokens")),
        "{r:?}"
    );
    assert_eq!(kvd.metric("kvd_registration_refusals_total"), 3.0);
}

/// A state group's lookup (`LookupLast`): the latest stored chunk of those named, whatever is
/// missing before it, pinned alone; a retrieve through that pin gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_last_answers_the_latest_stored_chunk_and_pins_only_it() {
    let kvd = InProcess::ready(&["--chunk-tokens", "32"]);
    let (client, _kv, reg) = setup(&kvd).await;
    let tokens: Vec<u32> = (0..32 * 8).collect();
    let h = chain(&tokens, 32);
    // States stored after chunks 2 and 5 only (the steps that ended there).
    store(&client, &reg, 0, &h[2..3], 0).await;
    store(&client, &reg, 0, &h[5..6], 10).await;
    let last = |hashes: &[u128], pin: bool| client.lookup_last(lookup(hashes, pin));
    assert_eq!(last(&h, false).await.unwrap().hit_chunks, 6);
    assert_eq!(last(&h[..5], false).await.unwrap().hit_chunks, 3);
    assert_eq!(last(&h[..2], false).await.unwrap().hit_chunks, 0);
    assert_eq!(
        last(&h[..2], true).await.unwrap().pin_id,
        0,
        "nothing found, nothing pinned"
    );
    // The prefix lookup of the same chunks finds nothing: chunk 0 is missing.
    assert_eq!(
        client.lookup(lookup(&h, false)).await.unwrap().hit_chunks,
        0
    );

    let hit = last(&h, true).await.unwrap();
    assert_eq!(hit.hit_chunks, 6);
    assert_ne!(hit.pin_id, 0);
    assert_eq!(kvd.metric("kvd_lookup_pins"), 1.0, "one pin");
    let per = reg.chunk_blocks;
    let got = client
        .retrieve(Retrieve {
            region: reg.region,
            salt: 0,
            pin_id: hit.pin_id,
            chunks: vec![chunk(h[5], (0..per).map(|b| 40 + b).collect())],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(got.outcomes, vec![RetrieveOutcome::Loaded]);
    assert_eq!(
        kvd.metric("kvd_lookup_pins"),
        0.0,
        "the retrieve ended the pin"
    );
    // A wrong salt or fingerprint finds nothing.
    let mut other = lookup(&h, false);
    other.salt = 9;
    assert_eq!(client.lookup_last(other).await.unwrap().hit_chunks, 0);
}
