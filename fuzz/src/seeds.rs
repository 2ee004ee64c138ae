//! Starting inputs for each target, built from the real encoders so the fuzzer begins from
//! valid messages; `scripts/fuzz.sh` writes them where a corpus is empty.

use kvd_proto::fdpass::Header;
use kvd_proto::layouts::{flash_attn_v0_layout, vllm_layout};
use kvd_proto::wire::*;
use kvd_proto::zmtp::write_message;

fn requests() -> Vec<Request> {
    let (layout, layers, size_bytes) =
        vllm_layout("BLNHC", 4, 64, 8, 16, 128, 2).expect("a valid layout");
    let (v0, layer_bytes) = flash_attn_v0_layout(64, 16, 8, 128, 2);
    let chunk = |hash: u128| ChunkBlocks {
        hash,
        blocks: vec![3, 4, u32::MAX],
    };
    vec![
        Request::Hello(Hello {
            protocol_version: 1,
            client: "fuzz".into(),
            pid: 42,
            role: Role::Worker,
        }),
        Request::Register(Register {
            fingerprint: 7,
            shard: 0,
            device: DeviceSpec::Host,
            fd_token: 99,
            allocations: vec![AllocationSpec::HostFd {
                fd_index: 0,
                size_bytes,
            }],
            layout,
            layers,
            client_events: vec![],
        }),
        Request::Register(Register {
            fingerprint: 8,
            shard: 1,
            device: DeviceSpec::Cuda { uuid: [5; 16] },
            fd_token: 0,
            allocations: vec![
                AllocationSpec::CudaIpc {
                    handle: IpcHandle([1; 64]),
                    offset_bytes: 0,
                    size_bytes: layer_bytes,
                },
                AllocationSpec::CudaVmm {
                    chunks: vec![VmmChunk {
                        fd_index: 0,
                        offset_bytes: 0,
                        size_bytes: 20 << 20,
                    }],
                    offset_bytes: 4096,
                    size_bytes: layer_bytes,
                },
            ],
            layout: v0,
            layers: vec![
                LayerPlacement {
                    allocation: 0,
                    offset_bytes: 0,
                },
                LayerPlacement {
                    allocation: 1,
                    offset_bytes: 0,
                },
            ],
            client_events: vec![IpcHandle([2; 64])],
        }),
        Request::Unregister(Unregister { region: 1 }),
        Request::Lookup(Lookup {
            fingerprint: 7,
            salt: 0,
            shards: vec![0, 1],
            hashes: vec![1, 2, 3],
            pin: true,
            readers: 1,
            held: 0,
        }),
        Request::Store(Store {
            region: 1,
            salt: 3,
            chunks: vec![chunk(1), chunk(2)],
            wait_slot: Some(0),
            deadline_ns: 0,
        }),
        Request::Retrieve(Retrieve {
            region: 1,
            salt: 3,
            pin_id: 5,
            chunks: vec![chunk(1)],
            wait_slot: None,
            deadline_ns: 0,
        }),
        Request::Release(Release { pin_id: 5 }),
        Request::Ping(Ping {}),
        Request::Stats(StatsRequest {}),
        Request::Events(Events {
            since: 3,
            max: 4096,
        }),
        Request::Remember(Remember {
            group: "replica-0".into(),
            salt: String::new(),
            tokens: vec![1, 2, 3],
        }),
        Request::Recall(Recall {
            group: "replica-0".into(),
            index: 0,
        }),
    ]
}

fn replies() -> Vec<Reply> {
    vec![
        Reply::Hello(HelloOk {
            protocol_version: 1,
            server_version: "0.1.0".into(),
            session_id: 1,
            chunk_tokens: 256,
            fd_socket: "/tmp/kvd-5555.fd.sock".into(),
            session_timeout_ms: 30_000,
            max_frame_bytes: 4 << 20,
            presence: "/dev/shm/kvd-presence-1-0".into(),
        }),
        Reply::Registered(Registered {
            region: 1,
            page_bytes: 1 << 20,
            chunk_blocks: 16,
            server_events: vec![IpcHandle([3; 64])],
        }),
        Reply::Unregistered,
        Reply::Lookup(LookupReply {
            hit_chunks: 2,
            pin_id: 9,
        }),
        Reply::Store(StoreReply {
            outcomes: vec![
                StoreOutcome::Stored,
                StoreOutcome::RefusedPoolFull,
                StoreOutcome::Skipped,
            ],
            done_slot: Some(1),
        }),
        Reply::Retrieve(RetrieveReply {
            outcomes: vec![RetrieveOutcome::Loaded, RetrieveOutcome::Missing],
            done_slot: None,
        }),
        Reply::Released(Released { chunks: 3 }),
        Reply::Pong(Pong { uptime_ms: 1000 }),
        Reply::Stats(Stats {
            pool_bytes_total: 1 << 30,
            pool_bytes_used: 1 << 20,
            chunks: 1,
            pinned_pages: 0,
            sessions: 2,
            regions: 1,
            evictions: 0,
            store_refusals: 0,
        }),
        Reply::Events(EventsReply {
            records: vec![RemovedChunk {
                fingerprint: 7,
                salt: 3,
                shard: 1,
                hash: 2,
            }],
            next: 9,
            dropped: 5,
        }),
        Reply::Remembered(Remembered { prompts: 2 }),
        Reply::Recalled(Recalled {
            prompt: Some(RecalledPrompt {
                salt: "s".into(),
                tokens: vec![1, 2, 3],
                age_ms: 40,
            }),
            prompts: 2,
        }),
        Reply::error(ErrorCode::InvalidArgument, "block id 9 is out of range"),
    ]
}

/// A DEALER's side of a connection: greeting, READY, then `frames` as messages, a PING between.
fn zmtp_stream(mode: u8, frames: &[bytes::Bytes]) -> Vec<u8> {
    let mut out = vec![mode];
    out.extend_from_slice(&kvd_proto::zmtp::codec::greeting(false));
    let mut ready = vec![0x04, 0];
    ready.extend_from_slice(b"\x05READY\x0bSocket-Type\0\0\0\x06DEALER\x08Identity\0\0\0\x02me");
    ready[1] = (ready.len() - 2) as u8;
    out.extend_from_slice(&ready);
    out.extend_from_slice(b"\x04\x07\x04PING\x00\x10c");
    let mut messages = Vec::new();
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime")
        .block_on(async {
            for f in frames {
                write_message(&mut messages, &[bytes::Bytes::new(), f.clone()])
                    .await
                    .expect("writing to a Vec");
            }
        });
    out.extend_from_slice(&messages);
    out
}

/// Seed inputs of `target`.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    match target {
        "wire_request" => requests()
            .iter()
            .enumerate()
            .map(|(i, r)| encode_request(i as u64, r).to_vec())
            .collect(),
        "wire_reply" => replies()
            .iter()
            .enumerate()
            .map(|(i, r)| encode_reply(i as u64, r).to_vec())
            .collect(),
        "zmtp" => {
            let frames: Vec<_> = requests().iter().map(|r| encode_request(1, r)).collect();
            vec![
                zmtp_stream(0x80 | 0x0c | 3, &frames),
                zmtp_stream(0x80 | 0x04 | 2, &frames[..3]),
                zmtp_stream(0x80 | 1, &frames[7..]),
            ]
        }
        "fd_header" => vec![
            Header { token: 1, count: 1 }.encode().to_vec(),
            Header {
                token: u128::MAX,
                count: 253,
            }
            .encode()
            .to_vec(),
        ],
        "geometry" => (0u8..16)
            .map(|k| {
                // raw flags (none), elem, blocks, planes, heads, tokens, content, layers, order,
                // base, slack, then block ids.
                let mut s = vec![0, 0, 0, 0, 1, 63, 0, k & 1, 7, 15, 127, 0, 3];
                s.push(k.wrapping_mul(37));
                s.extend_from_slice(&[0, 0, 0, 0, 2, 5, 6, 7, 8, 9, 10, 11, 12]);
                s
            })
            .collect(),
        _ => Vec::new(),
    }
}
