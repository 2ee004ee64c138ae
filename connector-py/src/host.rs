//! Host memory that stands in for a GPU's KV cache: a sealed memfd mapped here, which kvd maps
//! too when a cache in it is registered with device `host`. It lets the worker-side code run —
//! layout detection, registration, stores, retrieves — on machines without a GPU.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use kvd_gpu::host::SharedMemory;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::gpu_error;

/// Live host buffers by base address, so a registration can find the memfd behind a pointer.
static BUFFERS: Mutex<BTreeMap<u64, Weak<SharedMemory>>> = Mutex::new(BTreeMap::new());

/// The host buffer holding address `ptr`, if any.
pub(crate) fn find(ptr: u64) -> Option<Arc<SharedMemory>> {
    let map = BUFFERS.lock();
    let (_, w) = map.range(..=ptr).next_back()?;
    let m = w.upgrade()?;
    (ptr < m.address() + m.size_bytes()).then_some(m)
}

/// A memfd-backed byte buffer shared with kvd by descriptor.
#[pyclass(module = "kvd._native", frozen)]
pub(crate) struct HostBuffer {
    mem: Arc<SharedMemory>,
}

#[pymethods]
impl HostBuffer {
    /// Maps `size` bytes of fresh, zeroed memory.
    #[new]
    fn new(size: u64) -> PyResult<Self> {
        let mem = Arc::new(SharedMemory::create("kvd-host-kv", size).map_err(gpu_error)?);
        let mut map = BUFFERS.lock();
        map.retain(|_, w| w.strong_count() > 0);
        map.insert(mem.address(), Arc::downgrade(&mem));
        Ok(HostBuffer { mem })
    }

    /// Address of the first byte in this process.
    #[getter]
    fn ptr(&self) -> u64 {
        self.mem.address()
    }

    /// Size in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.mem.size_bytes()
    }

    /// Copies `length` bytes at `offset` out.
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let v = self.mem.read_vec(offset, length).map_err(gpu_error)?;
        Ok(PyBytes::new(py, &v))
    }

    /// Copies `data` in at `offset`.
    fn write(&self, offset: u64, data: &[u8]) -> PyResult<()> {
        self.mem.write(offset, data).map_err(gpu_error)
    }

    /// Fills the whole buffer with bytes from a seeded generator (xorshift64*).
    fn fill_random(&self, py: Python<'_>, seed: u64) -> PyResult<()> {
        let mem = self.mem.clone();
        py.detach(move || {
            let mut x = seed | 1;
            let mut buf = vec![0u8; 1 << 20];
            let mut at = 0;
            while at < mem.size_bytes() {
                for c in buf.chunks_mut(8) {
                    x ^= x >> 12;
                    x ^= x << 25;
                    x ^= x >> 27;
                    let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
                    c.copy_from_slice(&v[..c.len()]);
                }
                let n = (mem.size_bytes() - at).min(buf.len() as u64) as usize;
                mem.write(at, &buf[..n])?;
                at += n as u64;
            }
            Ok(())
        })
        .map_err(gpu_error)
    }
}
