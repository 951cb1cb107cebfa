//! `braid plan`: the balancer's choice of a layout per module for a run config on N GPUs,
//! side by side with the best LLM-centric layout (and brute force where the space is
//! small), an explanation of what binds, and the plan file `braid train` reads.

use std::path::{Path, PathBuf};

use braid_balancer::cluster::GIB;
use braid_balancer::plan::bound::Gap;
use braid_balancer::plan::closest_to_baseline;
use braid_balancer::plan::search::Found;
use braid_balancer::{Module, Placement, StepSim};
use braid_train::RunConfig;
use braid_train::planning::{
    MAX_PLAN_CHECK, PlanFile, PlanSchedule, Planned, as_trained, llm_alone, plan,
};
use clap::Args;

mod explain;
mod json;
use explain::{explain, idle_note, layout_str};
use json::to_json;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The run config (its [model], [train] batch_rows and optional [plan] section).
    #[arg(long)]
    config: PathBuf,
    /// GPUs to plan for (default: the config's plan.gpus).
    #[arg(long)]
    gpus: Option<usize>,
    /// A preset (h100, h200) or a cluster TOML from `braid profile` (default: plan.cluster).
    #[arg(long)]
    cluster: Option<String>,
    /// Packed shards whose rows the batches are drawn from (default: the [plan.mix]).
    #[arg(long)]
    data: Option<PathBuf>,
    /// `best` (both searched, the faster plan written; default: plan.schedule), `phased`
    /// (braid train's default) or `overlapped` (1F1B across modules; colocated or disjoint, as plan.placement allows).
    #[arg(long)]
    schedule: Option<String>,
    /// Where to write the plan file.
    #[arg(long, default_value = "plan.toml")]
    out: PathBuf,
    /// Also write the simulator's predicted timeline of the pick's step (on the first
    /// sampled batch) to this Chrome trace file: a row per pipeline stage of a replica,
    /// spans named like a run's `log.trace` (`braid trace FILE --png` draws it).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Also write the LLM-centric baseline's plan file here (Megatron's layout: the
    /// encoders inside the LLM's first pipeline stage, which `braid train` runs as
    /// `parallel.placement = "centric"`), to run and measure it beside the pick.
    #[arg(long, value_name = "FILE")]
    baseline_out: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Override a config key (`KEY=VALUE`), as in `braid train`.
    #[arg(long = "set")]
    sets: Vec<String>,
    /// Also simulate the N best-estimated combinations, where brute force cannot run
    /// (slow: tens of ms each at 1,024 GPUs): their best is reported beside the search's
    /// pick and, where faster, is the plan written.
    #[arg(long, value_name = "N")]
    check: Option<usize>,
}

pub fn run(a: PlanArgs) -> u8 {
    match plan_cmd(&a) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("braid plan: error: {e}");
            2
        }
    }
}

/// Seconds as s or ms, whichever reads better.
fn secs(x: f64) -> String {
    if x < 0.1 {
        format!("{:.3} ms", x * 1e3)
    } else {
        format!("{x:.3} s")
    }
}

/// Bytes as GiB or MiB.
fn bytes(x: f64) -> String {
    if x < 0.1 * GIB {
        format!("{:.1} MiB", x / (1u64 << 20) as f64)
    } else {
        format!("{:.1} GiB", x / GIB)
    }
}

/// Refuses, before the search, outputs that could not be written or would overwrite an
/// input or each other: a folder that does not exist, a path that is a folder, two flags
/// naming one file, a file that is the config. (Found after the search, the plan file
/// would already be written when the trace failed.)
fn check_outputs(a: &PlanArgs, cluster: Option<&str>) -> Result<(), String> {
    let mut outs: Vec<(&str, &Path)> = vec![("--out", a.out.as_path())];
    outs.extend(a.baseline_out.as_deref().map(|p| ("--baseline-out", p)));
    outs.extend(a.trace.as_deref().map(|p| ("--trace", p)));
    // The same file under two spellings (`plan.toml`, `./plan.toml`): compared by the
    // canonical folder and the file name.
    let key = |p: &Path| -> Option<PathBuf> {
        let parent = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let parent = parent.canonicalize().ok().filter(|d| d.is_dir())?;
        Some(parent.join(p.file_name()?))
    };
    let config = a.config.canonicalize().ok();
    // A cluster file (not a preset's name) is an input too.
    let cluster = cluster.and_then(|c| Path::new(c).canonicalize().ok());
    let mut seen: Vec<(&str, PathBuf)> = Vec::new();
    for (flag, path) in outs {
        let shown = path.display();
        if path.file_name().is_none() || path.is_dir() {
            return Err(format!("{flag} {shown}: a folder, not a file to write"));
        }
        let Some(k) = key(path) else {
            return Err(format!(
                "{flag} {shown}: its folder does not exist or is not a folder (create it first)"
            ));
        };
        if config.as_ref() == Some(&k) {
            return Err(format!(
                "{flag} {shown} is the config itself: writing there would replace it"
            ));
        }
        if cluster.as_ref() == Some(&k) {
            return Err(format!(
                "{flag} {shown} is the cluster file: writing there would replace it"
            ));
        }
        if let Some((other, _)) = seen.iter().find(|(_, p)| *p == k) {
            return Err(format!(
                "{flag} {shown} names the same file as {other}: give each its own"
            ));
        }
        seen.push((flag, k));
    }
    Ok(())
}

fn plan_cmd(a: &PlanArgs) -> Result<(), String> {
    let mut sets = a.sets.clone();
    if let Some(n) = a.check {
        if n > MAX_PLAN_CHECK {
            return Err(format!(
                "--check {n}: at most {MAX_PLAN_CHECK} combinations (each is simulated)"
            ));
        }
        sets.push(format!("plan.check={n}"));
    }
    let cfg = RunConfig::from_file(&a.config, &sets).map_err(|e| e.to_string())?;
    let gpus = a
        .gpus
        .or(cfg.plan.as_ref().and_then(|p| p.gpus))
        .ok_or("say how many GPUs: --gpus N (or plan.gpus in the config)")?;
    let schedule = match a.schedule.as_deref() {
        None => None,
        Some("best") => Some(PlanSchedule::Best),
        Some("phased") => Some(PlanSchedule::Phased),
        Some("overlapped") => Some(PlanSchedule::Overlapped),
        Some(s) => {
            return Err(format!(
                "--schedule {s:?}: expected best, phased or overlapped"
            ));
        }
    };
    let cluster = a
        .cluster
        .clone()
        .or_else(|| cfg.plan.as_ref().map(|p| p.cluster.clone()));
    check_outputs(a, cluster.as_deref())?;
    let check = cfg.plan.as_ref().map_or(0, |p| p.check);
    if check > 0 {
        eprintln!(
            "braid plan: after the search, simulating its {check} best-estimated combinations \
             (plan.check / --check: tens of ms each at 1,024 GPUs)"
        );
    }
    let p = plan(
        &cfg,
        gpus,
        a.cluster.as_deref(),
        a.data.as_deref(),
        schedule,
        true,
    )
    .map_err(|e| e.to_string())?;
    let alone = llm_alone(&p).map_err(|e| e.to_string())?;
    // A report beside the pick: if it cannot be simulated, the plan stands without it.
    let trained = as_trained(&p).unwrap_or_else(|e| {
        eprintln!("braid plan: the pick as braid train runs it could not be simulated: {e}");
        None
    });
    // Where the LLM-centric layout wins, what `braid train` can run nearest to it.
    let closest = (p.outcome.baseline.sim.step_s < p.outcome.best.sim.step_s)
        .then(|| {
            closest_to_baseline(
                &p.problem,
                &p.outcome.baseline.plan,
                &p.workload.batches(p.batches),
                p.problem.cluster.usable_bytes(),
            )
        })
        .flatten();
    let o = &p.outcome;
    let file = PlanFile {
        gpus: p.gpus,
        cluster: p.cluster.clone(),
        step_time_s: o.best.sim.step_s,
        baseline_step_time_s: o.baseline.sim.step_s,
        sequence_parallel: p.problem.sequence_parallel,
        plan: o.best.plan.clone(),
    };
    // `braid train` runs the baseline as planned, its shorter first stage included
    // (`parallel.llm.first_stage_layers`).
    let baseline_file = match &a.baseline_out {
        Some(path) => {
            let b = &o.baseline.plan;
            Some((
                path,
                PlanFile {
                    gpus: b.gpus(),
                    cluster: p.cluster.clone(),
                    step_time_s: o.baseline.sim.step_s,
                    baseline_step_time_s: o.baseline.sim.step_s,
                    sequence_parallel: p.problem.sequence_parallel,
                    plan: b.clone(),
                },
            ))
        }
        None => None,
    };
    file.write(&a.out).map_err(|e| e.to_string())?;
    if let Some((path, f)) = &baseline_file {
        f.write(path).map_err(|e| e.to_string())?;
    }
    if let Some(path) = &a.trace {
        let (_, timeline) = p
            .problem
            .timeline(&o.best.plan, &p.workload.batch(0))
            .map_err(|e| format!("--trace: {e}"))?;
        braid_train::trace::write_plan(path, &timeline).map_err(|e| e.to_string())?;
        if !a.json {
            println!("predicted timeline: {}", path.display());
        }
    }
    let report = Report {
        p: &p,
        alone: alone.as_ref(),
        closest: closest.as_ref(),
        trained: trained.as_ref(),
        gap: gap(&p),
    };
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&report, a)).map_err(|e| e.to_string())?
        );
    } else {
        print_text(&report, a);
    }
    Ok(())
}

/// Module `m`'s figure in one of the simulation's per-module lists.
fn of_module(v: &[(Module, f64)], m: Module) -> Option<f64> {
    v.iter().find(|x| x.0 == m).map(|x| x.1)
}

/// What the report (text or JSON) says beside the pick.
struct Report<'a> {
    p: &'a Planned,
    /// The LLM alone, its encoders' work free (the ceiling).
    alone: Option<&'a Found>,
    /// Where the LLM-centric layout wins, the nearest plan `braid train` runs.
    closest: Option<&'a Found>,
    /// The pick as `braid train` runs it, where that differs ([`as_trained`]).
    trained: Option<&'a StepSim>,
    gap: Gap,
}

/// The pick's distance from the work-conserving bound, split into its parts.
fn gap(p: &Planned) -> Gap {
    let b = &p.outcome.best;
    p.problem
        .gap(&b.plan, &p.workload.batches(p.batches), &b.sim)
}

fn print_text(r: &Report, a: &PlanArgs) {
    let (p, alone, closest, trained, g) = (r.p, r.alone, r.closest, r.trained, &r.gap);
    let o = &p.outcome;
    let c = &p.problem.cluster;
    let (tokens, images, clips) = p.workload.summary();
    println!(
        "braid plan: {} on {} GPUs{} ({}: {} per node, {:.0} GiB each)",
        a.config.display(),
        p.gpus,
        if p.gpus < p.asked_gpus {
            format!(
                " of the {} asked ({}: launch {} ranks)",
                p.asked_gpus,
                if p.fits_all {
                    format!("faster than the best plan on all {}", p.asked_gpus)
                } else {
                    format!("no layout that fits in memory tiles all {}", p.asked_gpus)
                },
                p.gpus
            )
        } else {
            String::new()
        },
        p.cluster,
        c.gpus_per_node,
        c.memory_gib
    );
    println!(
        "  workload   {} rows x {} tokens a step; per row {:.0} tokens, {:.1} images, {:.1} clips ({})",
        p.workload.batch_rows,
        p.workload.seq_len,
        tokens,
        images,
        clips,
        a.data
            .as_ref()
            .map_or("the [plan.mix] distribution".to_string(), |d| d
                .display()
                .to_string())
    );
    println!(
        "  search     {} combinations, {} simulated, {:.2} s; gradient sync {} (plan.overlap_grad_sync); TP {} (plan.sequence_parallel)",
        o.combinations,
        o.simulated,
        o.search_s,
        if p.problem.overlap_sync {
            "overlapped with the passes"
        } else {
            "after the backward"
        },
        if p.problem.sequence_parallel {
            "sequence-parallel"
        } else {
            "repeating the norms on every rank"
        }
    );
    if p.schedule_steps.len() > 1 {
        let each: Vec<String> = p
            .schedule_steps
            .iter()
            .map(|(s, t)| format!("{} {}", s.name(), secs(*t)))
            .collect();
        println!(
            "  schedules  {} (plan.schedule = \"best\": the faster written)",
            each.join(", ")
        );
    }
    let b = &o.best;
    println!(
        "\n  {:<7} {:<22} {:>6} {:>11} {:>12} {:>12}",
        "module", "layout", "GPUs", "memory/GPU", "busy/step", "busiest GPU"
    );
    for m in [Module::Vision, Module::Audio, Module::Llm] {
        let Some(l) = b.plan.layout(m) else { continue };
        let get = |v: &[(Module, f64)]| of_module(v, m).unwrap_or(0.0);
        // An LLM-centric encoder's replicas and time are the LLM first stage's (counted
        // there).
        let [layout, mem, busy, most] =
            if b.plan.placement == Placement::LlmCentric && m != Module::Llm {
                [
                    format!("tp{} in LLM stage 0", l.tp),
                    "(in llm)".into(),
                    "(in llm)".into(),
                    "(in llm)".into(),
                ]
            } else {
                [
                    layout_str(l),
                    bytes(get(&b.sim.memory)),
                    secs(get(&b.sim.busy)),
                    secs(get(&b.sim.busiest)),
                ]
            };
        println!(
            "  {:<7} {layout:<22} {:>6} {mem:>11} {busy:>12} {most:>12}",
            m.name(),
            l.gpus(),
        );
    }
    let interleaved = match b.plan.llm_virtual_stages {
        v if v > 1 => format!(" (LLM interleaved: {v} chunks per stage)"),
        _ if b.plan.llm_zero_bubble => {
            " (LLM zero-bubble: weight gradients in passes of their own)".into()
        }
        _ => String::new(),
    };
    let reversed = if b.plan.reverse_encoder_stages {
        "; encoder stages reversed (stage 0 beside the LLM's last stage)"
    } else {
        ""
    };
    println!(
        "\n  placement {}, schedule {}{interleaved}, {} microbatches, recompute llm {} / encoders {}{}{reversed}",
        b.plan.placement.name(),
        b.plan.schedule.name(),
        b.plan.microbatches,
        b.plan.recompute,
        b.plan.recompute_encoders,
        b.plan
            .own_audio_recompute()
            .map_or(String::new(), |a| format!(" (audio {a})"))
    );
    println!(
        "  predicted step   {:>10}   (idle {:.0}%, peak {})",
        secs(b.sim.step_s),
        100.0 * b.sim.idle,
        bytes(b.sim.peak_memory)
    );
    if let Some(t) = trained {
        let usable = p.problem.cluster.usable_bytes();
        println!(
            "  as trained       {:>10}   (peak {}{}{}: `braid train`'s TP does not run sequence parallelism yet, which this plan assumes; --set plan.sequence_parallel=false plans what it runs)",
            secs(t.step_s),
            bytes(t.peak_memory),
            if t.peak_memory <= usable {
                String::new()
            } else {
                format!(", over the {} usable", bytes(usable))
            },
            if p.problem.cluster.replicated_elementwise > 0.0 {
                ""
            } else {
                "; the time as planned: this cluster does not model the repeated norms"
            }
        );
    }
    let base = &o.baseline.plan;
    let enc_tps: Vec<String> = [("vision", base.vision), ("audio", base.audio)]
        .into_iter()
        .filter_map(|(name, l)| l.map(|l| format!("{name} tp{}", l.tp)))
        .collect();
    println!(
        "  LLM-centric      {:>10}   (llm {}, encoders in stage 0{}{})",
        secs(o.baseline.sim.step_s),
        layout_str(base.llm),
        if enc_tps.is_empty() {
            String::new()
        } else {
            format!(" at {}", enc_tps.join(", "))
        },
        idle_note(base.gpus(), p.gpus)
    );
    println!(
        "  speedup          {:>8.2}x",
        o.baseline.sim.step_s / b.sim.step_s
    );
    if let Some(al) = alone {
        println!(
            "  LLM alone        {:>10}   (encoders free: the ceiling is {:.2}x{})",
            secs(al.sim.step_s),
            o.baseline.sim.step_s / al.sim.step_s,
            idle_note(al.plan.gpus(), p.gpus)
        );
    }
    // Where brute force or the check found a faster plan than the search, that one is
    // written (and above); the search's own pick is measured against it here.
    let searched = o.searched.sim.step_s;
    let written = if o.best.sim.step_s < searched {
        "; that plan is the one above and written"
    } else {
        ""
    };
    match &o.brute {
        Some(bf) => println!(
            "  brute force      {:>10}   (every combination simulated; the search's pick is {:.1}% slower{written})",
            secs(bf.sim.step_s),
            100.0 * (searched / bf.sim.step_s - 1.0)
        ),
        None => println!(
            "  brute force      (not run: {} combinations)",
            o.combinations
        ),
    }
    if let Some((n, c)) = &o.checked {
        println!(
            "  check            {:>10}   (the best of the {n} best-estimated combinations, each simulated; the search's pick is {:.1}% slower{written})",
            secs(c.sim.step_s),
            100.0 * (searched / c.sim.step_s - 1.0)
        );
    }
    println!();
    for line in explain(p, alone, closest, g) {
        println!("  - {line}");
    }
    println!(
        "\n  wrote {} (train with it: --set parallel.plan={})",
        a.out.display(),
        a.out.display()
    );
    if let Some(path) = &a.baseline_out {
        println!(
            "  wrote {} (the LLM-centric baseline: --set parallel.plan={})",
            path.display(),
            path.display()
        );
    }
}
