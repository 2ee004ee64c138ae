//! L1 → disk → L2: the tiers below L1 as one chain. A lookup that L1 does not answer in full
//! asks each tier in turn, nearest first, to fill L1 with what it holds of the prefix beyond
//! what L1 and the tiers before it hold ([`Tier::fill`]); the lookup then answers from L1
//! alone, so a hit from any tier is reported, pinned and retrieved like an L1 hit. A tier that
//! answers at once (the disk: its reads overlap the request's wait for its load) lets the
//! chain go on at once; one that must finish first (L2's round trip) makes the rest of the
//! chain, and the lookup, wait for it.
//!
//! Stored chunks go to every tier that takes them as they are stored ([`Tier::stored`]), and a
//! retrieve of chunks still being filled waits for the tiers that answered early
//! ([`Tier::settle`]).

use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::disk::DiskTier;
use super::fill::{Fill, PrefixPin, Registrations, Tier};
use super::l2::L2Tier;
use crate::l1::cache::Key;
use crate::l1::L1;
use crate::wire::Lookup;

/// The tiers below L1, nearest first.
#[derive(Debug)]
pub struct Tiers {
    chain: Arc<[Arc<dyn Tier>]>,
    /// Whether a tier lets lookups answer before its fill is done.
    answers_early: bool,
    /// The disk tier, for `/healthz` and shutdown.
    pub disk: Option<Arc<DiskTier>>,
    /// The L2 tier, for `/healthz`.
    pub l2: Option<Arc<L2Tier>>,
}

impl Tiers {
    /// The chain: the disk (when configured), then L2 (when configured).
    pub fn new(disk: Option<Arc<DiskTier>>, l2: Option<Arc<L2Tier>>) -> Tiers {
        let mut chain: Vec<Arc<dyn Tier>> = Vec::new();
        if let Some(d) = &disk {
            chain.push(d.clone());
        }
        if let Some(t) = &l2 {
            chain.push(t.clone());
        }
        Tiers {
            answers_early: chain.iter().any(|t| t.answers_early()),
            chain: chain.into(),
            disk,
            l2,
        }
    }

    /// Whether no tier is configured.
    pub fn is_empty(&self) -> bool {
        self.chain.is_empty()
    }

    /// Asks the tiers, in order, to fill L1 for lookup `l`, keeping L1's head of its prefix
    /// pinned while they do. The tiers that answer at once run here; the returned [`Filling`]
    /// says whether the rest must be awaited before the lookup answers.
    pub fn fill(&self, l1: &Arc<L1>, regs: &Arc<dyn Registrations>, l: Arc<Lookup>) -> Filling {
        let mut filling = Filling {
            head: PrefixPin::new(l1),
            l1: l1.clone(),
            regs: regs.clone(),
            lookup: l,
            rest: self.chain.clone(),
            next: 0,
            waiting: None,
        };
        filling.run_until_wait();
        filling
    }

    /// Hands chunks just stored in L1 to the tiers that take them.
    pub fn stored(&self, keys: &[Key], digest: u64) {
        for t in self.chain.iter() {
            t.stored(keys, digest);
        }
    }

    /// Whether a retrieve must look for chunks still being filled ([`Tiers::settle`]).
    pub fn answers_early(&self) -> bool {
        self.answers_early
    }

    /// Waits until none of `keys` is being filled, each tier for at most its deadline.
    pub async fn settle(&self, l1: &L1, keys: &[Key]) {
        for t in self.chain.iter().filter(|t| t.answers_early()) {
            t.settle(l1, keys).await;
        }
    }
}

/// A lookup's trip down the chain: L1's head of its prefix pinned, and the tiers still to ask.
pub struct Filling {
    head: PrefixPin,
    l1: Arc<L1>,
    regs: Arc<dyn Registrations>,
    lookup: Arc<Lookup>,
    rest: Arc<[Arc<dyn Tier>]>,
    next: usize,
    /// The fill the chain waits for before it goes on.
    waiting: Option<BoxFuture<'static, ()>>,
}

impl std::fmt::Debug for Filling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filling")
            .field("head", &self.head)
            .field("next", &self.next)
            .field("waiting", &self.waiting.is_some())
            .finish_non_exhaustive()
    }
}

impl Filling {
    /// Asks the next tiers until one must be waited for, or none is left.
    fn run_until_wait(&mut self) {
        while self.waiting.is_none() && self.next < self.rest.len() {
            let tier = self.rest[self.next].clone();
            self.next += 1;
            // What the tiers before filled is L1's now: pinned too, before this tier's pages
            // are taken.
            self.head.extend(&self.lookup);
            let above = &self.rest[..self.next - 1];
            if let Fill::Later(wait) = tier.fill(&self.l1, &self.regs, &self.lookup, above) {
                self.waiting = Some(wait);
            }
        }
    }

    /// Whether the lookup may answer now.
    pub fn is_done(&self) -> bool {
        self.waiting.is_none()
    }

    /// Waits for the tiers still filling, in order; then the lookup may answer. Returns the
    /// head's pin, to drop once the lookup has pinned what it reports.
    pub async fn finish(mut self) -> PrefixPin {
        while let Some(wait) = self.waiting.take() {
            wait.await;
            self.run_until_wait();
        }
        self.head
    }

    /// The head's pin, for a lookup that answers now ([`Filling::is_done`]).
    pub fn into_head(self) -> PrefixPin {
        self.head
    }
}
