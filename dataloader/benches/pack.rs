//! Packing throughput and fill on the synthetic LLaVA-like mix, side by side with Python.
//!
//! `cargo bench -p braid-dataloader --bench pack` (env `PYTHON` picks the interpreter, default
//! `python3`; `PACK_BENCH_SIZES=100000,1000000` the corpus sizes). For each size it times, as
//! medians: the packer (`pack::pack`, default config: 10k-sample pool, balancing on) and best-fit
//! decreasing on bare lengths (`best_fit_decreasing_lengths`); writes the lengths (clipped to the
//! row, as truncation does) to `target/pack-bench/` and runs `tools/bench_pack_py.py` on them, a
//! textbook Python best-fit decreasing (sorted list + bisect). Ratios: Rust BFD vs Python BFD (same
//! algorithm, same packs) and the packer vs Python BFD.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use braid_dataloader::pack::synth::{Mix, generate};
use braid_dataloader::pack::{PackConfig, best_fit_decreasing_lengths, pack};

const CAP: usize = 4096;
const SEED: u64 = 1;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sizes: Vec<usize> = std::env::var("PACK_BENCH_SIZES")
        .unwrap_or_else(|_| "100000,1000000".into())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/pack-bench");
    std::fs::create_dir_all(&dir)?;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/bench_pack_py.py");
    println!("LLaVA-like mix, max_seq_len {CAP}, seed {SEED}");
    for n in sizes {
        let metas = generate(Mix::Llava, n, SEED);
        let runs = if n <= 200_000 { 5 } else { 3 };
        let config = PackConfig {
            max_seq_len: CAP,
            ..PackConfig::default()
        };
        let (mut t_pack, mut out) = (Vec::new(), None);
        for _ in 0..runs {
            let t = Instant::now();
            out = Some(pack(&metas, &config)?);
            t_pack.push(t.elapsed().as_secs_f64());
        }
        let out = out.ok_or("no run")?;
        let lengths: Vec<u32> = metas.iter().map(|m| m.llm_len.min(CAP as u32)).collect();
        let (mut t_bfd, mut bins) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            let t = Instant::now();
            bins = best_fit_decreasing_lengths(&lengths, CAP as u32);
            t_bfd.push(t.elapsed().as_secs_f64());
        }
        let used: u64 = lengths.iter().map(|&l| l as u64).sum();
        let bfd_fill = used as f64 / (bins.len() * CAP) as f64;
        let (tp, tb) = (median(t_pack), median(t_bfd));
        let s = &out.stats;
        println!("n = {n}");
        println!(
            "  rust packer (min-slack, pool 10k, balance): {:>9.0} samples/s ({tp:.3} s)  fill {:.4}  packs {}",
            n as f64 / tp,
            s.fill,
            s.packs
        );
        println!(
            "    vision max/mean {:.3} -> {:.3} (std/mean {:.3} -> {:.3})",
            s.vision.before.max_over_mean,
            s.vision.after.max_over_mean,
            s.vision.before.std / s.vision.before.mean.max(f64::MIN_POSITIVE),
            s.vision.after.std / s.vision.after.mean.max(f64::MIN_POSITIVE)
        );
        println!(
            "  rust best-fit decreasing (lengths):          {:>9.0} samples/s ({tb:.3} s)  fill {bfd_fill:.4}  packs {}",
            n as f64 / tb,
            bins.len()
        );
        let file = dir.join(format!("llava_{n}.u32"));
        let bytes: Vec<u8> = lengths.iter().flat_map(|l| l.to_le_bytes()).collect();
        std::fs::write(&file, bytes)?;
        let py_runs = if n <= 200_000 { "3" } else { "1" };
        let res = Command::new(&python)
            .arg(&script)
            .args(["--cap", &CAP.to_string(), "--runs", py_runs])
            .arg(&file)
            .output();
        match res {
            Ok(o) if o.status.success() => {
                let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
                let ps = v["seconds"].as_f64().ok_or("python: no seconds")?;
                let pf = v["fill"].as_f64().ok_or("python: no fill")?;
                let pp = v["packs"].as_u64().ok_or("python: no packs")?;
                println!(
                    "  python best-fit decreasing (bisect):         {:>9.0} samples/s ({ps:.3} s)  fill {pf:.4}  packs {pp}",
                    n as f64 / ps
                );
                println!(
                    "  ratio: rust BFD / python BFD = {:.1}x; rust packer / python BFD = {:.1}x (fill {:.4} vs {pf:.4})",
                    ps / tb,
                    ps / tp,
                    s.fill
                );
            }
            Ok(o) => println!("  python failed: {}", String::from_utf8_lossy(&o.stderr)),
            Err(e) => println!("  python not run ({python}: {e})"),
        }
    }
    Ok(())
}
