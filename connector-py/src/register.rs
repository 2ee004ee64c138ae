//! Registering a worker's KV cache: from the layers' addresses and their shared layout to the
//! allocations kvd must import. Layers are grouped by allocation so each is imported once; CUDA
//! memory goes by legacy IPC handle, VMM memory (expandable segments, cumem) by one descriptor
//! per physical chunk, sent and closed in batches; host buffers by their memfd. The arithmetic
//! (extents, grouping, offsets) is [`crate::plan`]'s; this module asks the driver and exports.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use kvd_gpu::client::{self as gpu, ClientEvents, GpuApi, ServerEvents};
use kvd_proto::client::Client as RustClient;
use kvd_proto::fdpass::MAX_FDS_PER_MESSAGE;
use kvd_proto::wire::*;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{client_error, gpu_error, plan_error, KvdError};
use crate::plan::{self, LayerMemory, Range, Sharing};
use crate::runtime::runtime;

/// Reads a layout dict with the KvLayout field names.
pub(crate) fn layout_from_dict(d: &Bound<'_, PyDict>) -> PyResult<KvLayout> {
    fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<T> {
        d.get_item(k)?
            .ok_or_else(|| PyValueError::new_err(format!("layout is missing {k:?}")))?
            .extract()
            .map_err(Into::into)
    }
    Ok(KvLayout {
        elem_bytes: get(d, "elem_bytes")?,
        num_blocks: get(d, "num_blocks")?,
        kv_planes: get(d, "kv_planes")?,
        heads: get(d, "heads")?,
        block_tokens: get(d, "block_tokens")?,
        content: get(d, "content")?,
        block_stride_bytes: get(d, "block_stride_bytes")?,
        plane_stride_bytes: get(d, "plane_stride_bytes")?,
        head_stride_bytes: get(d, "head_stride_bytes")?,
        token_stride_bytes: get(d, "token_stride_bytes")?,
        content_stride_bytes: get(d, "content_stride_bytes")?,
        state_tokens: match d.get_item("state_tokens")? {
            Some(v) => v.extract()?,
            None => 1,
        },
    })
}

/// A registered cache, with its events on a GPU.
#[pyclass(module = "kvd._native", frozen)]
pub(crate) struct Registration {
    #[pyo3(get)]
    region: u32,
    #[pyo3(get)]
    page_bytes: u64,
    #[pyo3(get)]
    chunk_blocks: u32,
    /// "cuda", "hip" or "host".
    #[pyo3(get)]
    device: String,
    /// GPU ordinal in this process (-1 for host).
    #[pyo3(get)]
    ordinal: i32,
    /// How the memory was shared: "ipc", "vmm" or "memfd".
    #[pyo3(get)]
    shared_by: String,
    client_events: Option<Arc<ClientEvents>>,
    server_events: Option<Arc<ServerEvents>>,
}

fn no_events() -> PyErr {
    KvdError::new_err(
        "this registration has no events (host memory): its copies complete before the reply",
    )
}

#[pymethods]
impl Registration {
    /// Number of client event slots (0 for host memory).
    #[getter]
    fn num_events(&self) -> usize {
        self.client_events.as_ref().map_or(0, |e| e.handles().len())
    }

    /// Records client event `slot` on GPU stream `stream` (e.g.
    /// `torch.cuda.current_stream().cuda_stream`, a `hipStream_t` on ROCm).
    fn record(&self, slot: usize, stream: u64) -> PyResult<()> {
        self.client_events
            .as_ref()
            .ok_or_else(no_events)?
            .record(slot, stream)
            .map_err(gpu_error)
    }

    /// Whether kvd's copy announced on `slot` has completed (never blocks).
    fn query(&self, slot: u16) -> PyResult<bool> {
        self.server_events
            .as_ref()
            .ok_or_else(no_events)?
            .query(slot)
            .map_err(gpu_error)
    }

    /// Makes `stream` wait for kvd's copy announced on `slot`, without blocking the host.
    fn stream_wait(&self, slot: u16, stream: u64) -> PyResult<()> {
        self.server_events
            .as_ref()
            .ok_or_else(no_events)?
            .stream_wait(slot, stream)
            .map_err(gpu_error)
    }

    /// Blocks until kvd's copy announced on `slot` has completed.
    fn synchronize(&self, py: Python<'_>, slot: u16) -> PyResult<()> {
        let ev = self.server_events.clone().ok_or_else(no_events)?;
        py.detach(move || ev.synchronize(slot)).map_err(gpu_error)
    }
}

struct Plan {
    device: DeviceSpec,
    allocations: Vec<AllocationSpec>,
    layers: Vec<LayerPlacement>,
    fds: Vec<Vec<OwnedFd>>,
    ordinal: i32,
    shared_by: &'static str,
    api: Option<GpuApi>,
}

fn plan_host(layer_ptrs: &[u64], ext: u64) -> PyResult<Plan> {
    let (buffers, layers) = plan::place_in_buffers(layer_ptrs, ext, |p| {
        let b = crate::host::find(p)?;
        let range = Range {
            start: b.address(),
            size_bytes: b.size_bytes(),
        };
        Some((b, range))
    })
    .map_err(plan_error)?;
    let fds = buffers
        .iter()
        .map(|b| {
            rustix::io::fcntl_dupfd_cloexec(b.fd(), 0)
                .map_err(|e| KvdError::new_err(format!("dup: {e}")))
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(Plan {
        device: DeviceSpec::Host,
        allocations: buffers
            .iter()
            .enumerate()
            .map(|(i, b)| AllocationSpec::HostFd {
                fd_index: i as u32,
                size_bytes: b.size_bytes(),
            })
            .collect(),
        layers,
        fds: vec![fds],
        ordinal: -1,
        shared_by: "memfd",
        api: None,
    })
}

/// Plans a GPU registration with the client side of `api` (CUDA, or HIP on ROCm). Both send the
/// same wire messages: kvd matches the GPU by UUID and imports with the backend it runs.
fn plan_gpu(api: GpuApi, layer_ptrs: &[u64], ext: u64) -> PyResult<Plan> {
    let infos = layer_ptrs
        .iter()
        .map(|&p| gpu::describe(api, p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(gpu_error)?;
    let memory: Vec<LayerMemory> = layer_ptrs
        .iter()
        .zip(&infos)
        .map(|(&ptr, i)| LayerMemory {
            ptr,
            allocation: Range {
                start: i.base,
                size_bytes: i.alloc_bytes,
            },
            uuid: i.uuid,
            legacy_ipc: i.legacy_ipc,
        })
        .collect();
    let sharing = plan::sharing(&memory).map_err(plan_error)?;
    let first = &infos[0];
    let device = DeviceSpec::Cuda { uuid: first.uuid };
    if sharing == Sharing::Ipc {
        // One allocation per distinct base; each imported once.
        let (imports, layers) = plan::group_ipc(&memory, ext).map_err(plan_error)?;
        let allocations = imports
            .iter()
            .map(|imp| {
                let handle = gpu::ipc_handle(api, &infos[imp.layer]).map_err(gpu_error)?;
                Ok(AllocationSpec::CudaIpc {
                    handle: IpcHandle(handle),
                    offset_bytes: imp.offset_bytes,
                    size_bytes: imp.size_bytes,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(Plan {
            device,
            allocations,
            layers,
            fds: Vec::new(),
            ordinal: first.ordinal,
            shared_by: "ipc",
            api: Some(api),
        });
    }
    // VMM: the physical chunks under the layers' range, exported in batches so that this
    // process never holds more descriptors than one message carries.
    let (range, layers) = plan::span_layers(layer_ptrs, ext).map_err(plan_error)?;
    let spans =
        gpu::vmm_chunks(api, first.ordinal, range.start, range.size_bytes).map_err(gpu_error)?;
    let origin = spans[0].0;
    let mut chunks = Vec::with_capacity(spans.len());
    let mut fds = Vec::new();
    for batch in spans.chunks(MAX_FDS_PER_MESSAGE) {
        let exported = gpu::export_chunks(api, first.ordinal, batch, origin).map_err(gpu_error)?;
        let mut these = Vec::with_capacity(exported.len());
        for c in exported {
            chunks.push(VmmChunk {
                fd_index: chunks.len() as u32,
                offset_bytes: c.offset_bytes,
                size_bytes: c.size_bytes,
            });
            these.push(c.fd);
        }
        fds.push(these);
    }
    Ok(Plan {
        device,
        allocations: vec![AllocationSpec::CudaVmm {
            chunks,
            offset_bytes: range.start - origin,
            size_bytes: range.size_bytes,
        }],
        layers,
        fds,
        ordinal: first.ordinal,
        shared_by: "vmm",
        api: Some(api),
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn register(
    py: Python<'_>,
    client: &RustClient,
    fingerprint: u64,
    shard: u32,
    device: &str,
    layer_ptrs: Vec<u64>,
    layout: KvLayout,
    events: usize,
) -> PyResult<Registration> {
    if layer_ptrs.is_empty() {
        return Err(PyValueError::new_err("no layers to register"));
    }
    let ext = plan::extent(&layout).map_err(plan_error)?;
    let plan = match device {
        "host" => plan_host(&layer_ptrs, ext)?,
        "cuda" | "hip" => {
            let api = GpuApi::from_name(device).expect("matched above");
            py.detach(|| plan_gpu(api, &layer_ptrs, ext))?
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "device {other:?}: use cuda, hip or host"
            )))
        }
    };
    let client_events = match plan.api {
        Some(api) if events > 0 => Some(Arc::new(
            ClientEvents::new(api, plan.ordinal, events).map_err(gpu_error)?,
        )),
        _ => None,
    };
    let c = client.clone();
    let handles: Vec<IpcHandle> = client_events
        .iter()
        .flat_map(|e| e.handles().iter().map(|h| IpcHandle(*h)))
        .collect();
    let Plan {
        device,
        allocations,
        layers,
        fds,
        ordinal,
        shared_by,
        api,
    } = plan;
    let reply = py
        .detach(move || {
            runtime().block_on(async move {
                let token = if fds.is_empty() {
                    0
                } else {
                    RustClient::fd_token()
                };
                for batch in fds {
                    c.share_fds_under(token, batch).await?;
                }
                c.register(Register {
                    fingerprint,
                    shard,
                    device,
                    fd_token: token,
                    allocations,
                    layout,
                    layers,
                    client_events: handles,
                })
                .await
            })
        })
        .map_err(client_error)?;
    let server_events = match api {
        Some(api) if !reply.server_events.is_empty() => {
            let hs: Vec<[u8; 64]> = reply.server_events.iter().map(|h| h.0).collect();
            Some(Arc::new(
                ServerEvents::open(api, ordinal, &hs).map_err(gpu_error)?,
            ))
        }
        _ => None,
    };
    Ok(Registration {
        region: reply.region,
        page_bytes: reply.page_bytes,
        chunk_blocks: reply.chunk_blocks,
        device: api.map_or("host", GpuApi::name).into(),
        ordinal,
        shared_by: shared_by.into(),
        client_events,
        server_events,
    })
}

fn api_named(api: &str) -> PyResult<GpuApi> {
    GpuApi::from_name(api)
        .ok_or_else(|| PyValueError::new_err(format!("GPU API {api:?}: use cuda or hip")))
}

/// Whether a CUDA driver can be used here, and if not, why.
#[pyfunction]
pub(crate) fn cuda_available() -> (bool, String) {
    gpu_available("cuda").unwrap_or_else(|e| (false, e.to_string()))
}

/// Whether the GPU runtime `api` ("cuda" or "hip") can be used here, and if not, why.
#[pyfunction]
pub(crate) fn gpu_available(api: &str) -> PyResult<(bool, String)> {
    Ok(match gpu::available(api_named(api)?) {
        Ok(()) => (true, String::new()),
        Err(e) => (false, e.to_string()),
    })
}

/// What the runtime `api` ("cuda" or "hip") says about a device pointer: base, alloc_bytes,
/// offset, ordinal, uuid (string), legacy_ipc.
#[pyfunction]
#[pyo3(signature = (ptr, api = "cuda"))]
pub(crate) fn describe_pointer<'py>(
    py: Python<'py>,
    ptr: u64,
    api: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let api = api_named(api)?;
    let p = gpu::describe(api, ptr).map_err(gpu_error)?;
    let d = PyDict::new(py);
    d.set_item("base", p.base)?;
    d.set_item("alloc_bytes", p.alloc_bytes)?;
    d.set_item("offset", p.offset)?;
    d.set_item("ordinal", p.ordinal)?;
    d.set_item("uuid", gpu::format_uuid(api, &p.uuid))?;
    d.set_item("legacy_ipc", p.legacy_ipc)?;
    Ok(d)
}

/// Free and total bytes of a GPU, as this process sees it.
#[pyfunction]
#[pyo3(signature = (ordinal, api = "cuda"))]
pub(crate) fn device_memory(ordinal: i32, api: &str) -> PyResult<(u64, u64)> {
    gpu::mem_info(api_named(api)?, ordinal).map_err(gpu_error)
}
