//! Every parallel layout against the one-rank run, on a tiny three-module model (SigLIP-
//! style ViT + Whisper-style encoder + Llama-style LLM) over demo data:
//!
//! - the first step's gradient of every parameter (slices joined) within 1e-5 of the
//!   one-rank gradient, relative to the tensor's largest entry;
//! - 20 training steps whose losses match the one-rank run's within 1e-4 relative, for
//!   layouts covering TP, CP, PP and DP on every module, disjoint and colocated, uneven DP
//!   sizes between modules, a frozen encoder, ZeRO-1 on and off, activation
//!   recomputation (one rank, TP, CP + PP on the LLM and on both encoders);
//! - a checkpoint written under one layout resumed under another (an interleaved
//!   pipeline, and one rank) gives the same losses as not stopping;
//! - interleaved pipeline stages (`parallel.llm.virtual_stages`) among the layouts;
//! - the overlapped schedule's layouts and the LLM-centric placement's the same way.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use braid_comm::local::{LocalComm, run_local};
use braid_dataloader::loader::Row;
use braid_kernels::Device;
use braid_nn::{Module, Shard};
use braid_train::data::{rows_to_batch, split_even};
use braid_train::metrics::read_metrics;
use braid_train::parallel::ckpt::join_slices;
use braid_train::parallel::engine::Engine;
use braid_train::parallel::layout::{Layouts, ModuleKind};
use braid_train::parallel::model::ShardSource;
use braid_train::trainer::train;
use braid_train::{Quiet, Trainer};

mod common;
use common::layouts::{CENTRIC, LAYOUTS, OVERLAPPED};
use common::{config, first_batch, fixture, losses, run_dir};

fn reference(frozen_vision: bool) -> &'static [(f64, f64)] {
    static PLAIN: OnceLock<Vec<(f64, f64)>> = OnceLock::new();
    static FROZEN: OnceLock<Vec<(f64, f64)>> = OnceLock::new();
    if frozen_vision {
        FROZEN.get_or_init(|| losses("ref-frozen", &[r#"train.freeze=["vision"]"#]))
    } else {
        PLAIN.get_or_init(|| losses("ref", &[]))
    }
}

fn assert_same_losses(what: &str, got: &[(f64, f64)], want: &[(f64, f64)]) {
    assert_eq!(got.len(), want.len(), "{what}: step count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let rel = (g.0 - w.0).abs() / w.0.abs();
        assert!(
            rel <= 1e-4,
            "{what}: step {} loss {} vs one rank {} (rel {rel:.2e})",
            i + 1,
            g.0,
            w.0
        );
        let rel_norm = (g.1 - w.1).abs() / w.1.abs();
        assert!(
            rel_norm <= 1e-3,
            "{what}: step {} grad norm {} vs one rank {}",
            i + 1,
            g.1,
            w.1
        );
    }
    // The run must actually learn, or matching would prove little.
    assert!(want.last().unwrap().0 < want[0].0 - 0.1, "{what}: {want:?}");
}

#[test]
fn twenty_steps_of_every_layout_match_one_rank() {
    for (name, sets, frozen) in LAYOUTS {
        let got = losses(name, sets);
        assert_same_losses(name, &got, reference(*frozen));
    }
}

#[test]
fn twenty_steps_of_every_overlapped_layout_match_one_rank() {
    for (name, sets, frozen) in OVERLAPPED {
        let got = losses(name, sets);
        assert_same_losses(name, &got, reference(*frozen));
    }
}

#[test]
fn twenty_steps_of_every_centric_layout_match_one_rank() {
    for (name, sets, frozen) in CENTRIC {
        let got = losses(name, sets);
        assert_same_losses(name, &got, reference(*frozen));
    }
}

/// The one-rank gradient of the first batch, by parameter name.
fn one_rank_grads(t: &mut Trainer, rows: &[Row], microbatches: usize) -> HashMap<String, Vec<f32>> {
    let refs: Vec<&Row> = rows.iter().collect();
    let micro: Vec<_> = split_even(refs.len(), microbatches)
        .into_iter()
        .map(|r| rows_to_batch(&refs[r], Device::Cpu).unwrap())
        .collect();
    let targets: usize = micro.iter().map(|b| b.num_targets()).sum();
    let model = t.model.as_mut().unwrap();
    model.zero_grads().unwrap();
    for mb in &micro {
        let (_, cache) = model.forward_normalized(mb, Some(targets)).unwrap();
        model.backward(cache).unwrap();
    }
    let mut out = HashMap::new();
    model.visit_params(&mut |p| {
        if let Some(g) = &p.grad {
            out.insert(p.name.clone(), g.to_vec_f32().unwrap());
        }
    });
    out
}

#[test]
fn first_step_gradients_of_every_layout_match_one_rank() {
    let dir = run_dir("grads");
    let _ = std::fs::remove_dir_all(&dir);
    let base = config(&dir, &[]);
    let mut t = Trainer::new(base.clone(), false, &mut Quiet).unwrap();
    let rows = first_batch(&base);
    let want = one_rank_grads(&mut t, &rows, base.train.microbatches);
    assert!(want.len() > 40, "{} trainable tensors", want.len());

    for (name, sets, frozen) in LAYOUTS.iter().chain(OVERLAPPED).chain(CENTRIC) {
        if *frozen {
            continue;
        }
        let cfg = config(&dir, sets);
        let model = t.model.as_ref().unwrap();
        let layouts = Layouts::new(&cfg.parallel, &model.config).unwrap();
        let world = layouts.world;
        // Every rank's primary slices: (name, shard, data, dims).
        let per_rank = run_local(world, Duration::from_secs(60), |comm: LocalComm| {
            let mut e = Engine::new(
                ShardSource::Cut(model),
                Arc::new(comm),
                layouts.clone(),
                &cfg,
            )?;
            e.forward_backward(&rows)?;
            let mut out = Vec::new();
            e.model.visit_params(&mut |p| {
                if let Some(g) = &p.grad
                    && e.plan.is_primary(&p.name)
                {
                    out.push((
                        p.name.clone(),
                        p.shard,
                        g.to_vec_f32().unwrap(),
                        g.dims().to_vec(),
                    ));
                }
            });
            Ok::<_, braid_train::TrainError>(out)
        })
        .unwrap_or_else(|f| panic!("{name}: {f}"));
        type Slices = Vec<(Shard, Vec<f32>, Vec<usize>)>;
        let mut slices: HashMap<String, Slices> = HashMap::new();
        for (n, s, d, dims) in per_rank.into_iter().flatten() {
            slices.entry(n).or_default().push((s, d, dims));
        }
        assert_eq!(slices.len(), want.len(), "{name}: every grad exactly once");
        for (n, mut parts) in slices {
            let (got, _) = join_slices(&n, &mut parts).unwrap();
            let w = &want[&n];
            let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
            let err = got
                .iter()
                .zip(w)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= 1e-5 * scale,
                "{name}: `{n}` grad differs by {err:e} (largest entry {scale:e})"
            );
        }
    }
}

#[test]
fn a_checkpoint_resumes_under_another_layout() {
    let want = reference(false);
    // 20 steps on 8 ranks (TP, PP, DP), checkpoints at 10 and 20; the last one removed,
    // the run resumes from step 10 on 6 ranks with CP, and (a copy) on one rank.
    let dir = run_dir("switch");
    let _ = std::fs::remove_dir_all(&dir);
    let first = [
        "parallel.world_size=8",
        "parallel.llm.tp=2",
        "parallel.llm.pp=2",
        "parallel.vision.dp=2",
        "parallel.audio.dp=2",
        "checkpoint.interval=10",
    ];
    train(config(&dir, &first), false, &mut Quiet).unwrap();
    assert!(
        dir.join("checkpoints/step-00000010/model-rank-00000.safetensors")
            .exists()
    );
    std::fs::remove_dir_all(dir.join("checkpoints/step-00000020")).unwrap();
    let copy = run_dir("switch-one-rank");
    let _ = std::fs::remove_dir_all(&copy);
    copy_dir(&dir, &copy);
    // A copy that lost one rank's file: resuming names the file, not a missing tensor.
    let lost = run_dir("switch-lost-rank");
    let _ = std::fs::remove_dir_all(&lost);
    copy_dir(&dir, &lost);
    std::fs::remove_file(lost.join("checkpoints/step-00000010/model-rank-00003.safetensors"))
        .unwrap();
    let e = train(config(&lost, &[]), true, &mut Quiet)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model-rank-00003.safetensors is missing") && e.contains("step-00000010"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&lost);
    // Losing the last rank's optimizer file leaves no gap in the numbering: resuming on
    // several ranks names it all the same (it had read as a tensor missing a slice).
    copy_dir(&dir, &lost);
    std::fs::remove_file(lost.join("checkpoints/step-00000010/optim-rank-00007.safetensors"))
        .unwrap();
    let e = train(
        config(&lost, &["parallel.world_size=4", "parallel.llm.dp=2"]),
        true,
        &mut Quiet,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("optim-rank-00007.safetensors (and any after it) is missing")
            && e.contains("step-00000010"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&lost);

    // Resumed interleaved: each stage's two chunks load their layers by name.
    let second = [
        "parallel.world_size=6",
        "parallel.llm.cp=2",
        "parallel.llm.pp=2",
        "parallel.llm.virtual_stages=2",
    ];
    train(config(&dir, &second), true, &mut Quiet).unwrap();
    let got: Vec<(f64, f64)> = read_metrics(&dir.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|m| (m.loss, m.grad_norm))
        .collect();
    assert_same_losses("8 ranks then 6", &got, want);

    // One rank, and another microbatch count (a plan for another world sets its own).
    train(config(&copy, &["train.microbatches=2"]), true, &mut Quiet).unwrap();
    let got: Vec<(f64, f64)> = read_metrics(&copy.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|m| (m.loss, m.grad_norm))
        .collect();
    assert_same_losses("8 ranks then one", &got, want);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn layouts_that_do_not_fit_the_model_or_world_name_the_key() {
    let dir = run_dir("bad");
    let layouts_of = |sets: &[&str]| {
        let cfg = config(&dir, sets);
        let t = braid_train::assemble::model_config(&cfg).unwrap();
        Layouts::new(&cfg.parallel, &t)
    };
    let full = |sets: &[&str]| layouts_of(sets).unwrap_err().to_string();
    let e = full(&["parallel.world_size=8", "parallel.llm.tp=3"]);
    assert!(
        e.contains("parallel.llm.tp") && e.contains("heads = 4"),
        "{e}"
    );
    let e = full(&["parallel.world_size=5", "parallel.llm.pp=3"]);
    assert!(
        e.contains("parallel.llm.pp") && e.contains("layers = 4"),
        "{e}"
    );
    let e = full(&["parallel.world_size=8", "parallel.llm.tp=8"]);
    assert!(e.contains("parallel.llm.tp"), "{e}");
    let e = full(&["parallel.world_size=8"]);
    assert!(
        e.contains("parallel.world_size") && e.contains("1 (vision) + 1 (audio) + 1 (llm) = 3"),
        "{e}"
    );
    let e = full(&[
        "parallel.world_size=4",
        "parallel.placement=\"colocated\"",
        "parallel.llm.dp=4",
    ]);
    assert!(
        e.contains("parallel.vision") && e.contains("whole world of 4"),
        "{e}"
    );
    // Reversed stages: the encoder's stage 0 on its last slice of ranks, the same
    // replicas in each slice.
    let layouts = layouts_of(&[
        "parallel.world_size=4",
        "parallel.placement=\"colocated\"",
        "parallel.llm.pp=4",
        "parallel.vision.pp=2",
        "parallel.vision.dp=2",
        "parallel.vision.reverse_stages=true",
        "parallel.audio.pp=2",
        "parallel.audio.dp=2",
    ])
    .unwrap();
    let (vision, audio) = (
        layouts.grid(ModuleKind::Vision).unwrap(),
        layouts.grid(ModuleKind::Audio).unwrap(),
    );
    let stages =
        |g: &braid_comm::grid::Grid| (0..4).map(|r| g.coord(r).unwrap().pp).collect::<Vec<_>>();
    assert_eq!(stages(vision), [1, 1, 0, 0]);
    assert_eq!(stages(audio), [0, 0, 1, 1]);
    // The start-up lines say which grids are reversed.
    let lines = layouts.describe();
    let reversed = |key: &str| {
        lines
            .iter()
            .any(|l| l.starts_with(key) && l.contains("stages reversed"))
    };
    assert!(
        reversed("vision") && !reversed("audio") && !reversed("llm"),
        "{lines:?}"
    );
    // And which LLM splits its backward.
    let lines = layouts_of(&[
        "parallel.world_size=4",
        "parallel.llm.pp=2",
        "parallel.llm.zero_bubble=true",
    ])
    .unwrap()
    .describe();
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("llm") && l.contains("zero-bubble")),
        "{lines:?}"
    );
    let e = full(&["parallel.world_size=5", "parallel.vision.pp=3"]);
    assert!(e.contains("parallel.vision.pp"), "{e}");
    let e = full(&["parallel.world_size=4", "parallel.audio.tp=4"]);
    assert!(e.contains("parallel.audio.tp"), "{e}");
    for v in ["3", "4"] {
        let e = full(&[
            "parallel.world_size=4",
            "parallel.llm.pp=2",
            &format!("parallel.llm.virtual_stages={v}"),
        ]);
        assert!(
            e.contains("parallel.llm.virtual_stages") && e.contains("model.llm.layers = 4"),
            "{e}"
        );
    }
    // "centric": the encoders tile the LLM's first stage, whole and inside its TP.
    let centric = |extra: &[&str]| {
        let mut sets = vec![
            "parallel.placement=\"centric\"",
            "parallel.world_size=8",
            "parallel.llm.tp=2",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.vision.dp=4",
            "parallel.audio.dp=4",
        ];
        sets.extend_from_slice(extra);
        full(&sets)
    };
    for (extra, key, says) in [
        (
            &["parallel.vision.dp=2"][..],
            "parallel.vision.dp",
            "set dp = 4",
        ),
        (
            &["parallel.vision.cp=2", "parallel.vision.dp=2"],
            "parallel.vision.cp",
            "set cp = 1",
        ),
        (
            &["parallel.audio.pp=2", "parallel.audio.dp=2"],
            "parallel.audio.pp",
            "set pp = 1",
        ),
        (&["parallel.llm.dp=1"], "parallel.llm", "whole world of 8"),
        (
            &["parallel.llm.first_stage_layers=4"],
            "parallel.llm.first_stage_layers",
            "leaves 0",
        ),
        (
            &["parallel.llm.first_stage_layers=0"],
            "parallel.llm.first_stage_layers",
            "leaves 4",
        ),
    ] {
        let e = centric(extra);
        assert!(e.contains(key) && e.contains(says), "{extra:?}: {e}");
    }
    let e = full(&[
        "parallel.placement=\"centric\"",
        "parallel.world_size=4",
        "parallel.llm.pp=2",
        "parallel.llm.dp=2",
        "parallel.vision.tp=2",
        "parallel.audio.dp=2",
    ]);
    assert!(
        e.contains("parallel.vision.tp") && e.contains("divides the LLM's (1)"),
        "{e}"
    );
    let e = full(&["parallel.world_size=3", "parallel.llm.first_stage_layers=2"]);
    assert!(
        e.contains("parallel.llm.first_stage_layers") && e.contains("one pipeline stage"),
        "{e}"
    );
}

/// On a shared CPU every rank's loader reads the whole global batch beside the step, so
/// the planner times the loader on the run's data; on GPUs it runs beside the step and
/// is not charged. A missing data folder is an error naming it.
#[test]
fn planning_on_a_cpu_times_the_loader_on_the_data() {
    use braid_balancer::cluster::Cluster;
    use braid_train::planning::{loader_seconds, plan};
    let dir = run_dir("plan-loader");
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = config(&dir, &[]);
    let data = fixture().join("packed");
    let mut cpu = Cluster::preset("h100").unwrap();
    cpu.shared_compute = true;
    let path = dir.join("cpu.toml");
    std::fs::write(&path, cpu.to_toml().unwrap()).unwrap();
    let p = plan(
        &cfg,
        2,
        Some(path.to_str().unwrap()),
        Some(&data),
        None,
        true,
    )
    .unwrap();
    let input_s = p.problem.input_s;
    assert!(input_s > 0.0 && input_s.is_finite(), "{input_s}");
    let g = plan(&cfg, 2, Some("h100"), Some(&data), None, true).unwrap();
    assert_eq!(g.problem.input_s, 0.0);
    let missing = dir.join("no-such-data");
    let e = loader_seconds(&cfg, &missing, 1).unwrap_err().to_string();
    assert!(e.contains("no-such-data"), "{e}");
    // A run laid out by `parallel.plan = "auto"` reports the plan's prediction beside
    // its measured median step.
    let run = config(
        &dir.join("run"),
        &[
            "parallel.plan=\"auto\"",
            "parallel.world_size=2",
            "train.steps=2",
        ],
    );
    let s = train(run, false, &mut Quiet).unwrap();
    let predicted = s.predicted.unwrap();
    assert_eq!(predicted.cluster, "h100");
    assert!(predicted.step_s > 0.0, "{predicted:?}");
    assert!(
        s.median_step_s.is_some_and(|m| m > 0.0),
        "{:?}",
        s.median_step_s
    );
    // "auto" plans once per run: the resumed run reuses the plan its start saved, and a
    // world it was not planned for is an error naming the file.
    assert!(dir.join("run").join("plan.toml").exists());
    let auto = |world: &str, steps: &str| {
        let sets = ["parallel.plan=\"auto\"", world, steps];
        config(&dir.join("run"), &sets)
    };
    let again = train(
        auto("parallel.world_size=2", "train.steps=3"),
        true,
        &mut Quiet,
    )
    .unwrap();
    assert_eq!(again.predicted, Some(predicted));
    let e = train(
        auto("parallel.world_size=4", "train.steps=4"),
        true,
        &mut Quiet,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("plan.toml") && e.contains("world_size = 4"),
        "{e}"
    );
}

/// A second run on a `run.dir` another live run holds is refused, naming the folder,
/// and the folder is free again once the first run is gone.
#[test]
fn a_second_run_in_the_same_folder_is_refused_while_the_first_lives() {
    let dir = run_dir("run-lock");
    let _ = std::fs::remove_dir_all(&dir);
    let first = Trainer::new(config(&dir, &[]), false, &mut Quiet).unwrap();
    let e = Trainer::new(config(&dir, &[]), false, &mut Quiet)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("run.dir") && e.contains("another braid train is running"),
        "{e}"
    );
    drop(first);
    Trainer::new(config(&dir, &[]), false, &mut Quiet).unwrap();
}

/// A shard whose bytes no longer match `dataset.json` (a flipped byte here) stops the run
/// before training, naming the shard and the way around; `data.verify = false` trains on.
#[test]
fn a_damaged_shard_is_refused_before_training() {
    let damaged = fixture().join("packed-damaged");
    let _ = std::fs::remove_dir_all(&damaged);
    copy_dir(&fixture().join("packed"), &damaged);
    let shard = std::fs::read_dir(&damaged)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "parquet"))
        .unwrap();
    let mut bytes = std::fs::read(&shard).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x5a;
    std::fs::write(&shard, bytes).unwrap();
    let dir = run_dir("damaged");
    let _ = std::fs::remove_dir_all(&dir);
    let path = format!("data.path={:?}", damaged.display().to_string());
    let e = Trainer::new(config(&dir, &[&path]), false, &mut Quiet)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("checksum mismatch") && e.contains("shard-") && e.contains("data.verify"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Trainer::new(
        config(&dir, &[&path, "data.verify=false"]),
        false,
        &mut Quiet,
    )
    .unwrap();
}
