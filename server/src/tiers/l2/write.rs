//! Write-behind: stored chunks go to L2 after their copy into L1 has completed, never on a
//! store's path. The queue holds keys, not bytes (`--l2-queue` of them; a full queue drops and
//! counts); a batch pins its pages only while a blocking thread reads them into values, so a
//! page being written by a copy is never read and a page being read is never evicted. A chunk
//! evicted while it waited is dropped and counted. At most `--l2-connections` batches of about
//! [`WRITE_BATCH_BYTES`] are in flight, which bounds the memory write-behind holds.

use std::sync::Arc;

use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use super::config::{WRITE_BATCH_BYTES, WRITE_TIMEOUT};
use super::{L2Error, L2Tier, WriteItem};
use crate::l1::cache::{Key, ReadPlan};
use crate::l1::L1;

/// A chunk pinned for reading.
#[derive(Debug)]
struct Pinned {
    item: WriteItem,
    plan: ReadPlan,
    page_bytes: u64,
}

/// Takes queued chunks in batches and writes them to L2 until `stop`.
pub async fn run(
    tier: Arc<L2Tier>,
    l1: Arc<L1>,
    mut rx: mpsc::Receiver<WriteItem>,
    stop: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(tier.config.connections));
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => return,
            item = rx.recv() => match item {
                Some(i) => i,
                None => return,
            },
        };
        let permit = tokio::select! {
            _ = stop.cancelled() => return,
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
        };
        let mut batch = Vec::new();
        let mut bytes = 0u64;
        let mut next = Some(first);
        while let Some(item) = next.take() {
            match l1.cache().pin_ready(&item.key) {
                Some((plan, page_bytes)) => {
                    bytes += page_bytes;
                    batch.push(Pinned {
                        item,
                        plan,
                        page_bytes,
                    });
                }
                None => tier
                    .metrics
                    .write_behind
                    .with_label_values(&["dropped_evicted"])
                    .inc(),
            }
            if bytes < WRITE_BATCH_BYTES {
                next = rx.try_recv().ok();
            }
        }
        if batch.is_empty() {
            continue;
        }
        let (tier, l1) = (tier.clone(), l1.clone());
        tokio::spawn(async move {
            write_batch(&tier, &l1, batch).await;
            drop(permit);
        });
    }
}

async fn write_batch(tier: &Arc<L2Tier>, l1: &Arc<L1>, batch: Vec<Pinned>) {
    let Some(pool) = l1.memory().cloned() else {
        return;
    };
    let entries: Vec<_> = batch.iter().map(|p| p.plan.entry).collect();
    let names: Vec<String> = batch
        .iter()
        .map(|p| tier.store.name_of(&p.item.key))
        .collect();
    let codec = tier.codec.clone();
    let header = codec.header_bytes();
    let read = tokio::task::spawn_blocking(move || {
        batch
            .into_iter()
            .zip(names)
            .filter_map(|(p, name)| {
                let mut buf = codec.buffer(p.page_bytes as usize);
                match pool.read(p.plan.offset, &mut buf[header..]) {
                    Ok(()) => {
                        codec.seal(&mut buf, p.item.digest, &name);
                        Some((p.item.key, buf))
                    }
                    Err(e) => {
                        tracing::warn!("reading a chunk for L2: {e}");
                        None
                    }
                }
            })
            .collect::<Vec<(Key, Vec<u8>)>>()
    })
    .await;
    // The pages were read (or the read failed): they may be evicted again.
    l1.cache().finish_retrieve(&entries, None);
    let items = match read {
        Ok(items) => items,
        Err(e) => {
            tracing::error!("the L2 write-behind read task failed: {e}");
            return;
        }
    };
    let n = items.len() as u64;
    let sizes: Vec<u64> = items
        .iter()
        .map(|(_, v)| (v.len() - header) as u64)
        .collect();
    let m = &tier.metrics;
    let results = match tokio::time::timeout(WRITE_TIMEOUT, tier.store.put_many(items)).await {
        Ok(r) => r,
        Err(_) => {
            tier.note_error(&L2Error::Unavailable {
                op: "set",
                message: format!(
                    "a write-behind batch took longer than {} s",
                    WRITE_TIMEOUT.as_secs()
                ),
            });
            m.write_behind.with_label_values(&["failed"]).inc_by(n);
            return;
        }
    };
    let mut first_error: Option<L2Error> = None;
    for (r, size) in results.into_iter().zip(sizes) {
        match r {
            Ok(()) => {
                tier.note_ok();
                m.write_behind.with_label_values(&["written"]).inc();
                m.bytes.with_label_values(&["write"]).inc_by(size);
            }
            Err(e) => {
                m.write_behind.with_label_values(&["failed"]).inc();
                first_error.get_or_insert(e);
            }
        }
    }
    // One error per batch: a batch against a full or absent L2 fails as one.
    if let Some(e) = first_error {
        tier.note_error(&e);
    }
}
