//! The memory limit kvd runs under, for the default pool size.
//!
//! A systemd unit's `MemoryMax=`, a container's `--memory` or a Kubernetes limit sets the limit
//! on the process's own cgroup (or on one above it), not at the hierarchy's root: reading
//! `/sys/fs/cgroup/memory.max` alone finds no limit, the 75%-of-RAM default exceeds the real
//! one and the kernel OOM-kills kvd while its pool grows. So: find the process's cgroup in
//! `/proc/self/cgroup` (v2: the `0::` line; v1: the line whose controllers include `memory`),
//! find where that hierarchy is mounted in `/proc/self/mountinfo` (a container sees its own
//! cgroup as the mount's root), and take the lowest limit from that cgroup up to the mount
//! point: `memory.max` on v2 (`max` = none), `memory.limit_in_bytes` on v1 (a value near 2^63
//! = none).

use std::path::{Path, PathBuf};

/// A memory limit and the file that set it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    /// Bytes.
    pub bytes: u64,
    /// The `memory.max` or `memory.limit_in_bytes` that holds it.
    pub file: PathBuf,
}

/// One cgroup hierarchy that may hold kvd's memory limit.
#[derive(Debug)]
struct Hierarchy {
    /// Where it is mounted.
    mount_point: PathBuf,
    /// kvd's cgroup below the mount point (already stripped of the mount's own root).
    cgroup: PathBuf,
    /// The limit's file name in each cgroup directory.
    file: &'static str,
}

/// The cgroup path of `/proc/self/cgroup`'s line for `v2` (the unified hierarchy) or the v1
/// memory controller.
fn own_cgroup(proc_self_cgroup: &str, v2: bool) -> Option<&str> {
    proc_self_cgroup.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let matches = if v2 {
            id == "0" && controllers.is_empty()
        } else {
            controllers.split(',').any(|c| c == "memory")
        };
        matches.then_some(path)
    })
}

/// The memory hierarchies in `mountinfo`: (mount root, mount point, v2).
fn mounts(mountinfo: &str) -> Vec<(String, String, bool)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let f: Vec<&str> = before.split(' ').collect();
            let a: Vec<&str> = after.split(' ').collect();
            let (root, point) = (f.get(3)?, f.get(4)?);
            let fstype = a.first()?;
            let v2 = *fstype == "cgroup2";
            let v1_memory = *fstype == "cgroup"
                && a.get(2)
                    .is_some_and(|opts| opts.split(',').any(|o| o == "memory"));
            (v2 || v1_memory).then(|| (unescape(root), unescape(point), v2))
        })
        .collect()
}

/// mountinfo escapes spaces and a few other bytes as `\ooo`.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let oct: String = chars.clone().take(3).collect();
            if let Ok(v) = u8::from_str_radix(&oct, 8) {
                out.push(v as char);
                chars.nth(2);
                continue;
            }
        }
        out.push(c);
    }
    out
}

fn hierarchies(root: &Path) -> Vec<Hierarchy> {
    let cgroups = std::fs::read_to_string(root.join("proc/self/cgroup")).unwrap_or_default();
    let mountinfo = std::fs::read_to_string(root.join("proc/self/mountinfo")).unwrap_or_default();
    let mut out = Vec::new();
    for (mount_root, point, v2) in mounts(&mountinfo) {
        let Some(path) = own_cgroup(&cgroups, v2) else {
            continue;
        };
        // Inside a container the mount's root is the container's cgroup; outside a path that
        // does not lie below it, the nearest limit we can see is at the mount point.
        let below = Path::new(path)
            .strip_prefix(&mount_root)
            .map(Path::to_path_buf)
            .unwrap_or_default();
        out.push(Hierarchy {
            mount_point: root.join(point.trim_start_matches('/')),
            cgroup: below,
            file: if v2 {
                "memory.max"
            } else {
                "memory.limit_in_bytes"
            },
        });
    }
    if out.is_empty() {
        // No /proc (or an unusual mount table): the conventional places.
        for (point, file) in [
            ("sys/fs/cgroup", "memory.max"),
            ("sys/fs/cgroup/memory", "memory.limit_in_bytes"),
        ] {
            out.push(Hierarchy {
                mount_point: root.join(point),
                cgroup: PathBuf::new(),
                file,
            });
        }
    }
    out
}

fn read_limit(file: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let text = text.trim();
    if text == "max" {
        return None;
    }
    // cgroup v1 reports "no limit" as a page-rounded 2^63 - 1.
    text.parse::<u64>().ok().filter(|&v| v < (1u64 << 60))
}

/// The lowest memory limit on kvd's own cgroup or any cgroup above it, in every hierarchy
/// that has the memory controller; `root` is `/` except in tests.
pub fn memory_limit(root: &Path) -> Option<Limit> {
    let mut best: Option<Limit> = None;
    for h in hierarchies(root) {
        let mut dir = h.mount_point.join(&h.cgroup);
        loop {
            let file = dir.join(h.file);
            if let Some(bytes) = read_limit(&file) {
                if best.as_ref().is_none_or(|b| bytes < b.bytes) {
                    best = Some(Limit { bytes, file });
                }
            }
            if dir == h.mount_point || !dir.pop() || !dir.starts_with(&h.mount_point) {
                break;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Tree(PathBuf);

    impl Tree {
        fn new(tag: &str) -> Tree {
            let p = std::env::temp_dir().join(format!("kvd-cgroup-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(p.join("proc/self")).unwrap();
            Tree(p)
        }
        fn write(&self, rel: &str, text: &str) {
            let p = self.0.join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const V2_MOUNT: &str = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n";

    #[test]
    fn v2_takes_the_nearest_limit_up_the_units_path() {
        let t = Tree::new("v2");
        t.write("proc/self/mountinfo", V2_MOUNT);
        t.write("proc/self/cgroup", "0::/system.slice/kvd.service\n");
        t.write("sys/fs/cgroup/memory.max", "max\n");
        t.write("sys/fs/cgroup/system.slice/memory.max", "8589934592\n");
        t.write("sys/fs/cgroup/system.slice/kvd.service/memory.max", "max\n");
        let l = memory_limit(&t.0).unwrap();
        assert_eq!(l.bytes, 8 << 30, "the slice's limit binds the unit");
        assert!(l.file.ends_with("system.slice/memory.max"), "{l:?}");
        t.write(
            "sys/fs/cgroup/system.slice/kvd.service/memory.max",
            "2147483648\n",
        );
        assert_eq!(
            memory_limit(&t.0).unwrap().bytes,
            2 << 30,
            "the lowest wins"
        );
        t.write("sys/fs/cgroup/system.slice/memory.max", "max\n");
        t.write("sys/fs/cgroup/system.slice/kvd.service/memory.max", "max\n");
        assert_eq!(memory_limit(&t.0), None);
    }

    #[test]
    fn v1_reads_the_memory_controllers_hierarchy() {
        let t = Tree::new("v1");
        t.write(
            "proc/self/mountinfo",
            "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n\
             32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n\
             35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
             41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
        );
        t.write("proc/self/cgroup", "4:memory:/jobs/a/b\n1:cpu:/\n0::/\n");
        t.write(
            "sys/fs/cgroup/memory/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        t.write(
            "sys/fs/cgroup/memory/jobs/memory.limit_in_bytes",
            "4294967296\n",
        );
        t.write(
            "sys/fs/cgroup/memory/jobs/a/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        t.write(
            "sys/fs/cgroup/memory/jobs/a/b/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        let l = memory_limit(&t.0).unwrap();
        assert_eq!(l.bytes, 4 << 30);
        assert!(
            l.file.ends_with("memory/jobs/memory.limit_in_bytes"),
            "{l:?}"
        );
    }

    #[test]
    fn a_container_sees_its_cgroup_as_the_mounts_root() {
        let t = Tree::new("ctr");
        t.write(
            "proc/self/mountinfo",
            "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n",
        );
        t.write("proc/self/cgroup", "9:memory:/docker/abc\n");
        t.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n");
        assert_eq!(memory_limit(&t.0).unwrap().bytes, 1 << 30);
        let t = Tree::new("ns");
        t.write(
            "proc/self/mountinfo",
            "30 23 0:26 /../.. /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        );
        t.write("proc/self/cgroup", "0::/\n");
        t.write("sys/fs/cgroup/memory.max", "3221225472\n");
        assert_eq!(memory_limit(&t.0).unwrap().bytes, 3 << 30);
    }

    #[test]
    fn without_proc_the_conventional_places_are_read() {
        let t = Tree::new("noproc");
        t.write("sys/fs/cgroup/memory.max", "1073741824\n");
        assert_eq!(memory_limit(&t.0).unwrap().bytes, 1 << 30);
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape("/plain"), "/plain");
    }
}
