//! Reading a crate's imports: the files of `src/` and their modules, each file's code without
//! comments and strings, the paths in its `use` declarations and in its code, and the module
//! each names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path from the crate root, `[]` being the root.
pub type ModPath = Vec<String>;

/// One import: from a file's module to the module it names, and where it is written.
#[derive(Debug, Clone)]
pub struct Import {
    /// The importing module.
    pub from: ModPath,
    /// The module it names.
    pub to: ModPath,
    /// `file:line`.
    pub at: String,
}

/// `src/a/b.rs` and `src/a/b/mod.rs` are `a::b`; `lib.rs` is the root; a file that a
/// `#[path]` attribute names belongs to the module that attribute declares.
pub fn module_of(src: &Path, file: &Path, by_path: &BTreeMap<PathBuf, ModPath>) -> Option<ModPath> {
    if let Some(m) = by_path.get(file) {
        return Some(m.clone());
    }
    let rel = file.strip_prefix(src).ok()?;
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?;
    match (parts.is_empty(), stem) {
        (true, "lib") => Some(Vec::new()),
        (true, "main") => None,
        (_, "mod") => Some(parts),
        _ => {
            parts.push(stem.to_string());
            Some(parts)
        }
    }
}

pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The code of a Rust file with comments, strings and character literals blanked out (newlines
/// kept, so positions still give line numbers).
pub fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r'
            && (next == Some('"') || next == Some('#'))
            && (i == 0 || !(b[i - 1].is_alphanumeric() || b[i - 1] == '_'))
        {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &ch in &b[i..j.min(b.len())] {
                out.push(blank(ch));
            }
            i = j;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && (next == Some('\\') || b.get(i + 2) == Some(&'\'')) {
            // A character literal ('x', '\n', '\u{..}'); a lifetime ('a) is left alone.
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '\'' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                out.push(' ');
                i += 1;
            }
            out.push(' ');
            i += 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

pub fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The word ending just before byte `at` (skipping spaces), if any.
pub fn word_before(code: &str, at: usize) -> &str {
    let head = code[..at].trim_end();
    let start = head
        .char_indices()
        .rev()
        .find(|&(_, c)| !is_ident(c))
        .map_or(0, |(i, c)| i + c.len_utf8());
    &head[start..]
}

/// Expands a `use` tree (`a::{b, c::{d, e}}`) into its paths, `self` in a group naming the
/// group's prefix.
pub fn expand_tree(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if tree.is_empty() {
        return;
    }
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        let close = tree.rfind('}').unwrap_or(tree.len());
        let inner = &tree[open + 1..close];
        let mut p = prefix.to_vec();
        p.extend(head);
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    expand_tree(&p, &inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        expand_tree(&p, &inner[start..], out);
        return;
    }
    let tree = tree.split(" as ").next().unwrap_or(tree).trim();
    let mut p = prefix.to_vec();
    for seg in tree.split("::").map(str::trim) {
        match seg {
            "" | "*" => {}
            "self" if !p.is_empty() => {}
            s => p.push(s.to_string()),
        }
    }
    out.push(p);
}

/// The paths a file names, each with the module it is written in (the file's, or an inline
/// `mod x { .. }` in it) and its line.
pub fn paths_in(code: &str, file_mod: &ModPath) -> Vec<(ModPath, Vec<String>, usize)> {
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    // Inline modules: byte ranges and their path.
    let mut inline: Vec<(usize, usize, ModPath)> = Vec::new();
    {
        let mut stack: Vec<(usize, ModPath, usize)> = Vec::new();
        let mut depth = 0usize;
        let bytes = code.as_bytes();
        for (i, &ch) in bytes.iter().enumerate() {
            match ch {
                b'{' => {
                    depth += 1;
                    let head = code[..i].trim_end();
                    let name = word_before(code, i);
                    let before = &head[..head.len() - name.len()];
                    if !name.is_empty() && word_before(before, before.len()) == "mod" {
                        let mut m = stack.last().map_or(file_mod.clone(), |s| s.1.clone());
                        m.push(name.to_string());
                        stack.push((i, m, depth));
                    }
                }
                b'}' => {
                    if let Some(top) = stack.last() {
                        if top.2 == depth {
                            let (start, m, _) = stack.pop().expect("checked");
                            inline.push((start, i, m));
                        }
                    }
                    depth = depth.saturating_sub(1);
                }
                _ => {}
            }
        }
    }
    let module_at = |at: usize| {
        inline
            .iter()
            .filter(|(s, e, _)| *s <= at && at <= *e)
            .max_by_key(|(_, _, m)| m.len())
            .map_or(file_mod.clone(), |(_, _, m)| m.clone())
    };
    let mut out = Vec::new();
    let mut rest = code.to_string();
    // `use` declarations first; then blank them so the scan below sees only paths in code.
    let mut from = 0;
    while let Some(pos) = rest[from..].find("use ") {
        let at = from + pos;
        from = at + 4;
        if at > 0 && is_ident(rest[..at].chars().next_back().unwrap_or(' ')) {
            continue;
        }
        let Some(end) = rest[at..].find(';') else {
            break;
        };
        let tree = rest[at + 4..at + end].to_string();
        let mut paths = Vec::new();
        expand_tree(&[], &tree, &mut paths);
        for p in paths {
            out.push((module_at(at), p, line_of(at)));
        }
        let blanked: String = rest[at..at + end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        rest.replace_range(at..at + end, &blanked);
    }
    for start_word in ["crate", "super", "self"] {
        let mut from = 0;
        while let Some(pos) = rest[from..].find(start_word) {
            let at = from + pos;
            from = at + start_word.len();
            if at > 0 && is_ident(rest[..at].chars().next_back().unwrap_or(' ')) {
                continue;
            }
            let mut segs = vec![start_word.to_string()];
            let mut j = at + start_word.len();
            loop {
                let tail = &rest[j..];
                let trimmed = tail.trim_start();
                let Some(after) = trimmed.strip_prefix("::") else {
                    break;
                };
                let after_trim = after.trim_start();
                let ident: String = after_trim.chars().take_while(|&c| is_ident(c)).collect();
                if ident.is_empty() {
                    break;
                }
                j += tail.len() - after_trim.len() + ident.len();
                segs.push(ident);
            }
            if segs.len() > 1 {
                // `super::x` inside `crate::..` was already read with it.
                if start_word != "crate" && word_before(&rest, at).is_empty() {
                    let prev = rest[..at].trim_end();
                    if prev.ends_with("::") {
                        continue;
                    }
                }
                out.push((module_at(at), segs, line_of(at)));
            }
            from = j.max(from);
        }
    }
    out
}

/// The module a path names from module `here`: the longest prefix that is a module of the
/// crate. `None` for paths outside it (another crate, a child named without `self::`).
pub fn resolve(here: &ModPath, path: &[String], modules: &BTreeSet<ModPath>) -> Option<ModPath> {
    let mut abs: ModPath = match path.first().map(String::as_str) {
        Some("crate") => Vec::new(),
        Some("super") | Some("self") => here.clone(),
        _ => return None,
    };
    let mut segs = path.iter().skip(1).peekable();
    if path[0] == "super" {
        abs.pop();
        while segs.peek().is_some_and(|s| s.as_str() == "super") {
            segs.next();
            abs.pop();
        }
    }
    let mut best = abs.clone();
    for s in segs {
        abs.push(s.clone());
        if modules.contains(&abs) {
            best = abs.clone();
        } else {
            break;
        }
    }
    Some(best)
}

pub fn is_prefix(a: &[String], b: &[String]) -> bool {
    a.len() <= b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// A crate's imports between modules that are not one unit (neither contains the other).
pub fn imports(src: &Path) -> (BTreeSet<ModPath>, Vec<Import>) {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    // Files named by `#[path = ".."] mod x;`.
    let mut by_path = BTreeMap::new();
    for _ in 0..2 {
        for f in &files {
            let Some(m) = module_of(src, f, &by_path) else {
                continue;
            };
            let text = std::fs::read_to_string(f).unwrap();
            for (i, line) in text.lines().enumerate() {
                let Some(rest) = line.trim().strip_prefix("#[path = \"") else {
                    continue;
                };
                let target = rest.split('"').next().unwrap_or_default();
                let decl = text.lines().nth(i + 1).unwrap_or_default().trim();
                let name = decl
                    .trim_start_matches("pub ")
                    .trim_start_matches("mod ")
                    .trim_end_matches(';');
                let dir = f.parent().unwrap();
                let mut sub = m.clone();
                sub.push(name.to_string());
                by_path.insert(dir.join(target), sub);
            }
        }
    }
    let mut modules = BTreeSet::new();
    let mut parsed = Vec::new();
    for f in &files {
        let Some(m) = module_of(src, f, &by_path) else {
            continue;
        };
        modules.insert(m.clone());
        let code = code_only(&std::fs::read_to_string(f).unwrap());
        parsed.push((f.clone(), m, code));
    }
    let mut out = Vec::new();
    for (f, m, code) in &parsed {
        for (here, path, line) in paths_in(code, m) {
            let Some(to) = resolve(&here, &path, &modules) else {
                continue;
            };
            if is_prefix(m, &to) || is_prefix(&to, m) {
                continue;
            }
            out.push(Import {
                from: m.clone(),
                to,
                at: format!(
                    "{}:{line}",
                    f.strip_prefix(src.parent().unwrap()).unwrap().display()
                ),
            });
        }
    }
    (modules, out)
}
