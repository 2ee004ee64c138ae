//! Eviction policies. A policy sees only entries that may be evicted: the cache removes an
//! entry from its policy while it is pinned (looked up, or in a copy) and puts it back when the
//! last pin goes, so choosing a victim is O(1) and can never pick a pinned page.
//!
//! Besides LRU and FIFO there is S3-FIFO (Yang et al., "FIFO queues are all you need for cache
//! eviction", SOSP 2023): new chunks enter a small FIFO holding about a tenth of the entries;
//! one read while there promotes a chunk to the main FIFO, which gives read chunks another lap
//! (a two-bit counter, as in CLOCK); chunks leaving the small FIFO unread are remembered in a
//! ghost FIFO of key digests, and a chunk stored again while remembered goes straight to main.
//! Chunks written once and never read again, like the tail of a conversation that ended, so
//! leave early without pushing out chunks that are read again and again.
//!
//! `prefix` knows the prefix structure (the cache tells it which entries are leaves of the
//! prefix tree, [`EvictionPolicy::set_leaf`]): it evicts the least recently used leaf, so a
//! prefix loses its tail before its head and no eviction leaves a stored chunk unreachable
//! while a leaf could go instead (`evict/prefix.rs`). `prefix-reuse` takes leaves too, but the
//! one whose next read is predicted furthest away (by its last reuse distance), which resists
//! the loop of many conversations each re-reading its context (`evict/reuse.rs`).

use std::str::FromStr;

mod prefix;
mod reuse;
mod s3fifo;

use prefix::PrefixLru;
use reuse::PrefixReuse;
use s3fifo::S3Fifo;

/// Index of an entry in the cache's entry table.
pub type EntryId = u32;

/// Chooses which unpinned entry to evict.
pub trait EvictionPolicy: Send + std::fmt::Debug {
    /// The entry may now be evicted (just stored, or its last pin went).
    fn insert(&mut self, id: EntryId);
    /// The entry was read (a lookup hit).
    fn touch(&mut self, id: EntryId);
    /// The entry may no longer be evicted (pinned); it may come back with `insert`.
    fn remove(&mut self, id: EntryId);
    /// A new entry for the key with digest `key` was made with id `id` (it is pinned while its
    /// store runs, and inserted when it ends).
    fn created(&mut self, id: EntryId, key: u64) {
        let _ = (id, key);
    }
    /// The entry is gone from the cache (evicted or dropped); its id may be reused for another
    /// key. `key` is its key's digest, for policies that remember evicted keys.
    fn forget(&mut self, id: EntryId, key: u64) {
        let _ = key;
        self.remove(id);
    }
    /// Whether the entry has no successor held in the prefix tree (the cache says so when an
    /// entry is created and whenever it changes, pinned or not). Policies that ignore prefix
    /// structure ignore it.
    fn set_leaf(&mut self, id: EntryId, leaf: bool) {
        let _ = (id, leaf);
    }
    /// The new entry `id` continues the prefix of the held entry `parent` (told just after
    /// `created`).
    fn inherit(&mut self, id: EntryId, parent: EntryId) {
        let _ = (id, parent);
    }
    /// A lookup asked for the new entry `id`'s chunk before it was stored (told just after
    /// `created`): its client reads by lookup, so it is likely asked for again.
    fn asked(&mut self, id: EntryId) {
        let _ = id;
    }
    /// Whether the entry, the next victim, is likely to be read again: the disk tier writes only
    /// such victims (its admission). Policies that predict nothing say yes.
    fn likely_read_again(&self, id: EntryId) -> bool {
        let _ = id;
        true
    }
    /// The next victim, left in place (the cache weighs it against other classes' victims
    /// before it removes one).
    fn peek_victim(&self) -> Option<EntryId>;
    /// Entries the policy holds.
    fn len(&self) -> usize;
    /// Whether the policy holds none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The policies `--eviction` can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least recently used.
    Lru,
    /// First in, first out (reads do not refresh).
    Fifo,
    /// S3-FIFO: a small probationary FIFO, a main FIFO with reinsertion, a ghost FIFO.
    S3Fifo,
    /// Prefix-aware LRU: the least recently used leaf of the prefix tree first.
    Prefix,
    /// Prefix-aware with reuse distances: an overdue leaf, else the leaf whose next read is
    /// predicted furthest away.
    PrefixReuse,
}

impl PolicyKind {
    /// Accepted names.
    pub const NAMES: &'static [&'static str] = &["lru", "fifo", "s3fifo", "prefix", "prefix-reuse"];

    /// A new empty policy of this kind.
    pub fn build(self) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru | PolicyKind::Fifo => Box::new(ListPolicy {
                list: LinkedList::default(),
                refresh_on_touch: self == PolicyKind::Lru,
            }),
            PolicyKind::S3Fifo => Box::new(S3Fifo::default()),
            PolicyKind::Prefix => Box::new(PrefixLru::default()),
            PolicyKind::PrefixReuse => Box::new(PrefixReuse::default()),
        }
    }
}

impl FromStr for PolicyKind {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s.to_ascii_lowercase().as_str() {
            "lru" => Ok(PolicyKind::Lru),
            "fifo" => Ok(PolicyKind::Fifo),
            "s3fifo" | "s3-fifo" => Ok(PolicyKind::S3Fifo),
            "prefix" | "prefix-lru" => Ok(PolicyKind::Prefix),
            "prefix-reuse" | "reuse" => Ok(PolicyKind::PrefixReuse),
            _ => Err(()),
        }
    }
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    linked: bool,
}

/// An intrusive doubly linked list over entry ids: head is the newest, tail the oldest.
#[derive(Debug)]
pub(crate) struct LinkedList {
    links: Vec<Link>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for LinkedList {
    fn default() -> Self {
        LinkedList {
            links: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl LinkedList {
    /// The oldest entry, if any.
    pub(crate) fn oldest(&self) -> Option<EntryId> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// Entries in the list.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, id: EntryId) -> bool {
        self.links.get(id as usize).is_some_and(|l| l.linked)
    }

    pub(crate) fn push_front(&mut self, id: EntryId) {
        let i = id as usize;
        if self.links.len() <= i {
            self.links.resize(
                i + 1,
                Link {
                    prev: NIL,
                    next: NIL,
                    linked: false,
                },
            );
        }
        debug_assert!(!self.links[i].linked);
        self.links[i] = Link {
            prev: NIL,
            next: self.head,
            linked: true,
        };
        if self.head != NIL {
            self.links[self.head as usize].prev = id;
        } else {
            self.tail = id;
        }
        self.head = id;
        self.len += 1;
    }

    pub(crate) fn unlink(&mut self, id: EntryId) -> bool {
        if !self.contains(id) {
            return false;
        }
        let Link { prev, next, .. } = self.links[id as usize];
        if prev != NIL {
            self.links[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.links[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
        self.links[id as usize].linked = false;
        self.len -= 1;
        true
    }
}

/// LRU (reads move an entry to the front) or FIFO (they do not).
#[derive(Debug)]
struct ListPolicy {
    list: LinkedList,
    refresh_on_touch: bool,
}

impl EvictionPolicy for ListPolicy {
    fn insert(&mut self, id: EntryId) {
        if !self.list.contains(id) {
            self.list.push_front(id);
        }
    }

    fn touch(&mut self, id: EntryId) {
        if self.refresh_on_touch && self.list.unlink(id) {
            self.list.push_front(id);
        }
    }

    fn remove(&mut self, id: EntryId) {
        self.list.unlink(id);
    }

    fn peek_victim(&self) -> Option<EntryId> {
        (self.list.tail != NIL).then_some(self.list.tail)
    }

    fn len(&self) -> usize {
        self.list.len
    }
}

#[cfg(test)]
mod tests;
