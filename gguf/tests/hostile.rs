//! Hostile and broken headers: each refusal, its byte offset and its exact message.

mod common;

use common::{error_text, llama_like, parse};
use gguf::ErrorKind;
use gguf::writer::Builder;

/// Raw header bytes, for inputs the writer cannot produce.
struct Raw(Vec<u8>);

impl Raw {
    /// Magic, version 3, and the two counts.
    fn header(tensors: u64, kvs: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(3).u64(tensors).u64(kvs);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Raw {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
}

fn kind(bytes: &[u8]) -> ErrorKind {
    parse(bytes).unwrap_err().kind()
}

#[test]
fn wrong_magic_says_what_the_file_is_not() {
    let elf = b"\x7fELF\x02\x01\x01\x00rest of a binary";
    assert_eq!(
        error_text(elf),
        "t.gguf: byte 0: not a GGUF file (magic 7f454c46); pass a .gguf model"
    );
    assert_eq!(kind(elf), ErrorKind::NotGguf);
    assert_eq!(
        error_text(b""),
        "t.gguf: byte 0: not a GGUF file (only 0 bytes long); pass a .gguf model"
    );
    assert_eq!(
        error_text(b"GG"),
        "t.gguf: byte 0: not a GGUF file (only 2 bytes long); pass a .gguf model"
    );
}

#[test]
fn unsupported_versions_are_refused() {
    let v = |n: u32| Builder::new().version(n).to_bytes();
    assert_eq!(
        error_text(&v(1)),
        "t.gguf: byte 4: GGUF version 1 is not supported (only 2 and 3); convert the model again with a current llama.cpp"
    );
    assert_eq!(
        error_text(&v(4)),
        "t.gguf: byte 4: GGUF version 4 is not supported (only 2 and 3); use a model converted for llama.cpp"
    );
    assert!(error_text(&v(0)).contains("version 0x00000000 looks byte-swapped"));
    assert_eq!(
        error_text(&v(0x0300_0000)),
        "t.gguf: byte 4: GGUF version 0x03000000 looks byte-swapped (a big-endian GGUF?); use a little-endian model"
    );
    assert_eq!(kind(&v(1)), ErrorKind::UnsupportedVersion);
}

#[test]
fn truncation_anywhere_says_where_the_file_ends() {
    let full = llama_like().to_bytes();
    // Inside the u32 value of the fifth key, "llama.embedding_length", at bytes 208..212.
    assert_eq!(
        error_text(&full[..210]),
        "t.gguf: byte 208: file ends inside key 'llama.embedding_length' (needs 4 bytes, 2 left); the file is incomplete, download it again"
    );
    assert_eq!(kind(&full[..210]), ErrorKind::Truncated);
    // Inside that key's name: its length (at byte 174) claims more than is left.
    assert_eq!(
        error_text(&full[..200]),
        "t.gguf: byte 174: key #4: string of 22 bytes but only 18 bytes remain in the file; the file is incomplete or corrupt, download it again"
    );
    assert_eq!(
        error_text(&full[..6]),
        "t.gguf: byte 4: file ends inside the version (needs 4 bytes, 2 left); the file is incomplete, download it again"
    );
    // Every cut inside the header is refused: as truncated or, where a count or length is
    // read before the cut, as a claim the remaining bytes cannot hold. (The last 32 bytes may
    // be alignment padding, which the reader never needs.)
    for cut in 4..full.len() - 32 {
        let k = kind(&full[..cut]);
        assert!(
            matches!(
                k,
                ErrorKind::Truncated | ErrorKind::AbsurdCount | ErrorKind::StringTooLong
            ),
            "cut at {cut}: {k:?}"
        );
    }
}

#[test]
fn a_stream_shorter_than_its_stated_length_is_truncated() {
    let full = llama_like().to_bytes();
    let err = gguf::read_header_from(&full[..100], full.len() as u64, "t.gguf").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Truncated);
}

#[test]
fn absurd_counts_are_refused_before_anything_is_allocated() {
    let huge = 1u64 << 60;
    assert_eq!(
        error_text(&Raw::header(0, huge).0),
        "t.gguf: byte 16: header claims 1152921504606846976 key/value pairs but only 0 bytes remain; the file is corrupt"
    );
    assert_eq!(
        error_text(&Raw::header(huge, 0).0),
        "t.gguf: byte 8: header claims 1152921504606846976 tensors but only 0 bytes remain; the file is corrupt"
    );
    assert_eq!(
        error_text(&Raw::header(u64::MAX / 2, 0).0),
        "t.gguf: byte 8: header claims 9223372036854775807 tensors but only 0 bytes remain; the file is corrupt"
    );
    assert_eq!(
        error_text(&Raw::header(0, u64::MAX).0),
        "t.gguf: byte 16: negative key/value count -1; the file is corrupt"
    );
    let mut r = Raw::header(0, 1);
    r.str("tokenizer.ggml.tokens").u32(9).u32(8).u64(huge);
    assert_eq!(
        error_text(&r.0),
        "t.gguf: byte 61: header claims 1152921504606846976 elements in key 'tokenizer.ggml.tokens' but only 0 bytes remain; the file is corrupt"
    );
    assert_eq!(kind(&r.0), ErrorKind::AbsurdCount);
    // Room for the metadata but not for the tensors it then claims.
    let mut r = Raw::header(1000, 1);
    r.str("a").u32(0);
    r.0.extend_from_slice(&[0u8; 24 * 1000 - 20]);
    assert_eq!(kind(&r.0), ErrorKind::AbsurdCount);
}

#[test]
fn a_string_longer_than_the_file_is_refused() {
    let mut r = Raw::header(0, 1);
    r.u64(1 << 62).0.extend_from_slice(&[b'a'; 20]);
    assert_eq!(
        error_text(&r.0),
        "t.gguf: byte 24: key #0: string of 4611686018427387904 bytes but only 20 bytes remain in the file; the file is corrupt"
    );
    let mut r = Raw::header(0, 1);
    r.str("general.name")
        .u32(8)
        .u64(100)
        .0
        .extend_from_slice(b"short");
    assert_eq!(
        error_text(&r.0),
        "t.gguf: byte 48: key 'general.name': string of 100 bytes but only 5 bytes remain in the file; the file is corrupt"
    );
    assert_eq!(kind(&r.0), ErrorKind::StringTooLong);
}

#[test]
fn an_unknown_value_type_is_refused() {
    let mut r = Raw::header(0, 1);
    r.str("k").u32(13).u64(0);
    assert_eq!(
        error_text(&r.0),
        "t.gguf: byte 33: key 'k': unknown value type 13 (GGUF defines 0 to 12); the file is corrupt or from a newer format"
    );
    let mut r = Raw::header(0, 1);
    r.str("k").u32(9).u32(0xdead).u64(0);
    assert_eq!(kind(&r.0), ErrorKind::UnknownValueType);
}

#[test]
fn nested_arrays_are_refused_without_recursing() {
    let mut r = Raw::header(0, 1);
    r.str("k").u32(9).u32(9).u64(1).u32(4).u64(1).u32(7);
    assert_eq!(
        error_text(&r.0),
        "t.gguf: byte 37: key 'k': array of arrays; nested arrays are not supported (llama.cpp refuses them too)"
    );
    // A deep chain of array headers is refused at its first level, however deep it goes.
    let mut r = Raw::header(0, 1);
    r.str("k").u32(9);
    for _ in 0..10_000 {
        r.u32(9).u64(1);
    }
    assert_eq!(kind(&r.0), ErrorKind::NestedArray);
}

#[test]
fn malformed_structure_is_refused() {
    let dup = Builder::new().kv("a", 1u8).kv("a", 2u8).to_bytes();
    assert_eq!(
        error_text(&dup),
        "t.gguf: byte 38: key 'a' appears twice; the file is corrupt"
    );
    let mut r = Raw::header(0, 1);
    r.str("").u32(0).0.extend_from_slice(&[0, 0]);
    assert_eq!(
        error_text(&r.0),
        "t.gguf: byte 24: key #0 is empty; the file is corrupt"
    );
    assert_eq!(
        error_text(&Builder::new().kv("general.alignment", 48u32).to_bytes()),
        "t.gguf: key 'general.alignment' is 48, must be a u32 power of two; the file is corrupt"
    );
    assert_eq!(
        error_text(&Builder::new().kv("general.alignment", 32u64).to_bytes()),
        "t.gguf: key 'general.alignment' is a u64, must be a u32 power of two; the file is corrupt"
    );
    assert_eq!(
        error_text(
            &Builder::new()
                .tensor("t", &[1, 1, 1, 1, 1], 0, 0)
                .to_bytes()
        ),
        "t.gguf: byte 33: tensor 't': 5 dimensions (ggml allows at most 4); the file is corrupt"
    );
    assert_eq!(
        error_text(&Builder::new().tensor("t", &[4, u64::MAX], 0, 0).to_bytes()),
        "t.gguf: byte 45: tensor 't': negative dimension -1; the file is corrupt"
    );
    assert_eq!(
        error_text(
            &Builder::new()
                .tensor("t", &[1 << 40, 1 << 40], 0, 0)
                .to_bytes()
        ),
        "t.gguf: byte 45: tensor 't': element count overflows; the file is corrupt"
    );
    assert_eq!(
        error_text(
            &Builder::new()
                .tensor("t", &[1], 0, 0)
                .tensor("t", &[1], 0, 32)
                .to_bytes()
        ),
        "t.gguf: byte 57: tensor 't' appears twice; the file is corrupt"
    );
    let long = "x".repeat(64);
    assert_eq!(
        error_text(&Builder::new().tensor(long, &[1], 0, 0).to_bytes()),
        "t.gguf: byte 24: tensor #0: name of 64 bytes (llama.cpp allows at most 63); the file is corrupt"
    );
    assert_eq!(kind(&dup), ErrorKind::Malformed);
}
