//! Every parallel layout against the one-rank run, on a tiny three-module model (SigLIP-
//! style ViT + Whisper-style encoder + Llama-style LLM) over demo data:
//!
//! - the first step's gradient of every parameter (slices joined) within 1e-5 of the
//!   one-rank gradient, relative to the tensor's largest entry;
//! - 20 training steps whose losses match the one-rank run's within 1e-4 relative, for
//!   layouts covering TP, CP, PP and DP on every module, disjoint and colocated, uneven DP
//!   sizes between modules, a frozen encoder, ZeRO-1 on and off, activation
//!   recomputation (one rank, TP, CP + PP on the LLM and on both encoders);
//! - a checkpoint written under one layout resumed under another (and on one rank) gives
//!   the same losses as not stopping.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use braid_comm::Comm;
use braid_comm::local::{LocalComm, run_local};
use braid_dataloader::loader::{Loader, LoaderConfig, Row};
use braid_kernels::Device;
use braid_nn::{Module, Shard};
use braid_train::data::{rows_to_batch, split_even};
use braid_train::metrics::read_metrics;
use braid_train::parallel::ckpt::join_slices;
use braid_train::parallel::engine::Engine;
use braid_train::parallel::layout::Layouts;
use braid_train::parallel::model::{RankModel, ShardSource};
use braid_train::trainer::train;
use braid_train::{Quiet, Trainer};

mod common;
use common::{config, fixture, losses, run_dir};

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

/// The layouts checked over 20 steps: (name, `--set`s, frozen vision).
const LAYOUTS: &[(&str, &[&str], bool)] = &[
    (
        "one-rank-recompute",
        &[
            "parallel.llm.recompute=true",
            "parallel.vision.recompute=true",
            "parallel.audio.recompute=true",
        ],
        false,
    ),
    (
        "llm-tp2",
        &["parallel.world_size=4", "parallel.llm.tp=2"],
        false,
    ),
    (
        "llm-cp2-pp2-recompute",
        &[
            "parallel.world_size=6",
            "parallel.llm.cp=2",
            "parallel.llm.pp=2",
            "parallel.llm.recompute=true",
        ],
        false,
    ),
    (
        "llm-pp2-dp2-vision-tp2-audio-dp2",
        &[
            "parallel.world_size=8",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.vision.tp=2",
            "parallel.audio.dp=2",
        ],
        false,
    ),
    (
        "colocated-4-llm-tp2-recompute",
        &[
            "parallel.world_size=4",
            "parallel.placement=\"colocated\"",
            "parallel.llm.recompute=true",
            "parallel.llm.tp=2",
            "parallel.llm.dp=2",
            "parallel.vision.dp=4",
            "parallel.audio.tp=2",
            "parallel.audio.dp=2",
        ],
        false,
    ),
    (
        "colocated-8-cp-pp-dp",
        &[
            "parallel.world_size=8",
            "parallel.placement=\"colocated\"",
            "parallel.llm.cp=2",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.vision.dp=8",
            "parallel.audio.tp=2",
            "parallel.audio.dp=4",
        ],
        false,
    ),
    (
        "uneven-dp-3-2-2",
        &[
            "parallel.world_size=7",
            "parallel.vision.dp=3",
            "parallel.audio.dp=2",
            "parallel.llm.dp=2",
        ],
        false,
    ),
    (
        "frozen-vision-llm-tp2-pp2",
        &[
            "parallel.world_size=7",
            "parallel.llm.tp=2",
            "parallel.llm.pp=2",
            "parallel.vision.dp=2",
            r#"train.freeze=["vision"]"#,
        ],
        true,
    ),
    (
        "llm-cp3-tp2",
        &[
            "parallel.world_size=8",
            "parallel.llm.cp=3",
            "parallel.llm.tp=2",
        ],
        false,
    ),
    (
        "encoders-cp2-pp2-recompute",
        &[
            "parallel.world_size=9",
            "parallel.vision.cp=2",
            "parallel.vision.pp=2",
            "parallel.vision.recompute=true",
            "parallel.audio.cp=2",
            "parallel.audio.pp=2",
            "parallel.audio.recompute=true",
        ],
        false,
    ),
    (
        "colocated-encoder-stages",
        &[
            "parallel.world_size=4",
            "parallel.placement=\"colocated\"",
            "parallel.vision.pp=2",
            "parallel.vision.dp=2",
            "parallel.audio.cp=2",
            "parallel.audio.dp=2",
            "parallel.llm.tp=2",
            "parallel.llm.dp=2",
        ],
        false,
    ),
    (
        "dp2-no-zero1",
        &[
            "parallel.world_size=4",
            "parallel.llm.dp=2",
            "parallel.zero1=false",
        ],
        false,
    ),
];

#[test]
fn twenty_steps_of_every_layout_match_one_rank() {
    for (name, sets, frozen) in LAYOUTS {
        let got = losses(name, sets);
        assert_same_losses(name, &got, reference(*frozen));
    }
}

/// (name, shard, trainable, value bits) of every parameter a rank holds.
type Held = Vec<(String, Shard, bool, Vec<u32>)>;

fn held(m: &RankModel) -> Held {
    let mut out = Vec::new();
    m.visit_params(&mut |p| {
        let v = p.value.to_vec_f32().unwrap();
        let bits = v.iter().map(|x| x.to_bits()).collect();
        out.push((p.name.clone(), p.shard, p.is_trainable(), bits));
    });
    out
}

/// On every rank of every layout, the shards made alone equal the shards cut from the
/// full model of `extra` sets, bit for bit (names, slices, frozen state, values).
fn alone_equals_cut(what: &str, extra: &[&str]) {
    let dir = run_dir(&format!("alone-{what}"));
    for (name, sets, _) in LAYOUTS {
        let _ = std::fs::remove_dir_all(&dir);
        let all: Vec<&str> = sets.iter().chain(extra).copied().collect();
        let cfg = config(&dir, &all);
        let t = Trainer::new(cfg.clone(), false, &mut Quiet).unwrap();
        let full = t.model.as_ref().unwrap();
        let mconfig = braid_train::assemble::model_config(&cfg).unwrap();
        let alone = ShardSource::Direct {
            config: &mconfig,
            cfg: &cfg,
        };
        let per_rank = run_local(
            t.layouts.world,
            Duration::from_secs(60),
            |comm: LocalComm| {
                let rank = comm.rank();
                let cut = RankModel::build(ShardSource::Cut(full), &comm, &t.layouts, rank)?;
                let made = RankModel::build(alone, &comm, &t.layouts, rank)?;
                Ok::<_, braid_train::TrainError>((held(&cut), held(&made)))
            },
        )
        .unwrap_or_else(|f| panic!("{what} {name}: {f}"));
        for (rank, (want, got)) in per_rank.into_iter().enumerate() {
            assert!(!want.is_empty(), "{what} {name}: rank {rank} holds nothing");
            assert_eq!(want.len(), got.len(), "{what} {name}: rank {rank}: count");
            for (w, g) in want.iter().zip(&got) {
                assert_eq!(
                    (&w.0, w.1, w.2),
                    (&g.0, g.1, g.2),
                    "{what} {name}: rank {rank}"
                );
                assert!(w.3 == g.3, "{what} {name}: rank {rank}: `{}` differs", w.0);
            }
        }
    }
}

/// What a process of a world makes alone (every weight drawn by name, frozen modules
/// frozen) is what the threads cut from the full model.
#[test]
fn shards_made_alone_equal_shards_cut_from_the_full_model() {
    alone_equals_cut("random", &[]);
}

/// Modules started from Hugging Face folders: each process reads only its slices of the
/// memory-mapped files, and gets exactly the slices of the one-rank import.
#[test]
fn shards_read_alone_from_hugging_face_equal_the_cut_import() {
    // Hugging Face folders of every module: the export of a randomly initialized model.
    let dir = run_dir("hf-source");
    let _ = std::fs::remove_dir_all(&dir);
    let t = Trainer::new(config(&dir, &[]), false, &mut Quiet).unwrap();
    let hf = dir.join("hf");
    braid_train::export::export_hf(t.model.unwrap(), &hf).unwrap();
    let init = |m: &str| format!("model.{m}={{ init = \"hf:{}\" }}", hf.join(m).display());
    let (llm, vision, audio) = (init("llm"), init("vision"), init("audio"));
    alone_equals_cut("hf", &[&llm, &vision, &audio]);
}

/// A global batch of 6 rows of `cfg`'s data, every item decoded.
fn first_batch(cfg: &braid_train::RunConfig) -> Vec<Row> {
    let loader_cfg = LoaderConfig {
        seed: 3,
        batch_rows: 6,
        workers: 1,
        prefetch: 1,
        shuffle: true,
    };
    let mut loader = Loader::open(&cfg.data.path, &loader_cfg, 0, 1, None).unwrap();
    loader.next_batch().unwrap().rows
}

/// Each rank's loader decodes only the media its encoders take: on every layout, each
/// image (clip) is wanted by exactly the first-stage ranks of one vision (audio) replica,
/// all of its TP x CP ranks, and by no other rank.
#[test]
fn each_rank_decodes_only_the_media_of_its_encoder_replica() {
    let dir = run_dir("media");
    let rows = first_batch(&config(&dir, &[]));
    let images: usize = rows.iter().map(|r| r.images.len()).sum();
    let clips: usize = rows.iter().map(|r| r.audio.len()).sum();
    assert!(images > 1 && clips > 1, "{images} images, {clips} clips");
    for (name, sets, _) in LAYOUTS {
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = config(&dir, sets);
        let t = Trainer::new(cfg.clone(), false, &mut Quiet).unwrap();
        let full = t.model.as_ref().unwrap();
        let per_rank = run_local(
            t.layouts.world,
            Duration::from_secs(60),
            |comm: LocalComm| {
                let e = Engine::new(
                    ShardSource::Cut(full),
                    Arc::new(comm),
                    t.layouts.clone(),
                    &cfg,
                )?;
                let wanted = (e.media_filter())(&rows).unwrap();
                let role = |g: Option<&braid_train::parallel::model::ModuleGroups>| {
                    g.map(|g| (g.coord.pp == 0, g.coord.dp))
                };
                let vision = role(e.model.vision.as_ref().map(|v| &v.groups));
                let audio = role(e.model.audio.as_ref().map(|a| &a.groups));
                Ok::<_, braid_train::TrainError>((wanted, vision, audio))
            },
        )
        .unwrap_or_else(|f| panic!("{name}: {f}"));
        let dims = |g: Option<braid_comm::grid::Grid>| g.map_or(0, |g| g.dims.tp * g.dims.cp);
        for (kind, total, per_item) in [
            ("image", images, dims(t.layouts.vision)),
            ("clip", clips, dims(t.layouts.audio)),
        ] {
            let mut seen = 0;
            for (r, row) in rows.iter().enumerate() {
                let n = if kind == "image" {
                    row.images.len()
                } else {
                    row.audio.len()
                };
                for i in 0..n {
                    let wanting: Vec<usize> = (0..per_rank.len())
                        .filter(|&k| {
                            let w = &per_rank[k].0;
                            let set = if kind == "image" { &w.images } else { &w.clips };
                            set.contains(&(r, i))
                        })
                        .collect();
                    let roles: Vec<_> = wanting
                        .iter()
                        .map(|&k| {
                            if kind == "image" {
                                per_rank[k].1
                            } else {
                                per_rank[k].2
                            }
                        })
                        .collect();
                    assert_eq!(
                        wanting.len(),
                        per_item,
                        "{name}: {kind} {i} of row {r}: {wanting:?}"
                    );
                    assert!(
                        roles.windows(2).all(|w| w[0] == w[1])
                            && roles.iter().all(|x| x.is_some_and(|(first, _)| first)),
                        "{name}: {kind} {i} of row {r} wanted by {roles:?}"
                    );
                    seen += 1;
                }
            }
            assert_eq!(seen, total, "{name}");
        }
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

    for (name, sets, frozen) in LAYOUTS {
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

    let second = [
        "parallel.world_size=6",
        "parallel.llm.cp=2",
        "parallel.llm.pp=2",
    ];
    train(config(&dir, &second), true, &mut Quiet).unwrap();
    let got: Vec<(f64, f64)> = read_metrics(&dir.join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|m| (m.loss, m.grad_norm))
        .collect();
    assert_same_losses("8 ranks then 6", &got, want);

    train(config(&copy, &[]), true, &mut Quiet).unwrap();
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
    let full = |sets: &[&str]| {
        let cfg = config(&dir, sets);
        let t = braid_train::assemble::model_config(&cfg).unwrap();
        Layouts::new(&cfg.parallel, &t).unwrap_err().to_string()
    };
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
    let e = full(&["parallel.world_size=5", "parallel.vision.pp=3"]);
    assert!(e.contains("parallel.vision.pp"), "{e}");
    let e = full(&["parallel.world_size=4", "parallel.audio.tp=4"]);
    assert!(e.contains("parallel.audio.tp"), "{e}");
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
    let p = plan(&cfg, 2, Some(path.to_str().unwrap()), Some(&data), None).unwrap();
    let input_s = p.problem.input_s;
    assert!(input_s > 0.0 && input_s.is_finite(), "{input_s}");
    let g = plan(&cfg, 2, Some("h100"), Some(&data), None).unwrap();
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
