//! Fuzzes the GGUF header reader: no input may panic it or make it allocate past its size.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The stated length matches the stream, as for a real file.
    let _ = gguf::read_header_from(data, data.len() as u64, "fuzz.gguf");
    // A caller that overstates the length must not make claimed sizes allocate either.
    let _ = gguf::read_header_from(data, u64::MAX, "fuzz.gguf");
});
