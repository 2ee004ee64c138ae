//! GPU tests: the GPU data plane against a real kvd on a real GPU. Compiled with
//! `--features gpu-tests`; on a machine without a GPU the sentinel says so and the GPU tests,
//! if run, fail — they never pass without checking.
//!
//! `KVD_GPU_BACKEND=hip` runs every test through the HIP backend instead of CUDA, on both
//! sides: the kvd these tests start (which reads the same variable) and the tests' own client
//! calls. On an NVIDIA GPU that needs `KVD_HIP_LIBRARY` pointing at the forwarding library of
//! `scripts/hip-nvidia/` (HIP's NVIDIA platform); on an AMD GPU, ROCm's own runtime.

mod common;

/// Reports what this build and machine allow, so a skip is visible in every test log.
#[test]
fn sentinel() {
    if !cfg!(feature = "gpu-tests") {
        eprintln!("SKIPPED: GPU tests not compiled; build with --features gpu-tests on a GPU host (scripts/gpu-check.sh)");
        return;
    }
    match kvd_server::data::devices::discover_gpu() {
        Ok(b) => eprintln!("GPU tests will run on the {} backend", b.name()),
        Err(e) => eprintln!(
            "SKIPPED: no usable GPU on this machine ({e}); the GPU tests fail here if run"
        ),
    }
}

/// The client side of whichever backend `KVD_GPU_BACKEND` names (CUDA by default): every call
/// of `kvd_gpu::client` with that backend's [`GpuApi`] filled in.
#[cfg(feature = "gpu-tests")]
mod rt {
    use kvd_gpu::client::{self, GpuApi};
    pub use kvd_gpu::client::{ClientEvents, DeviceBuffer, ExportedChunk, Pointer, ServerEvents};
    use kvd_gpu::GpuError;

    pub fn api() -> GpuApi {
        match std::env::var("KVD_GPU_BACKEND").as_deref() {
            Ok("hip") => GpuApi::Hip,
            _ => GpuApi::Cuda,
        }
    }

    pub fn describe(ptr: u64) -> Result<Pointer, GpuError> {
        client::describe(api(), ptr)
    }
    pub fn ipc_handle(p: &Pointer) -> Result<[u8; 64], GpuError> {
        client::ipc_handle(api(), p)
    }
    pub fn vmm_chunks(ordinal: i32, ptr: u64, size: u64) -> Result<Vec<(u64, u64)>, GpuError> {
        client::vmm_chunks(api(), ordinal, ptr, size)
    }
    pub fn export_chunks(
        ordinal: i32,
        chunks: &[(u64, u64)],
        first: u64,
    ) -> Result<Vec<ExportedChunk>, GpuError> {
        client::export_chunks(api(), ordinal, chunks, first)
    }
    pub fn mem_info(ordinal: i32) -> Result<(u64, u64), GpuError> {
        client::mem_info(api(), ordinal)
    }
    pub fn device_count() -> usize {
        let backend = kvd_server::data::devices::discover_gpu().expect("a GPU");
        backend.devices().len()
    }
    pub fn client_events(ordinal: i32, n: usize) -> Result<ClientEvents, GpuError> {
        ClientEvents::new(api(), ordinal, n)
    }
    pub fn server_events(ordinal: i32, handles: &[[u8; 64]]) -> Result<ServerEvents, GpuError> {
        ServerEvents::open(api(), ordinal, handles)
    }
    /// Plain device memory (`cuMemAlloc`/`hipMalloc`).
    pub fn plain_buffer(ordinal: i32, size: u64) -> Result<DeviceBuffer, GpuError> {
        DeviceBuffer::alloc(api(), ordinal, size)
    }
    /// VMM memory of `chunk` physical chunks, like PyTorch's expandable segments.
    pub fn vmm_buffer(ordinal: i32, size: u64, chunk: u64) -> Result<DeviceBuffer, GpuError> {
        DeviceBuffer::alloc_vmm(api(), ordinal, size, chunk)
    }
}

#[cfg(feature = "gpu-tests")]
mod gpu {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use super::common::*;
    use super::rt::{
        client_events, describe, export_chunks, ipc_handle, mem_info, plain_buffer, server_events,
        vmm_buffer, vmm_chunks, ClientEvents, DeviceBuffer, ServerEvents,
    };
    use kvd_proto::client::{Client, ClientError};
    use kvd_proto::layouts::{flash_attn_v0_layout, vllm_layout};
    use kvd_proto::wire::*;

    /// A KV cache in GPU memory, shaped like vLLM's.
    pub struct GpuKv {
        pub buf: DeviceBuffer,
        pub layout: KvLayout,
        pub layers: Vec<LayerPlacement>,
        pub ordinal: i32,
    }

    impl GpuKv {
        pub fn new(
            ordinal: i32,
            layout: KvLayout,
            layers: Vec<LayerPlacement>,
            size: u64,
        ) -> GpuKv {
            GpuKv {
                buf: plain_buffer(ordinal, size).expect("cuMemAlloc"),
                layout,
                layers,
                ordinal,
            }
        }

        /// The same cache in VMM memory of `chunk_bytes` physical chunks.
        pub fn vmm(
            ordinal: i32,
            layout: KvLayout,
            layers: Vec<LayerPlacement>,
            size: u64,
            chunk_bytes: u64,
        ) -> GpuKv {
            GpuKv {
                buf: vmm_buffer(ordinal, size, chunk_bytes).expect("cuMemCreate"),
                layout,
                layers,
                ordinal,
            }
        }

        #[allow(clippy::too_many_arguments)]
        pub fn vllm(
            ordinal: i32,
            order: &str,
            l: u32,
            b: u32,
            h: u32,
            n: u32,
            c: u32,
            e: u8,
        ) -> GpuKv {
            let (layout, layers, size) = vllm_layout(order, l, b, h, n, c, e).unwrap();
            GpuKv::new(ordinal, layout, layers, size)
        }

        pub fn fill_random(&self, rng: &mut Rng) {
            let mut host = vec![0u8; self.buf.size_bytes() as usize];
            rng.fill(&mut host);
            self.buf.write(0, &host).unwrap();
        }

        pub fn snapshot(&self) -> Vec<u8> {
            let mut host = vec![0u8; self.buf.size_bytes() as usize];
            self.buf.read(0, &mut host).unwrap();
            host
        }

        pub fn block(&self, snapshot: &[u8], block: u32) -> Vec<u8> {
            gather_block(&self.layout, &self.layers, block, &|_, off, len| {
                snapshot[off as usize..off as usize + len].to_vec()
            })
        }

        /// Registers by IPC handle, or by descriptors for VMM memory, as the connector does.
        pub async fn register(
            &self,
            client: &Client,
            fingerprint: u64,
            shard: u32,
            events: Option<&ClientEvents>,
        ) -> Result<Registered, ClientError> {
            let p = describe(self.buf.ptr()).unwrap();
            let size = self.buf.size_bytes();
            let (allocation, fd_token) = if p.legacy_ipc {
                let handle = ipc_handle(&p).unwrap();
                (
                    AllocationSpec::CudaIpc {
                        handle: IpcHandle(handle),
                        offset_bytes: p.offset,
                        size_bytes: size,
                    },
                    0,
                )
            } else {
                let spans = vmm_chunks(p.ordinal, self.buf.ptr(), size).unwrap();
                let first = spans[0].0;
                let exported = export_chunks(p.ordinal, &spans, first).unwrap();
                let chunks: Vec<VmmChunk> = exported
                    .iter()
                    .enumerate()
                    .map(|(i, c)| VmmChunk {
                        fd_index: i as u32,
                        offset_bytes: c.offset_bytes,
                        size_bytes: c.size_bytes,
                    })
                    .collect();
                let token = client
                    .share_fds(exported.into_iter().map(|c| c.fd).collect())
                    .await?;
                (
                    AllocationSpec::CudaVmm {
                        chunks,
                        offset_bytes: self.buf.ptr() - first,
                        size_bytes: size,
                    },
                    token,
                )
            };
            client
                .register(Register {
                    fingerprint,
                    shard,
                    device: DeviceSpec::Cuda { uuid: p.uuid },
                    fd_token,
                    allocations: vec![allocation],
                    layout: self.layout.clone(),
                    layers: self.layers.clone(),
                    client_events: events
                        .map(|e| e.handles().iter().map(|h| IpcHandle(*h)).collect())
                        .unwrap_or_default(),
                })
                .await
        }
    }

    /// Waits for kvd's event on `slot` by polling, as a vLLM worker does.
    fn poll(events: &ServerEvents, slot: Option<u16>) {
        let Some(slot) = slot else { return };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !events.query(slot).unwrap() {
            assert!(Instant::now() < deadline, "kvd's event never completed");
            std::thread::yield_now();
        }
    }

    fn shuffled(n: u32, rng: &mut Rng) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..n).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i as u64 + 1) as usize);
        }
        ids
    }

    /// Store three chunks from random blocks (after the client's event), overwrite the whole
    /// cache, look up, retrieve into other random blocks, check every byte.
    async fn round_trip(kvd: &Kvd, kv: &GpuKv, seed: u64, use_events: bool) {
        let client = kvd.client("gpu-roundtrip").await;
        let mut rng = Rng(seed);
        kv.fill_random(&mut rng);
        let cev = client_events(kv.ordinal, 4).unwrap();
        let fp = seed;
        let reg = kv
            .register(&client, fp, 0, use_events.then_some(&cev))
            .await
            .unwrap();
        let sev = server_events(
            kv.ordinal,
            &reg.server_events.iter().map(|h| h.0).collect::<Vec<_>>(),
        )
        .unwrap();
        let per = reg.chunk_blocks as usize;
        let ids = shuffled(kv.layout.num_blocks, &mut rng);
        let n = 3;
        let src: Vec<Vec<u32>> = ids[..n * per].chunks(per).map(<[u32]>::to_vec).collect();
        let dst: Vec<Vec<u32>> = ids[n * per..2 * n * per]
            .chunks(per)
            .map(<[u32]>::to_vec)
            .collect();
        let hashes: Vec<u128> = (0..n).map(|i| ((seed as u128) << 64) | i as u128).collect();
        let before = kv.snapshot();
        let expected: Vec<Vec<Vec<u8>>> = src
            .iter()
            .map(|c| c.iter().map(|&b| kv.block(&before, b)).collect())
            .collect();

        let wait_slot = if use_events {
            cev.record(1, 0).unwrap();
            Some(1)
        } else {
            None
        };
        let stored = client
            .store(Store {
                region: reg.region,
                salt: 0,
                chunks: chunks(&hashes, &src),
                wait_slot,
                deadline_ns: 0,
            })
            .await
            .unwrap();
        assert_eq!(stored.outcomes, vec![StoreOutcome::Stored; n]);
        assert_eq!(stored.done_slot.is_some(), use_events);
        poll(&sev, stored.done_slot);
        // The store's pages become hits once kvd has seen the copy complete.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let l = client
                .lookup(Lookup {
                    fingerprint: fp,
                    salt: 0,
                    shards: vec![0],
                    hashes: hashes.clone(),
                    pin: true,
                    readers: 1,
                    held: 0,
                })
                .await
                .unwrap();
            if l.hit_chunks == n as u32 {
                kv.fill_random(&mut rng);
                let r = client
                    .retrieve(Retrieve {
                        region: reg.region,
                        salt: 0,
                        pin_id: l.pin_id,
                        chunks: chunks(&hashes, &dst),
                        wait_slot: None,
                        deadline_ns: 0,
                    })
                    .await
                    .unwrap();
                assert_eq!(r.outcomes, vec![RetrieveOutcome::Loaded; n]);
                poll(&sev, r.done_slot);
                break;
            }
            assert!(Instant::now() < deadline, "stored chunks never became hits");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let after = kv.snapshot();
        for (c, blocks) in dst.iter().enumerate() {
            for (i, &b) in blocks.iter().enumerate() {
                assert!(
                    kv.block(&after, b) == expected[c][i],
                    "layout {:?}: chunk {c} block {i} differs",
                    kv.layout
                );
            }
        }
        client.unregister(reg.region).await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn every_layout_and_dtype_round_trips_bit_exact_on_the_gpu() {
        let kvd = Kvd::ready(&["--l1-size-gb", "2", "--chunk-tokens", "64"]);
        let mut seed = 1;
        for order in ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"] {
            for elem in [2u8, 1] {
                // 8 layers, 96 blocks of 16 tokens, 4 heads, K‖V content of 2×64.
                let kv = GpuKv::vllm(0, order, 8, 96, 4, 16, 128, elem);
                round_trip(&kvd, &kv, seed, seed % 2 == 0).await;
                seed += 1;
            }
        }
        // DeepSeek MLA: one head of 576, blocks of 16 and of 64 tokens.
        for block in [16u32, 64] {
            let kv = GpuKv::vllm(0, "LBNHC", 61, 32, 1, block, 576, 2);
            round_trip(&kvd, &kv, seed, true).await;
            seed += 1;
        }
        // FlashAttention before vLLM 0.33: (2, blocks, tokens, heads, dim) in one tensor per
        // layer — here all layers back to back in one allocation.
        let (layout, per_layer) = flash_attn_v0_layout(64, 16, 2, 64, 2);
        let layers = (0..6)
            .map(|l| LayerPlacement {
                allocation: 0,
                offset_bytes: l * per_layer,
            })
            .collect();
        round_trip(
            &kvd,
            &GpuKv::new(0, layout, layers, 6 * per_layer),
            seed,
            true,
        )
        .await;
        assert_eq!(kvd.metric("kvd_copy_errors_total"), 0.0);
        assert!(kvd.log().contains("populated and pinned"), "{}", kvd.log());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_store_waits_for_the_clients_event_not_the_host() {
        // The client queues a fill of the whole cache on its stream, records its event and
        // stores at once, without synchronising: kvd must copy the filled bytes.
        let kvd = Kvd::ready(&["--l1-size-gb", "2", "--chunk-tokens", "256"]);
        let client = kvd.client("ordering").await;
        let kv = GpuKv::vllm(0, "BLNHC", 32, 256, 8, 16, 256, 2);
        kv.fill_random(&mut Rng(5));
        let cev = client_events(0, 2).unwrap();
        let reg = kv.register(&client, 77, 0, Some(&cev)).await.unwrap();
        let sev = server_events(
            0,
            &reg.server_events.iter().map(|h| h.0).collect::<Vec<_>>(),
        )
        .unwrap();
        let size = kv.buf.size_bytes();
        let plain = &kv.buf;
        for round in 0..4u8 {
            let value = 0x40 + round;
            // Several passes so the fill is still running when the store arrives.
            for _ in 0..8 {
                plain.fill_async(0, size, value, 0).unwrap();
            }
            cev.record(0, 0).unwrap();
            let blocks: Vec<u32> = (0..16).map(|b| b + 16 * round as u32).collect();
            let s = client
                .store(Store {
                    region: reg.region,
                    salt: 0,
                    chunks: vec![chunk(round as u128 + 1, blocks)],
                    wait_slot: Some(0),
                    deadline_ns: 0,
                })
                .await
                .unwrap();
            assert_eq!(s.outcomes, vec![StoreOutcome::Stored]);
            poll(&sev, s.done_slot);
        }
        plain.fill_async(0, size, 0, 0).unwrap();
        plain.synchronize().unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        for round in 0..4u8 {
            let blocks: Vec<u32> = (0..16).map(|b| 128 + b).collect();
            let r = client
                .retrieve(Retrieve {
                    region: reg.region,
                    salt: 0,
                    pin_id: 0,
                    chunks: vec![chunk(round as u128 + 1, blocks)],
                    wait_slot: None,
                    deadline_ns: 0,
                })
                .await
                .unwrap();
            assert_eq!(r.outcomes, vec![RetrieveOutcome::Loaded]);
            poll(&sev, r.done_slot);
            let snap = kv.snapshot();
            for b in 128..144 {
                assert!(
                    kv.block(&snap, b).iter().all(|&x| x == 0x40 + round),
                    "round {round}: kvd copied before the client's fill finished"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn vmm_memory_is_refused_with_the_allocator_setting_and_the_fix() {
        let kvd = Kvd::ready(&["--l1-size-gb", "1"]);
        let client = kvd.client("vmm").await;
        let vmm = vmm_buffer(0, 64 << 20, 64 << 20).unwrap();
        let p = describe(vmm.ptr()).unwrap();
        assert!(
            !p.legacy_ipc,
            "VMM memory reports IS_LEGACY_CUDA_IPC_CAPABLE = 0"
        );
        let err = ipc_handle(&p).unwrap_err().to_string();
        assert!(
            err.contains("expandable_segments") && err.contains("cumem") && err.contains("Fix"),
            "{err}"
        );
        // A client that sends VMM memory without its descriptors gets the same reason, counted.
        let (layout, layers, size) = vllm_layout("LBNHC", 2, 16, 1, 16, 128, 2).unwrap();
        let r = client
            .register(Register {
                fingerprint: 1,
                shard: 0,
                device: DeviceSpec::Cuda { uuid: p.uuid },
                fd_token: 0,
                allocations: vec![AllocationSpec::CudaVmm {
                    chunks: vec![],
                    offset_bytes: 0,
                    size_bytes: size,
                }],
                layout,
                layers,
                client_events: vec![],
            })
            .await;
        match r {
            Err(ClientError::Server {
                code: ErrorCode::VmmMemory,
                message,
            }) => assert!(message.contains("expandable_segments"), "{message}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            kvd.metric("kvd_registration_refusals_total{reason=\"vmm_memory\""),
            1.0
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn vmm_memory_of_many_chunks_round_trips_by_descriptor() {
        // 4 GiB in 2 MiB chunks (the H200's granularity, the smallest a VMM allocator can
        // map): 2048 descriptors, nine SCM_RIGHTS messages. PyTorch's own 20 MiB chunks are
        // covered by connector-py's expandable-segments test.
        let kvd = Kvd::ready(&["--l1-size-gb", "2", "--chunk-tokens", "256"]);
        let (layout, layers, size) = vllm_layout("BLNHC", 32, 2048, 8, 16, 256, 2).unwrap();
        let kv = GpuKv::vmm(0, layout, layers, size, 2 << 20);
        let p = describe(kv.buf.ptr()).unwrap();
        assert!(!p.legacy_ipc);
        assert!(vmm_chunks(0, kv.buf.ptr(), size).unwrap().len() >= 2000);
        round_trip(&kvd, &kv, 4242, true).await;
        assert_eq!(kvd.metric("kvd_registration_refusals_total"), 0.0);
    }

    fn spawn_worker(spec: &str) -> std::process::Child {
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "gpu::worker",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("KVD_GPU_WORKER", spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap()
    }

    /// The worker's stdout as lines arriving on a channel, so waits can time out.
    fn lines(out: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        rx
    }

    fn expect_line(out: &std::sync::mpsc::Receiver<String>, want: &str) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match out.recv_timeout(left) {
                // libtest prints "test gpu::worker ... " without a newline before the test's own
                // output, so the marker can end a longer line.
                Ok(line) if line.trim().ends_with(want) => return,
                Ok(_) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("no {want} from the worker within 90 s")
                }
                Err(_) => panic!("worker exited before {want}"),
            }
        }
    }

    /// One vLLM-worker-like process, driven by the tests above through stdin/stdout: allocates a
    /// KV cache on its GPU, registers it, stores its shard, then (tp2) waits for a go, retrieves
    /// into other blocks and checks, or (hold) waits to be killed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "child process of the TP2 and SIGKILL tests"]
    async fn worker() {
        let spec = std::env::var("KVD_GPU_WORKER").expect("run by the GPU tests");
        let f: Vec<&str> = spec.split(',').collect();
        let (zmq, ordinal, mode, gib): (&str, i32, &str, u64) =
            (f[0], f[1].parse().unwrap(), f[2], f[3].parse().unwrap());
        let step = |what: &str| eprintln!("worker {ordinal}: {what}");
        step("connecting");
        let client = Client::connect(kvd_proto::client::ClientConfig::new(
            zmq,
            format!("worker{ordinal}"),
            Role::Worker,
        ))
        .await
        .unwrap();
        // Llama-8B-like TP shard: 32 layers, 4 KV heads (8 / TP2), K‖V 256, bf16, block 16.
        let blocks = ((gib << 30) / (32 * 4 * 16 * 256 * 2)) as u32;
        let (layout, layers, size) = vllm_layout("BLNHC", 32, blocks, 4, 16, 256, 2).unwrap();
        let kv = if f.get(4) == Some(&"vmm") {
            GpuKv::vmm(ordinal, layout, layers, size, 20 << 20)
        } else {
            GpuKv::new(ordinal, layout, layers, size)
        };
        let mut rng = Rng(100 + ordinal as u64);
        step("filling");
        kv.fill_random(&mut rng);
        let cev = client_events(ordinal, 2).unwrap();
        step("registering");
        let reg = kv
            .register(&client, 0x7b2, ordinal as u32, Some(&cev))
            .await
            .unwrap();
        step("storing");
        let sev = server_events(
            ordinal,
            &reg.server_events.iter().map(|h| h.0).collect::<Vec<_>>(),
        )
        .unwrap();
        let hashes: Vec<u128> = (1..=8).collect();
        let before = kv.snapshot();
        cev.record(0, 0).unwrap();
        let s = client
            .store(Store {
                region: reg.region,
                salt: 0,
                chunks: hashes
                    .iter()
                    .map(|&h| chunk(h, (0..16).map(|b| b + 16 * (h as u32 - 1)).collect()))
                    .collect(),
                wait_slot: Some(0),
                deadline_ns: 0,
            })
            .await
            .unwrap();
        assert_eq!(s.outcomes, vec![StoreOutcome::Stored; 8]);
        poll(&sev, s.done_slot);
        println!("STORED");
        std::io::stdout().flush().unwrap();
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        if mode == "hold" {
            std::thread::sleep(Duration::from_secs(3600));
        }
        kv.fill_random(&mut rng);
        let r = client
            .retrieve(Retrieve {
                region: reg.region,
                salt: 0,
                pin_id: 0,
                chunks: hashes
                    .iter()
                    .map(|&h| chunk(h, (0..16).map(|b| 200 + b + 16 * (h as u32 - 1)).collect()))
                    .collect(),
                wait_slot: None,
                deadline_ns: 0,
            })
            .await
            .unwrap();
        assert_eq!(r.outcomes, vec![RetrieveOutcome::Loaded; 8]);
        poll(&sev, r.done_slot);
        let after = kv.snapshot();
        for h in 1..=8u32 {
            for b in 0..16 {
                assert!(
                    kv.block(&after, 200 + b + 16 * (h - 1)) == kv.block(&before, b + 16 * (h - 1)),
                    "rank {ordinal} chunk {h}"
                );
            }
        }
        println!("VERIFIED");
        std::io::stdout().flush().unwrap();
    }

    #[test]
    fn tp2_two_processes_on_two_gpus_share_one_kvd() {
        let n = super::rt::device_count();
        assert!(n >= 2, "this test needs 2 GPUs (nvidia-h200-x2); found {n}");
        let kvd = Kvd::ready(&["--l1-size-gb", "4", "--chunk-tokens", "256"]);
        let mut workers: Vec<_> = (0..2)
            .map(|r| spawn_worker(&format!("{},{r},tp2,2,plain", kvd.zmq)))
            .collect();
        let outs: Vec<_> = workers
            .iter_mut()
            .map(|w| lines(w.stdout.take().unwrap()))
            .collect();
        for o in &outs {
            expect_line(o, "STORED");
        }
        // Both shards stored: a TP2 lookup hits all 8 chunks.
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let c = kvd.client("scheduler").await;
            let l = c
                .lookup(Lookup {
                    fingerprint: 0x7b2,
                    salt: 0,
                    shards: vec![0, 1],
                    hashes: (1..=8).collect(),
                    pin: false,
                    readers: 1,
                    held: 0,
                })
                .await
                .unwrap();
            assert_eq!(l.hit_chunks, 8);
        });
        assert!(
            kvd.log().contains("kvd-gpu0")
                || kvd.log().contains("thread=\"kvd-gpu0\"")
                || kvd.log().contains("copy worker started")
        );
        for w in &mut workers {
            writeln!(w.stdin.as_mut().unwrap(), "go").unwrap();
        }
        for o in &outs {
            expect_line(o, "VERIFIED");
        }
        for mut w in workers {
            assert!(w.wait().unwrap().success());
        }
        let log = kvd.log();
        assert!(
            log.contains("thread=\"kvd-gpu0\"") && log.contains("thread=\"kvd-gpu1\""),
            "one copy thread per GPU: {log}"
        );
    }

    #[test]
    fn a_sigkilled_clients_gpu_memory_returns_within_10s() {
        sigkill_releases("plain");
    }

    #[test]
    fn a_sigkilled_clients_vmm_memory_returns_within_10s() {
        sigkill_releases("vmm");
    }

    fn sigkill_releases(kind: &str) {
        let kvd = Kvd::ready(&["--l1-size-gb", "4", "--chunk-tokens", "256"]);
        let (baseline, _) = mem_info(0).unwrap();
        let mut w = spawn_worker(&format!("{},0,hold,2,{kind}", kvd.zmq));
        let out = lines(w.stdout.take().unwrap());
        expect_line(&out, "STORED");
        let (held, _) = mem_info(0).unwrap();
        assert!(
            baseline - held >= 2 << 30,
            "the worker holds its 2 GiB cache"
        );
        w.kill().unwrap();
        let killed = Instant::now();
        w.wait().unwrap();
        loop {
            let (free, _) = mem_info(0).unwrap();
            // Within 64 MiB of the baseline: the cache and the worker's context are gone.
            if free + (64 << 20) >= baseline {
                eprintln!(
                    "GPU memory back to baseline {:.2} s after SIGKILL",
                    killed.elapsed().as_secs_f64()
                );
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(10),
                "kvd still holds {} MiB of a dead client's memory",
                (baseline - free) >> 20
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(kvd.log().contains("session ended"), "{}", kvd.log());
    }
}
