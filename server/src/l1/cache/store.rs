//! Stores: a page for every new chunk of a request (evicting if need be), each chunk linked to
//! its parent in the prefix tree; refusals counted by reason.

use super::{set_leaf, Cache, Entry, Key, Refusal, State, StorePlan};
use crate::l1::evict::EntryId;
use crate::l1::pool::{ClassId, Home, Page};

impl Cache {
    /// Plans a store of `keys` into pages of `class`: new keys get a page (evicting if need be)
    /// and a `Writing` entry. Every chunk is tried: one refused does not drop the rest, since a
    /// later store of that chunk alone makes them reachable again (until then they count as
    /// unreachable).
    pub fn begin_store(&mut self, class: ClassId, keys: &[Key]) -> Vec<StorePlan> {
        self.begin_store_near(class, keys, None)
    }

    /// Like [`Cache::begin_store`], taking pages at pool home `near` (the storing GPU's NUMA
    /// node) while it has room.
    pub fn begin_store_near(
        &mut self,
        class: ClassId,
        keys: &[Key],
        near: Option<Home>,
    ) -> Vec<StorePlan> {
        self.begin_store_with(class, keys, near, true)
    }

    /// Like [`Cache::begin_store_near`]; without `may_evict`, a chunk that finds no free page
    /// is refused rather than evicting one (a store that would rather wait for the growing
    /// pool than evict what was just stored).
    pub fn begin_store_with(
        &mut self,
        class: ClassId,
        keys: &[Key],
        near: Option<Home>,
        may_evict: bool,
    ) -> Vec<StorePlan> {
        self.plan_pages(class, keys, near, may_evict, false, &[])
    }

    /// Like [`Cache::begin_store_with`], where `below[i]` says a tier below L1 holds `keys[i]`:
    /// such a chunk that L1 lacks is `Present` without taking a page. Written again into L1 it
    /// would evict a chunk only L1 holds; a lookup brings it back from below instead.
    pub fn begin_store_above(
        &mut self,
        class: ClassId,
        keys: &[Key],
        near: Option<Home>,
        may_evict: bool,
        below: &[bool],
    ) -> Vec<StorePlan> {
        self.plan_pages(class, keys, near, may_evict, false, below)
    }

    /// Plans pages for chunks the disk tier is about to read back into L1. A fill stands in
    /// for the store the request would make after recomputing them, so it takes pages as a
    /// store does, evicting the same victims a store would (which the disk tier may take,
    /// [`super::demote`]). Where no page can be had the chunk is `Refused`, which is not
    /// counted as a store refusal. Its entries are `Filling` until [`Cache::finish_store`]:
    /// lookups report and pin them, retrieves wait for them. They know they are on disk, so
    /// evicting them later writes nothing.
    pub fn begin_fill(&mut self, class: ClassId, keys: &[Key]) -> Vec<StorePlan> {
        self.plan_pages(class, keys, None, true, true, &[])
    }

    fn plan_pages(
        &mut self,
        class: ClassId,
        keys: &[Key],
        near: Option<Home>,
        may_evict: bool,
        fill: bool,
        below: &[bool],
    ) -> Vec<StorePlan> {
        let mut plans = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            // The chunk before it in the request, or for the first one what a lookup taught.
            let parent_hash = match i {
                0 => self.hints.parent_of(key),
                _ => Some(keys[i - 1].hash),
            };
            let parent_key = parent_hash.map(|hash| Key { hash, ..*key });
            if let Some(&id) = self.map.get(key) {
                plans.push(StorePlan::Present);
                if let Some(pk) = parent_key {
                    if let Some(&p) = self.map.get(&pk) {
                        let (entries, policies) = (&self.entries, &mut self.policies);
                        self.tree.link(id, pk, p, &mut |n, leaf| {
                            set_leaf(entries, policies, n, leaf)
                        });
                    }
                }
                continue;
            }
            if below.get(i) == Some(&true) {
                plans.push(StorePlan::Present);
                continue;
            }
            let page = match self.alloc_page(class, near, may_evict) {
                Ok(page) => page,
                Err(_) if fill => {
                    plans.push(StorePlan::Refused);
                    continue;
                }
                Err(why) => {
                    plans.push(StorePlan::Refused);
                    self.counters.store_refusals += 1;
                    match why {
                        Refusal::Pinned => self.counters.refused_pinned += 1,
                        Refusal::NoPages => self.counters.refused_no_pages += 1,
                    }
                    continue;
                }
            };
            let state = if fill { State::Filling } else { State::Writing };
            let id = self.insert_entry(*key, class, page, state, parent_key);
            self.entry_mut(id).on_disk = fill;
            plans.push(StorePlan::Write {
                entry: id,
                offset: self.pool.offset(class, page),
            });
        }
        plans
    }

    /// Indexes a new entry for `key` in `page`, pinned once (until its bytes are there), as the
    /// child of `parent_key` when that is known.
    pub(super) fn insert_entry(
        &mut self,
        key: Key,
        class: ClassId,
        page: Page,
        state: State,
        parent_key: Option<Key>,
    ) -> EntryId {
        let id = self.free_ids.pop().unwrap_or_else(|| {
            self.entries.push(None);
            (self.entries.len() - 1) as EntryId
        });
        self.entries[id as usize] = Some(Entry {
            key,
            class,
            page,
            state,
            pins: 1,
            used: 0,
            hold: None,
            on_disk: false,
        });
        self.policies[class.0 as usize].created(id, key.digest());
        if self.hints.asked(&key) {
            self.policies[class.0 as usize].asked(id);
        }
        let parent = parent_key.map(|pk| (pk, self.map.get(&pk).copied()));
        let bytes = self.pool.page_bytes(class);
        let (entries, policies) = (&self.entries, &mut self.policies);
        self.tree.insert(id, key, parent, bytes, &mut |n, leaf| {
            set_leaf(entries, policies, n, leaf)
        });
        if let Some((_, Some(p))) = parent {
            self.policies[class.0 as usize].inherit(id, p);
        }
        self.page_owner.insert(page, id);
        self.pinned_pages += 1;
        if self.map.insert(key, id).is_none() {
            if let Some(p) = &self.presence {
                p.add(&key);
            }
        }
        id
    }

    /// Forgets `n` store refusals of an attempt that is being retried (a store waiting for the
    /// growing pool), so that the count is of stores refused, not of attempts. Such refusals
    /// are for want of a free page.
    pub fn forget_refusals(&mut self, n: u64) {
        self.counters.store_refusals = self.counters.store_refusals.saturating_sub(n);
        self.counters.refused_no_pages = self.counters.refused_no_pages.saturating_sub(n);
    }

    /// Ends a store's copy or a fill: the entries become hits, or on failure are dropped (a
    /// filled chunk a lookup pinned meanwhile leaves the index now and frees its page when
    /// the lookup's pin goes).
    pub fn finish_store(&mut self, entries: &[EntryId], ok: bool) {
        for &id in entries {
            if ok {
                self.entry_mut(id).state = State::Ready;
                self.unpin(id);
            } else {
                let e = self.entry_mut(id);
                e.pins -= 1;
                if e.pins > 0 {
                    self.unindex(id);
                    self.entry_mut(id).state = State::Failed;
                    continue;
                }
                self.pinned_pages -= 1;
                self.remove(id);
            }
        }
    }
}
