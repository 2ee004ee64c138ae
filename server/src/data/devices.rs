//! The devices kvd can copy with — the host backend always, a GPU backend (NVIDIA's CUDA or
//! AMD's HIP) when one is present — and one copy worker per device, started on first use. On a
//! machine with several NUMA nodes a GPU's copy-submitting threads run on its node's CPUs and its stores
//! take pages from that node's share of the pool (see `l1::numa`).

use std::collections::HashMap;
use std::sync::Arc;

use kvd_gpu::host::HostDevice;
use kvd_gpu::runtime::{Backend, Runtime};
use kvd_gpu::{Device, GpuError, PoolMemory};
pub use kvd_gpu::{GpuBackend, PoolPin};
use parking_lot::Mutex;

use crate::data::copier::CopyWorker;
use crate::l1::numa::{Placement, Topology};
use crate::l1::pool::Home;
use crate::ops::metrics::Metrics;
use crate::wire::DeviceSpec;

/// A device and its copy worker.
pub type DeviceWorker = (Arc<Device>, Arc<CopyWorker>);

/// Devices and their copy workers.
#[derive(Debug)]
pub struct Devices {
    pool: Arc<PoolMemory>,
    host: Arc<Device>,
    gpu: Option<GpuBackend>,
    workers: Mutex<HashMap<DeviceSpec, DeviceWorker>>,
    /// The pool home nearest each device that has one.
    homes: Mutex<HashMap<DeviceSpec, Home>>,
    numa: Option<(Topology, Placement)>,
    /// Give each GPU another node's slabs (`--numa remote`, to measure placement).
    remote: bool,
    queue_depth: usize,
    metrics: Metrics,
}

impl Devices {
    /// Devices over a ready pool.
    pub fn new(
        pool: Arc<PoolMemory>,
        gpu: Option<GpuBackend>,
        queue_depth: usize,
        metrics: Metrics,
    ) -> Self {
        Devices {
            pool,
            host: Arc::new(Device::Host(HostDevice)),
            gpu,
            workers: Mutex::new(HashMap::new()),
            homes: Mutex::new(HashMap::new()),
            numa: None,
            remote: false,
            queue_depth,
            metrics,
        }
    }

    /// Places copy threads and stores by NUMA node, where the pool has a placement; with
    /// `remote`, each GPU's stores go to the next node's slabs instead of its own.
    pub fn with_numa(
        mut self,
        topology: Topology,
        placement: Option<Placement>,
        remote: bool,
    ) -> Self {
        self.numa = placement.map(|p| (topology, p));
        self.remote = remote;
        self
    }

    /// The pool home nearest a registered device, once its worker started; `None` on one node.
    pub fn home_of(&self, spec: &DeviceSpec) -> Option<Home> {
        self.homes.lock().get(spec).copied()
    }

    /// The pool's memory.
    pub fn pool(&self) -> &Arc<PoolMemory> {
        &self.pool
    }

    /// The device for a registration and its copy worker, started if need be.
    pub fn device_for(&self, spec: &DeviceSpec) -> Result<DeviceWorker, GpuError> {
        let mut workers = self.workers.lock();
        if let Some((d, w)) = workers.get(spec) {
            return Ok((d.clone(), w.clone()));
        }
        let (device, thread): (Arc<Device>, String) = match spec {
            DeviceSpec::Host => (self.host.clone(), "kvd-host".to_string()),
            DeviceSpec::Cuda { uuid } => {
                let gpu = self.gpu.as_ref().ok_or_else(|| {
                    GpuError::Unavailable(
                        "this kvd found no GPU driver at start (neither NVIDIA's libcuda.so.1 nor \
                         ROCm's libamdhip64.so), so it cannot map GPU memory; run kvd on the GPU \
                         host with the driver visible"
                            .into(),
                    )
                })?;
                let (device, ordinal) = gpu.device(uuid)?;
                (Arc::new(device), format!("kvd-gpu{ordinal}"))
            }
        };
        let d = device.clone();
        let pool = self.pool.clone();
        let mut cpus = Vec::new();
        if let Some((topology, placement)) = &self.numa {
            let node = device.pci_bus_id().and_then(|id| topology.node_of_pci(&id));
            match node {
                Some(node) => {
                    if let Some(home) = placement.home_of_node(node) {
                        let home = if self.remote {
                            (home + 1) % placement.homes()
                        } else {
                            home
                        };
                        self.homes.lock().insert(*spec, home);
                    }
                    if let Some(n) = topology.nodes().iter().find(|n| n.id == node) {
                        cpus = n.cpus.clone();
                    }
                    tracing::info!(
                        device = %device.label(),
                        "NUMA node {node}: copies run on its CPUs, stores use {} node's slabs",
                        if self.remote { "another (--numa remote)" } else { "this" }
                    );
                }
                None => {
                    tracing::info!(device = %device.label(), "no NUMA node known for this device; its copies use the whole pool")
                }
            }
        }
        let worker = CopyWorker::start(
            &device.label(),
            &thread,
            self.queue_depth,
            self.metrics.clone(),
            Arc::new(move || {
                crate::l1::numa::pin_current_thread(&cpus);
                d.copy_engine(pool.clone())
            }),
        )?;
        tracing::info!(
            device = %device.label(),
            thread,
            "copy worker started: stores on {thread}-d2h, retrieves on {thread}-h2d"
        );
        workers.insert(*spec, (device.clone(), worker.clone()));
        Ok((device, worker))
    }

    /// Stops every copy worker after its queued jobs.
    pub fn shutdown(&self) {
        let workers: Vec<_> = self.workers.lock().drain().collect();
        for (_, (_, w)) in workers {
            w.shutdown();
        }
    }
}

/// Which GPU backend `KVD_GPU_BACKEND` asks for: `cuda`, `hip`, or (unset or `auto`) the first
/// that finds a GPU, CUDA first.
fn requested_backend() -> Result<Option<&'static str>, String> {
    match std::env::var("KVD_GPU_BACKEND").as_deref() {
        Err(_) | Ok("") | Ok("auto") => Ok(None),
        Ok("cuda") => Ok(Some("cuda")),
        Ok("hip") => Ok(Some("hip")),
        Ok(other) => Err(format!(
            "KVD_GPU_BACKEND={other:?} is not a backend; use cuda, hip or auto"
        )),
    }
}

/// The GPU backend, or why there is none here: NVIDIA GPUs through CUDA, else AMD GPUs through
/// HIP. The log says which one kvd uses and lists its GPUs.
pub fn discover_gpu() -> Result<GpuBackend, String> {
    let want = requested_backend()?;
    let mut why = Vec::new();
    if want.is_none() || want == Some("cuda") {
        match load::<kvd_gpu::cuda::Cuda>("CUDA (NVIDIA)".into()) {
            Ok(b) => return Ok(GpuBackend::Cuda(b)),
            Err(e) => why.push(format!("CUDA: {e}")),
        }
    }
    if want.is_none() || want == Some("hip") {
        let library = kvd_gpu::hip::library().unwrap_or_default();
        match load::<kvd_gpu::hip::Hip>(format!("HIP ({library})")) {
            Ok(b) => return Ok(GpuBackend::Hip(b)),
            Err(e) => why.push(format!("HIP: {e}")),
        }
    }
    Err(why.join("; "))
}

/// Loads runtime `R` and logs it as `what` with its GPUs.
fn load<R: Runtime>(what: String) -> Result<Arc<Backend<R>>, GpuError> {
    let b = Backend::<R>::load()?;
    tracing::info!("GPU backend: {what}, {} GPU(s)", b.devices().len());
    for d in b.devices() {
        tracing::info!(
            "GPU {}: {} ({})",
            d.ordinal,
            d.name,
            R::format_uuid(&d.uuid)
        );
    }
    Ok(b)
}
