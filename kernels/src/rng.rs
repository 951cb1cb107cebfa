//! Deterministic, portable random numbers for initialization and tests.
//!
//! ChaCha8 is specified bit for bit (unlike `StdRng`, which may change between `rand`
//! releases), so a seed gives the same weights on every machine and every version, and
//! its state can be saved in a checkpoint.

use rand::{Rng as _, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// Seeded random source.
#[derive(Clone, Debug)]
pub struct Rng(ChaCha8Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(ChaCha8Rng::seed_from_u64(seed))
    }

    /// A generator for one named stream (a parameter, a dropout site): the same
    /// `(seed, name)` always gives the same numbers, whatever else was drawn before.
    /// This is what makes parameter init independent of construction order, and lets a
    /// tensor-parallel shard be cut from the same full tensor the single rank draws.
    pub fn for_name(seed: u64, name: &str) -> Self {
        // FNV-1a: stable across platforms and Rust versions (std's hasher is not).
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        Rng::new(seed ^ h.rotate_left(17))
    }

    /// `n` draws from Normal(0, std).
    pub fn normal_vec(&mut self, n: usize, std: f32) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        self.extend_normal(&mut out, n, std);
        out
    }

    /// Appends `n` draws from Normal(0, std) to `out` (the same draws as
    /// [`Rng::normal_vec`]), into room the caller may have reserved fallibly.
    pub fn extend_normal(&mut self, out: &mut Vec<f32>, n: usize, std: f32) {
        out.extend((0..n).map(|_| {
            let z: f32 = StandardNormal.sample(&mut self.0);
            z * std
        }));
    }

    /// `n` draws from Uniform[lo, hi).
    pub fn uniform_vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.0.random_range(lo..hi)).collect()
    }

    /// `n` integers from [0, hi).
    pub fn index_vec(&mut self, n: usize, hi: u32) -> Vec<u32> {
        (0..n).map(|_| self.0.random_range(0..hi)).collect()
    }
}
