//! `braid profile`: measures the current device (the CPU for now) and writes a cluster
//! TOML for `braid plan --cluster`: the achieved matmul rate by GEMM size, the attention
//! kernel's share of it, the fixed cost of a transformer block, and the all-reduce
//! latency and bandwidth between ranks (threads of one process).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_balancer::cluster::{Cluster, GIB, Link, RatePoint};
use braid_balancer::plan::check::median;
use braid_comm::local::run_local;
use braid_comm::{Comm, SingleRank};
use braid_kernels::ops::{self, AttentionSpec};
use braid_kernels::rng::Rng;
use braid_kernels::{Device, Tensor};
use braid_nn::{
    AttentionConfig, AttentionDims, BlockConfig, Init, MlpConfig, MlpKind, NormKind, RopeConfig,
    SeqInfo, TransformerBlock,
};
use clap::Args;

#[derive(Debug, Args)]
pub struct ProfileArgs {
    /// Where to write the cluster TOML (then: braid plan --cluster PATH).
    #[arg(long, default_value = "cluster.toml")]
    out: PathBuf,
    /// Fewer and smaller sizes, fewer repeats, one round instead of the median of five:
    /// well under a second instead of ~10 s.
    #[arg(long)]
    quick: bool,
}

pub fn run(a: ProfileArgs) -> u8 {
    match profile(&a) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("braid profile: error: {e}");
            2
        }
    }
}

type Res<T> = Result<T, String>;

fn ctx<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> Res<T> {
    r.map_err(|e| format!("{what}: {e}"))
}

/// How hard to measure.
#[derive(Clone, Copy)]
struct Effort {
    /// Timed samples per measurement (the median is kept).
    samples: usize,
    /// Each sample repeats the call until it has run this long (tiny calls are timed in
    /// bulk, or the clock's resolution and one-off stalls would dominate).
    sample_s: f64,
}

/// Median seconds of one call of `f`, after a warm-up call.
fn time_median(e: Effort, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    let t0 = Instant::now();
    f()?; // warm-up: first-touch page faults, the rayon pool's threads, caches
    let once = t0.elapsed().as_secs_f64().max(1e-7);
    let iters = ((e.sample_s / once).ceil() as usize).clamp(1, 100_000);
    let mut per_call = Vec::with_capacity(e.samples);
    for _ in 0..e.samples {
        let t = Instant::now();
        for _ in 0..iters {
            f()?;
        }
        per_call.push(t.elapsed().as_secs_f64() / iters as f64);
    }
    per_call.sort_by(f64::total_cmp);
    Ok(per_call[per_call.len() / 2])
}

/// `rounds` calls of `f` (at least one).
fn each_round(rounds: usize, mut f: impl FnMut() -> Res<f64>) -> Res<Vec<f64>> {
    (0..rounds.max(1)).map(|_| f()).collect()
}

/// The median of `rounds` calls of `f`.
fn median_round(rounds: usize, f: impl FnMut() -> Res<f64>) -> Res<f64> {
    Ok(median(&each_round(rounds, f)?))
}

/// The least of `rounds` calls of `f`: for a small difference of a long timing and a
/// fixed figure, where a disturbance of a few per cent of the timing (which on a shared
/// machine only ever adds time) moves the difference by a multiple of itself.
fn least_round(rounds: usize, f: impl FnMut() -> Res<f64>) -> Res<f64> {
    Ok(each_round(rounds, f)?
        .into_iter()
        .fold(f64::INFINITY, f64::min))
}

/// The trainer's GEMM shapes: `(tokens M, hidden K, width N)`, ~1e5 to ~2e10 FLOPs.
const SIZES: [(usize, usize, usize); 6] = [
    (32, 64, 32),
    (128, 64, 128),
    (256, 256, 256),
    (512, 512, 1024),
    (1024, 1024, 2048),
    (2048, 1024, 4096),
];

/// Achieved rate of `linear_fwd` (what every projection of the trainer calls) on f32
/// CPU tensors, ascending in FLOPs.
fn matmul_rates(e: Effort, quick: bool) -> Res<Vec<RatePoint>> {
    let sizes = if quick { &SIZES[..4] } else { &SIZES[..] };
    let mut rng = Rng::new(1);
    let mut out = Vec::new();
    for &(m, k, n) in sizes {
        let x = ctx(
            Tensor::randn([m, k], 1.0, &mut rng, Device::Cpu),
            "matmul x",
        )?;
        let w = ctx(
            Tensor::randn([n, k], 0.02, &mut rng, Device::Cpu),
            "matmul w",
        )?;
        let flops = 2.0 * (m * n * k) as f64;
        let s = time_median(e, || {
            ctx(ops::linear_fwd(&x, &w, None), "linear_fwd").map(drop)
        })?;
        let tflops = flops / s / 1e12;
        eprintln!(
            "  matmul {m}x{k}x{n}: {flops:.2e} FLOPs in {:.3} ms = {:.2} GFLOP/s",
            s * 1e3,
            tflops * 1e3
        );
        out.push(RatePoint { flops, tflops });
    }
    Ok(out)
}

/// The attention kernel's achieved rate (forward + backward, the cost model's 3x the
/// forward's FLOPs) over the matmul rate at the forward's FLOPs, clamped to (0, 1].
fn attention_efficiency(e: Effort, quick: bool, c: &Cluster) -> Res<f64> {
    let (len, nseq, nh, hs) = (if quick { 128 } else { 256 }, 2usize, 4usize, 16usize);
    let t = len * nseq;
    let mut rng = Rng::new(2);
    let mut r = |shape: [usize; 3]| ctx(Tensor::randn(shape, 1.0, &mut rng, Device::Cpu), "qkv");
    let (q, k, v, dout) = (
        r([t, nh, hs])?,
        r([t, nh, hs])?,
        r([t, nh, hs])?,
        r([t, nh, hs])?,
    );
    let cu: Vec<usize> = (0..=nseq).map(|i| i * len).collect();
    let spec = AttentionSpec {
        causal: false,
        scale: 1.0 / (hs as f32).sqrt(),
    };
    let s = time_median(e, || {
        let (out, lse) = ctx(ops::attention_fwd(&q, &k, &v, &cu, &spec), "attention_fwd")?;
        ctx(
            ops::attention_bwd(&dout, &q, &k, &v, &out, &lse, &cu, &spec),
            "attention_bwd",
        )
        .map(drop)
    })?;
    // QKᵀ and PV: 2 x 2 FLOPs per attended pair and head dimension (balancer dims).
    let fwd = 4.0 * (nseq * len * len) as f64 * (nh * hs) as f64;
    let achieved = 3.0 * fwd / s;
    let eff = (achieved / c.matmul_rate(fwd)).clamp(1e-3, 1.0);
    eprintln!(
        "  attention {nseq}x{len} tokens, {nh} heads of {hs}: fwd+bwd {:.3} ms = {:.2} GFLOP/s, {:.2} of the matmul rate",
        s * 1e3,
        achieved / 1e9,
        eff
    );
    Ok(eff)
}

/// A pre-norm block (RMSNorm, causal attention with RoPE, SwiGLU) of width `c` with
/// `nh` heads of 16 and an MLP of `2c`, on `nseq` sequences of `len`: median seconds of
/// forward + backward, and the cost model's terms for it (forward FLOPs of the
/// projections, of attention, and the MLP GEMM's FLOPs that set its rate).
fn time_block(e: Effort, c: usize, nh: usize, nseq: usize, len: usize) -> Res<(f64, [f64; 3])> {
    let (hs, ff) = (c / nh, 2 * c);
    let lens = vec![len; nseq];
    let seq = SeqInfo::packed(&lens);
    let t = seq.num_tokens();
    let config = BlockConfig {
        attn: AttentionConfig {
            dims: AttentionDims { c, nh, nkv: nh, hs },
            causal: true,
            qkv_bias: false,
            o_bias: false,
            rope: Some(RopeConfig {
                theta: 1e4,
                rot_dim: hs,
            }),
        },
        mlp: MlpConfig {
            c,
            ff,
            kind: MlpKind::SwiGlu,
            bias: false,
        },
        norm: NormKind::RmsNorm,
        norm_eps: 1e-6,
    };
    let group: Arc<dyn Comm> = Arc::new(SingleRank);
    let mut block = ctx(
        TransformerBlock::new(&Init::new(0, Device::Cpu), "blocks.0", config, group),
        "block",
    )?;
    let mut rng = Rng::new(3);
    let x = ctx(Tensor::randn([t, c], 1.0, &mut rng, Device::Cpu), "x")?;
    let dy = ctx(Tensor::randn([t, c], 1.0, &mut rng, Device::Cpu), "dy")?;
    let s = time_median(e, || {
        let (_, cache) = ctx(block.forward(&x, &seq), "block forward")?;
        ctx(block.backward(cache, &dy), "block backward").map(drop)
    })?;
    let (tf, cf, width) = (t as f64, c as f64, (nh * hs) as f64);
    let linear = 2.0 * tf * cf * 4.0 * width + 2.0 * tf * cf * 3.0 * ff as f64;
    let pairs: f64 = lens.iter().map(|&l| (l * (l + 1) / 2) as f64).sum();
    Ok((s, [linear, 4.0 * pairs * width, 2.0 * tf * cf * ff as f64]))
}

/// Seconds the cost model gives a block's forward + backward (3 passes' worth) from the
/// matmul and attention rates alone.
fn flop_time(c: &Cluster, [linear, attention, gemm]: [f64; 3]) -> f64 {
    let rate = c.matmul_rate(gemm);
    3.0 * linear / rate + (1.0 + c.attention_backward) * attention / (rate * c.attention_efficiency)
}

/// Fixed cost of a transformer block per pass: a tiny block's (16 tokens, width 16)
/// forward + backward minus its FLOP time, over the 3 passes the cost model charges
/// (forward 1, backward 2).
fn layer_overhead_us(e: Effort, c: &Cluster) -> Res<f64> {
    let (s, f) = time_block(e, 16, 2, 2, 8)?;
    let flop_s = flop_time(c, f);
    let us = ((s - flop_s) / 3.0 * 1e6).max(0.0);
    eprintln!(
        "  tiny block (16 tokens, width 16): fwd+bwd {:.1} us, {:.1} us of it FLOPs -> {us:.1} us per block per pass",
        s * 1e6,
        flop_s * 1e6
    );
    Ok(us)
}

/// The non-matmul work per activation value: a block of the tiny config's LLM width (64)
/// on 512 tokens, less its FLOP time and fixed overhead, per token x width per pass.
fn elementwise_ns(e: Effort, quick: bool, c: &Cluster) -> Res<f64> {
    let (width, len) = (64usize, if quick { 128 } else { 256 });
    let (s, f) = time_block(e, width, 4, 2, len)?;
    let flop_s = flop_time(c, f);
    let fixed = 3.0 * c.layer_overhead_us * 1e-6;
    let values = (2 * len * width) as f64;
    let ns = ((s - flop_s - fixed) / 3.0 / values * 1e9).max(0.0);
    eprintln!(
        "  block (2x{len} tokens, width {width}): fwd+bwd {:.3} ms, {:.3} ms of it FLOPs -> {ns:.2} ns per value per pass",
        s * 1e3,
        flop_s * 1e3
    );
    Ok(ns)
}

/// The [`elementwise_ns`] block's main elementwise work timed directly on its width at 4x
/// its tokens (not as a difference of timings, which carries the matmul table's noise;
/// the longer rows dilute the per-call costs `layer_overhead_us` charges): its two RMSNorms
/// and residual adds, which TP without sequence parallelism repeats on every TP rank,
/// and what TP splits (SwiGLU on the MLP's width, RoPE on q and k), each forward and
/// backward. Returns (the repeated share, ns per activation value per pass): the share
/// sets `replicated_elementwise`, the ns a floor under `elementwise_ns`.
fn elementwise_parts(e: Effort, quick: bool) -> Res<(f64, f64)> {
    let (width, nh, len) = (64usize, 4usize, if quick { 128 } else { 1024 });
    let (t, hs, ff) = (2 * len, width / nh, 2 * width);
    let mut rng = Rng::new(5);
    let mut randn = |shape: &[usize], what: &str| {
        ctx(
            Tensor::randn(shape.to_vec(), 1.0, &mut rng, Device::Cpu),
            what,
        )
    };
    let x = randn(&[t, width], "x")?;
    let r = randn(&[t, width], "residual")?;
    let w = randn(&[width], "norm weight")?;
    let gate = randn(&[t, ff], "gate")?;
    let up = randn(&[t, ff], "up")?;
    let q = randn(&[t, nh, hs], "q")?;
    let cos = randn(&[t, hs / 2], "cos")?;
    let sin = randn(&[t, hs / 2], "sin")?;
    let mut dw = ctx(
        Tensor::zeros([width], braid_kernels::DType::F32, Device::Cpu),
        "norm weight grad",
    )?;
    let repeated = time_median(e, || {
        for _ in 0..2 {
            let (y, rstd) = ctx(ops::rms_norm_fwd(&x, &w, 1e-6), "rms_norm_fwd")?;
            let h = ctx(ops::add(&y, &r), "residual add")?;
            let dx = ctx(
                ops::rms_norm_bwd(&h, &x, &w, &rstd, Some(&mut dw)),
                "rms_norm_bwd",
            )?;
            ctx(ops::add(&dx, &h), "residual grad add").map(drop)?;
        }
        Ok(())
    })?;
    let split = time_median(e, || {
        let y = ctx(ops::swiglu_fwd(&gate, &up), "swiglu_fwd")?;
        ctx(ops::swiglu_bwd(&y, &gate, &up), "swiglu_bwd").map(drop)?;
        for _ in 0..2 {
            let y = ctx(ops::rope_fwd(&q, &cos, &sin), "rope_fwd")?;
            ctx(ops::rope_bwd(&y, &cos, &sin), "rope_bwd").map(drop)?;
        }
        Ok(())
    })?;
    let share = repeated / (repeated + split).max(1e-12);
    let ns = (repeated + split) / 3.0 / (t * width) as f64 * 1e9;
    eprintln!(
        "  elementwise (2x{len} tokens, width {width}): norms and residuals {:.3} ms, SwiGLU and RoPE {:.3} ms -> {share:.2} repeated by TP, {ns:.2} ns per value per pass",
        repeated * 1e3,
        split * 1e3
    );
    Ok((share, ns))
}

/// Median seconds of an all-reduce of `elems` f32 among 2 ranks (threads).
fn all_reduce_s(e: Effort, elems: usize) -> Res<f64> {
    let times = run_local(2, Duration::from_secs(60), |comm| -> Res<f64> {
        let mut t = ctx(Tensor::full(0.0, [elems], Device::Cpu), "all-reduce buffer")?;
        // One call per sample (sample_s 0): a per-rank calibration could give the ranks
        // different call counts, and their collectives would not pair up.
        time_median(
            Effort {
                samples: e.samples,
                sample_s: 0.0,
            },
            || ctx(comm.all_reduce_sum(&mut t), "all_reduce_sum"),
        )
    });
    let times = ctx(times, "all-reduce between 2 threads")?;
    Ok(times.iter().copied().fold(0.0, f64::max))
}

/// Latency from a 1-element all-reduce, bandwidth from a large one (ring model:
/// 2 ranks cost 2 latencies + bytes / bandwidth).
fn link(e: Effort, quick: bool) -> Res<Link> {
    let small = all_reduce_s(
        Effort {
            samples: e.samples * 20,
            ..e
        },
        1,
    )?;
    let elems = if quick { 1 << 20 } else { 1 << 23 };
    let large = all_reduce_s(e, elems)?;
    let bytes = 4.0 * elems as f64;
    let latency_us = small / 2.0 * 1e6;
    let bandwidth_gbs = bytes / (large - small).max(1e-9) / 1e9;
    eprintln!(
        "  all-reduce 2 ranks: 4 B in {:.1} us, {:.0} MB in {:.2} ms -> latency {latency_us:.1} us, {bandwidth_gbs:.2} GB/s",
        small * 1e6,
        bytes / 1e6,
        large * 1e3
    );
    Ok(Link {
        bandwidth_gbs,
        latency_us,
    })
}

fn memory_gib() -> Res<f64> {
    let text = ctx(std::fs::read_to_string("/proc/meminfo"), "/proc/meminfo")?;
    let kb = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .ok_or("/proc/meminfo: no MemTotal line")?;
    Ok(kb * 1024.0 / GIB)
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "host".into())
}

/// Writes `text` to `path` through a temporary file and a rename, so a reader never sees
/// half a file.
fn write_atomic(path: &Path, text: &str) -> Res<()> {
    braid_nn::hf::write_atomic(path, |tmp| {
        std::fs::write(tmp, text).map_err(|e| braid_nn::Error::io(tmp, "write", e))
    })
    .map_err(|e| format!("writing {}: {e}", path.display()))
}

fn profile(a: &ProfileArgs) -> Res<()> {
    // Fail on a bad --out before ~10 s of measuring.
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        return Err(format!(
            "--out {}: the folder {} does not exist",
            a.out.display(),
            dir.display()
        ));
    }
    let e = if a.quick {
        Effort {
            samples: 3,
            sample_s: 0.01,
        }
    } else {
        Effort {
            samples: 7,
            sample_s: 0.05,
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    eprintln!("braid profile: measuring the CPU ({threads} threads) ...");
    let matmul = matmul_rates(e, a.quick)?;
    let mut c = Cluster {
        name: format!("cpu-{}", host_name()),
        // Every rank is a thread of one process: no node boundary, so TP may span any
        // number of ranks.
        gpus_per_node: 64,
        memory_gib: memory_gib()?,
        usable_memory: 0.9,
        matmul,
        attention_efficiency: 1.0,
        // What the profile assumes when it splits a block's forward + backward into
        // passes: the backward is twice the forward, fixed costs included.
        attention_backward: 2.0,
        layer_overhead_us: 0.0,
        backward_overhead_us: None,
        elementwise_ns: 0.0,
        intra: Link {
            bandwidth_gbs: 1.0,
            latency_us: 0.0,
        },
        inter: Link {
            bandwidth_gbs: 1.0,
            latency_us: 0.0,
        },
        shared_compute: true,
        // Braid's CPU ranks compute in f32.
        compute_bytes: 4.0,
        replicated_elementwise: 0.0,
    };
    // Each derived figure is the median of `rounds` measurements: the overhead and the
    // elementwise cost are differences of two timings, and one disturbed sample (rayon's
    // workers asleep or spinning, another process) moved them 2x between runs.
    let rounds = if a.quick { 1 } else { 5 };
    let mut tables = vec![std::mem::take(&mut c.matmul)];
    for _ in 1..rounds {
        tables.push(matmul_rates(e, a.quick)?);
    }
    c.matmul = (0..tables[0].len())
        .map(|i| RatePoint {
            flops: tables[0][i].flops,
            tflops: median(&tables.iter().map(|t| t[i].tflops).collect::<Vec<_>>()),
        })
        .collect();
    c.attention_efficiency = median_round(rounds, || attention_efficiency(e, a.quick, &c))?;
    c.layer_overhead_us = median_round(rounds, || layer_overhead_us(e, &c))?;
    // The block's elementwise cost is its time less FLOPs and overhead, a small
    // difference: the small-GEMM rates' noise often drove it to 0, and a block timing 10 %
    // slow doubles it (its median over five rounds came out 5.6-11.4 ns per value in four
    // profiles a minute apart, each round 3.8-24.3 ns, which moved the CPU validation's
    // mean error 8.1-17.3 % on one set of measured steps). So the least round is kept, and the
    // directly timed norms, residuals, SwiGLU and RoPE are a floor under it.
    let parts = (0..rounds.max(1))
        .map(|_| elementwise_parts(e, a.quick))
        .collect::<Res<Vec<_>>>()?;
    c.replicated_elementwise = median(&parts.iter().map(|p| p.0).collect::<Vec<_>>());
    let direct_ns = median(&parts.iter().map(|p| p.1).collect::<Vec<_>>());
    c.elementwise_ns = least_round(rounds, || elementwise_ns(e, a.quick, &c))?.max(direct_ns);
    let l = link(e, a.quick)?;
    c.intra = l;
    c.inter = l;
    c.validate()
        .map_err(|m| format!("the measured cluster is invalid: {m}"))?;
    let body = format!(
        "# Written by `braid profile{}` on {} ({threads} CPU threads): achieved rates of Braid's CPU kernels.\n# Use it with: braid plan --cluster {}\n{}",
        if a.quick { " --quick" } else { "" },
        host_name(),
        a.out.display(),
        c.to_toml()?
    );
    write_atomic(&a.out, &body)?;
    let (lo, hi) = (&c.matmul[0], &c.matmul[c.matmul.len() - 1]);
    println!(
        "braid profile: {} ({threads} threads, {:.1} GiB)",
        c.name, c.memory_gib
    );
    println!(
        "  matmul          {:.2} GFLOP/s at {:.1e} FLOPs .. {:.2} GFLOP/s at {:.1e} FLOPs ({} sizes)",
        lo.tflops * 1e3,
        lo.flops,
        hi.tflops * 1e3,
        hi.flops,
        c.matmul.len()
    );
    println!(
        "  attention       {:.2} of the matmul rate",
        c.attention_efficiency
    );
    println!(
        "  block overhead  {:.1} us per block per pass, {:.2} ns per activation value",
        c.layer_overhead_us, c.elementwise_ns
    );
    println!(
        "  elementwise     {:.0}% of it on full hidden rows (norms, residuals: repeated by TP)",
        100.0 * c.replicated_elementwise
    );
    println!(
        "  all-reduce      {:.1} us latency, {:.2} GB/s",
        l.latency_us, l.bandwidth_gbs
    );
    println!("  wrote {}", a.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{least_round, median_round};

    #[test]
    fn median_round_takes_the_middle_round_and_passes_errors() {
        let mut seq = [9.0, 1.0, 4.0].into_iter();
        assert_eq!(median_round(3, || Ok(seq.next().unwrap_or(0.0))), Ok(4.0));
        assert_eq!(
            median_round(3, || Err::<f64, _>("boom".to_string())),
            Err("boom".to_string())
        );
    }

    #[test]
    fn least_round_takes_the_least_round_and_passes_errors() {
        let mut seq = [9.0, 1.0, 4.0].into_iter();
        assert_eq!(least_round(3, || Ok(seq.next().unwrap_or(0.0))), Ok(1.0));
        let mut calls = 0;
        assert_eq!(
            least_round(0, || {
                calls += 1;
                Ok(2.5)
            }),
            Ok(2.5)
        );
        assert_eq!(calls, 1, "zero rounds still measure once");
        assert_eq!(
            least_round(3, || Err::<f64, _>("boom".to_string())),
            Err("boom".to_string())
        );
    }
}
