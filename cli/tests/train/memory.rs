//! Each process holds only its share: the peak resident memory of a 101M-parameter model
//! trained by 4 tensor-parallel processes against one process.

use super::procs::launch;
use super::*;

/// The peak resident memory a line of `braid train`'s output reports, MiB: the summary's
/// `host memory      peak N MiB` or a rank's `peak host memory N MiB`.
fn peak_mib(line: &str) -> Option<f64> {
    let at = line
        .find("peak host memory ")
        .map(|i| i + 17)
        .or_else(|| line.find("host memory      peak ").map(|i| i + 22))?;
    line[at..].split_whitespace().next()?.parse().ok()
}

/// Each process holds only its share: a 101M-parameter model (the fixture's encoders, a
/// 12-layer, 768-wide LLM with a 32000-token vocabulary) with the LLM in TP 4 over 4
/// processes, every process's peak resident memory (VmHWM) under 40 % of the one-process
/// run's; rank 0, which reads the whole model back at the end to evaluate and export it,
/// included. Both runs report the same losses (within 1e-4: TP sums in another order).
#[test]
fn four_tp_processes_each_hold_under_40_percent_of_one_process() {
    reference(); // the dataset is packed once, by the reference run
    let model = [
        "model.llm.hidden=768",
        "model.llm.intermediate=2048",
        "model.llm.layers=12",
        "model.llm.heads=12",
        "model.llm.kv_heads=4",
        "model.llm.head_dim=64",
        "model.llm.vocab=32000",
        "model.projector.vision.out_dim=768",
        "model.projector.audio.out_dim=768",
        "train.steps=2",
        "checkpoint.interval=0",
    ];
    let mut sets: Vec<&str> = Vec::new();
    for s in &model {
        sets.extend(["--set", s]);
    }
    let one = fixture().join("runs/mem-one");
    let o = train(&one, &sets).output().unwrap();
    let out = text(&o);
    assert!(o.status.success(), "one process: {out}");
    // A 101M-parameter run folder (its export, its checkpoint) is 1.5 GiB: not kept.
    let a = losses(&one);
    let _ = std::fs::remove_dir_all(&one);
    assert!(out.contains("101.37M params"), "{out}");
    let whole = out.lines().find_map(peak_mib).expect("the summary's peak");
    let four = fixture().join("runs/mem-four");
    let mut layout = sets.clone();
    layout.extend([
        "--set",
        "parallel.placement=\"colocated\"",
        "--set",
        "parallel.llm.tp=4",
        "--set",
        "parallel.vision.dp=4",
        "--set",
        "parallel.audio.dp=4",
    ]);
    let o = launch(4, &four, &layout).output().unwrap();
    let out = text(&o);
    assert!(o.status.success(), "four processes: {out}");
    let b = losses(&four);
    let _ = std::fs::remove_dir_all(&four);
    let mut peaks = Vec::new();
    for rank in 0..4 {
        let tag = format!("[rank {rank}]");
        let peak = out
            .lines()
            .filter(|l| l.starts_with(&tag))
            .find_map(peak_mib)
            .unwrap_or_else(|| panic!("rank {rank} reports no peak: {out}"));
        peaks.push(peak);
    }
    eprintln!("peak resident MiB: one process {whole}, four processes {peaks:?}");
    for (rank, p) in peaks.iter().enumerate() {
        assert!(
            *p < 0.4 * whole,
            "rank {rank}: {p} MiB is {:.0} % of the one-process run's {whole} MiB",
            100.0 * p / whole
        );
    }
    assert_eq!((a.len(), b.len()), (2, 2));
    for (x, y) in a.iter().zip(&b) {
        let (lx, ly) = (f64::from_bits(x.1), f64::from_bits(y.1));
        assert!(
            (lx - ly).abs() <= 1e-4 * lx.abs(),
            "step {}: {lx} vs {ly}",
            x.0
        );
    }
}
