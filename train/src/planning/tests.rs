//! `parallel.plan` files and `"auto"`: what a plan sets, what it refuses, and a search on the tiny config.
use super::*;
use braid_balancer::{Placement, Plan};

/// `configs/<name>` with `sets` applied.
pub(super) fn config(name: &str, sets: &[&str]) -> RunConfig {
    let path = format!("{}/../configs/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::from_toml(&text, name, &sets).unwrap()
}

/// configs/tiny.toml's model and batch, with a synthetic mix to plan on.
pub(super) fn tiny(sets: &[&str]) -> RunConfig {
    config("tiny.toml", sets)
}

/// A plan file for `gpus` GPUs of the h100 preset: predicted 1 s a step, the baseline 2 s.
fn file_of(gpus: usize, plan: Plan) -> PlanFile {
    PlanFile {
        gpus,
        cluster: "h100".into(),
        step_time_s: 1.0,
        baseline_step_time_s: 2.0,
        sequence_parallel: false,
        plan,
    }
}

#[test]
fn a_plan_file_sets_the_world_layouts_and_microbatches() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.toml");
    let file = file_of(
        4,
        Plan {
            placement: Placement::Colocated,
            schedule: Schedule::Phased,
            microbatches: 2,
            recompute: true,
            recompute_encoders: false,
            recompute_audio: None,
            llm_first_stage_layers: None,
            llm_virtual_stages: 2,
            reverse_encoder_stages: false,
            llm_zero_bubble: false,
            zero1: false,
            llm: braid_balancer::Layout {
                tp: 2,
                cp: 1,
                pp: 2,
                dp: 1,
            },
            vision: Some(braid_balancer::Layout {
                tp: 1,
                cp: 1,
                pp: 1,
                dp: 4,
            }),
            audio: None,
        },
    );
    file.write(&path).unwrap();
    assert_eq!(PlanFile::read(&path).unwrap(), file);
    let mut cfg = tiny(&[&format!("parallel.plan={}", path.display())]);
    let applied = apply(&mut cfg).unwrap();
    let notes = &applied.notes;
    assert!(notes.iter().any(|n| n.contains("4 GPUs")), "{notes:?}");
    // The run's summary will set the plan's prediction beside its measured steps.
    let predicted = applied.predicted.unwrap();
    assert_eq!(
        (predicted.step_s, predicted.cluster.as_str()),
        (file.step_time_s, file.cluster.as_str())
    );
    assert_eq!(cfg.parallel.world_size, 4);
    assert_eq!(cfg.parallel.placement, crate::config::Placement::Colocated);
    assert_eq!((cfg.parallel.llm.tp, cfg.parallel.llm.pp), (2, 2));
    // Interleaved: two chunks per LLM stage.
    assert_eq!(cfg.parallel.llm.virtual_stages, 2);
    assert_eq!(cfg.parallel.vision.dp, 4);
    assert_eq!(cfg.parallel.audio.dp, 1);
    // Recomputation is the plan's, per module.
    assert!(cfg.parallel.llm.recompute);
    assert!(!cfg.parallel.vision.recompute && !cfg.parallel.audio.recompute);
    assert_eq!(cfg.train.microbatches, 2);
    assert!(!cfg.parallel.zero1);
    assert!(
        !notes.iter().any(|n| n.contains("sequence-parallel")),
        "{notes:?}"
    );
    // Planned with sequence-parallel TP (a GPU plan), which braid train's TP does not
    // run: the run says so, since its TP ranks hold more than the plan counted.
    let sp = PlanFile {
        sequence_parallel: true,
        ..file.clone()
    };
    sp.write(&path).unwrap();
    assert!(
        std::fs::read_to_string(&path)
            .unwrap()
            .contains("sequence_parallel = true")
    );
    let mut cfg = tiny(&[&format!("parallel.plan={}", path.display())]);
    let notes = apply(&mut cfg).unwrap().notes;
    assert!(
        notes.iter().any(|n| n.contains("sequence-parallel TP")),
        "{notes:?}"
    );
    // Without TP nothing differs: no note.
    let mut no_tp = sp.clone();
    no_tp.plan.llm = braid_balancer::Layout {
        tp: 1,
        cp: 1,
        pp: 2,
        dp: 2,
    };
    no_tp.write(&path).unwrap();
    let mut cfg = tiny(&[&format!("parallel.plan={}", path.display())]);
    let notes = apply(&mut cfg).unwrap().notes;
    assert!(
        !notes.iter().any(|n| n.contains("sequence-parallel")),
        "{notes:?}"
    );
    // A missing file names the key.
    let mut bad = tiny(&["parallel.plan=/nonexistent/plan.toml"]);
    let e = apply(&mut bad).unwrap_err().to_string();
    assert!(e.contains("parallel.plan"), "{e}");
}

#[test]
fn a_hostile_plan_file_is_an_error_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.toml");
    let layout = |dp| braid_balancer::Layout {
        tp: 1,
        cp: 1,
        pp: 2,
        dp,
    };
    let plan = Plan {
        placement: Placement::Disjoint,
        schedule: Schedule::Phased,
        microbatches: 2,
        recompute: false,
        recompute_encoders: false,
        recompute_audio: None,
        llm_first_stage_layers: None,
        llm_virtual_stages: 1,
        reverse_encoder_stages: false,
        llm_zero_bubble: false,
        zero1: true,
        llm: layout(1),
        vision: Some(layout(1)),
        audio: Some(layout(1)),
    };
    let run = |plan: Plan| {
        let file = file_of(6, plan);
        file.write(&path).unwrap();
        let mut cfg = tiny(&[&format!("parallel.plan={}", path.display())]);
        // Applying sets the config; the layouts are checked as the trainer does.
        apply(&mut cfg)?;
        cfg.validate()?;
        let model = crate::assemble::model_config(&cfg)?;
        crate::parallel::layout::Layouts::new(&cfg.parallel, &model)?;
        Ok::<(), TrainError>(())
    };
    assert!(run(plan.clone()).is_ok());
    // No model chunk on a stage: rejected, not read as 1.
    let e = run(Plan {
        llm_virtual_stages: 0,
        reverse_encoder_stages: false,
        llm_zero_bubble: false,
        ..plan.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("llm_virtual_stages = 0"), "{e}");
    // Sizes whose product overflows: an error naming the world size, not a wrapped
    // count or a panic.
    let e = run(Plan {
        llm: layout(usize::MAX / 2),
        ..plan
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("parallel.world_size") && e.contains("18446744073709551615"),
        "{e}"
    );
}

#[test]
fn auto_plans_the_tiny_model_for_its_world() {
    let mix = "plan.mix={text_median=40.0,text_sigma=0.5,image_prob=0.8,audio_prob=0.3}";
    let mut cfg = tiny(&[
        "parallel.plan=auto",
        "parallel.world_size=4",
        mix,
        "plan.seq_len=256",
    ]);
    let applied = apply(&mut cfg).unwrap();
    // The run plans for what it runs: TP without sequence parallelism, on the h100
    // preset too, unless the config says otherwise.
    assert!(!applied.searched.unwrap().sequence_parallel);
    let mut sp = tiny(&[
        "parallel.plan=auto",
        "parallel.world_size=4",
        mix,
        "plan.seq_len=256",
        "plan.sequence_parallel=true",
    ]);
    assert!(apply(&mut sp).unwrap().searched.unwrap().sequence_parallel);
    assert_eq!(cfg.parallel.world_size, 4);
    let l = &cfg.parallel.llm;
    let ranks = l.tp * l.cp * l.pp * l.dp;
    match cfg.parallel.placement {
        crate::config::Placement::Colocated | crate::config::Placement::Centric => {
            assert_eq!(ranks, 4)
        }
        crate::config::Placement::Disjoint => assert!(ranks < 4),
    }
    // Without a mix or data, planning says what it needs.
    let mut none = tiny(&["parallel.plan=auto", "parallel.world_size=4"]);
    let e = apply(&mut none).unwrap_err().to_string();
    assert!(e.contains("[plan.mix]"), "{e}");
    // Sampling settings that cannot work, or would run for hours, are named before any.
    for (set, says) in [
        ("plan.batches=0", "plan.batches = 0"),
        ("plan.seq_len=0", "plan.seq_len = 0"),
        ("plan.seq_len=1000000000", "plan.seq_len = 1000000000"),
        ("plan.batches=1000000000", "rows to sample"),
    ] {
        let cfg = tiny(&["parallel.world_size=4", mix, set]);
        let model = crate::assemble::model_config(&cfg).unwrap();
        let e = workload(&cfg, &model, None).err().unwrap().to_string();
        assert!(e.contains(says), "{set}: {e}");
    }
}

#[test]
fn the_dims_of_the_tiny_model() {
    let cfg = tiny(&[]);
    let m = crate::assemble::model_config(&cfg).unwrap();
    let d = model_dims(&m);
    assert_eq!(d.llm.layers, 4);
    assert_eq!(d.llm.heads, 4);
    assert_eq!(d.vision.as_ref().unwrap().head_dim, 8);
    assert_eq!(d.audio_llm_ratio, 1.0 / 8.0);
    assert_eq!(media_tokens(&m, &d).image_encoder, 16);
    // Outside the blocks, per encoder token: the patch embedding 3*8*8 -> 32 and the
    // projector 32 -> 64 -> 64; Whisper's convs 80 -> 32 on 2 frames and 32 -> 32
    // (kernel 3), the projector 4*32 -> 64 -> 64 per 4 tokens. In this tiny model
    // they rival the blocks (2 * 2 * (4*32*32 + 2*32*64) = 32,768 per token).
    let (v, a) = (d.vision.as_ref().unwrap(), d.audio.as_ref().unwrap());
    assert_eq!(v.layers as f64 * v.layer_flops_per_token(), 32_768.0);
    assert_eq!(v.stem_flops_per_token, 2.0 * 192.0 * 32.0);
    assert_eq!(
        v.projector_flops_per_token,
        2.0 * (32.0 * 64.0 + 64.0 * 64.0)
    );
    assert_eq!(
        a.stem_flops_per_token,
        2.0 * (2.0 * 3.0 * 80.0 * 32.0 + 3.0 * 32.0 * 32.0)
    );
    assert_eq!(
        a.projector_flops_per_token,
        2.0 * (128.0 * 64.0 + 64.0 * 64.0) / 4.0
    );
}

/// An LLM-centric plan file (what `braid plan --baseline-out` writes) sets the "centric"
/// placement with each encoder's replicas derived from its TP and the LLM's grid, and the
/// LLM's shorter first stage.
#[test]
fn an_llm_centric_plan_file_sets_the_centric_placement() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("baseline.toml");
    std::fs::write(
        &path,
        "gpus = 8\ncluster = \"h100\"\nstep_time_s = 1.0\nbaseline_step_time_s = 1.0\n[plan]\nplacement = \"llm_centric\"\nschedule = \"phased\"\nmicrobatches = 4\nrecompute = false\nrecompute_encoders = true\nzero1 = true\nllm_first_stage_layers = 1\n[plan.llm]\ntp = 2\ncp = 1\npp = 2\ndp = 2\n[plan.vision]\ntp = 1\ncp = 1\npp = 1\ndp = 2\n[plan.audio]\ntp = 2\ncp = 1\npp = 1\ndp = 2\n",
    )
    .unwrap();
    let mut cfg = tiny(&[&format!("parallel.plan={}", path.display())]);
    apply(&mut cfg).unwrap();
    let p = &cfg.parallel;
    assert_eq!(p.placement, crate::config::Placement::Centric);
    assert_eq!(p.llm.first_stage_layers, Some(1));
    assert_eq!(
        (p.vision.tp, p.vision.dp, p.vision.cp, p.vision.pp),
        (1, 4, 1, 1)
    );
    // A file without `recompute_audio` (every file before it existed) recomputes both.
    assert!(p.vision.recompute && p.audio.recompute);
    assert_eq!((p.audio.tp, p.audio.dp), (2, 2));
    assert_eq!(cfg.train.microbatches, 4);
}

/// Each encoder takes its own recomputation from a plan: `recompute_encoders` for the
/// vision encoder, `recompute_audio` for the audio one where it differs, either way.
#[test]
fn a_plan_file_sets_each_encoder_s_recomputation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.toml");
    for (encoders, audio) in [(true, Some(false)), (false, Some(true)), (true, None)] {
        let file = file_of(
            4,
            Plan {
                placement: Placement::Colocated,
                schedule: Schedule::Phased,
                microbatches: 2,
                recompute: false,
                recompute_encoders: encoders,
                recompute_audio: audio,
                llm_first_stage_layers: None,
                llm_virtual_stages: 1,
                reverse_encoder_stages: false,
                llm_zero_bubble: false,
                zero1: true,
                llm: braid_balancer::Layout {
                    tp: 1,
                    cp: 1,
                    pp: 1,
                    dp: 4,
                },
                vision: Some(braid_balancer::Layout {
                    tp: 1,
                    cp: 1,
                    pp: 1,
                    dp: 4,
                }),
                audio: Some(braid_balancer::Layout {
                    tp: 1,
                    cp: 1,
                    pp: 1,
                    dp: 4,
                }),
            },
        );
        file.write(&path).unwrap();
        assert_eq!(PlanFile::read(&path).unwrap(), file);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.contains("recompute_audio"), audio.is_some(), "{text}");
        let mut cfg = tiny(&[&format!("parallel.plan={}", path.display())]);
        let applied = apply(&mut cfg).unwrap();
        let p = &cfg.parallel;
        let at = format!("encoders {encoders}, audio {audio:?}");
        assert_eq!(p.vision.recompute, encoders, "{at}");
        assert_eq!(p.audio.recompute, audio.unwrap_or(encoders), "{at}");
        assert!(!p.llm.recompute, "{at}");
        // The start-up line names the audio encoder's own choice where it differs.
        let differs = audio.is_some_and(|a| a != encoders);
        let said = applied.notes.iter().any(|n| n.contains(" / audio "));
        assert_eq!(said, differs, "{at}: {:?}", applied.notes);
    }
}

/// `reverse_encoder_stages` reverses the stages of each encoder that has two or more
/// (the trainer refuses the key on a one-stage encoder), and `llm_zero_bubble` splits
/// the LLM's backward; the start-up line says so. A file without them does neither.
#[test]
fn a_plan_file_reverses_the_encoder_stages_it_can() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.toml");
    let lay = |pp, dp| braid_balancer::Layout {
        tp: 1,
        cp: 1,
        pp,
        dp,
    };
    for reverse in [false, true] {
        let file = file_of(
            4,
            Plan {
                placement: Placement::Colocated,
                schedule: Schedule::Overlapped,
                microbatches: 2,
                recompute: false,
                recompute_encoders: false,
                recompute_audio: None,
                llm_first_stage_layers: None,
                llm_virtual_stages: 1,
                reverse_encoder_stages: reverse,
                llm_zero_bubble: reverse,
                zero1: true,
                llm: lay(2, 2),
                vision: Some(lay(2, 2)),
                audio: Some(lay(1, 4)),
            },
        );
        file.write(&path).unwrap();
        assert_eq!(PlanFile::read(&path).unwrap(), file);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.contains("reverse_encoder_stages"), reverse, "{text}");
        assert_eq!(text.contains("llm_zero_bubble"), reverse, "{text}");
        let mut cfg = tiny(&[&format!("parallel.plan={}", path.display())]);
        let applied = apply(&mut cfg).unwrap();
        let p = &cfg.parallel;
        assert_eq!(p.vision.reverse_stages, reverse);
        assert!(!p.audio.reverse_stages && !p.llm.reverse_stages);
        assert_eq!(p.llm.zero_bubble, reverse);
        let split = applied.notes.iter().any(|n| n.contains("zero-bubble"));
        assert_eq!(split, reverse, "{:?}", applied.notes);
        let said = applied
            .notes
            .iter()
            .any(|n| n.contains("encoder stages reversed"));
        assert_eq!(said, reverse, "{:?}", applied.notes);
        cfg.validate().unwrap();
    }
}
