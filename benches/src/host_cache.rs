//! What the `disk` and `l2` benchmarks share: a host-memory KV cache registered with a running
//! kvd, standing in for a vLLM worker's GPU cache, and kvd's metrics read over HTTP.

use std::net::SocketAddr;

use anyhow::Result;
use kvd_gpu::host::SharedMemory;
use kvd_proto::client::{Client, ClientConfig};
use kvd_proto::layouts::vllm_layout;
use kvd_proto::wire::*;

/// A memfd of `blocks` blocks in the Llama-3.1-8B-like TP8 shard's BLNHC layout (32 layers, one
/// KV head, K‖V 256, bf16, 16-token blocks), filled with pseudo-random bytes, registered with kvd
/// by one tool client.
pub struct HostCache {
    pub client: Client,
    pub region: u32,
    /// Blocks per chunk.
    pub per: u32,
    fingerprint: u64,
    _shm: SharedMemory,
}

impl HostCache {
    /// Connects to kvd at `zmq` as `name` and registers the cache, a memfd named `memfd`, under
    /// `fingerprint`; `seed` (nonzero) picks the fill.
    pub async fn register(
        zmq: &str,
        name: &str,
        memfd: &str,
        fingerprint: u64,
        seed: u64,
        blocks: u32,
    ) -> Result<Self> {
        let mut cfg = ClientConfig::new(zmq, name, Role::Tool);
        cfg.heartbeat = false;
        let client = Client::connect(cfg).await?;
        let (layout, layers, size) = vllm_layout("BLNHC", 32, blocks, 1, 16, 256, 2)?;
        let shm = SharedMemory::create(memfd, size)?;
        let mut fill = vec![0u8; size as usize];
        let mut x = seed;
        for c in fill.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        shm.write(0, &fill)?;
        let reg = crate::register_host(&client, fingerprint, &shm, layout, layers).await?;
        Ok(Self {
            client,
            region: reg.region,
            per: reg.chunk_blocks,
            fingerprint,
            _shm: shm,
        })
    }

    /// The chunks `hashes` on consecutive blocks from block 0: what a store of them sends.
    pub fn chunk_list(&self, hashes: &[u128]) -> Vec<ChunkBlocks> {
        hashes
            .iter()
            .enumerate()
            .map(|(i, &hash)| ChunkBlocks {
                hash,
                blocks: (0..self.per).map(|b| i as u32 * self.per + b).collect(),
            })
            .collect()
    }

    /// A lookup of `hashes` in this cache's fingerprint, shard 0, pinning the hit for a retrieve.
    pub fn lookup(&self, hashes: &[u128]) -> Lookup {
        Lookup {
            fingerprint: self.fingerprint,
            salt: 0,
            shards: vec![0],
            hashes: hashes.to_vec(),
            pin: true,
            readers: 1,
            held: 0,
        }
    }
}

/// kvd's whole HTTP reply to `GET path`, status line and headers included.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: kvd\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// The sum of the samples of every series in `/metrics` whose line starts with `prefix`.
pub fn metric(addr: SocketAddr, prefix: &str) -> Result<f64> {
    Ok(http_get(addr, "/metrics")?
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}
