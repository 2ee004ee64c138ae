//! The import rules of kvd's Rust code, checked: no circles, and no import running from a lower
//! layer back up. Reads the `crate::`, `super::` and `self::` paths of `server/src` and
//! `connector-py/src` (in `use` declarations and in code; comments and strings are skipped) and
//! checks them against the layer order declared below, bottom first.
//!
//! The server's `src/` is in wings (its top-level modules), and each wing in modules. A wing
//! may use the wings below it; within a wing a module may use the modules below it; a module
//! and its own submodules are one unit (a parent declares its children, children use their
//! parent's types), but two sibling files of a unit must not import each other. A wing's root
//! (`mod.rs`) is its top: it declares and re-exports, and nothing inside the wing goes through
//! it. Every wing and module must be named here, so the order stays the map of the code.
//!
//! Run alone: `cargo test -p kvd-server --test layers -- --nocapture`.

#[path = "layers/read.rs"]
mod read;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use read::{code_only, imports, paths_in, resolve, Import, ModPath};

/// The server's wings, bottom first, each with its modules bottom first.
const SERVER: &[(&str, &[&str])] = &[
    // Flag checks and their error: imports nothing of the server.
    ("config", &[]),
    // The L1 core: pure logic over the pinned pool, and the one handle the rest uses.
    (
        "l1",
        &[
            "key", "geometry", "pool", "numa", "evict", "events", "presence", "cache", "handle",
        ],
    ),
    // Metrics, the HTTP responder, the accept loop, cgroup.
    (
        "ops",
        &["cgroup", "process_metrics", "metrics", "accept", "http"],
    ),
    // Devices and their copy workers.
    ("data", &["copier", "devices"]),
    // Below L1: the value header, the fill both tiers share, disk and L2 side by side, the chain.
    ("tiers", &["value", "fill", "disk", "l2", "chain"]),
    // Router, fd socket, sessions, remembered prompts, the shared state, the handler.
    (
        "control",
        &[
            "refused",
            "router",
            "fdpass",
            "session",
            "error",
            "recall",
            "state",
            "handler",
            "connections",
        ],
    ),
    // Flags, growth, health, bind/serve/drain.
    (
        "life",
        &[
            "machine",
            "flags",
            "pool_size",
            "config",
            "grow",
            "health",
            "server",
        ],
    ),
];

/// The connector's Rust modules (one file each), bottom first.
const CONNECTOR: &[(&str, &[&str])] = &[
    ("plan", &[]),
    ("errors", &[]),
    ("runtime", &[]),
    ("hashing", &[]),
    ("host", &[]),
    ("register", &[]),
    ("presence", &[]),
    ("client", &[]),
];

fn show(m: &ModPath) -> String {
    if m.is_empty() {
        "crate".into()
    } else {
        m.join("::")
    }
}

/// Why an import runs the wrong way or names an undeclared module, if it does.
fn against_order(order: &[(&str, &[&str])], i: &Import) -> Option<String> {
    let rank = |m: &ModPath| -> Result<(usize, Option<usize>), String> {
        let wing = &m[0];
        let w = order
            .iter()
            .position(|(n, _)| n == wing)
            .ok_or_else(|| format!("`{wing}` is not in the declared order"))?;
        let unit = match m.get(1) {
            None => None,
            Some(u) if order[w].1.is_empty() => {
                return Err(format!(
                    "`{wing}::{u}`: `{wing}` declares no modules, so it may have none"
                ))
            }
            Some(u) => Some(
                order[w]
                    .1
                    .iter()
                    .position(|n| n == u)
                    .ok_or_else(|| format!("`{wing}::{u}` is not in the declared order"))?,
            ),
        };
        Ok((w, unit))
    };
    let (from, to) = match (rank(&i.from), rank(&i.to)) {
        (Ok(f), Ok(t)) => (f, t),
        (Err(e), _) | (_, Err(e)) => return Some(e),
    };
    let upward = if from.0 != to.0 {
        to.0 > from.0
    } else {
        match (from.1, to.1) {
            // Into the wing's root from inside the wing: the root is its top.
            (Some(_), None) => true,
            (Some(f), Some(t)) => t > f,
            _ => false,
        }
    };
    upward.then(|| {
        format!(
            "{} -> {} ({}): runs up the declared order",
            show(&i.from),
            show(&i.to),
            i.at
        )
    })
}

/// Circles among files: strongly connected components of more than one module (Tarjan).
fn circles(modules: &BTreeSet<ModPath>, imports: &[Import]) -> Vec<Vec<ModPath>> {
    let ids: BTreeMap<&ModPath, usize> = modules.iter().enumerate().map(|(i, m)| (m, i)).collect();
    let names: Vec<&ModPath> = modules.iter().collect();
    let mut next: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); names.len()];
    for i in imports {
        next[ids[&i.from]].insert(ids[&i.to]);
    }
    struct Tarjan<'a> {
        next: &'a [BTreeSet<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        count: usize,
        out: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.count);
            self.low[v] = self.count;
            self.count += 1;
            self.stack.push(v);
            self.on[v] = true;
            for &w in &self.next[v].clone() {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on[w] => self.low[v] = self.low[v].min(iw),
                    _ => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut c = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on[w] = false;
                    c.push(w);
                    if w == v {
                        break;
                    }
                }
                if c.len() > 1 {
                    self.out.push(c);
                }
            }
        }
    }
    let n = names.len();
    let mut t = Tarjan {
        next: &next,
        index: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: Vec::new(),
        count: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    t.out
        .into_iter()
        .map(|c| c.into_iter().map(|i| names[i].clone()).collect())
        .collect()
}

/// Checks one crate; returns its report and whether it kept the rules.
fn check(name: &str, src: &Path, order: &[(&str, &[&str])]) -> (String, bool) {
    let (modules, imports) = imports(src);
    let circles = circles(&modules, &imports);
    let mut wrong: Vec<String> = imports
        .iter()
        .filter_map(|i| against_order(order, i))
        .collect();
    for m in modules.iter().filter(|m| !m.is_empty()) {
        let probe = Import {
            from: m.clone(),
            to: m.clone(),
            at: String::new(),
        };
        if let Some(e) = against_order(order, &probe) {
            wrong.push(e);
        }
    }
    for (wing, units) in order {
        let w = vec![wing.to_string()];
        if !modules.contains(&w) {
            wrong.push(format!("`{wing}` is declared but is not a module"));
        }
        for u in *units {
            if !modules.contains(&vec![wing.to_string(), u.to_string()]) {
                wrong.push(format!("`{wing}::{u}` is declared but is not a module"));
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    let upward = wrong.iter().filter(|w| w.contains("runs up")).count();
    let mut report = format!(
        "{name}: {} modules, {} imports between them: {} circles, {} upward arrows, {} off the declared order\n",
        modules.len(),
        imports.len(),
        circles.len(),
        upward,
        wrong.len() - upward
    );
    for c in &circles {
        let names: Vec<String> = c.iter().map(show).collect();
        report.push_str(&format!("  circle: {}\n", names.join(" <-> ")));
        for i in imports
            .iter()
            .filter(|i| c.contains(&i.from) && c.contains(&i.to))
        {
            report.push_str(&format!(
                "    {} -> {} ({})\n",
                show(&i.from),
                show(&i.to),
                i.at
            ));
        }
    }
    for w in &wrong {
        report.push_str(&format!("  {w}\n"));
    }
    let ok = circles.is_empty() && wrong.is_empty();
    (report, ok)
}

#[test]
fn imports_keep_the_layers() {
    let server = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all_ok = true;
    let mut reports = String::new();
    for (name, src, order) in [
        ("server/src", server.join("src"), SERVER),
        (
            "connector-py/src",
            server.join("../connector-py/src"),
            CONNECTOR,
        ),
    ] {
        let (report, ok) = check(name, &src, order);
        all_ok &= ok;
        reports.push_str(&report);
    }
    println!("{reports}");
    assert!(all_ok, "the import rules are broken:\n{reports}");
}

#[test]
fn the_checker_reads_paths_as_rustc_does() {
    let code = code_only(
        "use crate::a::{b, c::{self, D}};\n// use crate::x;\nlet s = \"crate::y\";\nfn f() { super::z::g(); crate::w::V }\nmod tests { use super::*; use super::q::R; }\nlet c = '\"'; crate::after::T;",
    );
    let here: ModPath = vec!["m".into()];
    let got: Vec<String> = paths_in(&code, &here)
        .into_iter()
        .map(|(m, p, _)| format!("{}:{}", show(&m), p.join("::")))
        .collect();
    assert_eq!(
        got,
        [
            "m:crate::a::b",
            "m:crate::a::c",
            "m:crate::a::c::D",
            "m::tests:super",
            "m::tests:super::q::R",
            "m:crate::w::V",
            "m:crate::after::T",
            "m:super::z::g",
        ]
    );
    let modules: BTreeSet<ModPath> = [vec![], vec!["m".into()], vec!["m".into(), "q".into()]]
        .into_iter()
        .collect();
    let tests: ModPath = vec!["m".into(), "tests".into()];
    assert_eq!(
        resolve(&tests, &["super".into(), "q".into(), "R".into()], &modules),
        Some(vec!["m".to_string(), "q".to_string()])
    );
}
