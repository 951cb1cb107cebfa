//! GEMM throughput of the CPU backend (`ops::matmul`, f32) at the sizes Braid uses,
//! on 1 and 2 threads: `cargo bench -p braid-kernels --bench gemm`.
//!
//! Each case: 2 warmup runs, then the median of N timed runs (this machine is noisy;
//! the median is the figure to quote). Allocation of the output is included, as a
//! layer would pay it.

use std::time::Instant;

use braid_kernels::rng::Rng;
use braid_kernels::{Device, Result, Tensor, ops};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench_case(m: usize, n: usize, k: usize, trans_b: bool, reps: usize) -> Result<f64> {
    let mut rng = Rng::new(7);
    let a = Tensor::randn([m, k], 1.0, &mut rng, Device::Cpu)?;
    let b_shape = if trans_b { [n, k] } else { [k, n] };
    let b = Tensor::randn(b_shape, 1.0, &mut rng, Device::Cpu)?;
    for _ in 0..2 {
        ops::matmul(&a, &b, false, trans_b)?;
    }
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        let c = ops::matmul(&a, &b, false, trans_b)?;
        times.push(t0.elapsed().as_secs_f64());
        drop(c);
    }
    Ok(2.0 * (m * n * k) as f64 / median(times) / 1e9)
}

fn main() -> Result<()> {
    // (M, N, K, B transposed, label): 1024^3 is the headline; the others are a
    // transformer block's projections at T = 4096, C = 512 (weights are (out, in),
    // hence B transposed).
    let cases = [
        (1024, 1024, 1024, false, "1024^3"),
        (4096, 1536, 512, true, "qkv  4096x1536x512"),
        (4096, 512, 512, true, "proj 4096x512x512"),
        (4096, 2048, 512, true, "up   4096x2048x512"),
        (4096, 512, 2048, true, "down 4096x512x2048"),
    ];
    println!("braid-kernels ops::matmul, f32, median GFLOP/s");
    println!(
        "{:<22} {:>10} {:>10} {:>8}",
        "case", "1 thread", "2 threads", "speedup"
    );
    for (m, n, k, tb, label) in cases {
        let mut g = [0.0f64; 2];
        for (slot, threads) in [1usize, 2].into_iter().enumerate() {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .map_err(|e| braid_kernels::Error::invalid("bench", e.to_string()))?;
            g[slot] = pool.install(|| bench_case(m, n, k, tb, 9))?;
        }
        println!(
            "{label:<22} {:>10.1} {:>10.1} {:>7.2}x",
            g[0],
            g[1],
            g[1] / g[0]
        );
        if label == "1024^3" {
            // Machine-readable, for tools/bench_vs_torch.py.
            println!(
                "BENCH gemm1024_t1_gflops={:.2} gemm1024_t2_gflops={:.2}",
                g[0], g[1]
            );
        }
    }
    Ok(())
}
