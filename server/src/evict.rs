//! Eviction policies. A policy sees only entries that may be evicted: the cache removes an
//! entry from its policy while it is pinned (looked up, or in a copy) and puts it back when the
//! last pin goes, so choosing a victim is O(1) and can never pick a pinned page.

use std::str::FromStr;

/// Index of an entry in the cache's entry table.
pub type EntryId = u32;

/// Chooses which unpinned entry to evict.
pub trait EvictionPolicy: Send + std::fmt::Debug {
    /// The entry may now be evicted (just stored, or its last pin went).
    fn insert(&mut self, id: EntryId);
    /// The entry was read (a lookup hit).
    fn touch(&mut self, id: EntryId);
    /// The entry may no longer be evicted (pinned) or is gone.
    fn remove(&mut self, id: EntryId);
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
}

impl PolicyKind {
    /// Accepted names.
    pub const NAMES: &'static [&'static str] = &["lru", "fifo"];

    /// A new empty policy of this kind.
    pub fn build(self) -> Box<dyn EvictionPolicy> {
        Box::new(ListPolicy {
            list: LinkedList::default(),
            refresh_on_touch: self == PolicyKind::Lru,
        })
    }
}

impl FromStr for PolicyKind {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s.to_ascii_lowercase().as_str() {
            "lru" => Ok(PolicyKind::Lru),
            "fifo" => Ok(PolicyKind::Fifo),
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
struct LinkedList {
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
    fn contains(&self, id: EntryId) -> bool {
        self.links.get(id as usize).is_some_and(|l| l.linked)
    }

    fn push_front(&mut self, id: EntryId) {
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

    fn unlink(&mut self, id: EntryId) -> bool {
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Takes the next victim out, as the cache does when it evicts it.
    fn pop_victim(p: &mut Box<dyn EvictionPolicy>) -> Option<EntryId> {
        let v = p.peek_victim()?;
        p.remove(v);
        Some(v)
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut p = PolicyKind::Lru.build();
        for id in [1, 2, 3] {
            p.insert(id);
        }
        p.touch(1);
        assert_eq!(pop_victim(&mut p), Some(2));
        p.remove(3);
        assert_eq!(pop_victim(&mut p), Some(1));
        assert_eq!(pop_victim(&mut p), None);
    }

    #[test]
    fn fifo_ignores_reads() {
        let mut p = PolicyKind::Fifo.build();
        for id in [5, 6] {
            p.insert(id);
        }
        p.touch(5);
        assert_eq!(pop_victim(&mut p), Some(5));
    }

    #[test]
    fn names_parse() {
        assert_eq!("LRU".parse(), Ok(PolicyKind::Lru));
        assert_eq!("fifo".parse(), Ok(PolicyKind::Fifo));
        assert!("arc".parse::<PolicyKind>().is_err());
    }

    proptest! {
        /// Against a model: the victim is always the oldest (FIFO) or least recently touched
        /// (LRU) entry among those inserted and not removed.
        #[test]
        fn matches_a_model(lru in any::<bool>(), ops in proptest::collection::vec((0u8..4, 0u32..16), 0..200)) {
            let kind = if lru { PolicyKind::Lru } else { PolicyKind::Fifo };
            let mut p = kind.build();
            let mut model: Vec<u32> = Vec::new(); // front = newest
            for (op, id) in ops {
                match op {
                    0 => if !model.contains(&id) { model.insert(0, id); p.insert(id); },
                    1 => {
                        p.touch(id);
                        if lru {
                            if let Some(pos) = model.iter().position(|&x| x == id) {
                                model.remove(pos);
                                model.insert(0, id);
                            }
                        }
                    }
                    2 => { p.remove(id); model.retain(|&x| x != id); }
                    _ => { prop_assert_eq!(pop_victim(&mut p), model.pop()); }
                }
                prop_assert_eq!(p.len(), model.len());
            }
        }
    }
}
