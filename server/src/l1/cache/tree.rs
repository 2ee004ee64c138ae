//! The prefix structure of what is stored: each chunk's parent is the chunk before it in its
//! prompt (keys are chained, so a chunk has one parent). A lookup stops at the first chunk that
//! is not held, so a chunk is worth its page only while every chunk before it is held: it is
//! *reachable*. This tree lets eviction take a prefix's tail before its head (leaves first) and
//! counts what is stored but unreachable.
//!
//! Links are intrusive over entry ids: a parent's children form a doubly linked sibling list,
//! so linking and unlinking are O(1). A chunk whose parent key is known but not held is an
//! orphan: it waits in a list under that key and is adopted when the key is stored again (the
//! next turn of a conversation often stores exactly the chunk that was missing). Making a
//! subtree reachable or unreachable walks it, pruned at nodes already in that state; each walk
//! follows a store or an eviction that touched the subtree's root.
//!
//! Parents come from two places: the chunk before each one in a store request, and, for the
//! first chunk of a store, the lookup that preceded it (see [`super::Cache::lookup`]).

use std::collections::HashMap;

use super::Key;
use crate::l1::evict::EntryId;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    live: bool,
    parent: u32,
    first_child: u32,
    next: u32,
    prev: u32,
    /// The parent's key, when known.
    parent_key: Option<Key>,
    reachable: bool,
    bytes: u64,
}

const EMPTY: Node = Node {
    live: false,
    parent: NIL,
    first_child: NIL,
    next: NIL,
    prev: NIL,
    parent_key: None,
    reachable: true,
    bytes: 0,
};

/// Parent links, leaf status and reachability of every entry; see the module header.
#[derive(Debug, Default)]
pub(crate) struct PrefixTree {
    nodes: Vec<Node>,
    /// Heads of the lists of chunks waiting for a parent key that is not held.
    orphans: HashMap<Key, EntryId>,
    unreachable_chunks: u64,
    unreachable_bytes: u64,
}

impl PrefixTree {
    /// Chunks held whose prefix is broken (some chunk before them is not held).
    pub(crate) fn unreachable_chunks(&self) -> u64 {
        self.unreachable_chunks
    }

    /// Their bytes.
    pub(crate) fn unreachable_bytes(&self) -> u64 {
        self.unreachable_bytes
    }

    /// Whether `id` has no child held.
    pub(crate) fn is_leaf(&self, id: EntryId) -> bool {
        self.nodes[id as usize].first_child == NIL
    }

    /// Whether `id`'s parent key is known.
    pub(crate) fn has_parent_key(&self, id: EntryId) -> bool {
        self.nodes[id as usize].parent_key.is_some()
    }

    /// A new entry `id` for `key`; `parent` is its parent's key and entry, when known (the
    /// entry is `None` when that key is not held). Adopts the orphans waiting for `key`.
    /// `on_leaf` hears every entry whose leaf status is set or changes, `id` included.
    pub(crate) fn insert(
        &mut self,
        id: EntryId,
        key: Key,
        parent: Option<(Key, Option<EntryId>)>,
        bytes: u64,
        on_leaf: &mut impl FnMut(EntryId, bool),
    ) {
        let i = id as usize;
        if self.nodes.len() <= i {
            self.nodes.resize(i + 1, EMPTY);
        }
        debug_assert!(!self.nodes[i].live);
        // A chunk named as its own parent (a client repeating a hash) is a root.
        let parent = parent.filter(|(pk, _)| *pk != key);
        self.nodes[i] = Node {
            live: true,
            parent_key: parent.map(|(k, _)| k),
            bytes,
            ..EMPTY
        };
        match parent {
            Some((_, Some(p))) => self.attach(id, p, on_leaf),
            Some((pk, None)) => {
                let head = self.orphans.get(&pk).copied().unwrap_or(NIL);
                self.push(id, head);
                self.orphans.insert(pk, id);
                self.nodes[i].reachable = false;
                self.count(id, true);
            }
            None => {}
        }
        if let Some(head) = self.orphans.remove(&key) {
            self.nodes[i].first_child = head;
            let reachable = self.nodes[i].reachable;
            let mut c = head;
            while c != NIL {
                self.nodes[c as usize].parent = id;
                let next = self.nodes[c as usize].next;
                self.set_reachable(c, reachable);
                c = next;
            }
        }
        on_leaf(id, self.is_leaf(id));
    }

    /// Gives root `id` (no parent key yet) the parent `parent` (held, with key `parent_key`),
    /// as learnt from a lookup naming them in order.
    pub(crate) fn link(
        &mut self,
        id: EntryId,
        parent_key: Key,
        parent: EntryId,
        on_leaf: &mut impl FnMut(EntryId, bool),
    ) {
        if id == parent || self.nodes[id as usize].parent_key.is_some() {
            return;
        }
        self.nodes[id as usize].parent_key = Some(parent_key);
        self.attach(id, parent, on_leaf);
    }

    /// Makes `id` (in no list) a child of the held `p` and takes `p`'s reachability.
    fn attach(&mut self, id: EntryId, p: EntryId, on_leaf: &mut impl FnMut(EntryId, bool)) {
        let was_leaf = self.is_leaf(p);
        let head = self.nodes[p as usize].first_child;
        self.push(id, head);
        self.nodes[p as usize].first_child = id;
        self.nodes[id as usize].parent = p;
        if was_leaf {
            on_leaf(p, false);
        }
        let reachable = self.nodes[p as usize].reachable;
        self.set_reachable(id, reachable);
    }

    /// The entry `id` for `key` is gone: its children become orphans waiting for `key`.
    pub(crate) fn remove(
        &mut self,
        id: EntryId,
        key: &Key,
        on_leaf: &mut impl FnMut(EntryId, bool),
    ) {
        let i = id as usize;
        let head = self.nodes[i].first_child;
        if head != NIL {
            let mut c = head;
            while c != NIL {
                self.nodes[c as usize].parent = NIL;
                let next = self.nodes[c as usize].next;
                self.set_reachable(c, false);
                c = next;
            }
            self.nodes[i].first_child = NIL;
            self.orphans.insert(*key, head);
        }
        let p = self.nodes[i].parent;
        self.unlink(id);
        if p != NIL && self.is_leaf(p) {
            on_leaf(p, true);
        }
        if !self.nodes[i].reachable {
            self.count(id, false);
        }
        self.nodes[i] = EMPTY;
    }

    fn push(&mut self, id: EntryId, head: EntryId) {
        let n = &mut self.nodes[id as usize];
        n.next = head;
        n.prev = NIL;
        if head != NIL {
            self.nodes[head as usize].prev = id;
        }
    }

    /// Takes `id` out of its sibling list (its parent's children, or the orphans of its parent
    /// key), if it is in one.
    fn unlink(&mut self, id: EntryId) {
        let Node {
            prev,
            next,
            parent,
            parent_key,
            ..
        } = self.nodes[id as usize];
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else if parent != NIL {
            if self.nodes[parent as usize].first_child == id {
                self.nodes[parent as usize].first_child = next;
            }
        } else if let Some(pk) = parent_key {
            if self.orphans.get(&pk) == Some(&id) {
                if next != NIL {
                    self.orphans.insert(pk, next);
                } else {
                    self.orphans.remove(&pk);
                }
            }
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        }
        let n = &mut self.nodes[id as usize];
        n.prev = NIL;
        n.next = NIL;
        n.parent = NIL;
    }

    /// Sets the reachability of `root`'s subtree, walking it where it changes.
    fn set_reachable(&mut self, root: EntryId, reachable: bool) {
        let mut stack = vec![root];
        while let Some(n) = stack.pop() {
            if self.nodes[n as usize].reachable == reachable {
                continue;
            }
            self.nodes[n as usize].reachable = reachable;
            self.count(n, !reachable);
            let mut c = self.nodes[n as usize].first_child;
            while c != NIL {
                stack.push(c);
                c = self.nodes[c as usize].next;
            }
        }
    }

    fn count(&mut self, id: EntryId, unreachable: bool) {
        let bytes = self.nodes[id as usize].bytes;
        if unreachable {
            self.unreachable_chunks += 1;
            self.unreachable_bytes += bytes;
        } else {
            self.unreachable_chunks -= 1;
            self.unreachable_bytes -= bytes;
        }
    }

    /// Checks the links and counts against the live entries' keys; for tests.
    #[cfg(test)]
    pub(crate) fn check(&self, live: &HashMap<Key, EntryId>) {
        let mut unreachable = 0;
        let mut children = 0usize;
        for (i, n) in self.nodes.iter().enumerate() {
            if !n.live {
                continue;
            }
            let id = i as EntryId;
            if !n.reachable {
                unreachable += 1;
            }
            if n.parent != NIL {
                assert!(self.nodes[n.parent as usize].live, "{id}'s parent is gone");
                assert_eq!(live.get(&n.parent_key.unwrap()), Some(&n.parent));
                assert_eq!(n.reachable, self.nodes[n.parent as usize].reachable);
            } else if let Some(pk) = n.parent_key {
                assert!(!n.reachable, "{id}: an orphan counted reachable");
                assert!(
                    !live.contains_key(&pk),
                    "{id}: an orphan whose parent is held"
                );
            } else {
                assert!(n.reachable, "{id}: a root counted unreachable");
            }
            let mut c = n.first_child;
            while c != NIL {
                assert_eq!(self.nodes[c as usize].parent, id);
                children += 1;
                c = self.nodes[c as usize].next;
            }
        }
        let mut waiting = 0usize;
        for (pk, &head) in &self.orphans {
            let mut c = head;
            while c != NIL {
                let n = &self.nodes[c as usize];
                assert!(n.live && n.parent == NIL && n.parent_key == Some(*pk));
                waiting += 1;
                c = n.next;
            }
        }
        let parented = self
            .nodes
            .iter()
            .filter(|n| n.live && n.parent_key.is_some())
            .count();
        assert_eq!(
            children + waiting,
            parented,
            "every parented entry in one list"
        );
        assert_eq!(self.unreachable_chunks, unreachable);
    }
}
