//! Stamps the commit kvd is built from into `KVD_GIT_COMMIT`, for `kvd_build_info`:
//! `$KVD_GIT_COMMIT` when set (a container build has no `.git` and passes it as a build
//! argument), else `git rev-parse`, else nothing (the metric says `unknown`).

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=KVD_GIT_COMMIT");
    let commit = std::env::var("KVD_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]));
    if let Some(c) = commit {
        println!("cargo:rustc-env=KVD_GIT_COMMIT={c}");
    }
    // Stamp again when HEAD moves: HEAD itself (a checkout) and the branch it names (a commit).
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(b) = &branch {
        watched.push(git(&["rev-parse", "--git-path", b]));
        watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    }
    // Only files that exist: a missing one would make cargo run this on every build.
    for p in watched.into_iter().flatten() {
        if Path::new(&p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}
