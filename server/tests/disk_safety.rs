//! The disk tier never destroys data it did not write and never fills a filesystem, tried as a
//! new user would: a file of someone's bytes, an ext4 filesystem on a loop device (unmounted and
//! mounted), one disk file named by two kvds, a `--disk-index` that is someone's file, and a
//! `--disk-size-gb` larger than the filesystem's free space, and a path that kvd sees
//! read-only (as a systemd unit's `ProtectSystem=strict` makes it). Loop devices and mounts need
//! root (CI runs as root); without it those tests say they were skipped.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn refused(extra: &[&str]) -> String {
    let (code, err) = run(&serve(extra));
    assert_ne!(code, 0, "kvd started: {err}");
    fatal(&err).to_string()
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng(seed).fill(&mut v);
    v
}

#[test]
fn a_file_of_someone_elses_bytes_is_refused_and_left_as_it_was() {
    let dir = TempDir::new("safety-file");
    let f = dir.0.join("someone.bin");
    let data = random_bytes(64 << 20, 1);
    std::fs::write(&f, &data).unwrap();
    let shown = f.display().to_string();
    let line = refused(&["--disk", &shown]);
    assert!(
        line.contains("which kvd did not write")
            && line.contains(&format!("--disk-overwrite {shown}")),
        "{line}"
    );
    let line = refused(&["--disk", &shown, "--disk-size-gb", "0.03"]);
    assert!(line.contains("kvd will not overwrite it"), "{line}");
    assert!(std::fs::read(&f).unwrap() == data, "the file changed");

    // Named to be overwritten, it is taken, and is kvd's from then on.
    let mut kvd = Kvd::ready(&["--disk", &shown, "--disk-overwrite", &shown]);
    assert!(kvd
        .log()
        .contains("kvd overwrites it, as --disk-overwrite says"));
    assert!(kvd.terminate().0.success());
    let again = Kvd::ready(&["--disk", &shown]);
    assert!(!again.log().contains("overwrites"), "{}", again.log());
}

#[test]
fn a_disk_index_that_is_someone_elses_file_is_refused() {
    let dir = TempDir::new("safety-index");
    let index = dir.0.join("notes.txt");
    std::fs::write(&index, b"an operator's notes\n").unwrap();
    let disk = dir.0.join("kvd.disk").display().to_string();
    let shown = index.display().to_string();
    let line = refused(&[
        "--disk",
        &disk,
        "--disk-size-gb",
        "0.01",
        "--disk-index",
        &shown,
    ]);
    assert!(
        line.contains("not a kvd index") && line.contains(&format!("--disk-overwrite {shown}")),
        "{line}"
    );
    assert_eq!(std::fs::read(&index).unwrap(), b"an operator's notes\n");
}

#[test]
fn two_kvds_never_share_a_disk() {
    let dir = TempDir::new("safety-two");
    let disk = dir.0.join("shared.disk").display().to_string();
    let _first = Kvd::ready(&["--disk", &disk, "--disk-size-gb", "0.01"]);
    let line = refused(&[
        "--disk",
        &disk,
        "--disk-index",
        &dir.0.join("second.index").display().to_string(),
    ]);
    assert!(line.contains("in use by another process"), "{line}");
}

/// A loop device over a file, detached on drop; `None` (with the reason printed) where this
/// process cannot make one.
struct Loop {
    dev: String,
    _img: TempDir,
    mount: Option<PathBuf>,
}

impl Loop {
    fn ext4(mb: u64) -> Option<Loop> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: loop devices need root");
            return None;
        }
        let img = TempDir::new("safety-loop");
        let file = img.0.join("fs.img");
        let f = std::fs::File::create(&file).unwrap();
        f.set_len(mb << 20).unwrap();
        drop(f);
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&file)
            .output()
            .expect("mkfs.ext4 (e2fsprogs)");
        assert!(out.status.success(), "mkfs.ext4: {out:?}");
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&file)
            .output()
            .expect("losetup (util-linux)");
        if !out.status.success() {
            eprintln!(
                "skipped: losetup could not make a loop device here: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return None;
        }
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
        Some(Loop {
            dev,
            _img: img,
            mount: None,
        })
    }

    fn mount(&mut self) -> PathBuf {
        let at = self._img.0.join("m");
        std::fs::create_dir_all(&at).unwrap();
        let out = Command::new("mount")
            .arg(&self.dev)
            .arg(&at)
            .output()
            .unwrap();
        assert!(out.status.success(), "mount: {out:?}");
        self.mount = Some(at.clone());
        at
    }

    fn head(&self) -> Vec<u8> {
        let mut v = vec![0u8; 2 << 20];
        std::io::Read::read_exact(&mut std::fs::File::open(&self.dev).unwrap(), &mut v).unwrap();
        v
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        if let Some(m) = &self.mount {
            let _ = Command::new("umount").arg(m).status();
        }
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

#[test]
fn a_device_holding_a_filesystem_is_refused_and_a_mounted_one_even_when_named() {
    let Some(mut lo) = Loop::ext4(64) else { return };
    let dir = TempDir::new("safety-dev");
    let index = dir.0.join("dev.index").display().to_string();
    let before = lo.head();
    let line = refused(&["--disk", &lo.dev, "--disk-index", &index]);
    assert!(
        line.contains("an ext2/3/4 filesystem") && line.contains("--disk-overwrite"),
        "{line}"
    );
    assert!(lo.head() == before, "the filesystem's first MiBs changed");

    // Mounted, it is the kernel's: refused even when named to be overwritten.
    let mounted = lo.mount();
    let line = refused(&[
        "--disk",
        &lo.dev,
        "--disk-index",
        &index,
        "--disk-overwrite",
        &lo.dev,
    ]);
    assert!(line.contains("mounted"), "{line}");
    assert!(
        mounted.join("lost+found").exists(),
        "the filesystem is still there"
    );
}

fn used_bytes(mount: &Path) -> u64 {
    let s = rustix::fs::statvfs(mount).unwrap();
    (s.f_blocks - s.f_bfree) * s.f_frsize
}

#[test]
fn a_size_larger_than_the_free_space_allocates_nothing_and_names_the_flag() {
    let Some(mut lo) = Loop::ext4(300) else {
        return;
    };
    let m = lo.mount();
    let before = used_bytes(&m);
    let disk = m.join("kvd").display().to_string();
    for size in ["1", "100000"] {
        let mut kvd = Kvd::ready(&[
            "--l1-size-gb",
            "0.25",
            "--disk",
            &disk,
            "--disk-size-gb",
            size,
        ]);
        let (code, body) = kvd.get("/healthz");
        assert_eq!(code, 200, "{body}");
        let disk_state: serde_json::Value = serde_json::from_str(&body).unwrap();
        let why = disk_state["disk"]["last_error"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            why.contains("--disk-size-gb") && why.contains("nothing was allocated"),
            "{why}"
        );
        assert!(kvd.terminate().0.success());
        assert!(!Path::new(&disk).exists(), "kvd left {disk} behind");
        // The index beside it is all kvd leaves: a few KiB, not the filesystem.
        let used = used_bytes(&m);
        assert!(
            used < before + (1 << 20),
            "{size} GiB: {} MiB more used than before",
            (used - before) >> 20
        );
    }
}

/// A directory bind-mounted read-only over another — what systemd's `ProtectSystem=strict` does
/// to every path the unit's `ReadWritePaths=` leaves out. Unmounted on drop; `None` (with the
/// reason printed) where this process cannot mount.
struct ReadOnlyView {
    at: PathBuf,
    _dir: TempDir,
}

impl ReadOnlyView {
    fn new() -> Option<ReadOnlyView> {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: a read-only bind mount needs root");
            return None;
        }
        let dir = TempDir::new("safety-ro");
        let (rw, at) = (dir.0.join("rw"), dir.0.join("ro"));
        std::fs::create_dir_all(&rw).unwrap();
        std::fs::create_dir_all(&at).unwrap();
        let out = Command::new("mount")
            .arg("--bind")
            .args([&rw, &at])
            .output()
            .expect("mount (util-linux)");
        if !out.status.success() {
            eprintln!(
                "skipped: cannot bind-mount here: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            return None;
        }
        let view = ReadOnlyView { at, _dir: dir };
        let out = Command::new("mount")
            .args(["-o", "remount,bind,ro"])
            .arg(&view.at)
            .output()
            .unwrap();
        assert!(out.status.success(), "remount read-only: {out:?}");
        Some(view)
    }
}

impl Drop for ReadOnlyView {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.at).status();
    }
}

#[test]
fn a_read_only_path_is_refused_with_the_systemd_fix() {
    let Some(ro) = ReadOnlyView::new() else {
        return;
    };
    let disk = ro.at.join("kvd.disk").display().to_string();
    let line = refused(&["--disk", &disk, "--disk-size-gb", "0.01"]);
    assert!(
        line.contains(&format!("--disk {disk}: Read-only file system"))
            && line.contains("ProtectSystem=strict")
            && line.contains("ReadWritePaths="),
        "{line}"
    );
    assert!(!line.contains("check the drive"), "{line}");
    // The index too, with the drive on a writable path.
    let dir = TempDir::new("safety-ro-index");
    let writable = dir.0.join("kvd.disk").display().to_string();
    let index = ro.at.join("kvd.index").display().to_string();
    let line = refused(&[
        "--disk",
        &writable,
        "--disk-size-gb",
        "0.01",
        "--disk-index",
        &index,
    ]);
    assert!(
        line.contains(&format!("--disk-index {index}")) && line.contains("ReadWritePaths="),
        "{line}"
    );
}
