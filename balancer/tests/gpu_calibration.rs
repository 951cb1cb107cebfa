//! The cost model against one measured GPU: whole transformer blocks (Llama 7B/70B and
//! their TP shards, ViT-L, Whisper, a 6B ViT), forward and forward+backward, timed with
//! PyTorch on an NVIDIA H200 (`python3 tools/gpu_calibrate.py --out h200.json`, committed
//! as `fixtures/h200.json`), predicted by `StageCost` with the `h200` preset, whose
//! matmul table and attention efficiency come from the same file's GEMM and flash
//! attention sweeps. Compute only: one GPU has no links to time.
#![allow(clippy::unwrap_used)]

use braid_balancer::cluster::Cluster;
use braid_balancer::plan::StageCost;
use braid_balancer::plan::check::{median, rel_error, spearman};
use braid_balancer::{Layout, ModuleDims};
use serde::Deserialize;

#[derive(Deserialize)]
struct Block {
    name: String,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    llama: bool,
    seqs: usize,
    len: usize,
    fwd_s: f64,
    fwdbwd_s: f64,
}

#[derive(Deserialize)]
struct Gemm {
    flops: f64,
    tflops: f64,
}

#[derive(Deserialize)]
struct Measured {
    device: String,
    block: Vec<Block>,
    gemm: Vec<Gemm>,
}

fn measured() -> Measured {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/h200.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// (predicted forward, predicted forward+backward) seconds of one block on one GPU.
fn predict(b: &Block, cluster: &Cluster) -> (f64, f64) {
    let dims = ModuleDims {
        layers: 1,
        hidden: b.hidden,
        heads: b.heads,
        kv_heads: b.kv_heads,
        head_dim: b.head_dim,
        ffn: b.ffn,
        mlp_mats: if b.llama { 3 } else { 2 },
        causal: b.llama,
        vocab: 0,
        tied: false,
        extra_params: 0,
        stem_flops_per_token: 0.0,
        projector_flops_per_token: 0.0,
    };
    let sc = StageCost {
        dims: &dims,
        layout: Layout::ONE,
        cluster,
        recompute: false,
        zero1: true,
        frozen: false,
        checkpoint_stages: false,
        overlap_sync: false,
        sequence_parallel: true,
        first_stage_layers: None,
        chunks: 1,
        first_gpu: 0,
        split_backward: false,
    };
    let tokens = (b.seqs * b.len) as f64;
    let sq = (b.seqs * b.len * b.len) as f64;
    let f = sc.forward(0, tokens, sq).compute;
    (f, f + sc.backward(0, tokens, sq).compute)
}

#[test]
fn the_h200_preset_predicts_measured_blocks() {
    let m = measured();
    let c = Cluster::preset("h200").unwrap();
    println!("{}: {} blocks", m.device, m.block.len());
    println!(
        "{:22} {:>10} {:>10} {:>7}   {:>10} {:>10} {:>7}",
        "block", "fwd ms", "model", "err", "f+b ms", "model", "err"
    );
    let (mut mf, mut pf, mut mb, mut pb) = (vec![], vec![], vec![], vec![]);
    for b in &m.block {
        let (f, fb) = predict(b, &c);
        println!(
            "{:22} {:10.3} {:10.3} {:+6.0}%   {:10.3} {:10.3} {:+6.0}%",
            b.name,
            b.fwd_s * 1e3,
            f * 1e3,
            100.0 * rel_error(f, b.fwd_s),
            b.fwdbwd_s * 1e3,
            fb * 1e3,
            100.0 * rel_error(fb, b.fwdbwd_s)
        );
        mf.push(b.fwd_s);
        pf.push(f);
        mb.push(b.fwdbwd_s);
        pb.push(fb);
    }
    let err = |p: &[f64], m: &[f64]| {
        median(
            &p.iter()
                .zip(m)
                .map(|(p, m)| rel_error(*p, *m).abs())
                .collect::<Vec<_>>(),
        )
    };
    let (rf, rb) = (spearman(&mf, &pf), spearman(&mb, &pb));
    let (ef, eb) = (err(&pf, &mf), err(&pb, &mb));
    let worst = pb
        .iter()
        .zip(&mb)
        .map(|(p, m)| rel_error(*p, *m).abs())
        .fold(0.0, f64::max);
    println!(
        "forward: Spearman {rf:.3}, median |error| {:.1}%",
        100.0 * ef
    );
    println!(
        "forward+backward: Spearman {rb:.3}, median |error| {:.1}%, worst {:.1}%",
        100.0 * eb,
        100.0 * worst
    );
    assert!(m.block.len() >= 15, "the fixture lost its blocks");
    assert!(
        rf >= 0.95 && rb >= 0.95,
        "rank correlation {rf:.3} / {rb:.3}"
    );
    assert!(ef <= 0.10 && eb <= 0.10, "median error {ef:.3} / {eb:.3}");
    assert!(worst <= 0.20, "worst forward+backward error {worst:.3}");
}

/// Every point of the preset's matmul table lies within 10 % of the median measured rate
/// of the GEMMs within a factor 2 of its size (the table is the measurement, rounded).
#[test]
fn the_h200_matmul_table_is_the_measured_one() {
    let m = measured();
    let c = Cluster::preset("h200").unwrap();
    for p in &c.matmul {
        let near: Vec<f64> = m
            .gemm
            .iter()
            .filter(|g| (g.flops / p.flops).log2().abs() <= 1.0)
            .map(|g| g.tflops)
            .collect();
        assert!(
            !near.is_empty(),
            "no GEMM measured near {:e} FLOPs",
            p.flops
        );
        let med = median(&near);
        println!(
            "{:9.2e} FLOPs: preset {:5.0}, measured median {med:5.0} TFLOP/s ({} GEMMs)",
            p.flops,
            p.tflops,
            near.len()
        );
        assert!(
            (p.tflops / med - 1.0).abs() <= 0.10,
            "{:e} FLOPs: preset {} against measured {med}",
            p.flops,
            p.tflops
        );
    }
}
