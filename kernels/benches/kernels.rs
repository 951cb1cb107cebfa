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

/// Fused softmax cross-entropy (loss and dlogits in one call) on N = 2048 tokens over a
/// vocabulary of V = 8192: the LLM head's loss.
fn bench_cross_entropy() -> Result<()> {
    let (n, v, runs) = (2048usize, 8192usize, 11);
    let dev = Device::Cpu;
    let mut rng = Rng::new(3);
    let logits = Tensor::randn([n, v], 2.0, &mut rng, dev)?;
    let targets: Vec<u32> = (0..n).map(|i| (i * 7919 % v) as u32).collect();
    let targets = Tensor::from_vec_u32(targets, [n], dev)?;
    let ms = median_ms(runs, || {
        ops::loss::cross_entropy_fwd_bwd(&logits, &targets, u32::MAX, 1.0 / n as f32).map(drop)
    })?;
    println!(
        "cross_entropy, N={n} V={v}, {} threads, median of {runs}: {ms:.2} ms, {:.2} ns per logit",
        rayon::current_num_threads(),
        ms * 1e6 / (n * v) as f64
    );
    println!();
    println!("BENCH cross_entropy_ms={ms:.4}");
    Ok(())
}

/// The Whisper stem's two convolutions on a microbatch of `b` clips of `frames` mel frames
/// (80 bins) at width `c`, forward and backward (input, weight and bias grads), next to
/// one GEMM of the same FLOPs (`linear_fwd`, the rate the cost model assumes).
fn bench_conv(b: usize, frames: usize, c: usize) -> Result<()> {
    use braid_kernels::ops::conv::Conv1dSpec;
    let (mels, runs) = (80, 21);
    let dev = Device::Cpu;
    let mut rng = Rng::new(1);
    println!(
        "conv1d, Whisper stem, B={b} clips of {frames} frames, width {c}, {} threads, median of {runs}",
        rayon::current_num_threads()
    );
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>9} {:>11}",
        "conv", "fwd ms", "bwd ms", "GFLOP/s", "GEMM ms", "GEMM GF/s"
    );
    for (name, ci, l, stride) in [
        ("conv1 80->C k3", mels, frames, 1),
        ("conv2 C->C k3 s2", c, frames, 2),
    ] {
        let spec = Conv1dSpec { stride, padding: 1 };
        let x = Tensor::randn([b, ci, l], 1.0, &mut rng, dev)?;
        let w = Tensor::randn([c, ci, 3], 0.05, &mut rng, dev)?;
        let bias = Tensor::randn([c], 0.05, &mut rng, dev)?;
        let y = ops::conv1d_fwd(&x, &w, Some(&bias), &spec)?;
        let lo = y.shape().dims()[2];
        let dy = Tensor::randn([b, c, lo], 1.0, &mut rng, dev)?;
        let fwd_ms = median_ms(runs, || {
            ops::conv1d_fwd(&x, &w, Some(&bias), &spec).map(drop)
        })?;
        let mut dw = Tensor::full(0.0, [c, ci, 3], dev)?;
        let mut db = Tensor::full(0.0, [c], dev)?;
        let bwd_ms = median_ms(runs, || {
            ops::conv1d_bwd(&dy, &x, &w, &spec, Some(&mut dw), Some(&mut db)).map(drop)
        })?;
        // The same FLOPs as one GEMM: (B*LO, CI*K) @ (CI*K, C).
        let a = Tensor::randn([b * lo, ci * 3], 1.0, &mut rng, dev)?;
        let wm = Tensor::randn([c, ci * 3], 0.05, &mut rng, dev)?;
        let gemm_ms = median_ms(runs, || ops::linear_fwd(&a, &wm, None).map(drop))?;
        let flop = 2.0 * (b * lo * c * ci * 3) as f64;
        let gf = |ms: f64| flop / (ms * 1e-3) / 1e9;
        println!(
            "{name:<22} {fwd_ms:>9.3} {bwd_ms:>9.3} {:>9.1} {gemm_ms:>9.3} {:>11.1}",
            gf(fwd_ms),
            gf(gemm_ms)
        );
    }
    println!();
    Ok(())
}

/// Activations forward and backward (`activation_bwd`; SwiGLU's two grads) on
/// N = 2^20 values of N(0, 2), the MLP activation of a (1024, 1024) hidden.
fn bench_activations() -> Result<()> {
    use braid_kernels::ops::activation::{self as act, Activation};
    let (n, runs) = (1usize << 20, 15);
    let dev = Device::Cpu;
    let mut rng = Rng::new(2);
    let x = Tensor::randn([n], 2.0, &mut rng, dev)?;
    let up = Tensor::randn([n], 1.0, &mut rng, dev)?;
    let dy = Tensor::randn([n], 1.0, &mut rng, dev)?;
    println!(
        "activations, N = {n} values, {} threads, median of {runs}",
        rayon::current_num_threads()
    );
    println!(
        "{:<12} {:>9} {:>9} {:>12}",
        "op", "fwd ms", "bwd ms", "ns/value f+b"
    );
    let mut line = String::from("BENCH");
    for (name, a) in [
        ("gelu_erf", Some(Activation::GeluErf)),
        ("gelu_tanh", Some(Activation::GeluTanh)),
        ("silu", Some(Activation::Silu)),
        ("swiglu", None),
    ] {
        let (fwd, bwd) = match a {
            Some(a) => (
                median_ms(runs, || act::activation_fwd(&x, a).map(drop))?,
                median_ms(runs, || act::activation_bwd(&dy, &x, a).map(drop))?,
            ),
            None => (
                median_ms(runs, || act::swiglu_fwd(&x, &up).map(drop))?,
                median_ms(runs, || act::swiglu_bwd(&dy, &x, &up).map(drop))?,
            ),
        };
        let ns = (fwd + bwd) * 1e6 / n as f64;
        println!("{name:<12} {fwd:>9.3} {bwd:>9.3} {ns:>12.2}");
        line += &format!(" {name}_fwd_ms={fwd:.4} {name}_bwd_ms={bwd:.4}");
    }
    println!();
    println!("{line}");
    Ok(())
}

fn main() -> Result<()> {
    bench_attention()?;
    bench_activations()?;
    bench_cross_entropy()?;
    bench_conv(8, 100, 32)?;
    bench_conv(8, 3000, 384)?;
    Ok(())
}
