//! One copy worker per device: a named thread (`kvd-host`, `kvd-gpu0`, ...) that owns the
//! device's copy engine and submits jobs in arrival order, and a second thread that waits for
//! their completion. Jobs arrive through a bounded queue; a full queue is refused at once (the
//! request gets a `Busy` reply and a counter moves) instead of blocking a tokio worker.
//! Never one thread for all GPUs: a slow or stuck device holds up only its own clients.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{bounded, Sender, TrySendError};
use kvd_gpu::{copy::total_bytes, Completion, CopyEngine, CopyJob, Direction, GpuError};
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::metrics::Metrics;

/// Why a job was not submitted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The device's queue is full.
    #[error("the copy queue of {device} is full ({depth} jobs); retry later or start kvd with a larger --copy-queue")]
    Busy {
        /// Device label.
        device: String,
        /// Queue depth.
        depth: usize,
    },
    /// The worker has stopped (shutdown).
    #[error("the copy worker of {0} has stopped")]
    Stopped(String),
    /// The device refused the job.
    #[error(transparent)]
    Device(#[from] GpuError),
}

/// A job the device has accepted.
#[derive(Debug)]
pub struct Submitted {
    /// kvd event slot the client can poll, where the device has events.
    pub event_slot: Option<u16>,
    /// Resolves when the copy has completed.
    pub done: oneshot::Receiver<Result<(), GpuError>>,
}

struct Job {
    copy: CopyJob,
    submitted: oneshot::Sender<Result<Option<u16>, GpuError>>,
    done: oneshot::Sender<Result<(), GpuError>>,
}

struct Pending {
    completion: Box<dyn Completion>,
    done: oneshot::Sender<Result<(), GpuError>>,
    started: Instant,
    direction: Direction,
    // Keeps the imports alive until the device has finished with them.
    _copy: CopyJob,
}

fn direction_label(d: Direction) -> &'static str {
    match d {
        Direction::D2h => "d2h",
        Direction::H2d => "h2d",
    }
}

/// The copy worker of one device.
pub struct CopyWorker {
    label: String,
    depth: usize,
    tx: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for CopyWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyWorker")
            .field("label", &self.label)
            .finish()
    }
}

impl CopyWorker {
    /// Starts the threads. `make_engine` runs on the submitting thread, so a backend that needs
    /// per-thread state (a current CUDA context) sets it up there.
    pub fn start(
        label: &str,
        thread_name: &str,
        depth: usize,
        metrics: Metrics,
        make_engine: Box<dyn FnOnce() -> Result<Box<dyn CopyEngine>, GpuError> + Send>,
    ) -> Result<Arc<Self>, GpuError> {
        let (tx, rx) = bounded::<Job>(depth);
        let (pending_tx, pending_rx) = bounded::<Pending>(depth);
        let (init_tx, init_rx) = std::sync::mpsc::channel();
        let submit_metrics = metrics.clone();
        let submit_thread = std::thread::Builder::new()
            .name(thread_name.to_string())
            .spawn(move || {
                let mut engine = match make_engine() {
                    Ok(e) => {
                        let _ = init_tx.send(Ok(()));
                        e
                    }
                    Err(e) => {
                        let _ = init_tx.send(Err(e));
                        return;
                    }
                };
                for job in rx {
                    let started = Instant::now();
                    let submitted = engine.submit(&job.copy);
                    submit_metrics
                        .copy_submit_seconds
                        .with_label_values(&[direction_label(job.copy.direction)])
                        .observe(started.elapsed().as_secs_f64());
                    match submitted {
                        Ok(completion) => {
                            let _ = job.submitted.send(Ok(completion.event_slot()));
                            let pending = Pending {
                                completion,
                                done: job.done,
                                started,
                                direction: job.copy.direction,
                                _copy: job.copy,
                            };
                            if pending_tx.send(pending).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = job.submitted.send(Err(e));
                        }
                    }
                }
            })
            .map_err(|e| GpuError::io(format!("starting thread {thread_name}"), e))?;
        match init_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = submit_thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = submit_thread.join();
                return Err(GpuError::Unavailable(format!(
                    "copy thread {thread_name} died while starting"
                )));
            }
        }
        let done_name = format!("{thread_name}-done");
        let done_thread = std::thread::Builder::new()
            .name(done_name.clone())
            .spawn(move || {
                for p in pending_rx {
                    let r = p.completion.wait();
                    metrics
                        .copy_seconds
                        .with_label_values(&[direction_label(p.direction)])
                        .observe(p.started.elapsed().as_secs_f64());
                    if r.is_err() {
                        metrics.copy_errors.inc();
                    }
                    let _ = p.done.send(r);
                }
            })
            .map_err(|e| GpuError::io(format!("starting thread {done_name}"), e))?;
        Ok(Arc::new(CopyWorker {
            label: label.to_string(),
            depth,
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(vec![submit_thread, done_thread]),
        }))
    }

    /// The device label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Queues a job and waits until the device has accepted it.
    pub async fn submit(&self, copy: CopyJob) -> Result<Submitted, SubmitError> {
        let (sub_tx, sub_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        let bytes = total_bytes(&copy.runs);
        let job = Job {
            copy,
            submitted: sub_tx,
            done: done_tx,
        };
        {
            let tx = self.tx.lock();
            let tx = tx
                .as_ref()
                .ok_or_else(|| SubmitError::Stopped(self.label.clone()))?;
            match tx.try_send(job) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    return Err(SubmitError::Busy {
                        device: self.label.clone(),
                        depth: self.depth,
                    })
                }
                Err(TrySendError::Disconnected(_)) => {
                    return Err(SubmitError::Stopped(self.label.clone()))
                }
            }
        }
        let event_slot = sub_rx
            .await
            .map_err(|_| SubmitError::Stopped(self.label.clone()))??;
        tracing::trace!(device = %self.label, bytes, "copy submitted");
        Ok(Submitted {
            event_slot,
            done: done_rx,
        })
    }

    /// Stops accepting jobs, lets queued ones finish, and joins the threads.
    pub fn shutdown(&self) {
        self.tx.lock().take();
        for t in self.threads.lock().drain(..) {
            if t.join().is_err() {
                tracing::error!(device = %self.label, "a copy thread panicked");
            }
        }
    }
}

impl Drop for CopyWorker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_gpu::host::{HostDevice, SharedMemory};
    use kvd_gpu::{CopyRun, Device, ImportSource, PoolMemory};

    #[tokio::test]
    async fn jobs_run_on_the_named_thread_and_complete() {
        let pool = Arc::new(
            PoolMemory::allocate(kvd_gpu::PoolLayout::new(1 << 20, 1 << 20).unwrap(), false)
                .unwrap(),
        );
        pool.mark_ready(pool.size_bytes());
        let shm = SharedMemory::create("t", 1 << 16).unwrap();
        shm.write(0, &[5u8; 4096]).unwrap();
        let fd = rustix::io::fcntl_dupfd_cloexec(shm.fd(), 0).unwrap();
        let dev = HostDevice;
        let mem = dev
            .import(ImportSource::HostFd {
                fd,
                size_bytes: 1 << 16,
            })
            .unwrap();
        let p = pool.clone();
        let worker = CopyWorker::start(
            "host",
            "kvd-host",
            4,
            Metrics::new(),
            Box::new(move || HostDevice.copy_engine(p)),
        )
        .unwrap();
        let job = CopyJob {
            direction: Direction::D2h,
            memories: vec![mem],
            runs: vec![CopyRun {
                memory: 0,
                device_offset_bytes: 0,
                pool_offset_bytes: 8192,
                len_bytes: 4096,
            }],
            events: None,
            wait_slot: None,
        };
        let sub = worker.submit(job).await.unwrap();
        assert_eq!(sub.event_slot, None);
        sub.done.await.unwrap().unwrap();
        let mut back = [0u8; 4096];
        pool.read(8192, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 5));
        worker.shutdown();
    }

    #[tokio::test]
    async fn an_engine_that_cannot_start_is_an_error() {
        let r = CopyWorker::start(
            "x",
            "kvd-x",
            1,
            Metrics::new(),
            Box::new(|| Err(GpuError::Unavailable("no device".into()))),
        );
        assert!(matches!(r, Err(GpuError::Unavailable(_))));
    }
}
