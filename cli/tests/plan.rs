//! `braid plan`: the reference configs plan with every JSON key the issue names and
//! write plan files (bad input: `plan_inputs.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

mod common;
use common::braid_at_root as braid;

/// `braid plan --config CONFIG --gpus 64 EXTRA.. --json --out OUT`, which must succeed:
/// its JSON object.
fn plan_json(config: &str, extra: &[&str], out: &Path) -> serde_json::Value {
    let mut args = vec!["plan", "--config", config, "--gpus", "64"];
    args.extend_from_slice(extra);
    plan_json_with(&mut args, out)
}

/// `braid ARGS.. --json --out OUT`, which must succeed: its JSON object.
fn plan_json_with<'a>(args: &mut Vec<&'a str>, out: &'a Path) -> serde_json::Value {
    args.extend(["--json", "--out", out.to_str().unwrap()]);
    let res = braid(args);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    serde_json::from_slice(&res.stdout).unwrap()
}

/// `as_trained`: the pick as `braid train` runs it, whose TP does not split the norms
/// and residuals by sequence as the plan assumed (GPU clusters' default): present
/// exactly where a module of the pick has TP, and never faster or smaller.
fn check_as_trained(v: &serde_json::Value) {
    let tp = ["llm", "vision", "audio"]
        .iter()
        .any(|m| v[*m]["tp"].as_u64().is_some_and(|t| t > 1));
    let t = &v["as_trained"];
    if !tp {
        assert!(t.is_null(), "{v}");
        return;
    }
    let (step, peak) = (
        v["step_time_s"].as_f64().unwrap(),
        v["peak_memory_gib"].as_f64().unwrap(),
    );
    assert!(
        t["step_time_s"].as_f64().unwrap() >= step * (1.0 - 1e-9),
        "{v}"
    );
    assert!(t["peak_memory_gib"].as_f64().unwrap() >= peak, "{v}");
    // The h100 preset times the blocks whole: only the memory differs.
    assert_eq!(t["time_modelled"].as_bool(), Some(false), "{v}");
    let fits = t["peak_memory_gib"].as_f64().unwrap() <= 72.0;
    assert_eq!(t["fits"].as_bool(), Some(fits), "{v}");
}

#[test]
fn the_7b_reference_plans_on_64_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.toml");
    let v = plan_json("configs/plan-7b.toml", &["--check", "40"], &out);
    for key in ["step_time_s", "baseline_step_time_s", "speedup", "search_s"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    // Brute force cannot run at 64 GPUs; the check simulates the 40 best-estimated
    // combinations, and the pick is within 5 % of the best of them.
    assert!(v["brute_force_step_time_s"].is_null(), "{v}");
    assert_eq!(v["check_simulated"].as_u64(), Some(40), "{v}");
    let checked = v["check_step_time_s"].as_f64().unwrap();
    let searched = v["search_step_time_s"].as_f64().unwrap();
    assert!(searched <= 1.05 * checked, "{v}");
    // The plan written (and reported) is the fastest of the two and of the runnable
    // LLM-centric layout: here the check's, colocated and overlapped (the encoders in
    // the LLM pipeline's fill and drain), 2 % faster than the LLM-centric layout.
    let step = v["step_time_s"].as_f64().unwrap();
    let baseline = v["baseline_step_time_s"].as_f64().unwrap();
    let fastest = searched.min(checked).min(baseline);
    assert!((step - fastest).abs() <= 1e-12 * step, "{v}");
    assert!(v["speedup"].as_f64().unwrap() >= 1.0, "{v}");
    // The work-conserving bound sits below the step, which its parts add up to.
    let (step, bound) = (
        v["step_time_s"].as_f64().unwrap(),
        v["bound_step_time_s"].as_f64().unwrap(),
    );
    assert!(bound > 0.0 && bound <= step, "{v}");
    assert!((v["from_bound"].as_f64().unwrap() - step / bound).abs() < 1e-9);
    // The bound is the longest of what sets it: the work spread over the GPUs, a
    // critical path, a gradient sync.
    let set_by = ["bound_work_s", "bound_path_s", "bound_sync_s"].map(|k| v[k].as_f64().unwrap());
    assert!(set_by.iter().all(|&x| x >= 0.0), "{v}");
    assert_eq!(set_by.iter().copied().fold(0.0, f64::max), bound, "{v}");
    let parts: f64 = [
        "memory_forced",
        "grad_sync",
        "imbalance",
        "bridge",
        "bubbles",
    ]
    .iter()
    .map(|k| v[format!("gap_{k}_s")].as_f64().unwrap())
    .sum();
    assert!((bound + parts - step).abs() < 1e-6 * step, "{v}");
    // The bound names each module's layout: their busy GPU-seconds make its work term.
    let busy: f64 = ["llm", "vision", "audio"]
        .iter()
        .map(|m| {
            let l = &v["bound_layouts"][*m];
            let n: u64 = ["tp", "cp", "pp", "dp"]
                .iter()
                .map(|k| l[*k].as_u64().unwrap())
                .product();
            assert!(
                n >= 1 && l["gpus"].as_u64() == Some(n) && n <= 64,
                "{m}: {l}"
            );
            l["busy_gpu_s"].as_f64().unwrap()
        })
        .sum();
    let work = v["bound_work_s"].as_f64().unwrap();
    assert!((busy / 64.0 - work).abs() <= 1e-9 * work, "{v}");
    // GPU clusters hide the gradient sync behind the passes by default.
    assert_eq!(v["overlap_grad_sync"].as_bool(), Some(true), "{v}");
    assert_eq!(v["sequence_parallel"].as_bool(), Some(true), "{v}");
    check_as_trained(&v);
    let ratio = v["baseline_step_time_s"].as_f64().unwrap() / v["step_time_s"].as_f64().unwrap();
    assert!((ratio - v["speedup"].as_f64().unwrap()).abs() < 1e-9);
    // The LLM alone (encoders free) bounds every plan from below: its ceiling is above
    // the plan's speedup, and the encoders' work is not nothing.
    let alone = v["llm_alone_step_time_s"].as_f64().unwrap();
    assert!(alone < v["step_time_s"].as_f64().unwrap(), "{v}");
    let ceiling = v["speedup_ceiling"].as_f64().unwrap();
    assert!(ceiling > v["speedup"].as_f64().unwrap(), "{v}");
    assert!((ceiling - v["baseline_step_time_s"].as_f64().unwrap() / alone).abs() < 1e-9);
    // How far the LLM alone is from the bound: the nearest any plan can come to it.
    let alone_from_bound = v["llm_alone_from_bound"].as_f64().unwrap();
    assert!((alone_from_bound - alone / bound).abs() < 1e-9, "{v}");
    assert!(alone_from_bound <= v["from_bound"].as_f64().unwrap(), "{v}");
    // Idle time excludes the collectives, which the non-computing share counts.
    let (idle, bubble) = (v["idle"].as_f64().unwrap(), v["bubble"].as_f64().unwrap());
    assert!((0.0..=bubble).contains(&idle) && bubble < 1.0, "{v}");
    // Here the check's plan, colocated and overlapped, is the fastest (the LLM-centric
    // layout simulates 0.1 % faster than the search's own pick, under "search").
    assert_eq!(v["placement"].as_str(), Some("colocated"), "{v}");
    assert_eq!(v["schedule"].as_str(), Some("overlapped"), "{v}");
    let pick = &v["search"];
    let mut gpus = Vec::new();
    for m in ["llm", "vision", "audio"] {
        let l = &pick[m];
        let n: u64 = ["tp", "cp", "pp", "dp"]
            .iter()
            .map(|k| l[*k].as_u64().unwrap())
            .product();
        assert_eq!(l["gpus"].as_u64(), Some(n), "{m}: {l}");
        // The busiest GPU is at least as busy as the mean one, and busy at all.
        let (mean, most) = (
            l["busy_s"].as_f64().unwrap(),
            l["busy_max_s"].as_f64().unwrap(),
        );
        assert!(mean > 0.0 && most >= mean - 1e-12, "{m}: {l}");
        gpus.push(n);
    }
    match pick["placement"].as_str() {
        Some("colocated") => assert!(gpus.iter().all(|&g| g == 64), "{gpus:?}"),
        Some("disjoint") => assert_eq!(gpus.iter().sum::<u64>(), 64),
        p => panic!("placement {p:?}"),
    }
    assert!(v["peak_memory_gib"].as_f64().unwrap() < 80.0);
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(
        text.contains("gpus = 64") && text.contains("[plan.llm]"),
        "{text}"
    );
    // The text report says what binds and writes the same plan.
    let res = braid(&[
        "plan",
        "--config",
        "configs/plan-7b.toml",
        "--gpus",
        "64",
        "--out",
        out.to_str().unwrap(),
    ]);
    let s = String::from_utf8_lossy(&res.stdout);
    assert!(
        s.contains("LLM-centric")
            && s.contains("speedup")
            && s.contains("binds")
            && s.contains("LLM alone")
            && s.contains("work-conserving bound")
            && s.contains("overlapped with the passes"),
        "{s}"
    );
}

/// On 5 GPUs the LLM-centric layout beats every per-module plan `braid train` runs: it is
/// the plan written (the same file `--baseline-out` writes), and the report says so.
/// Where only the overlapped schedule may be picked, the baseline wins and the report says
/// why from the nearest plan `braid train` runs: that layout's LLM grid with the encoders
/// colocated needs more memory than a GPU has.
#[test]
fn where_the_baseline_wins_it_is_the_plan_or_the_report_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.toml");
    let base = dir.path().join("baseline.toml");
    let mut args = vec![
        "plan",
        "--config",
        "configs/plan-7b.toml",
        "--gpus",
        "5",
        "--baseline-out",
        base.to_str().unwrap(),
    ];
    let v = plan_json_with(&mut args, &out);
    // The baseline's own plan file, for `braid train`'s "centric" placement.
    let file = braid_train::planning::PlanFile::read(&base).unwrap();
    assert_eq!(file.plan.placement, braid_balancer::Placement::LlmCentric);
    assert_eq!(file.gpus, 5);
    assert_eq!(
        file.step_time_s,
        v["baseline_step_time_s"].as_f64().unwrap(),
        "{v}"
    );
    let written = braid_train::planning::PlanFile::read(&out).unwrap();
    assert_eq!(written.plan, file.plan);
    assert_eq!(v["speedup"].as_f64(), Some(1.0), "{v}");
    assert!(
        v["search_step_time_s"].as_f64().unwrap() > file.step_time_s,
        "{v}"
    );
    assert!(v["closest_to_baseline"].is_null(), "{v}");
    let why = v["explanation"].to_string();
    assert!(
        why.contains("the plan is the LLM-centric layout itself"),
        "{why}"
    );

    let overlapped = dir.path().join("overlapped.toml");
    let mut args = vec![
        "plan",
        "--config",
        "configs/plan-7b.toml",
        "--gpus",
        "5",
        "--schedule",
        "overlapped",
        "--set",
        "plan.placement=\"disjoint\"",
    ];
    let v = plan_json_with(&mut args, &overlapped);
    assert!(v["speedup"].as_f64().unwrap() < 1.0, "{v}");
    assert_eq!(v["placement"].as_str(), Some("disjoint"), "{v}");
    assert!(
        v["explanation"]
            .to_string()
            .contains("`braid train` runs the LLM-centric layout too"),
        "{v}"
    );
    let near = &v["closest_to_baseline"];
    assert_eq!(near["fits"].as_bool(), Some(false), "{v}");
    assert_eq!(near["plan"]["placement"].as_str(), Some("colocated"), "{v}");
    for k in ["tp", "cp", "pp", "dp"] {
        assert_eq!(near["plan"]["llm"][k], v["baseline"]["llm"][k], "{k}: {v}");
    }
    // More than the h100's usable 90 % of 80 GiB.
    assert!(near["peak_memory_gib"].as_f64().unwrap() > 72.0, "{v}");
    let why = v["explanation"].to_string();
    assert!(
        why.contains("memory is why") && why.contains("tp1 cp1 pp1 dp5"),
        "{why}"
    );
}

/// The 70B's strongest LLM-centric layout on 32 GPUs gives the first of its four
/// stages 11 of 80 layers (Megatron's first-stage count, room for the encoders):
/// `--baseline-out` writes it as it is, and the config it sets passes the trainer's
/// layout checks with that first stage (until 2026-12-03 the CLI refused to write it).
#[test]
fn the_baseline_file_keeps_a_shorter_first_stage_that_braid_train_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.toml");
    let base = dir.path().join("baseline.toml");
    let mut args = vec![
        "plan",
        "--config",
        "configs/plan-70b.toml",
        "--gpus",
        "32",
        "--baseline-out",
        base.to_str().unwrap(),
    ];
    let v = plan_json_with(&mut args, &out);
    let first = v["baseline"]["llm_first_stage_layers"].as_u64();
    assert!(first.is_some_and(|f| f >= 1), "{v}");
    let file = braid_train::planning::PlanFile::read(&base).unwrap();
    assert_eq!(file.plan.llm_first_stage_layers.map(|f| f as u64), first);
    let set = format!("parallel.plan={}", base.display());
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/plan-70b.toml");
    let mut cfg = braid_train::RunConfig::from_file(&config, &[set]).unwrap();
    braid_train::planning::apply(&mut cfg).unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.parallel.llm.first_stage_layers.map(|f| f as u64), first);
    assert_eq!(
        cfg.parallel.placement,
        braid_train::config::Placement::Centric
    );
    let model = braid_train::assemble::model_config(&cfg).unwrap();
    braid_train::parallel::layout::Layouts::new(&cfg.parallel, &model).unwrap();
}

/// No layout of the 120B tiles 100 GPUs (its stages need 16 each and more): the
/// baseline runs on 96 of them, as a Megatron job would, and so does the phased plan,
/// its file saying to launch 96 ranks; by default both schedules are searched, the
/// faster written, colocated on the 96 and faster than the disjoint plans that tile all
/// 100.
#[test]
fn where_no_layout_tiles_the_gpus_the_plan_says_how_many_to_launch() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.toml");
    let base = [
        "plan",
        "--config",
        "configs/plan-120b-hires.toml",
        "--gpus",
        "100",
    ];
    let mut args = [&base[..], &["--schedule", "phased"]].concat();
    let v = plan_json_with(&mut args, &out);
    assert_eq!(v["asked_gpus"].as_u64(), Some(100), "{v}");
    assert_eq!(v["baseline_gpus"].as_u64(), Some(96), "{v}");
    // Colocated on 96 beats every phased plan that tiles all 100 (disjoint splits).
    assert_eq!(v["gpus"].as_u64(), Some(96), "{v}");
    assert_eq!(v["placement"].as_str(), Some("colocated"), "{v}");
    assert!(v["speedup"].as_f64().unwrap() > 1.0, "{v}");
    let file = std::fs::read_to_string(&out).unwrap();
    assert!(file.contains("gpus = 96\n"), "{file}");
    let text_out = dir.path().join("text.toml");
    let res = braid(&[&args[..7], &["--out", text_out.to_str().unwrap()]].concat());
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(text.contains("on 96 GPUs of the 100 asked"), "{text}");
    let phased = v["step_time_s"].as_f64().unwrap();

    // Both schedules (the default): the faster plan, and each one's step reported.
    let best = plan_json_with(&mut base.to_vec(), &out);
    let steps = &best["schedule_step_times_s"];
    let overlapped = steps["overlapped"].as_f64().unwrap();
    let phased_here = steps["phased"].as_f64().unwrap();
    assert_eq!(
        best["step_time_s"].as_f64(),
        Some(overlapped.min(phased_here)),
        "{best}"
    );
    // The phased search alone finds the same phased plan.
    assert!((phased_here - phased).abs() <= 1e-9 * phased, "{best}");
    let faster = if overlapped < phased_here {
        "overlapped"
    } else {
        "phased"
    };
    assert_eq!(best["schedule"].as_str(), Some(faster), "{best}");
    // Colocated on the 96 GPUs beats the disjoint plans that tile all 100.
    assert_eq!(best["placement"].as_str(), Some("colocated"), "{best}");
    assert_eq!(best["gpus"].as_u64(), Some(96), "{best}");
    let mut disjoint = [&base[..], &["--set", "plan.placement=\"disjoint\""]].concat();
    let d = plan_json_with(&mut disjoint, &out);
    assert_eq!(d["gpus"].as_u64(), Some(100), "{d}");
    assert_eq!(d["placement"].as_str(), Some("disjoint"), "{d}");
    let best_step = best["step_time_s"].as_f64().unwrap();
    assert!(d["step_time_s"].as_f64().unwrap() > best_step, "{d}");
}

/// The overlapped schedule (1F1B across modules) on disjoint GPUs plans the 70B
/// reference, whose 6B ViT fits only when the batch is cut into many chunks: the search
/// ranks GPU splits at the LLM's own microbatch counts. Colocated, the same schedule is
/// faster here (every GPU interleaving its modules' passes).
#[test]
fn the_70b_reference_plans_the_overlapped_schedule_on_64_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.toml");
    let colocated = plan_json("configs/plan-70b.toml", &["--schedule", "overlapped"], &out);
    assert_eq!(
        colocated["placement"].as_str(),
        Some("colocated"),
        "{colocated}"
    );
    // Its LLM runs TP: as `braid train` runs it, every GPU holds more.
    assert!(colocated["llm"]["tp"].as_u64().unwrap() > 1, "{colocated}");
    check_as_trained(&colocated);
    let (planned, trained) = (
        colocated["peak_memory_gib"].as_f64().unwrap(),
        colocated["as_trained"]["peak_memory_gib"].as_f64().unwrap(),
    );
    assert!(trained > planned, "{colocated}");
    let v = plan_json(
        "configs/plan-70b.toml",
        &[
            "--schedule",
            "overlapped",
            "--set",
            "plan.placement=\"disjoint\"",
        ],
        &out,
    );
    assert!(
        colocated["step_time_s"].as_f64().unwrap() < v["step_time_s"].as_f64().unwrap(),
        "{colocated}\n{v}"
    );
    assert_eq!(v["schedule"].as_str(), Some("overlapped"), "{v}");
    assert_eq!(v["placement"].as_str(), Some("disjoint"), "{v}");
    assert!(
        v["check_simulated"].is_null(),
        "no check without --check: {v}"
    );
    // The explanation says why the GPUs are split so, with the split's own numbers.
    let why = v["explanation"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str())
        .find(|l| l.starts_with("why this split: disjoint"))
        .unwrap_or_else(|| panic!("{v}"))
        .to_string();
    let llm_gpus = v["llm"]["gpus"].as_u64().unwrap();
    assert!(why.contains(&format!("llm {llm_gpus} (")), "{why}");
    let gpus: u64 = ["llm", "vision", "audio"]
        .iter()
        .map(|m| v[*m]["gpus"].as_u64().unwrap())
        .sum();
    assert_eq!(gpus, 64, "{v}");
    assert!(v["peak_memory_gib"].as_f64().unwrap() <= 72.0, "{v}");
    assert!(v["step_time_s"].as_f64().unwrap() > 0.0, "{v}");
}

/// `braid plan --trace FILE`: the simulator's predicted timeline of the pick, as a
/// Chrome trace with a row per stage lane and spans named like a run's; `braid trace`
/// reads and draws it like a run's.
#[test]
fn a_plan_writes_its_predicted_timeline() {
    let dir = tempfile::tempdir().unwrap();
    let (out, trace, png) = (
        dir.path().join("plan.toml"),
        dir.path().join("predicted.json"),
        dir.path().join("predicted.png"),
    );
    let v = plan_json(
        "configs/plan-7b.toml",
        &[
            "--schedule",
            "overlapped",
            "--trace",
            trace.to_str().unwrap(),
        ],
        &out,
    );
    let file = braid_train::trace::read(&trace).unwrap();
    let spans: Vec<_> = file.trace_events.iter().filter(|e| e.ph == "X").collect();
    let names: std::collections::BTreeSet<&str> = spans.iter().map(|e| e.name.as_str()).collect();
    for n in [
        "llm fwd s0 mb0",
        "llm bwd s0 mb0",
        "vision fwd s0 mb0",
        "bridge fwd mb0",
    ] {
        assert!(names.contains(n), "no `{n}` in {names:?}");
    }
    // The timeline spans about the predicted step (which is the mean of several sampled
    // batches; the timeline is the first's).
    let end = spans
        .iter()
        .map(|e| (e.ts + e.dur.unwrap()) * 1e-6)
        .fold(0.0, f64::max);
    let step = v["step_time_s"].as_f64().unwrap();
    assert!(end > 0.5 * step && end < 2.0 * step, "{end} vs {step}");
    // Each row is named after its lane.
    assert!(file.trace_events.iter().any(|e| {
        e.ph == "M"
            && e.args
                .get("name")
                .and_then(|n| n.as_str())
                .is_some_and(|n| n.starts_with("llm r0 s0 ("))
    }));
    let res = braid(&[
        "trace",
        trace.to_str().unwrap(),
        "--png",
        png.to_str().unwrap(),
    ]);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let text = String::from_utf8_lossy(&res.stdout);
    assert!(text.contains("llm r0 s0"), "{text}");
    assert!(std::fs::metadata(&png).unwrap().len() > 1000);
}
