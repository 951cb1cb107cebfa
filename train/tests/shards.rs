//! Shards a process makes alone, against the shards threads cut from the full model:
//! random weights drawn by name and Hugging Face slices, bit for bit on every rank of
//! every layout; and each rank's loader decoding only the media its encoders take.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use braid_comm::Comm;
use braid_comm::local::{LocalComm, run_local};
use braid_nn::{Module, Shard};
use braid_train::parallel::engine::Engine;
use braid_train::parallel::model::{RankModel, ShardSource};
use braid_train::{Quiet, Trainer};

mod common;
use common::layouts::LAYOUTS;
use common::{config, first_batch, run_dir};

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
