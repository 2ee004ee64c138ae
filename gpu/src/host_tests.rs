//! The host backend through the dispatch layer, as the server drives it: imports by memfd,
//! copies both ways, and the refusals.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use rustix::fs::MemfdFlags;

use super::*;
use crate::copy::CopyRun;
use crate::host::{HostDevice, SharedMemory};

fn dup(fd: BorrowedFd<'_>) -> OwnedFd {
    rustix::io::fcntl_dupfd_cloexec(fd, 0).unwrap()
}

/// Imports one memfd through the device enum, as the server does.
fn import(dev: &Device, fd: OwnedFd, size_bytes: u64) -> Result<Imports, GpuError> {
    dev.import(vec![ImportSource::HostFd { fd, size_bytes }], &[], 0)
}

#[test]
fn round_trip_through_the_pool() {
    let shm = SharedMemory::create("kvd-test", 1 << 16).unwrap();
    let data: Vec<u8> = (0..8192u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    shm.write(4096, &data).unwrap();
    let dev = Device::Host(HostDevice);
    let imported = Arc::new(import(&dev, dup(shm.fd()), 1 << 16).unwrap());
    let pool = Arc::new(
        PoolMemory::allocate(crate::PoolLayout::new(1 << 20, 1 << 20).unwrap(), false).unwrap(),
    );
    pool.mark_ready(pool.size_bytes());
    let mut engine = dev.copy_engine(pool.clone()).unwrap();
    let run = |d, p| CopyRun {
        memory: 0,
        device_offset_bytes: d,
        pool_offset_bytes: p,
        len_bytes: 8192,
    };
    let store = CopyJob {
        direction: Direction::D2h,
        imports: imported.clone(),
        runs: vec![run(4096, 65536)],
        wait_slot: None,
    };
    let done = engine.submit(&store).unwrap();
    assert_eq!(done.event_slot(), None);
    done.wait().unwrap();
    let retrieve = CopyJob {
        direction: Direction::H2d,
        runs: vec![run(32768, 65536)],
        ..store.clone()
    };
    engine.submit(&retrieve).unwrap().wait().unwrap();
    assert_eq!(shm.read_vec(32768, 8192).unwrap(), data);
    assert!(shm.fd().as_raw_fd() >= 0);
}

#[test]
fn a_bad_run_copies_nothing() {
    let shm = SharedMemory::create("kvd-test", 8192).unwrap();
    shm.write(0, &[7u8; 8192]).unwrap();
    let dev = Device::Host(HostDevice);
    let imported = Arc::new(import(&dev, dup(shm.fd()), 8192).unwrap());
    let pool = Arc::new(
        PoolMemory::allocate(crate::PoolLayout::new(1 << 16, 1 << 16).unwrap(), false).unwrap(),
    );
    pool.mark_ready(pool.size_bytes());
    let mut engine = dev.copy_engine(pool.clone()).unwrap();
    let job = CopyJob {
        direction: Direction::D2h,
        imports: imported,
        runs: vec![
            CopyRun {
                memory: 0,
                device_offset_bytes: 0,
                pool_offset_bytes: 0,
                len_bytes: 4096,
            },
            CopyRun {
                memory: 0,
                device_offset_bytes: 4096,
                pool_offset_bytes: 0,
                len_bytes: 8192,
            },
        ],
        wait_slot: None,
    };
    assert!(matches!(
        engine.submit(&job),
        Err(GpuError::OutOfBounds { .. })
    ));
    let mut first = vec![1u8; 4096];
    pool.read(0, &mut first).unwrap();
    assert!(first.iter().all(|&b| b == 0), "nothing was copied");
}

#[test]
fn unsealed_or_short_memfds_are_refused() {
    let fd = rustix::fs::memfd_create("plain", MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, 4096).unwrap();
    let dev = Device::Host(HostDevice);
    let err = import(&dev, fd, 4096).unwrap_err();
    assert!(err.to_string().contains("F_SEAL_SHRINK"), "{err}");

    let shm = SharedMemory::create("kvd-test", 4096).unwrap();
    let err = import(&dev, dup(shm.fd()), 8192).unwrap_err();
    assert!(err.to_string().contains("holds 4096 bytes"), "{err}");
}

#[test]
fn an_engine_refuses_another_backends_wait_slot_and_events() {
    let shm = SharedMemory::create("kvd-test", 4096).unwrap();
    let dev = Device::Host(HostDevice);
    let err = dev
        .import(
            vec![ImportSource::HostFd {
                fd: dup(shm.fd()),
                size_bytes: 4096,
            }],
            &[[0u8; IPC_HANDLE_BYTES]],
            4,
        )
        .unwrap_err();
    assert!(err.to_string().contains("no interprocess events"), "{err}");
    let pool = Arc::new(
        PoolMemory::allocate(crate::PoolLayout::new(1 << 16, 1 << 16).unwrap(), false).unwrap(),
    );
    pool.mark_ready(pool.size_bytes());
    let mut engine = dev.copy_engine(pool).unwrap();
    assert!(matches!(engine, CopyEngine::Host(_)));
    let job = CopyJob {
        direction: Direction::D2h,
        imports: Arc::new(import(&dev, dup(shm.fd()), 4096).unwrap()),
        runs: Vec::new(),
        wait_slot: Some(0),
    };
    let err = engine.submit(&job).unwrap_err();
    assert!(err.to_string().contains("no events"), "{err}");
}
