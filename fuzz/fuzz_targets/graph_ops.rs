//! Graphs built from structured input (real op names, small shapes, the attribute names
//! the validator reads), down the same path as `graph`: most inputs reach shape inference
//! and planning.
#![no_main]

libfuzzer_sys::fuzz_target!(|spec: salus_fuzz::structured::GraphSpec| {
    salus_fuzz::graphs::check_proto(&spec.to_proto());
});
