//! Bit-exact store → retrieve round trips through a real kvd process, with memfd memory standing
//! in for GPU memory: every layout kvd accepts, random block ids, the blocks overwritten with
//! other random data between store and retrieve, and retrieval into different blocks.

mod common;

use common::*;
use kvd_proto::wire::*;

const CHUNK_TOKENS: u32 = 64;

async fn round_trip(kv: &HostKv, seed: u64) {
    let kvd = Kvd::ready(&["--chunk-tokens", &CHUNK_TOKENS.to_string()]);
    let client = kvd.client("roundtrip").await;
    let mut rng = Rng(seed);
    kv.fill_random(&mut rng);
    let reg = kv.register(&client, 0xfeed, 0).await.unwrap();
    let per_chunk = reg.chunk_blocks as usize;
    let blocks = kv.layout.num_blocks;
    assert_eq!(per_chunk as u32, CHUNK_TOKENS / kv.layout.block_tokens);

    // Three chunks from random, distinct blocks.
    let mut ids: Vec<u32> = (0..blocks).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let n = 3;
    let src: Vec<Vec<u32>> = ids[..n * per_chunk]
        .chunks(per_chunk)
        .map(<[u32]>::to_vec)
        .collect();
    let hashes: Vec<u128> = (0..n)
        .map(|_| rng.next() as u128 | ((rng.next() as u128) << 64))
        .collect();
    let expected: Vec<Vec<Vec<u8>>> = src
        .iter()
        .map(|c| c.iter().map(|&b| kv.block_bytes(b)).collect())
        .collect();

    let stored = client
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks: chunks(&hashes, &src),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(stored.outcomes, vec![StoreOutcome::Stored; n]);
    assert_eq!(
        stored.done_slot, None,
        "host copies finish before the reply"
    );

    // Overwrite the whole cache, then retrieve into other blocks.
    kv.fill_random(&mut rng);
    let dst: Vec<Vec<u32>> = ids[n * per_chunk..2 * n * per_chunk]
        .chunks(per_chunk)
        .map(<[u32]>::to_vec)
        .collect();
    let untouched = ids[2 * n * per_chunk];
    let untouched_before = kv.block_bytes(untouched);
    let got = client
        .retrieve(Retrieve {
            region: reg.region,
            salt: 0,
            pin_id: 0,
            chunks: chunks(&hashes, &dst),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(got.outcomes, vec![RetrieveOutcome::Loaded; n]);
    for (c, blocks) in dst.iter().enumerate() {
        for (i, &b) in blocks.iter().enumerate() {
            assert!(
                kv.block_bytes(b) == expected[c][i],
                "chunk {c} block {i} differs"
            );
        }
    }
    assert_eq!(
        kv.block_bytes(untouched),
        untouched_before,
        "a block outside the retrieve changed"
    );
    let bytes = kvd.metric("kvd_bytes_retrieved_total");
    let page = reg.page_bytes as f64;
    assert_eq!(bytes, page * n as f64);
    assert_eq!(kvd.metric("kvd_bytes_stored_total"), page * n as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vllm_033_layout_round_trips_bit_exact() {
    for (i, order) in ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "LHBNC", "BHLNC"]
        .iter()
        .enumerate()
    {
        // 4 layers, 40 blocks of 16 tokens, 2 heads, K‖V content of 2×16, bf16.
        let kv = HostKv::vllm(order, 4, 40, 2, 16, 32, 2);
        round_trip(&kv, 100 + i as u64).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fp8_mla_and_pre_033_layouts_round_trip_bit_exact() {
    // fp8 (1-byte elements), Llama-like.
    round_trip(&HostKv::vllm("BLNHC", 3, 30, 4, 16, 64, 1), 7).await;
    // DeepSeek MLA: one head of 576, block 64 (so one block per 64-token chunk).
    round_trip(&HostKv::vllm("LBNHC", 5, 12, 1, 64, 576, 2), 8).await;
    // FlashAttention before vLLM 0.33: per-layer tensors (2, blocks, tokens, heads, dim).
    round_trip(&HostKv::flash_attn_v0(3, 30, 16, 2, 32, 2), 9).await;
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: the clock a request's `deadline_ns` is on.
fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn expired(r: Result<Reply, kvd_proto::client::ClientError>) {
    match r {
        Ok(Reply::Error(e)) => {
            assert_eq!(e.code, ErrorCode::Expired, "{}", e.message);
            assert!(e.message.contains("nothing was copied"), "{}", e.message);
        }
        other => panic!("expected an Expired error, got {other:?}"),
    }
}

/// A client that stops waiting for a copy may reuse its blocks at once (vLLM hands a sliding
/// window's blocks to the next step). kvd paused (SIGSTOP) past a request's deadline must then
/// copy nothing when it wakes: a store stores nothing (a later lookup misses, never a hit on
/// bytes the blocks hold by then), a retrieve writes nothing into the blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_whose_deadline_passed_while_kvd_was_stopped_copies_nothing() {
    use rustix::process::{kill_process, Pid, Signal};
    let kvd = Kvd::ready(&["--chunk-tokens", &CHUNK_TOKENS.to_string()]);
    let pid = Pid::from_child(&kvd.child);
    let raw_pid = kvd.child.id();
    let client = kvd.client("deadline").await;
    let kv = HostKv::vllm("BLNHC", 2, 40, 2, 16, 32, 2);
    kv.fill_random(&mut Rng(77));
    let reg = kv.register(&client, 0xdead, 0).await.unwrap();
    let per = reg.chunk_blocks;
    let src = vec![(0..per).collect::<Vec<u32>>()];
    let dst = vec![(per..2 * per).collect::<Vec<u32>>()];
    let hashes = [0x5107u128];
    let lookup = |pin| Lookup {
        fingerprint: 0xdead,
        salt: 0,
        shards: vec![0],
        hashes: hashes.to_vec(),
        pin,
        readers: 1,
        held: 0,
    };
    let paused = |req: Request| {
        let client = &client;
        async move {
            stop_process(raw_pid);
            let sent = tokio::spawn({
                let c = client.clone();
                async move { c.request(req).await }
            });
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            kill_process(pid, Signal::CONT).unwrap();
            sent.await.unwrap()
        }
    };

    // A store sent while kvd is stopped, with a deadline 100 ms out.
    let store = |deadline_ns| {
        Request::Store(Store {
            region: reg.region,
            salt: 0,
            chunks: chunks(&hashes, &src),
            wait_slot: None,
            deadline_ns,
        })
    };
    expired(paused(store(monotonic_ns() + 100_000_000)).await);
    assert_eq!(client.lookup(lookup(false)).await.unwrap().hit_chunks, 0);
    assert_eq!(
        kvd.metric("kvd_copies_expired_total{direction=\"d2h\"}"),
        1.0
    );

    // The same store in time is stored.
    let Reply::Store(s) = client
        .request(store(monotonic_ns() + 10_000_000_000))
        .await
        .unwrap()
    else {
        panic!("not a store reply")
    };
    assert_eq!(s.outcomes, vec![StoreOutcome::Stored]);

    // A retrieve past its deadline leaves its blocks as they are and releases its pin's reader.
    let pin = client.lookup(lookup(true)).await.unwrap();
    assert_eq!(pin.hit_chunks, 1);
    let before: Vec<Vec<u8>> = dst[0].iter().map(|&b| kv.block_bytes(b)).collect();
    let retrieve = Request::Retrieve(Retrieve {
        region: reg.region,
        salt: 0,
        pin_id: pin.pin_id,
        chunks: chunks(&hashes, &dst),
        wait_slot: None,
        deadline_ns: monotonic_ns() + 100_000_000,
    });
    expired(paused(retrieve).await);
    let after: Vec<Vec<u8>> = dst[0].iter().map(|&b| kv.block_bytes(b)).collect();
    assert!(before == after, "an expired retrieve wrote into the blocks");
    assert_eq!(
        kvd.metric("kvd_copies_expired_total{direction=\"h2d\"}"),
        1.0
    );
    assert_eq!(
        client
            .release(Release { pin_id: pin.pin_id })
            .await
            .unwrap()
            .chunks,
        0,
        "the expired retrieve released its pin"
    );
}
