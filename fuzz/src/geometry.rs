//! Registration layouts (`kvd_server::l1::geometry::Geometry`): any `KvLayout`, placements,
//! allocation sizes and chunk size a client may send. A layout kvd accepts must yield copy runs
//! that stay inside the client's allocations and inside the page, cover the page exactly once,
//! and block ids must be refused exactly when they are out of range — otherwise one client could
//! make kvd copy into memory it did not register.
//!
//! Random strides are almost never valid, so inputs describe a real layout first (a random
//! order of the outer dims, heads inside or outside the dense run) and then may replace any
//! number with a raw value.

use kvd_gpu::CopyRun;
use kvd_proto::wire::{KvLayout, LayerPlacement};
use kvd_server::l1::geometry::{Geometry, SKIP_BLOCK};

use crate::Cursor;

/// Copy runs walked per input at most, so that one input stays fast.
const MAX_RUNS: u64 = 1 << 16;

/// Builds a layout from the input, registers it and checks the runs of one chunk.
pub fn layout(data: &[u8]) {
    let mut c = Cursor::new(data);
    let raw = c.u32();
    let raw_bit = |bit: u32| raw & (1 << bit) != 0;

    let elem_bytes = if raw_bit(0) {
        c.u8()
    } else {
        [1, 2, 4, 8][usize::from(c.u8() & 3)]
    };
    let num_blocks = if raw_bit(1) {
        c.u32()
    } else {
        1 + u32::from(c.u16() % 512)
    };
    let kv_planes = if raw_bit(2) { c.u8() } else { 1 + (c.u8() & 1) };
    let heads = if raw_bit(3) {
        c.u32()
    } else {
        1 + u32::from(c.u8() % 16)
    };
    let block_tokens = if raw_bit(4) {
        c.u32()
    } else {
        1 + u32::from(c.u8() % 32)
    };
    let content = if raw_bit(5) {
        c.u32()
    } else {
        1 + u32::from(c.u16() % 1024)
    };
    let layers = 1 + u64::from(c.u8() % 16);
    let order = c.u8();
    let heads_inside = order & 0x80 == 0;
    let heads_before_tokens = order & 0x40 != 0;

    // Strides of a real cache: the dense run innermost, then the outer dims in a chosen order.
    let e = u64::from(elem_bytes);
    let (h, n, cn) = (
        u64::from(heads),
        u64::from(block_tokens),
        u64::from(content),
    );
    let mut token_stride = e.wrapping_mul(cn);
    let mut head_stride = token_stride.wrapping_mul(n);
    if heads_before_tokens && heads_inside {
        head_stride = token_stride;
        token_stride = head_stride.wrapping_mul(h);
    }
    let mut size = if heads_inside {
        e.wrapping_mul(cn).wrapping_mul(n).wrapping_mul(h)
    } else {
        e.wrapping_mul(cn).wrapping_mul(n)
    };
    // Outer dims: 0 layer, 1 block, 2 plane, 3 head (when outside the run).
    let mut dims: Vec<(u8, u64)> = vec![(0, layers), (1, u64::from(num_blocks))];
    if kv_planes == 2 {
        dims.push((2, 2));
    }
    if !heads_inside {
        dims.push((3, h));
    }
    let mut k = order & 0x3f;
    for i in (1..dims.len()).rev() {
        dims.swap(i, usize::from(k) % (i + 1));
        k /= (i + 1) as u8;
    }
    let mut stride = [0u64; 4];
    for &(dim, n) in dims.iter().rev() {
        stride[usize::from(dim)] = size;
        size = size.wrapping_mul(n);
    }
    let base = u64::from(c.u16());
    let per_layer_allocation = raw_bit(6);
    let mut placements: Vec<LayerPlacement> = (0..layers)
        .map(|i| LayerPlacement {
            allocation: if per_layer_allocation { i as u16 } else { 0 },
            offset_bytes: if per_layer_allocation {
                base
            } else {
                base.wrapping_add(i.wrapping_mul(stride[0]))
            },
        })
        .collect();
    let slack = u64::from(c.u8());
    let whole = base.wrapping_add(size).wrapping_add(slack);
    let mut allocation_bytes = vec![
        whole;
        if per_layer_allocation {
            layers as usize
        } else {
            1
        }
    ];

    let mut layout = KvLayout {
        elem_bytes,
        num_blocks,
        kv_planes,
        heads,
        block_tokens,
        content,
        block_stride_bytes: stride[1],
        plane_stride_bytes: stride[2],
        head_stride_bytes: if heads_inside { head_stride } else { stride[3] },
        token_stride_bytes: token_stride,
        content_stride_bytes: e,
        state_tokens: 1,
    };
    // Then any number may be replaced by a raw value or nudged.
    for (bit, field) in [
        &mut layout.block_stride_bytes,
        &mut layout.plane_stride_bytes,
        &mut layout.head_stride_bytes,
        &mut layout.token_stride_bytes,
        &mut layout.content_stride_bytes,
    ]
    .into_iter()
    .enumerate()
    {
        mutate(field, raw >> (7 + 2 * bit), &mut c);
    }
    if raw_bit(17) {
        let i = usize::from(c.u8()) % placements.len();
        mutate(&mut placements[i].offset_bytes, raw >> 18, &mut c);
        placements[i].allocation = placements[i]
            .allocation
            .wrapping_add(u16::from(raw_bit(20)));
    }
    if raw_bit(21) {
        let i = usize::from(c.u8()) % allocation_bytes.len();
        mutate(&mut allocation_bytes[i], raw >> 22, &mut c);
    }
    if raw_bit(24) {
        allocation_bytes.truncate(usize::from(c.u8()) % (allocation_bytes.len() + 1));
    }
    let chunk_tokens = if raw_bit(25) {
        c.u32().max(1)
    } else {
        block_tokens.wrapping_mul(1 + u32::from(c.u8() % 8)).max(1)
    };

    let Ok(g) = Geometry::new(&layout, &placements, &allocation_bytes, chunk_tokens) else {
        return;
    };
    check_runs(&g, &allocation_bytes, &mut c, raw_bit(26));
}

/// `bits & 3`: 0 keep, 1 raw, 2 add a small delta, 3 subtract one.
fn mutate(v: &mut u64, bits: u32, c: &mut Cursor<'_>) {
    match bits & 3 {
        1 => *v = c.u64(),
        2 => *v = v.wrapping_add(u64::from(c.u8())),
        3 => *v = v.wrapping_sub(u64::from(c.u8() % 4 + 1)),
        _ => {}
    }
}

/// One chunk's block ids from the input, `check_blocks`, and the runs of a store or retrieve.
fn check_runs(g: &Geometry, allocation_bytes: &[u64], c: &mut Cursor<'_>, retrieve: bool) {
    let page_bytes = g.page_bytes();
    assert!(page_bytes > 0 && page_bytes <= 4 * u64::from(u32::MAX));
    assert_eq!(page_bytes % g.run_bytes(), 0);
    let chunk_blocks = g.chunk_blocks() as usize;
    if chunk_blocks == 0 || page_bytes / g.run_bytes() > MAX_RUNS {
        return;
    }
    let len = match c.u8() {
        0 => chunk_blocks.saturating_sub(1),
        1 => chunk_blocks + 1,
        _ => chunk_blocks,
    };
    let blocks: Vec<u32> = (0..len)
        .map(|_| match c.u8() {
            0 => SKIP_BLOCK,
            1 => c.u32(),
            b => u32::from(b) % g.num_blocks(),
        })
        .collect();
    let in_range = blocks.len() == chunk_blocks
        && blocks
            .iter()
            .all(|&b| b < g.num_blocks() || (retrieve && b == SKIP_BLOCK));
    assert_eq!(
        g.check_blocks(&blocks, retrieve).is_ok(),
        in_range,
        "check_blocks misjudged {blocks:?} of {} blocks",
        g.num_blocks()
    );
    if !in_range {
        return;
    }
    let page_offset = page_bytes * u64::from(c.u8());
    let mut runs: Vec<CopyRun> = Vec::new();
    g.push_runs(&blocks, page_offset, &mut runs);
    let mut covered = 0u64;
    let mut pool: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
    for r in &runs {
        assert!(r.len_bytes > 0, "{r:?}");
        let size = *allocation_bytes
            .get(usize::from(r.memory))
            .unwrap_or_else(|| panic!("{r:?} names an allocation that does not exist"));
        let end = r.device_offset_bytes.checked_add(r.len_bytes);
        assert!(
            end.is_some_and(|e| e <= size),
            "{r:?} reaches past the allocation's {size} bytes"
        );
        assert!(
            r.pool_offset_bytes >= page_offset
                && r.pool_offset_bytes + r.len_bytes <= page_offset + page_bytes,
            "{r:?} leaves the page at {page_offset} of {page_bytes} bytes"
        );
        covered += r.len_bytes;
        pool.push((r.pool_offset_bytes, r.len_bytes));
    }
    pool.sort_unstable();
    for w in pool.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "two runs write page bytes {w:?}");
    }
    let skipped = blocks.iter().filter(|&&b| b == SKIP_BLOCK).count() as u64;
    assert_eq!(
        covered,
        page_bytes / chunk_blocks as u64 * (chunk_blocks as u64 - skipped),
        "the runs do not cover the page's kept blocks exactly"
    );
}
