//! The KV layouts of vLLM's caches as kvd's wire type [`KvLayout`] describes them, built from a
//! shape: what tests, benches and tools register without a vLLM at hand.

use std::collections::HashMap;

use crate::wire::{KvLayout, LayerPlacement};

/// A layout that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(pub String);

/// The layout of a vLLM 0.33-style cache: one buffer holding `layers` views of
/// `[blocks, heads, tokens, content]`, in the physical order `order` — the letters L, B, H, N, C
/// outermost first (`"LBNHC"`, `"BLNHC"`, ...). Returns the layout, the layer placements in
/// allocation 0, and the buffer's size. For tests, benches and tools.
pub fn vllm_layout(
    order: &str,
    layers: u32,
    blocks: u32,
    heads: u32,
    tokens: u32,
    content: u32,
    elem_bytes: u8,
) -> Result<(KvLayout, Vec<LayerPlacement>, u64), LayoutError> {
    let mut letters: Vec<char> = order.chars().collect();
    letters.sort_unstable();
    if letters != ['B', 'C', 'H', 'L', 'N'] {
        return Err(LayoutError(format!(
            "{order}: a layout is a permutation of L, B, H, N, C"
        )));
    }
    let size = |c: char| match c {
        'L' => layers as u64,
        'B' => blocks as u64,
        'H' => heads as u64,
        'N' => tokens as u64,
        _ => content as u64,
    };
    let mut stride: HashMap<char, u64> = HashMap::new();
    let mut acc = elem_bytes as u64;
    for c in order.chars().rev() {
        stride.insert(c, acc);
        acc *= size(c);
    }
    let layout = KvLayout {
        elem_bytes,
        num_blocks: blocks,
        kv_planes: 1,
        heads,
        block_tokens: tokens,
        content,
        block_stride_bytes: stride[&'B'],
        plane_stride_bytes: 0,
        head_stride_bytes: stride[&'H'],
        token_stride_bytes: stride[&'N'],
        content_stride_bytes: stride[&'C'],
        state_tokens: 1,
    };
    let placements = (0..layers)
        .map(|l| LayerPlacement {
            allocation: 0,
            offset_bytes: l as u64 * stride[&'L'],
        })
        .collect();
    Ok((layout, placements, acc))
}

/// vLLM's FlashAttention layout before 0.33: one tensor per layer, `(2, blocks, tokens, heads,
/// dim)`, K and V in separate planes. Returns the layout and one layer's size in bytes. For
/// tests, benches and tools.
pub fn flash_attn_v0_layout(
    blocks: u32,
    tokens: u32,
    heads: u32,
    dim: u32,
    elem_bytes: u8,
) -> (KvLayout, u64) {
    let e = elem_bytes as u64;
    let run = tokens as u64 * heads as u64 * dim as u64 * e;
    let layout = KvLayout {
        elem_bytes,
        num_blocks: blocks,
        kv_planes: 2,
        heads,
        block_tokens: tokens,
        content: dim,
        block_stride_bytes: run,
        plane_stride_bytes: run * blocks as u64,
        head_stride_bytes: dim as u64 * e,
        token_stride_bytes: heads as u64 * dim as u64 * e,
        content_stride_bytes: e,
        state_tokens: 1,
    };
    (layout, 2 * run * blocks as u64)
}
