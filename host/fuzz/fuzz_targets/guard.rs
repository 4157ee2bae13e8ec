//! Fuzz the browser guard's header parsing: any bytes as Host and Origin values, both binds,
//! four methods. `fuzz_one` asserts that an accepted request on a loopback bind named loopback.
#![no_main]

#[path = "../../features/src/guard/rules.rs"]
#[allow(dead_code)] // the target uses fuzz_one alone
mod rules;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = rules::fuzz_one(data);
});
