//! No module over 600 lines of code, tests aside (issue 27): within each crate of the
//! workspace, a module file's lines before its first `#[cfg(test)]`, blank lines and comments
//! not counted; files that hold only tests (`tests.rs`, `*_tests.rs`) are not counted. A module
//! that grows past it splits into children, each with one reason (docs/architecture.md).
//! Functions have their own bound (clippy's `too_many_lines`, 120, in the workspace's lints).
//! No crate over 8,000 lines of code counted the same way, and xtask, a dispatcher, under
//! 4,000 (issue 43). In the host's crates every `static` says why it is one (issue 43: what
//! serve was told is passed in types; a static is left where the process or the ABI makes one).

use std::path::{Path, PathBuf};

const MOST: usize = 600;
/// The most lines of code one crate may have (xtask: [`XTASK_MOST`]).
const CRATE_MOST: usize = 8_000;
const XTASK_MOST: usize = 4_000;

/// The lines of code of a module's text, tests aside.
fn lines_of_code(text: &str) -> usize {
    text.lines()
        .take_while(|l| l.trim() != "#[cfg(test)]" || l.starts_with(char::is_whitespace))
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .count()
}

fn module_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            module_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_stem().unwrap().to_string_lossy();
            if name != "tests" && !name.ends_with("_tests") {
                out.push(path);
            }
        }
    }
}

#[test]
fn no_module_has_over_600_lines_of_code() {
    let mut over = Vec::new();
    for src in onebit_tests::crate_sources() {
        let mut files = Vec::new();
        module_files(&src, &mut files);
        for file in files {
            let n = lines_of_code(&std::fs::read_to_string(&file).unwrap());
            if n > MOST {
                over.push(format!("{}: {n}", file.display()));
            }
        }
    }
    assert!(
        over.is_empty(),
        "modules over {MOST} lines of code, tests aside (split them by reason):\n{}",
        over.join("\n")
    );
}

#[test]
fn no_crate_has_over_8000_lines_of_code_and_xtask_under_4000() {
    let mut over = Vec::new();
    let mut sizes = Vec::new();
    for src in onebit_tests::crate_sources() {
        let mut files = Vec::new();
        module_files(&src, &mut files);
        let n: usize = files
            .iter()
            .map(|f| lines_of_code(&std::fs::read_to_string(f).unwrap()))
            .sum();
        let name = src.parent().unwrap().display().to_string();
        let most = if name.ends_with("/xtask") {
            XTASK_MOST
        } else {
            CRATE_MOST
        };
        sizes.push(format!("{name}: {n}"));
        if n > most {
            over.push(format!("{name}: {n} (at most {most})"));
        }
    }
    assert!(
        sizes.iter().any(|s| s.contains("/host/relay:")),
        "the host's crates are counted: {sizes:?}"
    );
    assert!(
        over.is_empty(),
        "crates over their lines of code (split them by reason):\n{}",
        over.join("\n")
    );
}

/// Every `static` in the host's crates (and every group of statics, and a `thread_local!`)
/// has a comment just above it saying why it is one.
#[test]
fn every_static_of_the_host_says_why_it_is_one() {
    let mut silent = Vec::new();
    for src in onebit_tests::crate_sources() {
        if !src.to_string_lossy().contains("/host/") {
            continue;
        }
        let mut files = Vec::new();
        module_files(&src, &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            silent.extend(
                statics_without_a_reason(&text)
                    .into_iter()
                    .map(|line| format!("{}:{line}", file.display())),
            );
        }
    }
    assert!(
        silent.is_empty(),
        "statics with no comment saying why (pass the value in a type instead, or say why \
         the process or the ABI makes it one):\n{}",
        silent.join("\n")
    );
}

/// The 1-based lines of the statics in `text` (tests aside) with no comment above them.
fn statics_without_a_reason(text: &str) -> Vec<usize> {
    let lines: Vec<&str> = text
        .lines()
        .take_while(|l| l.trim() != "#[cfg(test)]" || l.starts_with(char::is_whitespace))
        .map(str::trim)
        .collect();
    let mut silent = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let is_static = line.starts_with("static ") || line.starts_with("pub static ");
        if !is_static {
            continue;
        }
        // Above it: a comment, or another static of its group, or `thread_local! {` (then
        // the comment is above that).
        let mut j = i;
        let reason = loop {
            let Some(above) = j.checked_sub(1).map(|k| lines[k]) else {
                break false;
            };
            if above.starts_with("//") {
                break true;
            }
            if above.starts_with("static ")
                || above.starts_with("pub static ")
                || above.starts_with("thread_local!")
            {
                j -= 1;
                continue;
            }
            break false;
        };
        if !reason {
            silent.push(i + 1);
        }
    }
    silent
}

#[test]
fn a_static_needs_a_comment_above_it_or_its_group() {
    let text = "/// why\nstatic A: u8 = 0;\nstatic B: u8 = 0;\n\nstatic C: u8 = 0;\n\
                fn f() {\n    // why\n    thread_local! {\n        static D: u8 = 0;\n    }\n}\n\
                #[cfg(test)]\nstatic E: u8 = 0;\n";
    assert_eq!(statics_without_a_reason(text), vec![5]);
}

#[test]
fn blank_lines_comments_and_tests_are_not_counted() {
    let text = "//! about\nuse a;\n\n/// doc\nfn f() {\n    // why\n    g();\n}\n\
                #[cfg(test)]\nmod tests {\n    fn t() {}\n}\n";
    assert_eq!(lines_of_code(text), 4);
    let nested = "fn f() {\n    #[cfg(test)]\n    let x = 1;\n}\n";
    assert_eq!(
        lines_of_code(nested),
        4,
        "only a top-level #[cfg(test)] ends the count"
    );
}
