//! No import circles between sibling modules of a crate (issue 27): within each crate of the
//! workspace, a module may use its parent's items and its own children's, but two siblings (or
//! the subtrees under them) must not use each other, directly or round a longer loop. The
//! code outside `#[cfg(test)]` is read for `crate::…` and `super::…` paths, braces expanded.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every module file under `src`, by its path (`relay::general`); the crate root is `[]`.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut module: Module = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            found.insert(module, path);
        }
    }
    found
}

/// Expand the use tree at the start of `text` (what follows `crate::` or `super::`, say
/// `a::b::{c, d::{e, self}};`) into its paths: `a::b::c`, `a::b::d::e`, `a::b::d`.
fn expand(text: &str) -> Vec<Module> {
    let mut out = Vec::new();
    tree(text.as_bytes(), &mut 0, Vec::new(), &mut out);
    out
}

fn skip_spaces(s: &[u8], i: &mut usize) {
    while s.get(*i).is_some_and(|c| c.is_ascii_whitespace()) {
        *i += 1;
    }
}

fn ident(s: &[u8], i: &mut usize) -> String {
    let start = *i;
    while s
        .get(*i)
        .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
    {
        *i += 1;
    }
    String::from_utf8_lossy(&s[start..*i]).into_owned()
}

/// One use tree: a path, then `::{tree, ...}`, `::*`, or its end (an `as` alias skipped).
fn tree(s: &[u8], i: &mut usize, mut path: Module, out: &mut Vec<Module>) {
    loop {
        match s.get(*i) {
            Some(b'{') => {
                *i += 1;
                loop {
                    skip_spaces(s, i);
                    if s.get(*i) == Some(&b'}') {
                        *i += 1;
                        return;
                    }
                    let before = *i;
                    tree(s, i, path.clone(), out);
                    skip_spaces(s, i);
                    match s.get(*i) {
                        Some(b',') => *i += 1,
                        Some(b'}') => {
                            *i += 1;
                            return;
                        }
                        _ if *i == before => return,
                        _ => return,
                    }
                }
            }
            Some(b'*') => {
                *i += 1;
                out.push(path);
                return;
            }
            _ => {}
        }
        let name = ident(s, i);
        if name.is_empty() {
            if !path.is_empty() {
                out.push(path);
            }
            return;
        }
        if name != "self" {
            path.push(name);
        }
        if s[*i..].starts_with(b"::") {
            *i += 2;
            continue;
        }
        let at = *i;
        skip_spaces(s, i);
        if s[*i..].starts_with(b"as ") {
            *i += 3;
            skip_spaces(s, i);
            ident(s, i);
        } else {
            *i = at;
        }
        out.push(path);
        return;
    }
}

/// The code of a file without line comments and without its `#[cfg(test)]` items (a `use` or
/// a static to its `;`, a module to its closing brace), wherever they stand: code after a
/// test-only item is read too.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let mut kept = String::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        kept.push_str(&rest[..at]);
        rest = &rest[at + "#[cfg(test)]".len()..];
        rest = &rest[item_end(rest)..];
    }
    kept.push_str(rest);
    kept
}

/// Where the item at the start of `text` ends: after its `;`, or after the brace that closes
/// its first `{`, whichever comes first.
fn item_end(text: &str) -> usize {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            ';' if depth == 0 => return i + 1,
            '{' => depth += 1,
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    text.len()
}

/// The edges between siblings: for a use of module B's item in module A, the two children
/// of their deepest common ancestor that hold A and B.
fn sibling_edges(src: &Path) -> BTreeSet<(Module, Module)> {
    let mods = modules(src);
    let mut edges = BTreeSet::new();
    for (module, path) in &mods {
        let text = code(path);
        let mut refs: Vec<Module> = Vec::new();
        for (at, _) in text.match_indices("crate::") {
            refs.extend(expand(&text[at + "crate::".len()..]));
        }
        // `super` is the parent of the file's module, whether it is `x.rs` or `x/mod.rs`.
        let parent = &module[..module.len().saturating_sub(1)];
        for (at, _) in text.match_indices("super::") {
            for r in expand(&text[at + "super::".len()..]) {
                refs.push(parent.iter().cloned().chain(r).collect());
            }
        }
        for r in refs {
            let Some(target) = (1..=r.len())
                .rev()
                .map(|k| r[..k].to_vec())
                .find(|k| mods.contains_key(k))
            else {
                continue;
            };
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common == module.len() || common == target.len() {
                continue; // a parent and its child
            }
            edges.insert((module[..=common].to_vec(), target[..=common].to_vec()));
        }
    }
    edges
}

/// The circles among `edges`: each strongly connected set of more than one module.
fn circles(edges: &BTreeSet<(Module, Module)>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&Module> = edges.iter().flat_map(|(a, b)| [a, b]).collect();
    let reaches = |from: &Module| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for (a, b) in edges {
                if *a == n && seen.insert(b.clone()) {
                    todo.push(b.clone());
                }
            }
        }
        seen
    };
    let mut found: BTreeSet<Vec<String>> = BTreeSet::new();
    for node in &nodes {
        let from = reaches(node);
        let mut circle: Vec<String> = nodes
            .iter()
            .filter(|other| from.contains(**other) && reaches(other).contains(*node))
            .map(|m| m.join("::"))
            .collect();
        if circle.len() > 1 {
            circle.sort();
            found.insert(circle);
        }
    }
    found.into_iter().collect()
}

#[test]
fn no_crate_has_an_import_circle_between_its_modules() {
    let mut all = Vec::new();
    for src in onebit_tests::crate_sources() {
        for circle in circles(&sibling_edges(&src)) {
            all.push(format!("{}: {}", src.display(), circle.join(" <-> ")));
        }
    }
    assert!(
        all.is_empty(),
        "modules that use each other (move what both need into one of them, or a third):\n{}",
        all.join("\n")
    );
}

#[test]
fn the_reader_sees_a_circle_through_braces_and_super() {
    let dir = std::env::temp_dir().join(format!("onebit-circles-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("relay")).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod relay; mod metrics;\n").unwrap();
    std::fs::write(dir.join("relay/mod.rs"), "mod a; mod b; pub struct App;\n").unwrap();
    std::fs::write(
        dir.join("relay/a.rs"),
        "use crate::relay::{App, b::{f, g}};\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("relay/b.rs"),
        "use super::a::x; // crate::metrics in a comment\n#[cfg(test)]\nuse crate::metrics;\n",
    )
    .unwrap();
    std::fs::write(dir.join("metrics.rs"), "use crate::relay::App;\n").unwrap();
    assert_eq!(
        circles(&sibling_edges(&dir)),
        vec![vec!["relay::a".to_string(), "relay::b".to_string()]]
    );
    std::fs::write(dir.join("relay/b.rs"), "pub fn f() {}\n").unwrap();
    std::fs::write(dir.join("relay/a.rs"), "use crate::metrics::M;\n").unwrap();
    assert_eq!(
        circles(&sibling_edges(&dir)),
        vec![vec!["metrics".to_string(), "relay".to_string()]]
    );
    // Code after a test-only item (a static, a test module) is still read.
    std::fs::write(dir.join("relay/a.rs"), "use super::b::f;\n").unwrap();
    std::fs::write(
        dir.join("relay/b.rs"),
        "#[cfg(test)]\nstatic T: u8 = 0;\n#[cfg(test)]\nmod tests { use crate::metrics; fn t() { {} } }\nuse super::a::x;\n",
    )
    .unwrap();
    assert_eq!(
        circles(&sibling_edges(&dir)),
        vec![vec!["relay::a".to_string(), "relay::b".to_string()]]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
