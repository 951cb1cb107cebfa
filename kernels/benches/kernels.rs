//! Benchmarks of braid-kernels ops (filled in with the ops).
fn main() {}
