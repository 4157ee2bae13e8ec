//! No module over 600 lines of code, tests aside (issue 27): within each crate of the
//! workspace, a module file's lines before its first `#[cfg(test)]`, blank lines and comments
//! not counted; files that hold only tests (`tests.rs`, `*_tests.rs`) are not counted. A module
//! that grows past it splits into children, each with one reason (docs/architecture.md).
//! Functions have their own bound (clippy's `too_many_lines`, 120, in the workspace's lints).

use std::path::{Path, PathBuf};

const MOST: usize = 600;

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
