//! Any bytes as a `salus.v1.Graph`, down salusd's graph path: decode, conversion,
//! validation and planning with the default limits, the sim device's cost; the memory
//! plan's invariants checked (`salus_fuzz::graphs`).
#![no_main]

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| {
    salus_fuzz::graphs::check_message(bytes);
});
