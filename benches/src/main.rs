//! Benchmarks of salus.
fn main() {}
