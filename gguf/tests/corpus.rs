//! The fuzz corpus as a regression suite on stable: every file parses or is refused, never panics.
//!
//! Files named `ok-*` must parse and `bad-*` must be refused; anything else (inputs cargo-fuzz
//! found, `crash-*`) must only not panic.

use std::path::Path;

#[test]
fn every_corpus_file_is_read_or_refused_without_panicking() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/read_header");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("the corpus directory exists") {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        let result = std::panic::catch_unwind(|| {
            gguf::read_header_from(&bytes[..], bytes.len() as u64, &name)
        });
        let Ok(result) = result else {
            panic!("{name} panicked the reader");
        };
        if name.starts_with("ok-") {
            assert!(result.is_ok(), "{name}: {}", result.unwrap_err());
        } else if name.starts_with("bad-") {
            let err = result.expect_err(&name);
            assert!(err.to_string().starts_with(&format!("{name}: ")), "{err}");
        }
        // The file-based path must agree with the in-memory one.
        assert_eq!(
            gguf::read_header(&path).is_ok(),
            gguf::read_header_from(&bytes[..], bytes.len() as u64, &name).is_ok()
        );
        seen += 1;
    }
    assert!(seen >= 10, "only {seen} corpus files in {}", dir.display());
}
