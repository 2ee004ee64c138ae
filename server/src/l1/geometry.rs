//! From a registered KV layout to copy runs: which bytes of the client's cache make up one chunk
//! (logical: which blocks), and where each lands in a page (physical: where bytes live).
//!
//! Every vLLM layout is a permutation of `[layer, block, (kv plane,) head, token, content]`. The
//! heads, tokens and content of one (layer, block, plane) must be one dense run; kvd copies runs
//! whole, so their inner order (LBNHC vs LBHNC) does not matter to it — only to the bytes' meaning,
//! which is why the inner order is part of the layout digest. A page lays its runs out in the
//! client's memory order of (layer, block, plane), so that blocks contiguous on the device are
//! contiguous in the page and coalesce into one copy: in a block-outermost layout (BLNHC) a chunk
//! of consecutive blocks is a single descriptor.

use kvd_gpu::CopyRun;

use crate::wire::{KvLayout, LayerPlacement};

pub use crate::wire::SKIP_BLOCK;

/// Most layers a registration may have.
pub const MAX_LAYERS: usize = 4096;
/// Most allocations a registration may have.
pub const MAX_ALLOCATIONS: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Dim {
    Layer,
    Block,
    Plane,
    Head,
}

/// One dim outside the dense run: its page order, size and device stride.
#[derive(Debug, Clone, Copy)]
struct OuterDim {
    dim: Dim,
    size: u64,
    stride: u64,
}

/// A validated layout.
#[derive(Debug, Clone)]
pub struct Geometry {
    layers: Vec<LayerPlacement>,
    num_blocks: u32,
    run_bytes: u64,
    chunk_blocks: u32,
    /// Dims outside the run in page order, outermost first.
    outer: Vec<OuterDim>,
    /// What copies walk: `outer` less its innermost dims that are contiguous on the device
    /// (every layer of a block in a block-outermost layout), which `copy_run_bytes` absorbs.
    copy_outer: Vec<OuterDim>,
    copy_run_bytes: u64,
    /// The layer dim was absorbed: copies start at layer 0's placement.
    layers_absorbed: bool,
    digest: u64,
}

/// Why a layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GeometryError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, GeometryError> {
    Err(GeometryError(msg.into()))
}

impl Geometry {
    /// Checks a layout against the allocations' sizes and the chunk size.
    pub fn new(
        layout: &KvLayout,
        layers: &[LayerPlacement],
        allocation_bytes: &[u64],
        chunk_tokens: u32,
    ) -> Result<Geometry, GeometryError> {
        let l = layout;
        if !matches!(l.elem_bytes, 1 | 2 | 4 | 8) {
            return err(format!("elem_bytes {} must be 1, 2, 4 or 8", l.elem_bytes));
        }
        if l.num_blocks == 0 || l.heads == 0 || l.block_tokens == 0 || l.content == 0 {
            return err("num_blocks, heads, block_tokens and content must all be above zero");
        }
        if !matches!(l.kv_planes, 1 | 2) {
            return err(format!(
                "kv_planes {} must be 1 (K and V packed) or 2",
                l.kv_planes
            ));
        }
        if layers.is_empty() || layers.len() > MAX_LAYERS {
            return err(format!("{} layers: need 1 to {MAX_LAYERS}", layers.len()));
        }
        if allocation_bytes.len() > MAX_ALLOCATIONS {
            return err(format!(
                "{} allocations: at most {MAX_ALLOCATIONS}",
                allocation_bytes.len()
            ));
        }
        if l.state_tokens == 0 {
            return err("state_tokens must be above zero (1 for a cache that is not compressed)");
        }
        // A block covers block_tokens rows of states, each standing for state_tokens tokens.
        let block_span = l
            .block_tokens
            .checked_mul(l.state_tokens)
            .ok_or_else(|| GeometryError("block_tokens × state_tokens overflows".into()))?;
        if !chunk_tokens.is_multiple_of(block_span) {
            return err(format!(
                "a chunk of {chunk_tokens} tokens is not a whole number of {block_span}-token blocks; \
                 start kvd with --chunk-tokens set to a multiple of {block_span}"
            ));
        }
        let chunk_blocks = chunk_tokens / block_span;

        // The run: content, then tokens and heads while they tile densely (dims of size 1 have
        // no meaningful stride). Content and tokens must be inside it; heads may sit outside
        // (LHBNC, BHLNC), which makes one run per head.
        let mut inner = [
            (l.content as u64, l.content_stride_bytes, 'C'),
            (l.block_tokens as u64, l.token_stride_bytes, 'N'),
            (l.heads as u64, l.head_stride_bytes, 'H'),
        ];
        inner.sort_by_key(|&(size, stride, _)| (size > 1, stride));
        let mut run_bytes = l.elem_bytes as u64;
        let mut in_run = Vec::new();
        let mut dense = true;
        for &(size, stride, tag) in &inner {
            if size == 1 {
                in_run.push(tag);
            } else if dense && stride == run_bytes {
                run_bytes = run_bytes
                    .checked_mul(size)
                    .ok_or_else(|| GeometryError("run size overflows".into()))?;
                in_run.push(tag);
            } else {
                dense = false;
            }
        }
        let heads_outside = !in_run.contains(&'H');
        if !in_run.contains(&'C') || !in_run.contains(&'N') {
            return err(
                "the tokens and content of one block are not one dense run; kvd needs each \
                 block of each layer (or each head of it) to be contiguous",
            );
        }
        if heads_outside && l.head_stride_bytes < run_bytes {
            return err(format!(
                "head stride {} is below the {run_bytes}-byte run",
                l.head_stride_bytes
            ));
        }
        let planes = l.kv_planes as u64;
        let heads_out = if heads_outside { l.heads as u64 } else { 1 };
        if l.num_blocks > 1 && l.block_stride_bytes < run_bytes {
            return err(format!(
                "block stride {} is below the {run_bytes}-byte run",
                l.block_stride_bytes
            ));
        }
        if planes == 2 && l.plane_stride_bytes < run_bytes {
            return err(format!(
                "K/V plane stride {} is below the {run_bytes}-byte block size",
                l.plane_stride_bytes
            ));
        }

        for (i, layer) in layers.iter().enumerate() {
            let Some(&size) = allocation_bytes.get(layer.allocation as usize) else {
                return err(format!(
                    "layer {i} names allocation {} of {}",
                    layer.allocation,
                    allocation_bytes.len()
                ));
            };
            let last = |n: u64, stride: u64| (n - 1).checked_mul(stride);
            let end = last(l.num_blocks as u64, l.block_stride_bytes)
                .and_then(|b| b.checked_add(last(planes, l.plane_stride_bytes)?))
                .and_then(|b| {
                    b.checked_add(if heads_outside {
                        last(heads_out, l.head_stride_bytes)?
                    } else {
                        0
                    })
                })
                .and_then(|b| b.checked_add(run_bytes))
                .and_then(|b| b.checked_add(layer.offset_bytes));
            match end {
                Some(end) if end <= size => {}
                _ => {
                    return err(format!(
                        "layer {i}'s blocks reach past the end of allocation {} ({size} bytes)",
                        layer.allocation
                    ))
                }
            }
        }

        // Order the page like the device memory: the dim with the largest stride outermost.
        let layer_stride = uniform_layer_stride(layers).unwrap_or(u64::MAX);
        let mut outer = vec![
            OuterDim {
                dim: Dim::Layer,
                size: layers.len() as u64,
                stride: layer_stride,
            },
            OuterDim {
                dim: Dim::Block,
                size: chunk_blocks as u64,
                stride: l.block_stride_bytes,
            },
        ];
        if planes == 2 {
            outer.push(OuterDim {
                dim: Dim::Plane,
                size: 2,
                stride: l.plane_stride_bytes,
            });
        }
        if heads_outside {
            outer.push(OuterDim {
                dim: Dim::Head,
                size: heads_out,
                stride: l.head_stride_bytes,
            });
        }
        outer.sort_by_key(|d| std::cmp::Reverse(d.stride));

        let page_bytes = outer
            .iter()
            .try_fold(run_bytes, |acc, d| acc.checked_mul(d.size))
            .ok_or_else(|| GeometryError("page size overflows".into()))?;
        if page_bytes > u32::MAX as u64 * 4 {
            return err(format!(
                "a page of {page_bytes} bytes is too large; lower --chunk-tokens"
            ));
        }

        // What decides the meaning of a page's bytes.
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for v in [
            l.elem_bytes as u64,
            planes,
            l.heads as u64,
            l.block_tokens as u64,
            l.content as u64,
            layers.len() as u64,
            chunk_blocks as u64,
            l.state_tokens as u64,
        ] {
            h.update(&v.to_le_bytes());
        }
        for (_, _, tag) in inner {
            h.update(&[tag as u8]);
        }
        for d in &outer {
            h.update(&[d.dim as u8]);
        }

        // A dim whose stride equals the run it encloses is contiguous with it: fold it into the
        // run, so copies walk (and coalescing merges) up to 80× fewer pieces. Block ids are
        // arbitrary per chunk, so the block dim is never folded here; push_runs merges
        // consecutive blocks as it goes. The page's byte order does not change.
        let (mut copy_outer, mut copy_run_bytes, mut layers_absorbed) =
            (outer.clone(), run_bytes, false);
        while let Some(d) = copy_outer.last().copied() {
            if d.dim == Dim::Block || d.stride != copy_run_bytes {
                break;
            }
            copy_run_bytes *= d.size;
            layers_absorbed |= d.dim == Dim::Layer;
            copy_outer.pop();
        }

        Ok(Geometry {
            layers: layers.to_vec(),
            num_blocks: l.num_blocks,
            run_bytes,
            chunk_blocks,
            outer,
            copy_outer,
            copy_run_bytes,
            layers_absorbed,
            digest: h.digest(),
        })
    }

    /// Bytes of one page (one chunk of this shard).
    pub fn page_bytes(&self) -> u64 {
        self.outer.iter().map(|d| d.size).product::<u64>() * self.run_bytes
    }

    /// Blocks per chunk.
    pub fn chunk_blocks(&self) -> u32 {
        self.chunk_blocks
    }

    /// Blocks per layer.
    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// Bytes of one contiguous run on the device.
    pub fn run_bytes(&self) -> u64 {
        self.run_bytes
    }

    /// Bytes of one copy descriptor before runs merge: `run_bytes`, or more where the device
    /// holds the dims around a run contiguously (every layer of a block, block-outermost).
    pub fn copy_run_bytes(&self) -> u64 {
        self.copy_run_bytes
    }

    /// Copy descriptors one chunk takes at most (fewer where its blocks' runs are adjacent).
    pub fn copy_runs_per_chunk(&self) -> u64 {
        self.copy_outer.iter().map(|d| d.size).product()
    }

    /// Digest of what gives a page's bytes their meaning: two registrations may share stored
    /// chunks only if their digests match.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// Checks a chunk's block ids; `allow_skip` admits [`SKIP_BLOCK`] (retrieves only).
    pub fn check_blocks(&self, blocks: &[u32], allow_skip: bool) -> Result<(), GeometryError> {
        if blocks.len() != self.chunk_blocks as usize {
            return err(format!(
                "a chunk names {} blocks; this registration has {} blocks per chunk",
                blocks.len(),
                self.chunk_blocks
            ));
        }
        if let Some(&b) = blocks
            .iter()
            .find(|&&b| b >= self.num_blocks && !(allow_skip && b == SKIP_BLOCK))
        {
            return err(format!(
                "block id {b} is out of range (the cache has {} blocks)",
                self.num_blocks
            ));
        }
        Ok(())
    }

    /// Appends the runs that copy one chunk held in `blocks` to or from the page at
    /// `page_offset`, leaving out blocks marked [`SKIP_BLOCK`]. `blocks` must have passed
    /// [`Geometry::check_blocks`].
    pub fn push_runs(&self, blocks: &[u32], page_offset: u64, out: &mut Vec<CopyRun>) {
        let dims = &self.copy_outer;
        let n = dims.len();
        let mut idx = [0u64; 4];
        let slots = dims.iter().map(|d| d.size).product::<u64>();
        let (base_memory, base_device) = if self.layers_absorbed {
            (self.layers[0].allocation, self.layers[0].offset_bytes)
        } else {
            (0, 0)
        };
        // Runs of this page only may merge: a page never straddles a pinned piece, but two
        // pages can (see kvd_gpu::copy::coalesce_within).
        let first = out.len();
        for slot in 0..slots {
            let (mut memory, mut device, mut skip) = (base_memory, base_device, false);
            for (d, &i) in dims.iter().zip(&idx[..n]) {
                match d.dim {
                    Dim::Layer => {
                        let p = &self.layers[i as usize];
                        memory = p.allocation;
                        device += p.offset_bytes;
                    }
                    // A skipped block has no offset: SKIP_BLOCK times a stride above 4 GiB
                    // overflows (found by fuzz/ geometry).
                    Dim::Block => match blocks[i as usize] {
                        SKIP_BLOCK => skip = true,
                        b => device += b as u64 * d.stride,
                    },
                    Dim::Plane | Dim::Head => device += i * d.stride,
                }
            }
            if !skip {
                let pool = page_offset + slot * self.copy_run_bytes;
                let in_page = out.len() > first;
                match out.last_mut() {
                    Some(last)
                        if in_page
                            && last.memory == memory
                            && last.device_offset_bytes + last.len_bytes == device
                            && last.pool_offset_bytes + last.len_bytes == pool =>
                    {
                        last.len_bytes += self.copy_run_bytes;
                    }
                    _ => out.push(CopyRun {
                        memory,
                        device_offset_bytes: device,
                        pool_offset_bytes: pool,
                        len_bytes: self.copy_run_bytes,
                    }),
                }
            }
            // Odometer: the innermost dim moves fastest.
            for k in (0..n).rev() {
                idx[k] += 1;
                if idx[k] < dims[k].size {
                    break;
                }
                idx[k] = 0;
            }
        }
    }
}

/// The spacing of layers that all live in one allocation at a constant positive stride.
fn uniform_layer_stride(layers: &[LayerPlacement]) -> Option<u64> {
    if layers.len() < 2 {
        return Some(0);
    }
    let first = &layers[0];
    let stride = layers[1].offset_bytes.checked_sub(first.offset_bytes)?;
    if stride == 0 {
        return None;
    }
    layers
        .iter()
        .enumerate()
        .all(|(i, l)| {
            l.allocation == first.allocation
                && Some(l.offset_bytes)
                    == (i as u64)
                        .checked_mul(stride)
                        .and_then(|o| o.checked_add(first.offset_bytes))
        })
        .then_some(stride)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_gpu::copy::coalesce;
    use kvd_proto::layouts::{flash_attn_v0_layout, vllm_layout};
    use std::collections::HashSet;

    /// FlashAttention before 0.33: per layer (2, blocks, block_size, heads, dim), each of three
    /// layers its own allocation. Returns the geometry and its run (block) bytes.
    fn flash_attn_v0_three_layers() -> (Geometry, u64) {
        let (layout, size) = flash_attn_v0_layout(6, 4, 2, 8, 2);
        let layers: Vec<_> = (0..3)
            .map(|i| LayerPlacement {
                allocation: i,
                offset_bytes: 0,
            })
            .collect();
        let g = Geometry::new(&layout, &layers, &[size; 3], 8).unwrap();
        (g, layout.block_stride_bytes)
    }

    fn all_runs(g: &Geometry, blocks: &[u32]) -> Vec<CopyRun> {
        let mut runs = Vec::new();
        g.push_runs(blocks, 0, &mut runs);
        runs
    }

    #[test]
    fn a_skipped_block_of_a_cache_with_blocks_over_4_gib_apart_is_left_out() {
        // Found by fuzzing: the skipped block's offset was computed (and overflowed) anyway.
        let run = 16 * 64 * 2;
        let layout = KvLayout {
            elem_bytes: 2,
            num_blocks: 2,
            kv_planes: 1,
            heads: 1,
            block_tokens: 16,
            content: 64,
            block_stride_bytes: 1 << 33,
            plane_stride_bytes: 0,
            head_stride_bytes: run,
            token_stride_bytes: 128,
            content_stride_bytes: 2,
            state_tokens: 1,
        };
        let layers = [LayerPlacement {
            allocation: 0,
            offset_bytes: 0,
        }];
        let g = Geometry::new(&layout, &layers, &[(1 << 33) + run], 32).unwrap();
        let blocks = [SKIP_BLOCK, 1];
        g.check_blocks(&blocks, true).unwrap();
        let runs = all_runs(&g, &blocks);
        assert_eq!(
            runs,
            vec![CopyRun {
                memory: 0,
                device_offset_bytes: 1 << 33,
                pool_offset_bytes: run,
                len_bytes: run,
            }]
        );
    }

    #[test]
    fn a_compressed_cache_covers_state_tokens_per_row_of_a_block() {
        // DeepSeek-V4's C128 layers: a 256-token block holds 2 states of 584 bytes; a
        // 256-token chunk is one block of it, not 128.
        let (mut layout, layers, total) = vllm_layout("BLNHC", 3, 10, 1, 2, 584, 1).unwrap();
        layout.state_tokens = 128;
        let g = Geometry::new(&layout, &layers, &[total], 256).unwrap();
        assert_eq!(g.chunk_blocks(), 1);
        assert_eq!(g.page_bytes(), 3 * 2 * 584);
        // A chunk that is not whole compressed blocks is refused, naming the block's span.
        let e = Geometry::new(&layout, &layers, &[total], 128).unwrap_err();
        assert!(e.0.contains("256-token blocks"), "{}", e.0);
        layout.state_tokens = 0;
        assert!(Geometry::new(&layout, &layers, &[total], 256).is_err());
    }

    #[test]
    fn every_vllm_permutation_is_accepted_and_covers_the_chunk_exactly() {
        for order in ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"] {
            let (layout, layers, total) = vllm_layout(order, 4, 10, 2, 4, 8, 2).unwrap();
            let g = Geometry::new(&layout, &layers, &[total], 8).unwrap();
            assert_eq!(g.chunk_blocks(), 2);
            assert_eq!(g.page_bytes(), 4 * 2 * 2 * 4 * 8 * 2);
            let runs = all_runs(&g, &[7, 3]);
            // Every byte of blocks 7 and 3 of every layer, exactly once; pages tile densely.
            let mut dev = HashSet::new();
            let mut pool = HashSet::new();
            for r in &runs {
                for i in 0..r.len_bytes {
                    assert!(dev.insert(r.device_offset_bytes + i));
                    assert!(pool.insert(r.pool_offset_bytes + i));
                }
            }
            assert_eq!(pool.len() as u64, g.page_bytes());
            assert_eq!(pool.iter().max(), Some(&(g.page_bytes() - 1)));
        }
    }

    #[test]
    fn block_outermost_layouts_coalesce_consecutive_blocks_into_one_run() {
        // Llama-3.1-8B: 32 layers, 8 KV heads, head 128 (K‖V: 256), bf16, block 16.
        let (layout, layers, total) = vllm_layout("BLNHC", 32, 64, 8, 16, 256, 2).unwrap();
        let g = Geometry::new(&layout, &layers, &[total], 256).unwrap();
        assert_eq!(g.run_bytes(), 64 * 1024);
        // What registration logs: a descriptor a block of all 32 layers.
        assert_eq!((g.copy_runs_per_chunk(), g.copy_run_bytes()), (16, 2 << 20));
        let mut runs = all_runs(&g, &(20..36).collect::<Vec<_>>());
        coalesce(&mut runs);
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].len_bytes, 32 << 20);
        // Scattered blocks: one 2 MiB run per block.
        let mut runs = all_runs(&g, &(0..16).map(|i| i * 3).collect::<Vec<_>>());
        coalesce(&mut runs);
        assert_eq!(runs.len(), 16);
        assert!(runs.iter().all(|r| r.len_bytes == 2 << 20));
        // Layer-outermost: one run per layer for consecutive blocks.
        let (layout, layers, total) = vllm_layout("LBNHC", 32, 64, 8, 16, 256, 2).unwrap();
        let g = Geometry::new(&layout, &layers, &[total], 256).unwrap();
        assert_eq!(
            (g.copy_runs_per_chunk(), g.copy_run_bytes()),
            (32 * 16, 64 * 1024)
        );
        let mut runs = all_runs(&g, &(20..36).collect::<Vec<_>>());
        coalesce(&mut runs);
        assert_eq!(runs.len(), 32);
    }

    #[test]
    fn older_layouts_with_separate_planes_and_per_layer_allocations() {
        let (g, run) = flash_attn_v0_three_layers();
        assert_eq!(g.page_bytes(), 3 * 2 * 2 * run);
        let mut runs = all_runs(&g, &[2, 3]);
        coalesce(&mut runs);
        // Per layer and plane, blocks 2 and 3 are adjacent: 3 layers × 2 planes.
        assert_eq!(runs.len(), 6);
        assert!(runs.iter().all(|r| r.len_bytes == 2 * run));
        // MLA (blocks, block_size, 576), one tensor per layer.
        let (layout, layers, total) = vllm_layout("LBNHC", 1, 5, 1, 16, 576, 2).unwrap();
        assert!(Geometry::new(&layout, &layers, &[total], 64).is_ok());
    }

    #[test]
    fn bad_layouts_are_refused_with_the_reason() {
        let (layout, layers, total) = vllm_layout("LBNHC", 2, 10, 2, 4, 8, 2).unwrap();
        let e = Geometry::new(&layout, &layers, &[total - 1], 8).unwrap_err();
        assert!(e.0.contains("reach past the end"), "{e}");
        let e = Geometry::new(&layout, &layers, &[total], 6).unwrap_err();
        assert!(e.0.contains("--chunk-tokens"), "{e}");
        let mut sparse = layout.clone();
        sparse.token_stride_bytes *= 2;
        assert!(Geometry::new(&sparse, &layers, &[total * 2], 8).is_err());
        let mut bad = layout.clone();
        bad.elem_bytes = 3;
        assert!(Geometry::new(&bad, &layers, &[total], 8).is_err());
        let g = Geometry::new(&layout, &layers, &[total], 8).unwrap();
        assert!(g.check_blocks(&[0, 10], false).is_err());
        assert!(g.check_blocks(&[0], false).is_err());
        assert!(g.check_blocks(&[9, 0], false).is_ok());
        assert!(g.check_blocks(&[SKIP_BLOCK, 0], false).is_err());
        assert!(g.check_blocks(&[SKIP_BLOCK, 0], true).is_ok());
    }

    /// One run per slot of the unfolded page order, none merged: the plan before any folding.
    fn naive_runs(g: &Geometry, blocks: &[u32], page_offset: u64) -> Vec<CopyRun> {
        let mut out = Vec::new();
        let sizes: Vec<u64> = g.outer.iter().map(|d| d.size).collect();
        let slots: u64 = sizes.iter().product();
        for slot in 0..slots {
            let (mut rest, mut memory, mut device, mut skip) = (slot, 0u16, 0u64, false);
            for (d, size) in g.outer.iter().zip(&sizes).rev() {
                let i = rest % size;
                rest /= size;
                match d.dim {
                    Dim::Layer => {
                        memory = g.layers[i as usize].allocation;
                        device += g.layers[i as usize].offset_bytes;
                    }
                    Dim::Block => {
                        skip |= blocks[i as usize] == SKIP_BLOCK;
                        device += blocks[i as usize] as u64 * d.stride;
                    }
                    Dim::Plane | Dim::Head => device += i * d.stride,
                }
            }
            if !skip {
                out.push(CopyRun {
                    memory,
                    device_offset_bytes: device,
                    pool_offset_bytes: page_offset + slot * g.run_bytes,
                    len_bytes: g.run_bytes,
                });
            }
        }
        out
    }

    /// Pool byte → (allocation, device byte), for every byte a plan copies.
    fn byte_map(runs: &[CopyRun]) -> std::collections::BTreeMap<u64, (u16, u64)> {
        let mut m = std::collections::BTreeMap::new();
        for r in runs {
            for i in 0..r.len_bytes {
                let fresh = m
                    .insert(
                        r.pool_offset_bytes + i,
                        (r.memory, r.device_offset_bytes + i),
                    )
                    .is_none();
                assert!(fresh, "pool byte {} copied twice", r.pool_offset_bytes + i);
            }
        }
        m
    }

    #[test]
    fn folded_plans_copy_the_same_bytes_as_one_run_per_block_and_layer() {
        let chunks: [&[u32]; 4] = [
            &[4, 5, 6],
            &[9, 2, 17],
            &[SKIP_BLOCK, 5, 6],
            &[3, SKIP_BLOCK, 4],
        ];
        for order in ["LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"] {
            let (layout, layers, total) = vllm_layout(order, 3, 20, 2, 4, 8, 2).unwrap();
            let g = Geometry::new(&layout, &layers, &[total], 12).unwrap();
            for blocks in chunks {
                let folded = {
                    let mut v = Vec::new();
                    g.push_runs(blocks, 4096, &mut v);
                    v
                };
                let naive = naive_runs(&g, blocks, 4096);
                assert_eq!(byte_map(&folded), byte_map(&naive), "{order} {blocks:?}");
                assert!(folded.len() <= naive.len());
            }
        }
        // Block-outermost: all layers of a block are one run, consecutive blocks one run.
        let (layout, layers, total) = vllm_layout("BLNHC", 80, 64, 1, 16, 256, 2).unwrap();
        let g = Geometry::new(&layout, &layers, &[total], 256).unwrap();
        assert_eq!(all_runs(&g, &(20..36).collect::<Vec<_>>()).len(), 1);
        assert_eq!(
            all_runs(&g, &(0..16).map(|i| 2 * i).collect::<Vec<_>>()).len(),
            16
        );
        // Separate allocations per layer (FlashAttention before 0.33) never fold layers.
        let (g, _) = flash_attn_v0_three_layers();
        assert_eq!(
            byte_map(&all_runs(&g, &[2, 3])),
            byte_map(&naive_runs(&g, &[2, 3], 0))
        );
    }

    #[test]
    fn runs_of_two_pages_never_merge() {
        // Two chunks of consecutive blocks whose pages sit side by side: one run each, so a
        // pinned-piece boundary between the pages is never crossed inside push_runs.
        let (layout, layers, total) = vllm_layout("BLNHC", 4, 64, 2, 4, 8, 2).unwrap();
        let g = Geometry::new(&layout, &layers, &[total], 8).unwrap();
        let mut runs = Vec::new();
        g.push_runs(&[0, 1], 0, &mut runs);
        g.push_runs(&[2, 3], g.page_bytes(), &mut runs);
        assert_eq!(runs.len(), 2);
    }

    #[test]
    fn skipped_blocks_copy_nothing_and_keep_the_page_layout() {
        for order in ["LBNHC", "BLNHC"] {
            let (layout, layers, total) = vllm_layout(order, 3, 20, 2, 4, 8, 2).unwrap();
            let g = Geometry::new(&layout, &layers, &[total], 12).unwrap();
            let full = byte_map(&all_runs(&g, &[4, 5, 6]));
            let part = byte_map(&all_runs(&g, &[SKIP_BLOCK, 5, 6]));
            assert_eq!(part.len(), full.len() / 3 * 2, "{order}");
            // The kept bytes are exactly the full plan's bytes of blocks 5 and 6, at the same
            // pool offsets.
            let block_of = |device: u64| {
                (device % (layout.block_stride_bytes * 20)) / layout.block_stride_bytes
            };
            let kept: std::collections::BTreeMap<_, _> = full
                .into_iter()
                .filter(|(_, (_, device))| block_of(*device) != 4)
                .collect();
            assert_eq!(part, kept, "{order}");
        }
    }

    #[test]
    fn digest_separates_inner_orders() {
        let (a, la, ta) = vllm_layout("LBNHC", 2, 10, 2, 4, 8, 2).unwrap();
        let (b, lb, tb) = vllm_layout("LBHNC", 2, 10, 2, 4, 8, 2).unwrap();
        let (c, lc, tc) = vllm_layout("LBNHC", 2, 20, 2, 4, 8, 2).unwrap();
        let ga = Geometry::new(&a, &la, &[ta], 8).unwrap();
        let gb = Geometry::new(&b, &lb, &[tb], 8).unwrap();
        let gc = Geometry::new(&c, &lc, &[tc], 8).unwrap();
        assert_ne!(ga.digest(), gb.digest());
        assert_eq!(
            ga.digest(),
            gc.digest(),
            "block count does not change a page's meaning"
        );
    }
}
