//! Fuzz the fast engine's wire reading: any bytes as a client's request head, and what follows
//! it as a chunked reply body. `fuzz_one` asserts that no second Content-Length or transfer
//! coding is let through and that the chunked end does not move with how the bytes are split.
#![no_main]

#[path = "../../relay/src/wire.rs"]
#[allow(dead_code)] // the target uses fuzz_one alone
mod wire;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    wire::fuzz_one(data);
});
