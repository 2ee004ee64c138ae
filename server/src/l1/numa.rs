//! NUMA placement: on a machine with several memory nodes, a GPU's copies should move bytes
//! between it and memory on its own socket, and its copy threads should run there too.
//!
//! Three facts come from sysfs, read under a root that tests replace with a directory tree of
//! their own (as `life::machine` injects the machine): the nodes and their CPUs
//! (`devices/system/node/node<N>/cpulist`), and each GPU's node
//! (`bus/pci/devices/<PCI bus id>/numa_node`, the bus id given by the GPU driver). From them:
//! the pool's pieces are dealt to the nodes in groups (a [`Placement`]; each group's memory is
//! bound to its node before it is first touched), each slab's home is its group's node, a registration's pages are taken at its GPU's node first, and the GPU's
//! copy threads (the store and the retrieve lane's submitting threads) are pinned to that node's CPUs. On a one-node machine there is no placement and
//! nothing changes.

use std::ops::Range;
use std::path::{Path, PathBuf};

use kvd_gpu::PoolLayout;

use super::pool::Home;

/// How kvd places the pool on a multi-node machine (`--numa`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumaMode {
    /// Each GPU's stores on its own node.
    Auto,
    /// No placement.
    Off,
    /// Each GPU's stores on another node (to measure placement).
    Remote,
}

/// One memory node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// The kernel's node number.
    pub id: u32,
    /// Its CPUs.
    pub cpus: Vec<usize>,
}

/// The machine's memory nodes, as sysfs lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    sysfs: PathBuf,
    nodes: Vec<Node>,
}

impl Topology {
    /// Reads the nodes under `sysfs` (normally `/sys`). A machine whose sysfs lists no node
    /// (or cannot be read) is taken as one node.
    pub fn read(sysfs: &Path) -> Topology {
        let dir = sysfs.join("devices/system/node");
        let mut nodes: Vec<Node> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|e| {
                let id: u32 = e.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
                let text = std::fs::read_to_string(e.path().join("cpulist")).ok()?;
                match parse_cpulist(&text) {
                    Ok(cpus) => Some(Node { id, cpus }),
                    Err(why) => {
                        tracing::warn!("ignoring NUMA node {id}: {why}");
                        None
                    }
                }
            })
            .collect();
        nodes.sort_by_key(|n| n.id);
        Topology {
            sysfs: sysfs.to_path_buf(),
            nodes,
        }
    }

    /// The nodes, by id.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Whether placement matters here: more than one node with CPUs or memory listed.
    pub fn is_multi_node(&self) -> bool {
        self.nodes.len() > 1
    }

    /// The node of the PCI device `pci_bus_id` (as the GPU driver names it, e.g.
    /// `0000:1B:00.0`), or `None` where sysfs does not say (`-1`: a one-node machine).
    pub fn node_of_pci(&self, pci_bus_id: &str) -> Option<u32> {
        let id = pci_bus_id.trim().to_ascii_lowercase();
        // The driver may give an 8-digit domain (00000000:1b:00.0); sysfs uses 4 digits.
        let id = match id.split_once(':') {
            Some((domain, rest)) if domain.len() > 4 => {
                format!("{}:{rest}", &domain[domain.len() - 4..])
            }
            _ => id,
        };
        let text = std::fs::read_to_string(
            self.sysfs
                .join("bus/pci/devices")
                .join(&id)
                .join("numa_node"),
        )
        .ok()?;
        let node: i64 = text.trim().parse().ok()?;
        u32::try_from(node)
            .ok()
            .filter(|n| self.nodes.iter().any(|x| x.id == *n))
    }
}

/// Parses a kernel CPU list such as `0-3,8-11,16`.
pub fn parse_cpulist(text: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let bad = || format!("bad CPU list entry {part:?} in {:?}", text.trim());
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) =
                    (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if b < a || b - a > 1 << 16 {
                    return Err(bad());
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(cpus)
}

/// Pins the calling thread to `cpus` (a node's CPUs); does nothing for an empty list. A
/// refusal (a cgroup without those CPUs) is logged: the thread then runs anywhere, as before.
pub fn pin_current_thread(cpus: &[usize]) {
    if cpus.is_empty() {
        return;
    }
    let mut set = rustix::thread::CpuSet::new();
    for &c in cpus
        .iter()
        .filter(|&&c| c < rustix::thread::CpuSet::MAX_CPU)
    {
        set.set(c);
    }
    if let Err(e) = rustix::thread::sched_setaffinity(None, &set) {
        tracing::warn!("could not pin a copy thread to CPUs {cpus:?}: {e}; it runs on any CPU");
    }
}

/// Most groups a placement cuts the pool into: each is one `mbind` and one kernel memory area,
/// and the kernel allows 65,530 areas per process by default.
const MAX_GROUPS: u32 = 4096;

/// Which pieces of the pool each node's memory backs: groups of whole pieces dealt to the nodes
/// in turn (node 0, node 1, …, node 0, …). The pool grows from its first piece on, so dealing
/// rather than halving lets every node's GPUs find local slabs from the first seconds, not
/// only once the growth reaches their half.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    nodes: Vec<u32>,
    group_pieces: u32,
    pieces: u32,
}

impl Placement {
    /// A placement of `layout` over the topology's nodes; `None` on a one-node machine, where
    /// nothing is placed.
    pub fn new(layout: &PoolLayout, topology: &Topology) -> Option<Placement> {
        if !topology.is_multi_node() {
            return None;
        }
        let pieces = layout.pieces();
        Some(Placement {
            nodes: topology.nodes().iter().map(|n| n.id).collect(),
            group_pieces: pieces.div_ceil(MAX_GROUPS).max(1),
            pieces,
        })
    }

    /// (node id, pieces) for each group, in piece order; the ranges tile the pool.
    pub fn groups(&self) -> impl Iterator<Item = (u32, Range<u32>)> + '_ {
        (0..self.pieces)
            .step_by(self.group_pieces as usize)
            .map(|start| {
                let end = start.saturating_add(self.group_pieces).min(self.pieces);
                (self.nodes[self.home_of_piece(start) as usize], start..end)
            })
    }

    /// Number of homes (one per node).
    pub fn homes(&self) -> Home {
        self.nodes.len() as Home
    }

    /// The home of piece `piece`.
    pub fn home_of_piece(&self, piece: u32) -> Home {
        ((piece / self.group_pieces) as usize % self.nodes.len()) as Home
    }

    /// The node of home `home`.
    pub fn node_of_home(&self, home: Home) -> u32 {
        self.nodes[home as usize]
    }

    /// The home backed by node `node`.
    pub fn home_of_node(&self, node: u32) -> Option<Home> {
        self.nodes
            .iter()
            .position(|&n| n == node)
            .map(|h| h as Home)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::l1::pool::PagePool;

    /// A sysfs-like tree: nodes with CPU lists, and PCI devices with a node.
    fn fake_sysfs(tag: &str, nodes: &[(u32, &str)], pci: &[(&str, &str)]) -> PathBuf {
        let root = std::env::temp_dir().join(format!("kvd-numa-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (id, cpus) in nodes {
            let d = root.join(format!("devices/system/node/node{id}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{cpus}\n")).unwrap();
        }
        // Entries that are not nodes are ignored, as in real sysfs.
        std::fs::create_dir_all(root.join("devices/system/node/power")).unwrap();
        std::fs::write(root.join("devices/system/node/possible"), "0-1\n").unwrap();
        for (bus, node) in pci {
            let d = root.join("bus/pci/devices").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("numa_node"), format!("{node}\n")).unwrap();
        }
        root
    }

    #[test]
    fn cpu_lists_parse_and_bad_ones_say_which_entry() {
        assert_eq!(
            parse_cpulist("0-3,8-9,12\n").unwrap(),
            vec![0, 1, 2, 3, 8, 9, 12]
        );
        assert_eq!(parse_cpulist("").unwrap(), Vec::<usize>::new());
        let e = parse_cpulist("0-3,x").unwrap_err();
        assert!(e.contains("\"x\""), "{e}");
        assert!(parse_cpulist("5-2").is_err());
    }

    #[test]
    fn a_two_socket_machine_places_shares_and_finds_each_gpus_node() {
        let root = fake_sysfs(
            "two",
            &[(0, "0-3,8-11"), (1, "4-7,12-15")],
            &[
                ("0000:1b:00.0", "0"),
                ("0000:9a:00.0", "1"),
                ("0000:03:00.0", "-1"),
            ],
        );
        let t = Topology::read(&root);
        assert!(t.is_multi_node());
        assert_eq!(t.nodes()[1].cpus, vec![4, 5, 6, 7, 12, 13, 14, 15]);
        // The driver's spelling: upper case, sometimes an 8-digit domain.
        assert_eq!(t.node_of_pci("0000:9A:00.0"), Some(1));
        assert_eq!(t.node_of_pci("00000000:1B:00.0"), Some(0));
        assert_eq!(t.node_of_pci("0000:03:00.0"), None, "-1: no node");
        assert_eq!(t.node_of_pci("0000:ff:00.0"), None, "unknown device");

        let layout = PoolLayout::new(11 << 20, 1 << 20).unwrap();
        let p = Placement::new(&layout, &t).unwrap();
        let groups: Vec<(u32, Range<u32>)> = p.groups().collect();
        assert_eq!(groups[0], (0, 0..1));
        assert_eq!(groups[1], (1, 1..2));
        assert_eq!(groups.len(), 11);
        assert_eq!(p.home_of_piece(4), 0);
        assert_eq!(p.home_of_piece(5), 1);
        assert_eq!(p.home_of_node(1), Some(1));
        assert_eq!(p.node_of_home(1), 1);
        assert_eq!(p.home_of_node(7), None);

        // The allocator built from it gives a node-1 GPU its pages from node 1's slabs (the
        // odd ones), from the first of them to be ready on.
        let mut pool = PagePool::growing(&layout);
        pool.set_homes(p.homes(), |s| p.home_of_piece(s));
        pool.grow_to(2);
        let class = pool.class_for(1 << 19).unwrap();
        let near = p.home_of_node(t.node_of_pci("0000:9a:00.0").unwrap());
        assert_eq!(pool.alloc_near(class, near).unwrap().slab, 1);
        pool.grow_to(layout.pieces());
        for _ in 0..9 {
            let page = pool.alloc_near(class, near).unwrap();
            assert_eq!(page.slab % 2, 1, "{page:?}");
        }
        // Node 1's slabs are full: the next page comes from node 0 rather than failing.
        let page = pool.alloc_near(class, near).unwrap();
        assert_eq!(page.slab % 2, 0);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn one_node_or_no_sysfs_places_nothing() {
        let layout = PoolLayout::new(8 << 20, 1 << 20).unwrap();
        let root = fake_sysfs("one", &[(0, "0-15")], &[("0000:1b:00.0", "-1")]);
        let t = Topology::read(&root);
        assert!(!t.is_multi_node());
        assert_eq!(Placement::new(&layout, &t), None);
        assert_eq!(t.node_of_pci("0000:1b:00.0"), None);
        let _ = std::fs::remove_dir_all(root);
        let none = Topology::read(Path::new("/nonexistent-kvd-sysfs"));
        assert!(none.nodes().is_empty());
        assert_eq!(Placement::new(&layout, &none), None);
    }

    #[test]
    fn groups_tile_the_pool_deal_nodes_in_turn_and_stay_few() {
        for nodes in 2..9u32 {
            for pieces in [1u32, 2, 7, 64, 1000, 9000, 1 << 20] {
                let list: Vec<(u32, String)> =
                    (0..nodes).map(|i| (i * 2, format!("{i}"))).collect();
                let refs: Vec<(u32, &str)> = list.iter().map(|(i, c)| (*i, c.as_str())).collect();
                let root = fake_sysfs(&format!("tile{nodes}-{pieces}"), &refs, &[]);
                let t = Topology::read(&root);
                let layout = PoolLayout::new(pieces as u64 * 4096, 4096).unwrap();
                let p = Placement::new(&layout, &t).unwrap();
                let mut at = 0;
                let mut per_node = vec![0u64; nodes as usize];
                for (i, (node, r)) in p.groups().enumerate() {
                    assert_eq!(r.start, at);
                    assert!(!r.is_empty());
                    assert_eq!(node, (i as u32 % nodes) * 2, "dealt in turn");
                    assert!(r
                        .clone()
                        .all(|piece| p.node_of_home(p.home_of_piece(piece)) == node));
                    per_node[(node / 2) as usize] += r.len() as u64;
                    at = r.end;
                }
                assert_eq!(at, pieces);
                assert!(p.groups().count() as u32 <= MAX_GROUPS);
                let group = pieces.div_ceil(MAX_GROUPS) as u64;
                let (min, max) = (
                    per_node.iter().min().unwrap(),
                    per_node.iter().max().unwrap(),
                );
                assert!(max - min <= group, "{per_node:?}");
                let _ = std::fs::remove_dir_all(root);
            }
        }
    }

    #[test]
    fn a_pinned_thread_runs_only_on_its_nodes_cpus() {
        let allowed = std::thread::spawn(|| {
            pin_current_thread(&[0]);
            rustix::thread::sched_getaffinity(None).unwrap()
        })
        .join()
        .unwrap();
        assert!(allowed.is_set(0));
        assert_eq!(allowed.count(), 1);
        // An empty list (one-node machine) leaves the thread as it was.
        let before = rustix::thread::sched_getaffinity(None).unwrap().count();
        pin_current_thread(&[]);
        assert_eq!(
            rustix::thread::sched_getaffinity(None).unwrap().count(),
            before
        );
    }
}
