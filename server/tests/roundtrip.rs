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
