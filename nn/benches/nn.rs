//! Benchmarks of braid-nn layers: one pre-norm transformer block (RMSNorm, causal GQA-free
//! attention with RoPE, SwiGLU MLP) forward and backward on packed samples.
//!
//! `cargo bench -p braid-nn`. Prints the median of N timed runs after a warmup, and the
//! achieved GFLOP/s counting model FLOPs (matmuls only, causal attention counted over the
//! unmasked half, backward = 2x forward, no recomputation).

use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_comm::SingleRank;
use braid_kernels::rng::Rng;
use braid_kernels::{Device, Tensor};
use braid_nn::{
    AttentionConfig, AttentionDims, BlockConfig, Init, MlpConfig, MlpKind, NormKind, RopeConfig,
    SeqInfo, TransformerBlock,
};

const WARMUP: usize = 1;
const RUNS: usize = 5;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (c, nh, nkv, hs, ff) = (512usize, 8usize, 8usize, 64usize, 1408usize);
    let lens = [1024usize; 4];
    let seq = SeqInfo::packed(&lens);
    let t = seq.num_tokens();
    let config = BlockConfig {
        attn: AttentionConfig {
            dims: AttentionDims { c, nh, nkv, hs },
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
    let dev = Device::Cpu;
    let mut block =
        TransformerBlock::new(&Init::new(0, dev), "blocks.0", config, Arc::new(SingleRank))?;
    let x = Tensor::randn([t, c], 1.0, &mut Rng::new(1), dev)?;
    let dy = Tensor::randn([t, c], 1.0, &mut Rng::new(2), dev)?;

    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + RUNS {
        let t0 = Instant::now();
        let (_, cache) = block.forward(&x, &seq)?;
        let t1 = Instant::now();
        block.backward(cache, &dy)?;
        let t2 = Instant::now();
        if i >= WARMUP {
            fwd.push(t1 - t0);
            bwd.push(t2 - t1);
        }
    }
    let (fwd, bwd) = (median(fwd), median(bwd));

    // Forward FLOPs: projections, then causal attention (QKᵀ and PV over L(L+1)/2 pairs).
    let tf = t as f64;
    let (cf, qf, kvf, fff) = (c as f64, (nh * hs) as f64, (nkv * hs) as f64, ff as f64);
    let linear = 2.0 * tf * cf * (qf + 2.0 * kvf + qf) + 2.0 * tf * cf * 3.0 * fff;
    let pairs: f64 = lens.iter().map(|&l| (l * (l + 1) / 2) as f64).sum();
    let attn = 2.0 * 2.0 * pairs * (nh * hs) as f64;
    let fwd_flops = linear + attn;
    let bwd_flops = 2.0 * fwd_flops;
    let gflops = |f: f64, d: Duration| f / d.as_secs_f64() / 1e9;
    println!(
        "transformer block T={t} ({}x{}) C={c} NH={nh} NKV={nkv} HS={hs} SwiGLU ff={ff} RMSNorm causal RoPE, {} threads",
        lens.len(),
        lens[0],
        rayon::current_num_threads(),
    );
    println!(
        "  forward : {:8.1} ms  {:6.1} GFLOP/s  ({:.2} GFLOP: {:.2} linear + {:.2} attention)",
        fwd.as_secs_f64() * 1e3,
        gflops(fwd_flops, fwd),
        fwd_flops / 1e9,
        linear / 1e9,
        attn / 1e9
    );
    println!(
        "  backward: {:8.1} ms  {:6.1} GFLOP/s  ({:.2} GFLOP)",
        bwd.as_secs_f64() * 1e3,
        gflops(bwd_flops, bwd),
        bwd_flops / 1e9
    );
    println!(
        "  fwd+bwd : {:8.1} ms  {:6.1} GFLOP/s  (median of {RUNS} after {WARMUP} warmup)",
        (fwd + bwd).as_secs_f64() * 1e3,
        gflops(fwd_flops + bwd_flops, fwd + bwd)
    );
    // One machine-readable line for tools/bench_vs_torch.py.
    println!(
        "BENCH block_fwd_ms={:.3} block_bwd_ms={:.3}",
        fwd.as_secs_f64() * 1e3,
        bwd.as_secs_f64() * 1e3
    );
    Ok(())
}
