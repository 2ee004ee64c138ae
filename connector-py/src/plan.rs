//! Registration planning as arithmetic over addresses: how far a layer reaches, which
//! allocations a cache's layers live in, and where each layer starts in what kvd imports. Kept
//! apart from the driver and from Python ([`crate::register`] asks the driver and does the
//! exporting) so that it is unit-tested on machines without either.

use kvd_proto::wire::{KvLayout, LayerPlacement};

/// Why a cache's layers cannot be registered as given; each a `ValueError` in Python.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PlanError {
    /// The layout's strides put a layer's last element beyond the 64-bit address space.
    #[error("the layout's strides reach past 2^64 bytes; pass the layer's strides in bytes")]
    LayoutOverflow,
    /// A host layer's pointer is not inside any live `kvd.HostBuffer`.
    #[error("address {ptr:#x} is not inside a kvd.HostBuffer; host registrations need one")]
    NotInHostBuffer { ptr: u64 },
    /// A host layer starts inside its buffer but ends beyond it.
    #[error("a layer reaches past the end of its HostBuffer")]
    PastHostBuffer,
    /// The layers are on more than one GPU.
    #[error("a KV cache's layers live on different GPUs; register each GPU's layers separately")]
    DifferentGpus,
    /// Some layers are legacy-IPC memory and some are VMM memory.
    #[error("a KV cache mixes VMM and ordinary CUDA memory; kvd cannot register it")]
    MixedMemory,
    /// A CUDA layer starts inside its allocation but ends beyond it.
    #[error("a layer reaches past the end of its allocation")]
    PastAllocation,
    /// More allocations than a registration can name (a `u16` index).
    #[error("the layers live in more than 65536 allocations, more than one registration takes; register them in parts")]
    TooManyAllocations,
}

/// Bytes from a layer's block 0 to the end of its last element.
pub(crate) fn extent(l: &KvLayout) -> Result<u64, PlanError> {
    let last = |n: u64, stride: u64| n.saturating_sub(1).checked_mul(stride);
    [
        last(l.num_blocks.into(), l.block_stride_bytes),
        last(l.kv_planes.into(), l.plane_stride_bytes),
        last(l.heads.into(), l.head_stride_bytes),
        last(l.block_tokens.into(), l.token_stride_bytes),
        last(l.content.into(), l.content_stride_bytes),
        Some(l.elem_bytes.into()),
    ]
    .into_iter()
    .try_fold(0u64, |sum, part| sum.checked_add(part?))
    .ok_or(PlanError::LayoutOverflow)
}

/// Where a layer ends: `ptr + extent_bytes`, or an error past the address space.
fn end_of(ptr: u64, extent_bytes: u64) -> Result<u64, PlanError> {
    ptr.checked_add(extent_bytes)
        .ok_or(PlanError::LayoutOverflow)
}

fn allocation_index(i: usize) -> Result<u16, PlanError> {
    u16::try_from(i).map_err(|_| PlanError::TooManyAllocations)
}

/// A range of addresses: an allocation, or a host buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    /// First byte.
    pub start: u64,
    /// Length in bytes.
    pub size_bytes: u64,
}

/// Host memory: the buffers holding the layers, each once in order of first use (what kvd
/// imports, by memfd), and each layer's place in them. `find` gives the buffer holding an
/// address and its range.
pub(crate) fn place_in_buffers<B>(
    layer_ptrs: &[u64],
    extent_bytes: u64,
    mut find: impl FnMut(u64) -> Option<(B, Range)>,
) -> Result<(Vec<B>, Vec<LayerPlacement>), PlanError> {
    let mut buffers: Vec<(B, Range)> = Vec::new();
    let mut layers = Vec::with_capacity(layer_ptrs.len());
    for &p in layer_ptrs {
        let (buf, range) = find(p).ok_or(PlanError::NotInHostBuffer { ptr: p })?;
        let offset_bytes = p
            .checked_sub(range.start)
            .filter(|&o| o < range.size_bytes)
            .ok_or(PlanError::NotInHostBuffer { ptr: p })?;
        if extent_bytes > range.size_bytes - offset_bytes {
            return Err(PlanError::PastHostBuffer);
        }
        let idx = match buffers.iter().position(|(_, r)| r.start == range.start) {
            Some(i) => i,
            None => {
                buffers.push((buf, range));
                buffers.len() - 1
            }
        };
        layers.push(LayerPlacement {
            allocation: allocation_index(idx)?,
            offset_bytes,
        });
    }
    Ok((buffers.into_iter().map(|(b, _)| b).collect(), layers))
}

/// A layer's pointer and what the driver said about the memory holding it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerMemory {
    /// The layer's block 0.
    pub ptr: u64,
    /// The allocation holding it.
    pub allocation: Range,
    /// The GPU it is on.
    pub uuid: [u8; 16],
    /// Whether legacy CUDA IPC can export it (false for VMM memory).
    pub legacy_ipc: bool,
}

/// How a CUDA cache's memory goes to kvd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sharing {
    /// By one legacy IPC handle per allocation.
    Ipc,
    /// By descriptors of the physical chunks (VMM memory: expandable segments, cumem).
    Vmm,
}

/// Whether the layers can be registered together, and how: all on one GPU, and all of one kind
/// of memory. (No layers at all is refused before this, by `register`.)
pub(crate) fn sharing(layers: &[LayerMemory]) -> Result<Sharing, PlanError> {
    let Some(first) = layers.first() else {
        return Ok(Sharing::Ipc);
    };
    if layers.iter().any(|l| l.uuid != first.uuid) {
        return Err(PlanError::DifferentGpus);
    }
    match layers.iter().filter(|l| l.legacy_ipc).count() {
        n if n == layers.len() => Ok(Sharing::Ipc),
        0 => Ok(Sharing::Vmm),
        _ => Err(PlanError::MixedMemory),
    }
}

/// One legacy-IPC allocation to import: only the part the layers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IpcImport {
    /// Index of a layer in this allocation (its pointer exports the allocation's handle).
    pub layer: usize,
    /// Where the used part starts, from the allocation's base.
    pub offset_bytes: u64,
    /// Bytes from the lowest layer's start to the highest layer's end.
    pub size_bytes: u64,
}

/// Legacy IPC memory: one import per distinct allocation, in order of first use, spanning its
/// layers; each layer's offset is from the start of its import.
pub(crate) fn group_ipc(
    layers: &[LayerMemory],
    extent_bytes: u64,
) -> Result<(Vec<IpcImport>, Vec<LayerPlacement>), PlanError> {
    // (first layer, allocation, lowest start, highest end) per distinct allocation.
    let mut groups: Vec<(usize, Range, u64, u64)> = Vec::new();
    let mut group_of = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let end = end_of(l.ptr, extent_bytes)?;
        let a = l.allocation;
        if l.ptr < a.start || end - a.start > a.size_bytes {
            return Err(PlanError::PastAllocation);
        }
        match groups.iter().position(|g| g.1.start == a.start) {
            Some(g) => {
                groups[g].2 = groups[g].2.min(l.ptr);
                groups[g].3 = groups[g].3.max(end);
                group_of.push(g);
            }
            None => {
                groups.push((i, a, l.ptr, end));
                group_of.push(groups.len() - 1);
            }
        }
    }
    let placements = layers
        .iter()
        .zip(&group_of)
        .map(|(l, &g)| {
            Ok(LayerPlacement {
                allocation: allocation_index(g)?,
                offset_bytes: l.ptr - groups[g].2,
            })
        })
        .collect::<Result<Vec<_>, PlanError>>()?;
    let imports = groups
        .into_iter()
        .map(|(layer, a, lo, hi)| IpcImport {
            layer,
            offset_bytes: lo - a.start,
            size_bytes: hi - lo,
        })
        .collect();
    Ok((imports, placements))
}

/// VMM memory: the address range the layers cover (kvd imports the physical chunks under it as
/// one allocation), and each layer's offset from its start.
pub(crate) fn span_layers(
    layer_ptrs: &[u64],
    extent_bytes: u64,
) -> Result<(Range, Vec<LayerPlacement>), PlanError> {
    let lo = layer_ptrs.iter().copied().min().unwrap_or(0);
    let mut hi = lo;
    for &p in layer_ptrs {
        hi = hi.max(end_of(p, extent_bytes)?);
    }
    let layers = layer_ptrs
        .iter()
        .map(|&p| LayerPlacement {
            allocation: 0,
            offset_bytes: p - lo,
        })
        .collect();
    Ok((
        Range {
            start: lo,
            size_bytes: hi - lo,
        },
        layers,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's per-layer `[blocks, heads, tokens, content]` cache, dense (strides in bytes).
    fn dense(num_blocks: u32, heads: u32, block_tokens: u32, content: u32, elem: u8) -> KvLayout {
        let c = u64::from(elem);
        let t = c * u64::from(content);
        let h = t * u64::from(block_tokens);
        let b = h * u64::from(heads);
        KvLayout {
            elem_bytes: elem,
            num_blocks,
            kv_planes: 1,
            heads,
            block_tokens,
            content,
            block_stride_bytes: b,
            plane_stride_bytes: 0,
            head_stride_bytes: h,
            token_stride_bytes: t,
            content_stride_bytes: c,
            state_tokens: 1,
        }
    }

    fn placement(allocation: u16, offset_bytes: u64) -> LayerPlacement {
        LayerPlacement {
            allocation,
            offset_bytes,
        }
    }

    #[test]
    fn a_dense_layers_extent_is_its_size() {
        let l = dense(100, 8, 16, 128, 2);
        assert_eq!(extent(&l), Ok(100 * 8 * 16 * 128 * 2));
        assert_eq!(extent(&dense(1, 1, 1, 1, 1)), Ok(1));
    }

    #[test]
    fn a_block_outermost_layers_extent_stops_at_its_last_element_not_the_next_layer() {
        // BLNHC with 4 layers: blocks are 4 layers apart, so one layer's extent is three
        // layers' worth short of num_blocks * block_stride.
        let mut l = dense(10, 2, 16, 64, 2);
        let one_layer_block = l.block_stride_bytes;
        l.block_stride_bytes = 4 * one_layer_block;
        assert_eq!(extent(&l), Ok(9 * 4 * one_layer_block + one_layer_block));
    }

    #[test]
    fn separate_k_and_v_planes_count_in_the_extent() {
        // (2, blocks, ...): the V plane starts after all K blocks.
        let mut l = dense(10, 2, 16, 64, 2);
        l.kv_planes = 2;
        l.plane_stride_bytes = 10 * l.block_stride_bytes;
        assert_eq!(extent(&l), Ok(2 * 10 * l.block_stride_bytes));
    }

    #[test]
    fn an_extent_past_the_address_space_is_an_error_not_a_wrap() {
        let mut l = dense(u32::MAX, 8, 16, 128, 2);
        l.block_stride_bytes = u64::MAX / 2;
        assert_eq!(extent(&l), Err(PlanError::LayoutOverflow));
        let mut l = dense(2, 1, 1, 1, 2);
        l.block_stride_bytes = u64::MAX;
        assert_eq!(extent(&l), Err(PlanError::LayoutOverflow));
    }

    /// Host buffers at 0x1000 (4 KiB) and 0x10000 (64 KiB), found like `host::find` finds them.
    fn find(ptr: u64) -> Option<(&'static str, Range)> {
        [
            (
                "a",
                Range {
                    start: 0x1000,
                    size_bytes: 0x1000,
                },
            ),
            (
                "b",
                Range {
                    start: 0x10000,
                    size_bytes: 0x10000,
                },
            ),
        ]
        .into_iter()
        .find(|(_, r)| ptr >= r.start && ptr < r.start + r.size_bytes)
    }

    #[test]
    fn host_layers_import_each_buffer_once_in_order_of_first_use() {
        let (bufs, layers) =
            place_in_buffers(&[0x10000, 0x1000, 0x10400, 0x1800], 0x400, find).unwrap();
        assert_eq!(bufs, ["b", "a"]);
        assert_eq!(
            layers,
            [
                placement(0, 0),
                placement(1, 0),
                placement(0, 0x400),
                placement(1, 0x800),
            ]
        );
    }

    #[test]
    fn a_host_layer_may_end_exactly_at_its_buffers_end_but_not_past_it() {
        assert!(place_in_buffers(&[0x1c00], 0x400, find).is_ok());
        assert_eq!(
            place_in_buffers(&[0x1c00], 0x401, find),
            Err(PlanError::PastHostBuffer)
        );
        assert_eq!(
            place_in_buffers(&[0x1c00], u64::MAX, find),
            Err(PlanError::PastHostBuffer)
        );
    }

    #[test]
    fn a_host_layer_outside_every_buffer_is_named() {
        let e = place_in_buffers(&[0x1000, 0x5000], 0x10, find).unwrap_err();
        assert_eq!(e, PlanError::NotInHostBuffer { ptr: 0x5000 });
        assert!(e.to_string().contains("0x5000") && e.to_string().contains("kvd.HostBuffer"));
        // A finder that answers with a buffer that does not hold the address is not trusted.
        let wrong = |_| {
            Some((
                (),
                Range {
                    start: 0x1000,
                    size_bytes: 0x10,
                },
            ))
        };
        assert_eq!(
            place_in_buffers(&[0x2000], 1, wrong),
            Err(PlanError::NotInHostBuffer { ptr: 0x2000 })
        );
    }

    #[test]
    fn more_allocations_than_a_u16_names_is_an_error_not_a_wrap() {
        // (Through place_in_buffers it takes 65537 buffers and a quadratic search: minutes.)
        assert_eq!(allocation_index(65535), Ok(65535));
        assert_eq!(allocation_index(65536), Err(PlanError::TooManyAllocations));
    }

    fn on_gpu(ptr: u64, start: u64, size_bytes: u64) -> LayerMemory {
        LayerMemory {
            ptr,
            allocation: Range { start, size_bytes },
            uuid: [7; 16],
            legacy_ipc: true,
        }
    }

    #[test]
    fn layers_of_one_gpu_and_one_kind_of_memory_register_together() {
        let ipc = [
            on_gpu(0x1000, 0x1000, 0x1000),
            on_gpu(0x9000, 0x9000, 0x1000),
        ];
        assert_eq!(sharing(&ipc), Ok(Sharing::Ipc));
        let vmm = ipc.map(|l| LayerMemory {
            legacy_ipc: false,
            ..l
        });
        assert_eq!(sharing(&vmm), Ok(Sharing::Vmm));
        assert_eq!(sharing(&[ipc[0], vmm[1]]), Err(PlanError::MixedMemory));
        let elsewhere = LayerMemory {
            uuid: [8; 16],
            ..ipc[1]
        };
        assert_eq!(sharing(&[ipc[0], elsewhere]), Err(PlanError::DifferentGpus));
    }

    #[test]
    fn ipc_layers_in_one_allocation_are_one_import_of_the_part_they_use() {
        // One 1 MiB allocation at 0x100000; layers from 0x1000 in, 0x400 apart, 0x400 long.
        let base = 0x100000;
        let layers: Vec<_> = (0..4)
            .map(|i| on_gpu(base + 0x1000 + i * 0x400, base, 0x100000))
            .collect();
        let (imports, placed) = group_ipc(&layers, 0x400).unwrap();
        assert_eq!(
            imports,
            [IpcImport {
                layer: 0,
                offset_bytes: 0x1000,
                size_bytes: 4 * 0x400
            }]
        );
        let offsets: Vec<_> = placed
            .iter()
            .map(|p| (p.allocation, p.offset_bytes))
            .collect();
        assert_eq!(offsets, [(0, 0), (0, 0x400), (0, 0x800), (0, 0xc00)]);
    }

    #[test]
    fn ipc_layers_in_separate_allocations_are_one_import_each_in_order_of_first_use() {
        // PyTorch's caching allocator: one allocation per layer, at no particular order.
        let layers = [
            on_gpu(0x30000, 0x30000, 0x10000),
            on_gpu(0x10000, 0x10000, 0x10000),
            on_gpu(0x20100, 0x20000, 0x10000),
        ];
        let (imports, placed) = group_ipc(&layers, 0x8000).unwrap();
        let want = |layer, offset_bytes| IpcImport {
            layer,
            offset_bytes,
            size_bytes: 0x8000,
        };
        assert_eq!(imports, [want(0, 0), want(1, 0), want(2, 0x100)]);
        assert_eq!(placed, [placement(0, 0), placement(1, 0), placement(2, 0)]);
    }

    #[test]
    fn an_ipc_layer_past_its_allocations_end_is_refused() {
        let l = on_gpu(0x1800, 0x1000, 0x1000);
        assert!(group_ipc(&[l], 0x800).is_ok());
        assert_eq!(group_ipc(&[l], 0x801), Err(PlanError::PastAllocation));
        assert_eq!(group_ipc(&[l], u64::MAX), Err(PlanError::LayoutOverflow));
    }

    #[test]
    fn vmm_layers_span_from_the_lowest_start_to_the_highest_end() {
        let (range, placed) = span_layers(&[0x5000, 0x1000, 0x3000], 0x800).unwrap();
        assert_eq!(
            range,
            Range {
                start: 0x1000,
                size_bytes: 0x4800
            }
        );
        assert_eq!(
            placed,
            [placement(0, 0x4000), placement(0, 0), placement(0, 0x2000)]
        );
        assert_eq!(
            span_layers(&[u64::MAX - 4], 8),
            Err(PlanError::LayoutOverflow)
        );
    }
}
