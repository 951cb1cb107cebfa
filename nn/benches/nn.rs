//! Benchmarks of braid-nn layers (filled in with the layers).
fn main() {}
