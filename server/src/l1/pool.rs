//! Page allocation in the L1 pool: where bytes live, not what they mean.
//!
//! The pool is cut into equal slabs, one per pinned piece of its [`PoolLayout`], so a page
//! never spans two pinned registrations. A page holds one chunk of one KV shard, so its size comes
//! from the geometry a worker registers; each page size is a class, and a class takes whole slabs
//! and cuts them into pages. Several models (or a model and its MLA variant) can share one kvd
//! this way, and allocation and free are O(1): a class keeps the slabs that have a free page, a
//! slab keeps a stack of returned pages and a count of never-used ones, and an empty slab goes
//! back to the pool for any class.
//!
//! A large pool becomes usable in steps, lowest slabs first, as the server populates and pins
//! them in the background: [`PagePool::growing`] starts with no slab and
//! [`PagePool::grow_to`] hands over slabs once they are pinned. Only those slabs ever give out
//! pages, so no copy can be planned into memory that is not pinned yet (the model-based test
//! `pages_come_only_from_ready_slabs` checks it).
//!
//! On a machine with several NUMA nodes each slab has a home (the node whose memory backs it,
//! set once with [`PagePool::set_homes`]); free slabs and a class's slabs with room are kept per
//! home, and [`PagePool::alloc_near`] takes a page at the requester's home first, then anywhere.
//! With one home (one node) this is the plain allocator above.

use std::collections::HashMap;

use kvd_gpu::PoolLayout;

/// A class of pages of one size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClassId(pub u16);

/// A slab's home: an index into the NUMA placement (0 where there is one node).
pub type Home = u16;

/// A page: a slab and an index in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Page {
    /// Slab number.
    pub slab: u32,
    /// Page number inside the slab.
    pub index: u32,
}

#[derive(Debug, Clone)]
struct Slab {
    class: Option<ClassId>,
    home: Home,
    used: u32,
    /// Pages returned to this slab.
    returned: Vec<u32>,
    /// Pages never handed out: `fresh..pages_per_slab`.
    fresh: u32,
    /// Position in its class's `partial` list, when it has a free page.
    partial_pos: Option<usize>,
}

#[derive(Debug, Clone)]
struct Class {
    page_bytes: u64,
    pages_per_slab: u32,
    /// Slabs of this class with at least one free page, by home.
    partial: Vec<Vec<u32>>,
    slabs: u32,
    used_pages: u64,
}

/// Why a class could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassError {
    /// Page larger than a slab.
    #[error(
        "a page of {page_bytes} bytes (one chunk of one KV shard) is larger than the pool's \
         {slab_bytes}-byte slabs; lower --chunk-tokens or raise --slab-mb"
    )]
    PageTooLarge {
        /// Requested page size.
        page_bytes: u64,
        /// Slab size.
        slab_bytes: u64,
    },
    /// Zero-sized page.
    #[error("a page of 0 bytes makes no sense; the registered geometry is empty")]
    Empty,
    /// Too many classes.
    #[error("too many distinct page sizes (65535)")]
    TooMany,
}

/// Byte accounting, for metrics and invariant checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Bytes in pages handed out.
    pub used_bytes: u64,
    /// Bytes that can still become pages: free slabs and free pages of owned slabs.
    pub free_bytes: u64,
    /// Bytes at the end of owned slabs that no page of their class fits in.
    pub slack_bytes: u64,
}

/// The page allocator.
#[derive(Debug)]
pub struct PagePool {
    slab_bytes: u64,
    /// Slabs `0..ready_slabs` are pinned and belong to the allocator; the rest are not yet.
    ready_slabs: u32,
    slabs: Vec<Slab>,
    /// Usable slabs owned by no class, by home.
    free_slabs: Vec<Vec<u32>>,
    classes: Vec<Class>,
    class_by_size: HashMap<u64, ClassId>,
}

impl PagePool {
    /// A pool cut into slabs along `layout`'s pinned pieces, one slab per piece, all usable.
    pub fn new(layout: &PoolLayout) -> Self {
        let mut pool = Self::growing(layout);
        pool.grow_to(layout.pieces());
        pool
    }

    /// Like [`PagePool::new`], but with no usable slab until [`PagePool::grow_to`] hands some
    /// over.
    pub fn growing(layout: &PoolLayout) -> Self {
        let n = layout.pieces();
        PagePool {
            slab_bytes: layout.piece_bytes(),
            ready_slabs: 0,
            slabs: (0..n)
                .map(|_| Slab {
                    class: None,
                    home: 0,
                    used: 0,
                    returned: Vec::new(),
                    fresh: 0,
                    partial_pos: None,
                })
                .collect(),
            free_slabs: vec![Vec::with_capacity(n as usize)],
            classes: Vec::new(),
            class_by_size: HashMap::new(),
        }
    }

    /// Makes slabs `0..slabs` usable (those already usable stay as they are). The caller
    /// guarantees they are populated and pinned.
    pub fn grow_to(&mut self, slabs: u32) {
        let slabs = slabs.min(self.slabs.len() as u32);
        if slabs <= self.ready_slabs {
            return;
        }
        // Popped from the end: the lowest new slab is handed out first.
        for s in (self.ready_slabs..slabs).rev() {
            let home = self.slabs[s as usize].home as usize;
            self.free_slabs[home].push(s);
        }
        self.ready_slabs = slabs;
    }

    /// Gives each slab the home `home_of(slab)` (below `homes`). Only before any slab is
    /// usable: a home says where the memory was placed, and placement happens before the first
    /// touch.
    pub fn set_homes(&mut self, homes: Home, home_of: impl Fn(u32) -> Home) {
        assert_eq!(self.ready_slabs, 0, "homes are set before the pool grows");
        let homes = homes.max(1);
        for (i, slab) in self.slabs.iter_mut().enumerate() {
            slab.home = home_of(i as u32).min(homes - 1);
        }
        self.free_slabs = vec![Vec::new(); homes as usize];
        for class in &mut self.classes {
            class.partial = vec![Vec::new(); homes as usize];
        }
    }

    /// Number of homes.
    pub fn homes(&self) -> Home {
        self.free_slabs.len() as Home
    }

    /// The home of a slab.
    pub fn slab_home(&self, slab: u32) -> Home {
        self.slabs[slab as usize].home
    }

    /// Slabs usable so far.
    pub fn ready_slabs(&self) -> u32 {
        self.ready_slabs
    }

    /// Bytes of the whole pool, usable or not yet.
    pub fn total_bytes(&self) -> u64 {
        self.slabs.len() as u64 * self.slab_bytes
    }

    /// Slab size in bytes.
    pub fn slab_bytes(&self) -> u64 {
        self.slab_bytes
    }

    /// Bytes the usable slabs cover.
    pub fn capacity_bytes(&self) -> u64 {
        self.ready_slabs as u64 * self.slab_bytes
    }

    /// The class for pages of `page_bytes`, made on first use.
    pub fn class_for(&mut self, page_bytes: u64) -> Result<ClassId, ClassError> {
        if page_bytes == 0 {
            return Err(ClassError::Empty);
        }
        if page_bytes > self.slab_bytes {
            return Err(ClassError::PageTooLarge {
                page_bytes,
                slab_bytes: self.slab_bytes,
            });
        }
        if let Some(&id) = self.class_by_size.get(&page_bytes) {
            return Ok(id);
        }
        let id = ClassId(u16::try_from(self.classes.len()).map_err(|_| ClassError::TooMany)?);
        self.classes.push(Class {
            page_bytes,
            pages_per_slab: u32::try_from(self.slab_bytes / page_bytes).unwrap_or(u32::MAX),
            partial: vec![Vec::new(); self.free_slabs.len()],
            slabs: 0,
            used_pages: 0,
        });
        self.class_by_size.insert(page_bytes, id);
        Ok(id)
    }

    /// Page size of a class.
    pub fn page_bytes(&self, class: ClassId) -> u64 {
        self.classes[class.0 as usize].page_bytes
    }

    /// Number of classes made so far.
    pub fn class_count(&self) -> usize {
        self.classes.len()
    }

    /// Byte offset of a page in the pool.
    pub fn offset(&self, class: ClassId, page: Page) -> u64 {
        page.slab as u64 * self.slab_bytes + page.index as u64 * self.page_bytes(class)
    }

    /// The class owning a slab, if any.
    pub fn slab_class(&self, slab: u32) -> Option<ClassId> {
        self.slabs
            .get(slab as usize)
            .filter(|_| slab < self.ready_slabs)
            .and_then(|s| s.class)
    }

    /// Pages of a class in one slab.
    pub fn pages_per_slab(&self, class: ClassId) -> u32 {
        self.classes[class.0 as usize].pages_per_slab
    }

    /// Slabs owned by a class.
    pub fn class_slabs(&self, class: ClassId) -> u32 {
        self.classes[class.0 as usize].slabs
    }

    /// Whether `alloc(class)` would succeed without eviction.
    pub fn can_alloc(&self, class: ClassId) -> bool {
        self.classes[class.0 as usize]
            .partial
            .iter()
            .any(|l| !l.is_empty())
            || self.free_slabs.iter().any(|l| !l.is_empty())
    }

    /// The slab to take a page of `class` from: one of the class's slabs with room at `near`,
    /// else a free slab at `near`, else the same anywhere else (a slab with room first, so free
    /// slabs stay free for other classes). `None` for no preference.
    fn pick_slab(&self, class: ClassId, near: Option<Home>) -> Option<(u32, bool)> {
        let c = &self.classes[class.0 as usize];
        if let Some(h) = near.map(usize::from).filter(|&h| h < self.free_slabs.len()) {
            if let Some(&s) = c.partial[h].last() {
                return Some((s, false));
            }
            if let Some(&s) = self.free_slabs[h].last() {
                return Some((s, true));
            }
        }
        if let Some(&s) = c.partial.iter().find_map(|l| l.last()) {
            return Some((s, false));
        }
        self.free_slabs
            .iter()
            .find_map(|l| l.last())
            .map(|&s| (s, true))
    }

    /// Takes a free page of `class`, or `None` when neither the class nor the pool has room.
    pub fn alloc(&mut self, class: ClassId) -> Option<Page> {
        self.alloc_near(class, None)
    }

    /// Like [`PagePool::alloc`], taking the page at home `near` when that home has room.
    pub fn alloc_near(&mut self, class: ClassId, near: Option<Home>) -> Option<Page> {
        let c = class.0 as usize;
        let slab_no = match self.pick_slab(class, near)? {
            (s, false) => s,
            (s, true) => {
                let home = self.slabs[s as usize].home as usize;
                let popped = self.free_slabs[home].pop();
                debug_assert_eq!(popped, Some(s));
                let slab = &mut self.slabs[s as usize];
                slab.class = Some(class);
                slab.used = 0;
                slab.fresh = 0;
                slab.returned.clear();
                self.classes[c].slabs += 1;
                self.push_partial(class, s);
                s
            }
        };
        let pages_per_slab = self.classes[c].pages_per_slab;
        let slab = &mut self.slabs[slab_no as usize];
        let index = match slab.returned.pop() {
            Some(i) => i,
            None => {
                let i = slab.fresh;
                slab.fresh += 1;
                i
            }
        };
        slab.used += 1;
        let full = slab.returned.is_empty() && slab.fresh == pages_per_slab;
        self.classes[c].used_pages += 1;
        if full {
            self.remove_partial(class, slab_no);
        }
        Some(Page {
            slab: slab_no,
            index,
        })
    }

    /// Returns a page. Freeing a page that is not allocated is a bug in the caller and panics
    /// in debug builds; release builds ignore it and log.
    pub fn free(&mut self, class: ClassId, page: Page) {
        let c = class.0 as usize;
        let pages_per_slab = self.classes[c].pages_per_slab;
        let Some(slab) = self
            .slabs
            .get_mut(page.slab as usize)
            .filter(|_| page.slab < self.ready_slabs)
        else {
            debug_assert!(false, "free of a page outside the pool: {page:?}");
            tracing::error!(?page, "free of a page outside the pool ignored");
            return;
        };
        if slab.class != Some(class) || page.index >= slab.fresh || slab.used == 0 {
            debug_assert!(false, "free of a page that is not allocated: {page:?}");
            tracing::error!(?page, "free of a page that is not allocated ignored");
            return;
        }
        let was_full = slab.partial_pos.is_none();
        slab.returned.push(page.index);
        slab.used -= 1;
        let now_empty = slab.used == 0;
        self.classes[c].used_pages -= 1;
        if was_full && pages_per_slab > 0 {
            self.push_partial(class, page.slab);
        }
        if now_empty {
            self.remove_partial(class, page.slab);
            let slab = &mut self.slabs[page.slab as usize];
            slab.class = None;
            slab.returned = Vec::new();
            slab.fresh = 0;
            self.classes[c].slabs -= 1;
            let home = slab.home as usize;
            self.free_slabs[home].push(page.slab);
        }
    }

    fn push_partial(&mut self, class: ClassId, slab: u32) {
        let home = self.slabs[slab as usize].home as usize;
        let list = &mut self.classes[class.0 as usize].partial[home];
        self.slabs[slab as usize].partial_pos = Some(list.len());
        list.push(slab);
    }

    fn remove_partial(&mut self, class: ClassId, slab: u32) {
        let Some(pos) = self.slabs[slab as usize].partial_pos.take() else {
            return;
        };
        let home = self.slabs[slab as usize].home as usize;
        let list = &mut self.classes[class.0 as usize].partial[home];
        list.swap_remove(pos);
        if let Some(&moved) = list.get(pos) {
            self.slabs[moved as usize].partial_pos = Some(pos);
        }
    }

    /// Bytes used, free and lost to slab tails.
    pub fn usage(&self) -> Usage {
        let mut u = Usage {
            free_bytes: self.free_slabs.iter().map(Vec::len).sum::<usize>() as u64
                * self.slab_bytes,
            ..Usage::default()
        };
        for class in &self.classes {
            let page_bytes = class.page_bytes;
            u.used_bytes += class.used_pages * page_bytes;
            u.free_bytes +=
                (class.slabs as u64 * class.pages_per_slab as u64 - class.used_pages) * page_bytes;
            u.slack_bytes +=
                class.slabs as u64 * (self.slab_bytes - class.pages_per_slab as u64 * page_bytes);
        }
        u
    }

    /// Pages handed out, over all classes.
    pub fn used_pages(&self) -> u64 {
        self.classes.iter().map(|c| c.used_pages).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn one_class_fills_then_refuses_then_recovers() {
        let mut pool = PagePool::new(&PoolLayout::new(4 * 1024, 1024).unwrap());
        let class = pool.class_for(256).unwrap();
        let pages: Vec<Page> = (0..16).map(|_| pool.alloc(class).unwrap()).collect();
        assert_eq!(pool.alloc(class), None);
        let offsets: HashSet<u64> = pages.iter().map(|&p| pool.offset(class, p)).collect();
        assert_eq!(offsets.len(), 16);
        assert!(offsets.iter().all(|&o| o % 256 == 0 && o < 4096));
        pool.free(class, pages[5]);
        assert_eq!(pool.alloc(class), Some(pages[5]));
        for p in pages {
            pool.free(class, p);
        }
        assert_eq!(
            pool.usage(),
            Usage {
                used_bytes: 0,
                free_bytes: 4096,
                slack_bytes: 0
            }
        );
    }

    #[test]
    fn empty_slabs_move_between_classes() {
        let mut pool = PagePool::new(&PoolLayout::new(2 * 1000, 1000).unwrap());
        let a = pool.class_for(300).unwrap();
        let b = pool.class_for(500).unwrap();
        let a_pages: Vec<Page> = (0..6).map(|_| pool.alloc(a).unwrap()).collect();
        assert_eq!(pool.alloc(b), None, "class a holds both slabs");
        assert_eq!(pool.usage().slack_bytes, 200);
        for p in &a_pages[..3] {
            pool.free(a, *p);
        }
        let b1 = pool.alloc(b).unwrap();
        let b2 = pool.alloc(b).unwrap();
        assert_eq!(pool.alloc(b), None);
        assert_ne!(pool.offset(b, b1), pool.offset(b, b2));
        assert_eq!(pool.class_slabs(a), 1);
        assert_eq!(pool.class_slabs(b), 1);
    }

    #[test]
    fn classes_are_checked() {
        let mut pool = PagePool::new(&PoolLayout::new(1 << 20, 1 << 16).unwrap());
        assert_eq!(pool.class_for(0), Err(ClassError::Empty));
        assert!(matches!(
            pool.class_for(1 << 17),
            Err(ClassError::PageTooLarge { .. })
        ));
        assert_eq!(pool.class_for(4096), pool.class_for(4096));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(usize),
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0usize..3).prop_map(Op::Alloc),
            2 => any::<usize>().prop_map(Op::Free),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Against a model: live pages never overlap, stay inside the pool and their class's
        /// slabs, and used + free + slack always equals capacity.
        #[test]
        fn allocator_invariants(ops in proptest::collection::vec(op(), 1..400)) {
            let slab = 4096u64;
            let mut pool = PagePool::new(&PoolLayout::new(slab * 8 + 100, slab).unwrap());
            let sizes = [512u64, 1000, 4096];
            let classes: Vec<ClassId> = sizes.iter().map(|&s| pool.class_for(s).unwrap()).collect();
            let mut live: Vec<(ClassId, Page)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(c) => {
                        if let Some(p) = pool.alloc(classes[c]) {
                            live.push((classes[c], p));
                        } else {
                            // Refused only when the class has no free page and no slab is free.
                            prop_assert!(!pool.can_alloc(classes[c]));
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (c, p) = live.swap_remove(i % live.len());
                        pool.free(c, p);
                    }
                    Op::Free(_) => {}
                }
                let mut ranges: Vec<(u64, u64)> = live
                    .iter()
                    .map(|&(c, p)| {
                        let o = pool.offset(c, p);
                        (o, o + pool.page_bytes(c))
                    })
                    .collect();
                ranges.sort();
                for w in ranges.windows(2) {
                    prop_assert!(w[0].1 <= w[1].0, "overlap {:?}", w);
                }
                for &(c, p) in &live {
                    prop_assert_eq!(pool.slab_class(p.slab), Some(c));
                    let o = pool.offset(c, p);
                    prop_assert!(o + pool.page_bytes(c) <= (p.slab as u64 + 1) * slab);
                }
                let u = pool.usage();
                let used: u64 = live.iter().map(|&(c, _)| pool.page_bytes(c)).sum();
                prop_assert_eq!(u.used_bytes, used);
                prop_assert_eq!(u.used_bytes + u.free_bytes + u.slack_bytes, pool.capacity_bytes());
                prop_assert_eq!(pool.used_pages(), live.len() as u64);
            }
        }

        /// The allocator of a pool that grows while it serves: every page handed out lies in a
        /// slab already handed over (so in pinned memory), growth never moves a live page, and
        /// a refusal means no usable slab had room.
        #[test]
        fn pages_come_only_from_ready_slabs(
            ops in proptest::collection::vec((op(), proptest::option::weighted(0.1, 0u32..12)), 1..300),
        ) {
            let slab = 4096u64;
            let layout = PoolLayout::new(slab * 10, slab).unwrap();
            let mut pool = PagePool::growing(&layout);
            let classes: Vec<ClassId> =
                [512u64, 1000, 4096].iter().map(|&s| pool.class_for(s).unwrap()).collect();
            let mut ready = 0u32;
            let mut live: Vec<(ClassId, Page, u64)> = Vec::new();
            for (op, grow) in ops {
                if let Some(to) = grow {
                    pool.grow_to(to);
                    ready = ready.max(to.min(layout.pieces()));
                }
                prop_assert_eq!(pool.ready_slabs(), ready);
                match op {
                    Op::Alloc(c) => match pool.alloc(classes[c]) {
                        Some(p) => live.push((classes[c], p, pool.offset(classes[c], p))),
                        None => prop_assert!(!pool.can_alloc(classes[c])),
                    },
                    Op::Free(i) if !live.is_empty() => {
                        let (c, p, _) = live.swap_remove(i % live.len());
                        pool.free(c, p);
                    }
                    Op::Free(_) => {}
                }
                let ready_end = layout.pieces_range(0..ready).end;
                for &(c, p, at) in &live {
                    prop_assert!(p.slab < ready, "page {:?} outside the {} ready slabs", p, ready);
                    prop_assert_eq!(pool.offset(c, p), at, "growth moved a page");
                    prop_assert!(at + pool.page_bytes(c) <= ready_end);
                    prop_assert!(layout.within_one_piece(at, pool.page_bytes(c)));
                }
                let u = pool.usage();
                prop_assert_eq!(u.used_bytes + u.free_bytes + u.slack_bytes, ready_end);
                prop_assert_eq!(pool.capacity_bytes(), ready_end);
                prop_assert_eq!(pool.total_bytes(), layout.size_bytes());
            }
        }

        /// With three NUMA homes: a page goes to the requester's home whenever a slab there has
        /// room for it (checked against the test's own model of slabs and pages), and never
        /// outside the ready slabs; accounting holds as with one home.
        #[test]
        fn pages_go_to_the_requesters_home_when_it_has_room(
            ops in proptest::collection::vec((op(), 0u16..3, proptest::option::weighted(0.15, 0u32..13)), 1..300),
        ) {
            let slab = 4096u64;
            let layout = PoolLayout::new(slab * 12, slab).unwrap();
            let home_of = |s: u32| (s / 4) as Home;
            let mut pool = PagePool::growing(&layout);
            let sizes = [512u64, 1000, 4096];
            let classes: Vec<ClassId> = sizes.iter().map(|&s| pool.class_for(s).unwrap()).collect();
            pool.set_homes(3, home_of);
            // Model: per slab, its class and live pages.
            let mut model: Vec<(Option<usize>, u64)> = vec![(None, 0); 12];
            let mut ready = 0u32;
            let mut live: Vec<(usize, Page)> = Vec::new();
            for (op, home, grow) in ops {
                if let Some(to) = grow {
                    pool.grow_to(to);
                    ready = ready.max(to.min(12));
                }
                match op {
                    Op::Alloc(c) => {
                        let per_slab = slab / sizes[c];
                        let room_at_home = (0..ready).any(|s| {
                            home_of(s) == home && match model[s as usize] {
                                (None, _) => true,
                                (Some(k), n) => k == c && n < per_slab,
                            }
                        });
                        match pool.alloc_near(classes[c], Some(home)) {
                            Some(p) => {
                                prop_assert!(p.slab < ready);
                                if room_at_home {
                                    prop_assert_eq!(home_of(p.slab), home, "went elsewhere though home had room");
                                }
                                let m = &mut model[p.slab as usize];
                                prop_assert!(m.0.is_none() || m.0 == Some(c));
                                *m = (Some(c), m.1 + 1);
                                live.push((c, p));
                            }
                            None => prop_assert!(!room_at_home),
                        }
                    }
                    Op::Free(i) if !live.is_empty() => {
                        let (c, p) = live.swap_remove(i % live.len());
                        pool.free(classes[c], p);
                        let m = &mut model[p.slab as usize];
                        m.1 -= 1;
                        if m.1 == 0 {
                            m.0 = None;
                        }
                    }
                    Op::Free(_) => {}
                }
                for &(c, p) in &live {
                    prop_assert_eq!(pool.slab_class(p.slab), Some(classes[c]));
                    prop_assert_eq!(pool.slab_home(p.slab), home_of(p.slab));
                }
                let u = pool.usage();
                prop_assert_eq!(u.used_bytes + u.free_bytes + u.slack_bytes, pool.capacity_bytes());
                prop_assert_eq!(pool.used_pages(), live.len() as u64);
            }
        }
    }
}
