//! No input panics the reader: a deterministic mutation loop over valid headers.
//!
//! Stable Rust's stand-in for the cargo-fuzz target: bit flips, byte overwrites, truncations,
//! inserted and overwritten huge counts, a few thousand times, in well under two seconds.

mod common;

use std::time::{Duration, Instant};

use common::llama_like;
use gguf::writer::Builder;

/// xorshift64*: deterministic, so a failure reproduces from its iteration number.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const HUGE: [u64; 6] = [
    1 << 60,
    u64::MAX,
    i64::MAX as u64,
    1 << 32,
    0xffff_ffff,
    (1 << 63) + 1,
];

fn mutate(rng: &mut Rng, mut bytes: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(4) {
        if bytes.is_empty() {
            break;
        }
        let at = rng.below(bytes.len());
        match rng.below(6) {
            0 => bytes[at] ^= 1 << rng.below(8),
            1 => bytes[at] = rng.next() as u8,
            2 => bytes.truncate(at),
            3 => {
                let v = HUGE[rng.below(HUGE.len())].to_le_bytes();
                let end = (at + 8).min(bytes.len());
                bytes[at..end].copy_from_slice(&v[..end - at]);
            }
            4 => {
                let v = HUGE[rng.below(HUGE.len())].to_le_bytes();
                bytes.splice(at..at, v);
            }
            _ => {
                // A small value type code (0..=15) where a type may be.
                let v = (rng.below(16) as u32).to_le_bytes();
                let end = (at + 4).min(bytes.len());
                bytes[at..end].copy_from_slice(&v[..end - at]);
            }
        }
    }
    bytes
}

#[test]
fn mutated_headers_never_panic() {
    let seeds = [
        llama_like().to_bytes(),
        llama_like().version(2).to_bytes(),
        Builder::new()
            .kv("general.architecture", "qwen35moe")
            .kv(
                "qwen35moe.attention.recurrent_layers",
                vec![true, false, true],
            )
            .kv("f64", 1.5f64)
            .kv("i64s", vec![-1i64, 2])
            .kv("u16s", vec![1u16])
            .to_bytes(),
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let started = Instant::now();
    let mut refused = 0;
    let iterations = 4000;
    for i in 0..iterations {
        let seed = &seeds[i % seeds.len()];
        let input = mutate(&mut rng, seed.clone());
        // Both a stated length that matches and one that overstates the stream.
        let result = std::panic::catch_unwind(|| {
            let a = gguf::read_header_from(&input[..], input.len() as u64, "m.gguf");
            let _ = gguf::read_header_from(&input[..], u64::MAX, "m.gguf");
            // The lean read walks arrays instead of keeping them: the same file, refused or
            // not, never a panic.
            let lean = gguf::read_header_lean_from(&input[..], input.len() as u64, "m.gguf");
            assert_eq!(
                lean.is_ok(),
                a.is_ok(),
                "lean and full reads agree on validity"
            );
            a
        });
        match result {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                refused += 1;
                assert!(e.to_string().starts_with("m.gguf: "), "{e}");
            }
            Err(_) => panic!("iteration {i} panicked on input {input:02x?}"),
        }
    }
    assert!(
        refused > iterations / 4,
        "mutations should mostly break the header: {refused}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}
