use braid_balancer::cluster::Cluster;
use braid_balancer::plan::search::{Space, search};
use braid_balancer::workload::{MediaTokens, Mix, Workload, generate};
use braid_balancer::{ModelDims, ModuleDims, Problem};

fn t(layers: usize, hidden: usize, heads: usize, kv: usize, hd: usize, ffn: usize, mats: usize, causal: bool, vocab: usize) -> ModuleDims {
    ModuleDims { layers, hidden, heads, kv_heads: kv, head_dim: hd, ffn, mlp_mats: mats, causal, vocab, tied: false, extra_params: 0 }
}

fn main() {
    let which = std::env::args().nth(1).unwrap_or("7b".into());
    let (model, mix, media, seq, rows) = if which == "7b" {
        (ModelDims {
            llm: t(32, 4096, 32, 32, 128, 11008, 3, true, 32000),
            vision: Some(t(24, 1024, 16, 16, 64, 4096, 2, false, 0)),
            audio: Some(t(24, 1024, 16, 16, 64, 4096, 2, false, 0)),
            vision_llm_ratio: 1.0, audio_llm_ratio: 0.125 },
         Mix { text_median: 120.0, text_sigma: 0.9, image_prob: 0.85, images_max: 1, audio_prob: 0.3, clips_max: 1, clip_s: [1.0, 30.0] },
         MediaTokens { image_encoder: 577, image_llm: 576, llm_per_frame: 0.125 }, 4096, 1024)
    } else {
        (ModelDims {
            llm: t(80, 8192, 64, 8, 128, 28672, 3, true, 32000),
            vision: Some(t(48, 3200, 32, 32, 100, 12800, 2, false, 0)),
            audio: Some(t(32, 1280, 20, 20, 64, 5120, 2, false, 0)),
            vision_llm_ratio: 0.25, audio_llm_ratio: 0.125 },
         Mix { text_median: 400.0, text_sigma: 1.0, image_prob: 0.7, images_max: 8, audio_prob: 0.3, clips_max: 4, clip_s: [10.0, 30.0] },
         MediaTokens { image_encoder: 1025, image_llm: 256, llm_per_frame: 0.125 }, 8192, 1024)
    };
    let n = rows * 3 * seq / 900;
    let pool = generate(&mix, media, n, seq, 1);
    let w = Workload { rows: pool, batch_rows: rows, seq_len: seq };
    println!("pool rows {} summary {:?}", w.rows.len(), w.summary());
    let p = Problem { model, cluster: Cluster::preset("h100").unwrap(), frozen: vec![] };
    for g in [64usize, 256, 1024, 4096] {
        let mut s = Space::new(g);
        if let Some(x) = std::env::args().nth(2) { if x == "ov" { s.schedule = braid_balancer::Schedule::Overlapped; s.placements = vec![braid_balancer::Placement::Disjoint]; } }
        match search(&p, &w, &s) {
            Ok(o) => {
                println!("G={g} best {:?} step {:.3}s bubble {:.2} mem {:.1}GiB | base {:?} {:.3}s | speedup {:.2} | brute {:?} | combos {} sims {} {:.2}s",
                    o.best.plan, o.best.sim.step_s, o.best.sim.bubble, o.best.sim.peak_memory/1073741824.0,
                    o.baseline.plan, o.baseline.sim.step_s, o.baseline.sim.step_s / o.best.sim.step_s,
                    o.brute.as_ref().map(|b| b.sim.step_s), o.combinations, o.simulated, o.search_s);
            }
            Err(e) => println!("G={g} error {e}"),
        }
    }
}
