//! One copy worker per device, in two lanes: stores (device → pool) and retrieves (pool →
//! device). Each lane is a named thread (`kvd-gpu0-d2h`, `kvd-gpu0-h2d`, ...) that owns its own
//! copy engine and submits its jobs in arrival order, and a second thread that waits for their
//! completion. Jobs arrive through a bounded queue per lane; a full queue is refused at once (the
//! request gets a `Busy` reply and a counter moves) instead of blocking a tokio worker.
//! Never one thread for all GPUs: a slow or stuck device holds up only its own clients.
//!
//! Why two lanes: submitting a job costs CPU time per descriptor (about a microsecond), and a
//! store of a long prompt in vLLM's per-layer layout is tens of thousands of descriptors. Behind
//! one thread, a retrieve that a step's forward pass is waiting for waited for every store
//! queued before it (a 70B shape's hit steps held 9-62 ms, once a pass 640-660 ms, for kvd's
//! answer; benches/results/2026-12-07-session-37.md). A retrieve now waits only for retrieves,
//! and a completion thread per lane settles a retrieve without waiting for a store's copy: on an
//! H100 with stores streaming, a retrieve was answered at 4.8 ms p50 against 126 ms on one thread
//! (`benches/lanes.py --gpu`, session 39).
//! Nothing orders a store against a retrieve but the GPU: they already ran on separate streams.
//! On the host backend a store's and a retrieve's memcpy may now run at once; no client relies on
//! their order (a host copy's reply comes after the copy, and the protocol orders no requests).
//!
//! A job carries its [`CopyListener`], which these threads call directly: the submitting thread
//! as soon as the device has taken the job (a request that the client will poll an event for is
//! answered from there), the completion thread once the copy is done. No task sits between the
//! device and the reply.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender, TryRecvError, TrySendError};
use kvd_gpu::{Completion, CopyEngine, CopyJob, Direction, GpuError, SubmitTimes};
use parking_lot::Mutex;

use crate::ops::metrics::Metrics;

/// How long the submitting thread stays awake for the next job after a copy completes.
const SPIN_AFTER_COMPLETION: Duration = Duration::from_micros(300);

/// A job whose submission takes longer is logged: a retrieve's holds the forward pass of every
/// request in the step waiting for it. A 4,096-token load of the 70B shape in vLLM 0.26's
/// per-layer layout is 20,480 descriptors: ~10–15 ms at the 0.5–0.7 µs a descriptor a retrieve
/// took in session 39 (benches/lanes.py on an H100), where single batch calls also blocked ~150 ms
/// (benches/results/2026-12-07-session-39.md).
const SLOW_SUBMIT: Duration = Duration::from_millis(100);

/// The least time between two slow-submission lines of one lane; the ones between are counted.
const SLOW_SUBMIT_EVERY: Duration = Duration::from_secs(10);

/// Which slow submissions a lane logs: the first, then one each [`SLOW_SUBMIT_EVERY`], counting
/// those left out.
#[derive(Debug, Default)]
struct SlowSubmits {
    /// Jobs this lane has submitted, the current one included.
    jobs: u64,
    last_line: Option<Instant>,
    left_out: u64,
}

impl SlowSubmits {
    /// Counts a job that took `took`; the line to log, if this one is logged.
    fn note(
        &mut self,
        job: &CopyJob,
        took: Duration,
        times: Option<SubmitTimes>,
        now: Instant,
    ) -> Option<String> {
        self.jobs += 1;
        if took < SLOW_SUBMIT {
            return None;
        }
        if self
            .last_line
            .is_some_and(|t| now.duration_since(t) < SLOW_SUBMIT_EVERY)
        {
            self.left_out += 1;
            return None;
        }
        self.last_line = Some(now);
        let left_out = std::mem::take(&mut self.left_out);
        let bytes = kvd_gpu::copy::total_bytes(&job.runs);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut line = format!(
            "a {} copy took {:.1} ms to submit: job {} of this lane, {} descriptors, {:.1} MiB",
            direction_label(job.direction),
            ms(took),
            self.jobs,
            job.runs.len(),
            bytes as f64 / (1u64 << 20) as f64,
        );
        if let Some(t) = times {
            // The rest: kvd's events recorded and created after the copies.
            let other = took.saturating_sub(t.checks + t.event_wait + t.calls_time);
            line += &format!(
                "; checks {:.1} ms, event wait {:.1} ms, {} copy calls {:.1} ms (slowest {:.1} ms{}), other {:.1} ms",
                ms(t.checks),
                ms(t.event_wait),
                t.calls,
                ms(t.calls_time),
                ms(t.slowest_call),
                if t.one_call_a_run { ", one a run" } else { "" },
                ms(other),
            );
        }
        if left_out > 0 {
            line += &format!("; {left_out} more slow submissions since the last such line");
        }
        Some(line)
    }
}

/// Why a job was not submitted.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The device's queue for that direction is full.
    #[error("the {lane} copy queue of {device} is full ({depth} jobs); retry later or start kvd with a larger --copy-queue")]
    Busy {
        /// Device label.
        device: String,
        /// Which queue: "store" or "retrieve".
        lane: &'static str,
        /// Queue depth.
        depth: usize,
    },
    /// The worker has stopped (shutdown).
    #[error("the copy worker of {0} has stopped")]
    Stopped(String),
    /// The device refused the job.
    #[error(transparent)]
    Device(#[from] GpuError),
    /// The client's deadline passed before the job reached the device: nothing was copied.
    #[error("the copy reached the device {late_ms} ms after the client's deadline and was not started; nothing was copied. kvd is lagging (a stopped or overloaded process, a long copy queue): check its CPU and kvd_copy_submit_seconds")]
    Expired {
        /// How late it was.
        late_ms: u64,
    },
}

/// The moment a client stops waiting for a copy and may reuse its blocks, in
/// `CLOCK_MONOTONIC` nanoseconds (the clock every process of the host shares; a request
/// carries it as `deadline_ns`). A copy must never start after it: the client's forward pass
/// may then be writing the blocks a store would read (a sliding window's blocks go back to
/// vLLM as they leave the window), or own the blocks a retrieve would write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline(pub u64);

impl Deadline {
    /// The request's deadline; `None` for 0 (none given).
    pub fn from_wire(deadline_ns: u64) -> Option<Self> {
        (deadline_ns != 0).then_some(Deadline(deadline_ns))
    }

    fn now_ns() -> u64 {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        (now.tv_sec as u64)
            .saturating_mul(1_000_000_000)
            .saturating_add(now.tv_nsec as u64)
    }

    /// Nanoseconds past it now (0 while it has not passed).
    pub fn late_ns(self) -> u64 {
        Self::now_ns().saturating_sub(self.0)
    }

    /// Time left until it (zero once it has passed).
    pub fn remaining(self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.0.saturating_sub(Self::now_ns()))
    }

    /// Whether it has passed, as a [`SubmitError::Expired`].
    pub fn check(deadline: Option<Self>) -> Result<(), SubmitError> {
        match deadline.map(Deadline::late_ns) {
            Some(late) if late > 0 => Err(SubmitError::Expired {
                late_ms: late / 1_000_000,
            }),
            _ => Ok(()),
        }
    }
}

/// Told how a job went, by the copy worker's threads.
pub trait CopyListener: Send {
    /// The device accepted the job (with kvd's event slot the client can poll, where the device
    /// has events) or it was not submitted. Called once, on the submitting thread — or on the
    /// caller's, for a full queue or a stopped worker.
    fn submitted(&mut self, result: Result<Option<u16>, SubmitError>);
    /// The copy completed, successfully or not. Called once, on the completion thread, and only
    /// after `submitted(Ok(..))`.
    fn done(self: Box<Self>, result: Result<(), GpuError>);
}

struct Job {
    copy: CopyJob,
    deadline: Option<Deadline>,
    listener: Box<dyn CopyListener>,
}

struct Pending {
    completion: Completion,
    listener: Box<dyn CopyListener>,
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

/// What a copy worker drives: a device's [`CopyEngine`] (the tests also drive a stand-in that
/// holds jobs back, to fill the queue).
pub trait Submit: Send + 'static {
    /// Enqueues (or performs) one job.
    fn submit(&mut self, job: &CopyJob) -> Result<Completion, GpuError>;
    /// Where the last submission's time went, where the engine knows.
    fn last_submit(&self) -> Option<SubmitTimes> {
        None
    }
}

impl Submit for CopyEngine {
    fn submit(&mut self, job: &CopyJob) -> Result<Completion, GpuError> {
        CopyEngine::submit(self, job)
    }
    fn last_submit(&self) -> Option<SubmitTimes> {
        CopyEngine::last_submit(self)
    }
}

/// Makes a lane's copy engine, on the lane's submitting thread (called once a lane).
pub type MakeEngine<E> = Arc<dyn Fn() -> Result<E, GpuError> + Send + Sync>;

/// One direction's queue and threads.
struct Lane {
    tx: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Lane {
    /// Stops accepting jobs, lets queued ones finish, and joins the threads.
    fn shutdown(&self, label: &str) {
        self.tx.lock().take();
        for t in self.threads.lock().drain(..) {
            if t.join().is_err() {
                tracing::error!(device = %label, "a copy thread panicked");
            }
        }
    }
}

/// The copy worker of one device: a store lane and a retrieve lane.
pub struct CopyWorker {
    label: String,
    depth: usize,
    metrics: Metrics,
    /// Indexed by [`lane_of`].
    lanes: [Lane; 2],
}

impl std::fmt::Debug for CopyWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyWorker")
            .field("label", &self.label)
            .finish()
    }
}

fn lane_of(d: Direction) -> usize {
    match d {
        Direction::D2h => 0,
        Direction::H2d => 1,
    }
}

impl CopyWorker {
    /// Starts both lanes' threads, named `{thread_name}-d2h` and `{thread_name}-h2d` (and
    /// `…-done` for their completion threads). `make_engine` runs on each lane's submitting
    /// thread, so a backend that needs per-thread state (a current CUDA context) sets it up
    /// there. `depth` is each lane's queue.
    pub fn start<E: Submit>(
        label: &str,
        thread_name: &str,
        depth: usize,
        metrics: Metrics,
        make_engine: MakeEngine<E>,
    ) -> Result<Arc<Self>, GpuError> {
        let stores = start_lane(
            &format!("{thread_name}-d2h"),
            depth,
            metrics.clone(),
            make_engine.clone(),
        )?;
        let retrieves = match start_lane(
            &format!("{thread_name}-h2d"),
            depth,
            metrics.clone(),
            make_engine,
        ) {
            Ok(l) => l,
            Err(e) => {
                stores.shutdown(label);
                return Err(e);
            }
        };
        Ok(Arc::new(CopyWorker {
            label: label.to_string(),
            depth,
            metrics,
            lanes: [stores, retrieves],
        }))
    }

    /// The device label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Queues a job on its direction's lane without waiting; `listener` hears how it goes. A
    /// full queue or a stopped worker is reported to `listener` before this returns. A job whose
    /// `deadline` has passed when its turn comes is not started ([`SubmitError::Expired`]).
    pub fn submit(
        &self,
        copy: CopyJob,
        deadline: Option<Deadline>,
        mut listener: Box<dyn CopyListener>,
    ) {
        let direction = copy.direction;
        let refused = {
            let tx = self.lanes[lane_of(direction)].tx.lock();
            match tx.as_ref() {
                None => Some((SubmitError::Stopped(self.label.clone()), listener)),
                Some(tx) => match tx.try_send(Job {
                    copy,
                    deadline,
                    listener,
                }) {
                    Ok(()) => None,
                    Err(TrySendError::Full(job)) => {
                        self.metrics.copy_queue_full.inc();
                        let busy = SubmitError::Busy {
                            device: self.label.clone(),
                            lane: match direction {
                                Direction::D2h => "store",
                                Direction::H2d => "retrieve",
                            },
                            depth: self.depth,
                        };
                        Some((busy, job.listener))
                    }
                    Err(TrySendError::Disconnected(job)) => {
                        Some((SubmitError::Stopped(self.label.clone()), job.listener))
                    }
                },
            }
        };
        if let Some((why, l)) = refused {
            listener = l;
            listener.submitted(Err(why));
        }
    }

    /// Stops accepting jobs, lets queued ones finish, and joins the threads.
    pub fn shutdown(&self) {
        for lane in &self.lanes {
            lane.tx.lock().take();
        }
        for lane in &self.lanes {
            lane.shutdown(&self.label);
        }
    }
}

/// Starts one lane: its submitting thread (named `thread_name`, with the engine `make_engine`
/// makes there) and its completion thread.
fn start_lane<E: Submit>(
    thread_name: &str,
    depth: usize,
    metrics: Metrics,
    make_engine: MakeEngine<E>,
) -> Result<Lane, GpuError> {
    let (tx, rx) = bounded::<Job>(depth);
    let (pending_tx, pending_rx) = bounded::<Pending>(depth);
    let (wake_tx, wake_rx) = bounded::<()>(1);
    let wake_on_done = wake_tx.clone();
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
            // A job's whole submission; false when the completion thread is gone.
            let mut slow = SlowSubmits::default();
            let lane_thread = std::thread::current().name().unwrap_or("copy").to_string();
            let mut run = |mut job: Job| -> bool {
                // The last moment before the device takes the copy: past the client's
                // deadline, the blocks may be another request's by now.
                if let Err(e) = Deadline::check(job.deadline) {
                    submit_metrics
                        .copies_expired
                        .with_label_values(&[direction_label(job.copy.direction)])
                        .inc();
                    job.listener.submitted(Err(e));
                    return true;
                }
                let started = Instant::now();
                let submitted = engine.submit(&job.copy);
                let took = started.elapsed();
                submit_metrics
                    .copy_submit_seconds
                    .with_label_values(&[direction_label(job.copy.direction)])
                    .observe(took.as_secs_f64());
                // Logged once the job is answered and handed on: a log write never delays a reply.
                let slow_line = slow.note(&job.copy, took, engine.last_submit(), Instant::now());
                let go_on = match submitted {
                    Ok(completion) => {
                        job.listener.submitted(Ok(completion.event_slot()));
                        let pending = Pending {
                            completion,
                            listener: job.listener,
                            started,
                            direction: job.copy.direction,
                            _copy: job.copy,
                        };
                        pending_tx
                            .send(pending)
                            .map_err(|lost| {
                                lost.0.listener.done(Err(GpuError::Unavailable(
                                    "the copy completion thread has stopped".into(),
                                )))
                            })
                            .is_ok()
                    }
                    Err(e) => {
                        job.listener.submitted(Err(SubmitError::Device(e)));
                        true
                    }
                };
                if let Some(line) = slow_line {
                    tracing::info!(thread = %lane_thread, "{line}");
                }
                go_on
            };
            // Keeps the wake channel open however the completion thread ends.
            let _open = wake_tx.clone();
            loop {
                crossbeam_channel::select! {
                    recv(rx) -> job => {
                        let Ok(job) = job else { return };
                        if !run(job) {
                            return;
                        }
                    }
                    recv(wake_rx) -> _ => {
                        // A copy just completed, and with one request in flight its
                        // client's next one follows within a few hundred microseconds:
                        // wait for it awake rather than be woken, a cross-CPU wake-up that
                        // such a request pays in full (tens of microseconds in a VM).
                        let until = Instant::now() + SPIN_AFTER_COMPLETION;
                        loop {
                            match rx.try_recv() {
                                Ok(job) => {
                                    if !run(job) {
                                        return;
                                    }
                                    break;
                                }
                                Err(TryRecvError::Empty) if Instant::now() < until => {
                                    std::hint::spin_loop()
                                }
                                Err(TryRecvError::Empty) => break,
                                Err(TryRecvError::Disconnected) => return,
                            }
                        }
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
                p.listener.done(r);
                let _ = wake_on_done.try_send(());
            }
        })
        .map_err(|e| GpuError::io(format!("starting thread {done_name}"), e));
    let done_thread = match done_thread {
        Ok(t) => t,
        Err(e) => {
            // Without a completion thread the submitting thread's first job ends it.
            drop(tx);
            let _ = submit_thread.join();
            return Err(e);
        }
    };
    Ok(Lane {
        tx: Mutex::new(Some(tx)),
        threads: Mutex::new(vec![submit_thread, done_thread]),
    })
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

    /// Forwards what a job hears to a channel.
    struct Heard(std::sync::mpsc::Sender<String>);

    impl CopyListener for Heard {
        fn submitted(&mut self, result: Result<Option<u16>, SubmitError>) {
            let _ = self.0.send(format!("submitted {result:?}"));
        }
        fn done(self: Box<Self>, result: Result<(), GpuError>) {
            let _ = self.0.send(format!("done {result:?}"));
        }
    }

    #[test]
    fn jobs_run_on_the_named_thread_and_complete() {
        let pool = Arc::new(
            PoolMemory::allocate(kvd_gpu::PoolLayout::new(1 << 20, 1 << 20).unwrap(), false)
                .unwrap(),
        );
        pool.mark_ready(pool.size_bytes());
        let shm = SharedMemory::create("t", 1 << 16).unwrap();
        shm.write(0, &[5u8; 4096]).unwrap();
        let fd = rustix::io::fcntl_dupfd_cloexec(shm.fd(), 0).unwrap();
        let dev = Device::Host(HostDevice);
        let imports = dev
            .import(
                vec![ImportSource::HostFd {
                    fd,
                    size_bytes: 1 << 16,
                }],
                &[],
                0,
            )
            .unwrap();
        let p = pool.clone();
        let worker = CopyWorker::start(
            "host",
            "kvd-host",
            4,
            Metrics::new(),
            Arc::new(move || Device::Host(HostDevice).copy_engine(p.clone())),
        )
        .unwrap();
        let job = CopyJob {
            direction: Direction::D2h,
            imports: Arc::new(imports),
            runs: vec![CopyRun {
                memory: 0,
                device_offset_bytes: 0,
                pool_offset_bytes: 8192,
                len_bytes: 4096,
            }],
            wait_slot: None,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        worker.submit(job, None, Box::new(Heard(tx)));
        assert_eq!(rx.recv().unwrap(), "submitted Ok(None)");
        assert_eq!(rx.recv().unwrap(), "done Ok(())");
        let mut back = [0u8; 4096];
        pool.read(8192, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 5));
        worker.shutdown();
    }

    #[test]
    fn an_engine_that_cannot_start_is_an_error() {
        let r = CopyWorker::start(
            "x",
            "kvd-x",
            1,
            Metrics::new(),
            Arc::new(|| Err::<CopyEngine, _>(GpuError::Unavailable("no device".into()))),
        );
        assert!(matches!(r, Err(GpuError::Unavailable(_))));
    }

    /// An engine that copies nothing of one direction until told to, so its queue fills; the
    /// other direction's jobs complete at once.
    #[derive(Debug)]
    struct Gated {
        gate: crossbeam_channel::Receiver<()>,
        direction: Direction,
    }

    impl Submit for Gated {
        fn submit(&mut self, job: &CopyJob) -> Result<Completion, GpuError> {
            if job.direction == self.direction {
                self.gate
                    .recv()
                    .map_err(|_| GpuError::Unavailable("gate dropped".into()))?;
            }
            // A copy finished before submit returned, as on the host backend.
            Ok(Completion::Host(kvd_gpu::host::HostCompletion))
        }
    }

    /// A job of no runs over no memory (what the stand-in engines take).
    fn empty_job(direction: Direction) -> CopyJob {
        CopyJob {
            direction,
            imports: Arc::new(kvd_gpu::Imports::Host(kvd_gpu::host::HostImports {
                memories: Vec::new(),
            })),
            runs: Vec::new(),
            wait_slot: None,
        }
    }

    #[test]
    fn a_full_queue_is_refused_as_busy_and_counted() {
        let (open, gate) = crossbeam_channel::unbounded();
        let metrics = Metrics::new();
        let worker = CopyWorker::start(
            "gated",
            "kvd-gated",
            2,
            metrics.clone(),
            Arc::new(move || {
                Ok(Gated {
                    gate: gate.clone(),
                    direction: Direction::H2d,
                })
            }),
        )
        .unwrap();
        let job = || empty_job(Direction::H2d);
        let (tx, rx) = std::sync::mpsc::channel();
        // Nothing is heard from an accepted job until the gate opens, so anything heard at
        // once is a refusal. A queue of 2 behind the job the engine holds takes 2 or 3 jobs.
        let mut accepted = 0;
        loop {
            worker.submit(job(), None, Box::new(Heard(tx.clone())));
            match rx.try_recv() {
                Ok(m) => {
                    assert!(m.starts_with("submitted Err(Busy"), "{m}");
                    assert!(
                        m.contains("\"retrieve\""),
                        "the retrieve lane is named: {m}"
                    );
                    break;
                }
                Err(_) => accepted += 1,
            }
            assert!(accepted <= 3, "a queue of 2 took {accepted} jobs");
        }
        assert!(accepted >= 2, "refused with {accepted} jobs queued");
        assert_eq!(metrics.copy_queue_full.get(), 1);
        // Every accepted job is submitted and completes once.
        for _ in 0..accepted {
            open.send(()).unwrap();
        }
        let heard: Vec<String> = (0..2 * accepted).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(
            heard.iter().filter(|m| *m == "done Ok(())").count(),
            accepted
        );
        assert_eq!(
            heard.iter().filter(|m| *m == "submitted Ok(None)").count(),
            accepted
        );
        drop(open);
        worker.shutdown();
    }

    #[test]
    fn a_retrieve_is_not_held_behind_a_store_being_submitted() {
        let (open, gate) = crossbeam_channel::unbounded();
        let worker = CopyWorker::start(
            "gated",
            "kvd-gated",
            4,
            Metrics::new(),
            Arc::new(move || {
                Ok(Gated {
                    gate: gate.clone(),
                    direction: Direction::D2h,
                })
            }),
        )
        .unwrap();
        let job = empty_job;
        let (stored_tx, stored) = std::sync::mpsc::channel();
        let (retrieved_tx, retrieved) = std::sync::mpsc::channel();
        // Two stores: one held in its submission, one queued behind it.
        worker.submit(
            job(Direction::D2h),
            None,
            Box::new(Heard(stored_tx.clone())),
        );
        worker.submit(job(Direction::D2h), None, Box::new(Heard(stored_tx)));
        worker.submit(job(Direction::H2d), None, Box::new(Heard(retrieved_tx)));
        let wait = std::time::Duration::from_secs(10);
        let heard = [retrieved.recv_timeout(wait), retrieved.recv_timeout(wait)];
        let early = stored.try_recv();
        // Open the gate before asserting, so that a failure ends instead of hanging the
        // worker's shutdown.
        open.send(()).unwrap();
        open.send(()).unwrap();
        assert_eq!(
            heard.map(|h| h.ok()),
            [
                Some("submitted Ok(None)".to_string()),
                Some("done Ok(())".to_string())
            ],
            "the retrieve waited for the stores"
        );
        assert!(early.is_err(), "a store was submitted with its gate shut");
        let heard: Vec<String> = (0..4).map(|_| stored.recv_timeout(wait).unwrap()).collect();
        assert_eq!(heard.iter().filter(|m| *m == "done Ok(())").count(), 2);
        worker.shutdown();
    }

    #[test]
    fn a_slow_submission_is_logged_with_its_size_and_where_its_time_went_then_once_each_ten_seconds(
    ) {
        let mut slow = SlowSubmits::default();
        let mut job = empty_job(Direction::H2d);
        job.runs = (0..2560)
            .map(|i| CopyRun {
                memory: 0,
                device_offset_bytes: i * 16384,
                pool_offset_bytes: i * 16384,
                len_bytes: 16384,
            })
            .collect();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(slow.note(&job, ms(99), None, t0), None);
        let times = SubmitTimes {
            checks: ms(2),
            event_wait: Duration::ZERO,
            calls: 5,
            calls_time: ms(140),
            slowest_call: ms(120),
            one_call_a_run: false,
        };
        let line = slow.note(&job, ms(150), Some(times), t0).unwrap();
        assert_eq!(
            line,
            "a h2d copy took 150.0 ms to submit: job 2 of this lane, 2560 descriptors, 40.0 MiB; \
             checks 2.0 ms, event wait 0.0 ms, 5 copy calls 140.0 ms (slowest 120.0 ms), other 8.0 ms"
        );
        // Within ten seconds of that line: counted, not logged.
        assert_eq!(slow.note(&job, ms(300), None, t0 + ms(9_000)), None);
        assert_eq!(slow.note(&job, ms(300), None, t0 + ms(9_500)), None);
        let line = slow.note(&job, ms(200), None, t0 + ms(10_000)).unwrap();
        assert_eq!(
            line,
            "a h2d copy took 200.0 ms to submit: job 5 of this lane, 2560 descriptors, 40.0 MiB; \
             2 more slow submissions since the last such line"
        );
        // The count starts again after each line; a copy made one call a run says so.
        assert_eq!(slow.note(&job, ms(300), None, t0 + ms(15_000)), None);
        let times = SubmitTimes {
            calls: 2560,
            calls_time: ms(290),
            slowest_call: ms(1),
            one_call_a_run: true,
            ..SubmitTimes::default()
        };
        let line = slow
            .note(&job, ms(300), Some(times), t0 + ms(20_000))
            .unwrap();
        assert!(
            line.ends_with(
                "2560 copy calls 290.0 ms (slowest 1.0 ms, one a run), other 10.0 ms; \
                 1 more slow submissions since the last such line"
            ),
            "{line}"
        );
    }
}
