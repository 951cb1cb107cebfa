//! Benchmarks of braid-kernels ops: `cargo bench -p braid-kernels --bench kernels`.
//! Each section times an op with `Instant`, reports the median of several runs after a
//! warm-up, and prints a table.

use std::time::Instant;

use braid_kernels::ops::{self, AttentionSpec};
use braid_kernels::rng::Rng;
use braid_kernels::{Device, Result, Tensor};

/// Median wall time of `f` in milliseconds over `runs` runs, after one warm-up run.
fn median_ms(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Attention forward and backward on one causal sequence of T = 2048, NH = NKV = 8,
/// HS = 64. FLOPs are counted as FlashAttention does: forward 4 * HS * NH per visible
/// (query, key) pair (q·kᵀ and p·v), backward 2.5x the forward (its 5 block products;
/// the second recompute of P is not counted).
fn bench_attention() -> Result<()> {
    let (t, nh, nkv, hs, runs) = (2048, 8, 8, 64, 5);
    let dev = Device::Cpu;
    let mut rng = Rng::new(0);
    let q = Tensor::randn([t, nh, hs], 1.0, &mut rng, dev)?;
    let k = Tensor::randn([t, nkv, hs], 1.0, &mut rng, dev)?;
    let v = Tensor::randn([t, nkv, hs], 1.0, &mut rng, dev)?;
    let dout = Tensor::randn([t, nh, hs], 1.0, &mut rng, dev)?;
    let cu = [0, t];
    let spec = AttentionSpec {
        causal: true,
        scale: 1.0 / (hs as f64).sqrt() as f32,
    };
    let (out, lse) = ops::attention_fwd(&q, &k, &v, &cu, &spec)?;
    let fwd_ms = median_ms(runs, || {
        ops::attention_fwd(&q, &k, &v, &cu, &spec).map(drop)
    })?;
    let bwd_ms = median_ms(runs, || {
        ops::attention_bwd(&dout, &q, &k, &v, &out, &lse, &cu, &spec).map(drop)
    })?;
    let pairs = (t * (t + 1) / 2) as f64;
    let fwd_flop = 4.0 * pairs * (hs * nh) as f64;
    let gflops = |flop: f64, ms: f64| flop / (ms * 1e-3) / 1e9;
    println!(
        "attention, causal, T={t} NH={nh} NKV={nkv} HS={hs}, {} threads, median of {runs}",
        rayon::current_num_threads()
    );
    println!("{:<12} {:>10} {:>10}", "pass", "ms", "GFLOP/s");
    for (name, ms, flop) in [
        ("forward", fwd_ms, fwd_flop),
        ("backward", bwd_ms, 2.5 * fwd_flop),
        ("fwd + bwd", fwd_ms + bwd_ms, 3.5 * fwd_flop),
    ] {
        println!("{name:<12} {ms:>10.2} {:>10.1}", gflops(flop, ms));
    }
    println!();
    // One machine-readable line for tools/bench_vs_torch.py.
    println!("BENCH attention_fwd_ms={fwd_ms:.3} attention_bwd_ms={bwd_ms:.3}");
    Ok(())
}

fn main() -> Result<()> {
    bench_attention()?;
    Ok(())
}
