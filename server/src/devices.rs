//! The devices kvd can copy with — the host backend always, a GPU driver when one is present —
//! and one copy worker per device, started on first use.

use std::collections::HashMap;
use std::sync::Arc;

use kvd_gpu::host::HostDevice;
use kvd_gpu::{Device, GpuError, PoolMemory};
pub use kvd_gpu::{GpuBackend, PoolPin};
use parking_lot::Mutex;

use crate::copier::CopyWorker;
use crate::metrics::Metrics;
use crate::wire::DeviceSpec;

/// A device and its copy worker.
pub type DeviceWorker = (Arc<dyn Device>, Arc<CopyWorker>);

/// Devices and their copy workers.
#[derive(Debug)]
pub struct Devices {
    pool: Arc<PoolMemory>,
    host: Arc<HostDevice>,
    gpu: Option<Arc<dyn GpuBackend>>,
    workers: Mutex<HashMap<DeviceSpec, DeviceWorker>>,
    queue_depth: usize,
    metrics: Metrics,
}

impl Devices {
    /// Devices over a ready pool.
    pub fn new(
        pool: Arc<PoolMemory>,
        gpu: Option<Arc<dyn GpuBackend>>,
        queue_depth: usize,
        metrics: Metrics,
    ) -> Self {
        Devices {
            pool,
            host: Arc::new(HostDevice),
            gpu,
            workers: Mutex::new(HashMap::new()),
            queue_depth,
            metrics,
        }
    }

    /// The pool's memory.
    pub fn pool(&self) -> &Arc<PoolMemory> {
        &self.pool
    }

    /// The device for a registration and its copy worker, started if need be.
    pub fn device_for(
        &self,
        spec: &DeviceSpec,
    ) -> Result<(Arc<dyn Device>, Arc<CopyWorker>), GpuError> {
        let mut workers = self.workers.lock();
        if let Some((d, w)) = workers.get(spec) {
            return Ok((d.clone(), w.clone()));
        }
        let (device, thread): (Arc<dyn Device>, String) = match spec {
            DeviceSpec::Host => (self.host.clone(), "kvd-host".to_string()),
            DeviceSpec::Cuda { uuid } => {
                let gpu = self.gpu.as_ref().ok_or_else(|| {
                    GpuError::Unavailable(
                        "this kvd found no CUDA driver (libcuda.so.1) at start, so it cannot map \
                         GPU memory; run kvd on the GPU host with the NVIDIA driver visible"
                            .into(),
                    )
                })?;
                let (device, ordinal) = gpu.device(uuid)?;
                (device, format!("kvd-gpu{ordinal}"))
            }
        };
        let d = device.clone();
        let pool = self.pool.clone();
        let worker = CopyWorker::start(
            &device.label(),
            &thread,
            self.queue_depth,
            self.metrics.clone(),
            Box::new(move || d.copy_engine(pool)),
        )?;
        tracing::info!(device = %device.label(), thread, "copy worker started");
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

/// The GPU driver, or why there is none here.
pub fn discover_gpu() -> Result<Arc<dyn GpuBackend>, String> {
    match kvd_gpu::cuda::CudaBackend::load() {
        Ok(b) => {
            for d in b.devices() {
                tracing::info!(
                    "GPU {}: {} ({})",
                    d.ordinal,
                    d.name,
                    kvd_gpu::cuda::format_uuid(&d.uuid)
                );
            }
            Ok(b)
        }
        Err(e) => Err(e.to_string()),
    }
}
