//! Validation of the balancer's cost model against measured CPU runs (issue 7, item 7):
//! trains `configs/tiny.toml` under several parallel layouts (ranks are threads), takes
//! each layout's median step time, predicts it with `Problem::simulate` on a profiled
//! cluster (`braid profile`) and the run's real batches, and prints both with the
//! Spearman rank correlation and the mean absolute relative error.
//!
//! ```text
//! cargo run --release -p braid -- profile --out /tmp/cpu.toml
//! cargo run --release -p braid-train --example validate_plan -- --cluster /tmp/cpu.toml [--steps 12] [--rounds 3] [--only 'NAME;NAME'] [--save FILE | --measured FILE]
//! ```
//! Run from the repository root (the config's data paths are relative to it).

use std::path::{Path, PathBuf};

use braid_balancer::cluster::Cluster;
use braid_balancer::plan::check::{median, spearman};
use braid_balancer::{Layout, Module, Placement, Plan, Problem, Schedule};
use braid_train::config::Placement as RunPlacement;
use braid_train::data::ensure_dataset;
use braid_train::metrics::StepMetrics;
use braid_train::planning::{PlanSection, loader_seconds, model_dims, workload};
use braid_train::trainer::train;
use braid_train::{Observer, RunConfig};

/// Like the `braid` binary, so the measured steps allocate as `braid train`'s do.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Res<T> = Result<T, String>;

/// (name, `--set`s): the layouts measured.
const LAYOUTS: &[(&str, &[&str])] = &[
    ("1 rank", &[]),
    (
        "1 rank, recompute",
        &[
            "parallel.llm.recompute=true",
            "parallel.vision.recompute=true",
            "parallel.audio.recompute=true",
        ],
    ),
    ("disjoint 3 (v1 a1 llm1)", &["parallel.world_size=3"]),
    ("llm dp2", &["parallel.world_size=4", "parallel.llm.dp=2"]),
    ("llm tp2", &["parallel.world_size=4", "parallel.llm.tp=2"]),
    (
        "llm pp2 m4",
        &["parallel.world_size=4", "parallel.llm.pp=2"],
    ),
    (
        "llm pp2 m4, interleaved v2",
        &[
            "parallel.world_size=4",
            "parallel.llm.pp=2",
            "parallel.llm.virtual_stages=2",
        ],
    ),
    (
        "llm pp2 m4, recompute",
        &[
            "parallel.world_size=4",
            "parallel.llm.pp=2",
            "parallel.llm.recompute=true",
        ],
    ),
    (
        "colocated 4",
        &[
            "parallel.world_size=4",
            "parallel.placement=\"colocated\"",
            "parallel.llm.tp=2",
            "parallel.llm.dp=2",
            "parallel.vision.dp=4",
            "parallel.audio.dp=4",
        ],
    ),
    (
        "llm pp2 dp2 + v dp2 + a dp2",
        &[
            "parallel.world_size=8",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.vision.dp=2",
            "parallel.audio.dp=2",
        ],
    ),
    (
        "8: llm tp2 pp2 + v dp2 + a dp2",
        &[
            "parallel.world_size=8",
            "parallel.llm.tp=2",
            "parallel.llm.pp=2",
            "parallel.vision.dp=2",
            "parallel.audio.dp=2",
        ],
    ),
    // The overlapped schedule (1F1B across the modules) on three of the disjoint ones.
    (
        "disjoint 3, overlapped",
        &["parallel.world_size=3", "parallel.schedule=\"overlapped\""],
    ),
    (
        "llm pp2 m4, overlapped",
        &[
            "parallel.world_size=4",
            "parallel.llm.pp=2",
            "parallel.schedule=\"overlapped\"",
        ],
    ),
    (
        "llm pp2 dp2 + v dp2 + a dp2, overlapped",
        &[
            "parallel.world_size=8",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.vision.dp=2",
            "parallel.audio.dp=2",
            "parallel.schedule=\"overlapped\"",
        ],
    ),
    // Colocated and overlapped: each rank interleaves its modules' passes.
    (
        "colocated 4, llm pp2 dp2, overlapped",
        &[
            "parallel.world_size=4",
            "parallel.placement=\"colocated\"",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.vision.dp=4",
            "parallel.audio.dp=4",
            "parallel.schedule=\"overlapped\"",
        ],
    ),
    // Interleaved LLM stages under the overlapped schedule, disjoint and colocated.
    (
        "llm pp2 m4 v2, overlapped",
        &[
            "parallel.world_size=4",
            "parallel.llm.pp=2",
            "parallel.llm.virtual_stages=2",
            "parallel.schedule=\"overlapped\"",
        ],
    ),
    (
        "colocated 4, llm pp2 dp2 v2, overlapped",
        &[
            "parallel.world_size=4",
            "parallel.placement=\"colocated\"",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.llm.virtual_stages=2",
            "parallel.vision.dp=4",
            "parallel.audio.dp=4",
            "parallel.schedule=\"overlapped\"",
        ],
    ),
    // Zero-bubble pipelining (the LLM's backward split into B and W) and encoder
    // stages reversed on colocated GPUs.
    (
        "llm pp2 m4, zero-bubble",
        &[
            "parallel.world_size=4",
            "parallel.llm.pp=2",
            "parallel.llm.zero_bubble=true",
        ],
    ),
    (
        "llm pp2 m4, overlapped, zero-bubble",
        &[
            "parallel.world_size=4",
            "parallel.llm.pp=2",
            "parallel.llm.zero_bubble=true",
            "parallel.schedule=\"overlapped\"",
        ],
    ),
    (
        "colocated 4, llm pp2 dp2, overlapped, zero-bubble",
        &[
            "parallel.world_size=4",
            "parallel.placement=\"colocated\"",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.llm.zero_bubble=true",
            "parallel.vision.dp=4",
            "parallel.audio.dp=4",
            "parallel.schedule=\"overlapped\"",
        ],
    ),
    (
        "colocated 4, llm pp2 dp2, vision pp2 reversed, overlapped",
        &[
            "parallel.world_size=4",
            "parallel.placement=\"colocated\"",
            "parallel.llm.pp=2",
            "parallel.llm.dp=2",
            "parallel.vision.pp=2",
            "parallel.vision.dp=2",
            "parallel.vision.reverse_stages=true",
            "parallel.audio.dp=4",
            "parallel.schedule=\"overlapped\"",
        ],
    ),
    // The LLM-centric placement (the planner's baseline): encoders inside the LLM's
    // first stage, microbatch by microbatch.
    (
        "centric llm pp2 m4",
        &[
            "parallel.placement=\"centric\"",
            "parallel.world_size=2",
            "parallel.llm.pp=2",
        ],
    ),
    (
        "centric llm tp2 dp2, vision tp2, audio tp1",
        &[
            "parallel.placement=\"centric\"",
            "parallel.world_size=4",
            "parallel.llm.tp=2",
            "parallel.llm.dp=2",
            "parallel.vision.tp=2",
            "parallel.vision.dp=2",
            "parallel.audio.dp=4",
        ],
    ),
];

/// Keeps every step's wall time.
struct Steps(Vec<f64>);

impl Observer for Steps {
    fn log(&mut self, _line: &str) {}
    fn step(&mut self, m: &StepMetrics, _total: u64) {
        self.0.push(m.step_time_s);
    }
}

/// The balancer's plan for the layout `cfg` trains with.
fn plan_of(cfg: &RunConfig, dims: &braid_balancer::ModelDims) -> Plan {
    let p = &cfg.parallel;
    let l = |m: &braid_train::config::ModuleLayout| Layout {
        tp: m.tp,
        cp: m.cp,
        pp: m.pp,
        dp: m.dp,
    };
    // One rank runs every module on it: the colocated plan of one GPU.
    let placement = match p.placement {
        RunPlacement::Centric => Placement::LlmCentric,
        _ if p.world_size == 1 || p.placement == RunPlacement::Colocated => Placement::Colocated,
        _ => Placement::Disjoint,
    };
    // The trainer runs the overlapped schedule on several ranks, disjoint or colocated.
    let schedule = if p.world_size > 1 && placement != Placement::LlmCentric {
        p.schedule
    } else {
        Schedule::Phased
    };
    Plan {
        placement,
        schedule,
        microbatches: cfg.train.microbatches,
        recompute: p.llm.recompute,
        recompute_encoders: p.vision.recompute,
        recompute_audio: (p.audio.recompute != p.vision.recompute).then_some(p.audio.recompute),
        llm_first_stage_layers: p.llm.first_stage_layers,
        llm_virtual_stages: p.llm.virtual_stages,
        reverse_encoder_stages: p.vision.reverse_stages || p.audio.reverse_stages,
        llm_zero_bubble: p.llm.zero_bubble,
        zero1: p.zero1,
        llm: l(&p.llm),
        vision: dims.vision.as_ref().map(|_| l(&p.vision)),
        audio: dims.audio.as_ref().map(|_| l(&p.audio)),
    }
}

struct Args {
    cluster: String,
    config: PathBuf,
    steps: u64,
    batches: usize,
    /// Sweeps over the layouts, interleaved: each layout's measured step is the median of
    /// all its rounds' timed steps, so a slow drift of a shared machine falls on every
    /// layout alike instead of on the few that ran during it.
    rounds: usize,
    only: Option<Vec<String>>,
    /// Writes each layout's measured step (`name<TAB>seconds`) here.
    save: Option<PathBuf>,
    /// Takes the measured steps from a file `--save` wrote instead of training: the same
    /// measurements predicted with another profile (the profile is the noisy part).
    measured: Option<PathBuf>,
}

fn args() -> Res<Args> {
    let mut a = Args {
        cluster: String::new(),
        config: PathBuf::from("configs/tiny.toml"),
        steps: 12,
        batches: 8,
        rounds: 1,
        only: None,
        save: None,
        measured: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--cluster" => a.cluster = v()?,
            "--config" => a.config = PathBuf::from(v()?),
            "--steps" => a.steps = v()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--batches" => a.batches = v()?.parse().map_err(|e| format!("--batches: {e}"))?,
            "--rounds" => a.rounds = v()?.parse().map_err(|e| format!("--rounds: {e}"))?,
            // Names hold commas: `;` between them, or `--only` again.
            "--only" => a.only.get_or_insert_with(Vec::new).extend(
                v()?.split(';')
                    .map(str::trim)
                    .filter(|x| !x.is_empty())
                    .map(str::to_string),
            ),
            "--save" => a.save = Some(PathBuf::from(v()?)),
            "--measured" => a.measured = Some(PathBuf::from(v()?)),
            _ => return Err(format!("unknown argument {k}")),
        }
    }
    if let Some(unknown) = a
        .only
        .iter()
        .flatten()
        .find(|x| !LAYOUTS.iter().any(|(name, _)| name == x))
    {
        let names: Vec<&str> = LAYOUTS.iter().map(|(name, _)| *name).collect();
        return Err(format!(
            "--only: no layout {unknown:?}; the layouts: {}",
            names.join("; ")
        ));
    }
    if a.cluster.is_empty() {
        return Err("--cluster PATH (from `braid profile`) is required".into());
    }
    if a.steps < 4 {
        return Err("--steps must be at least 4 (the first 2 are not timed)".into());
    }
    Ok(a)
}

fn config(a: &Args, dir: &Path, sets: &[&str]) -> Res<RunConfig> {
    let mut all = vec![
        format!("run.dir={}", dir.display()),
        format!("train.steps={}", a.steps),
        "checkpoint.interval=0".to_string(),
        // Short runs: the schedule does not change a step's work.
        "optim.warmup_steps=1".to_string(),
    ];
    all.extend(sets.iter().map(|s| s.to_string()));
    let mut cfg = RunConfig::from_file(&a.config, &all).map_err(|e| e.to_string())?;
    // No held-out evaluation: it runs after the timed steps and only slows the check.
    cfg.eval.path = None;
    cfg.eval.input = None;
    Ok(cfg)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("validate_plan: error: {e}");
        std::process::exit(2);
    }
}

fn run() -> Res<()> {
    let a = args()?;
    let cluster = Cluster::load(&a.cluster).map_err(|e| e.to_string())?;
    let root = std::env::temp_dir().join(format!("braid-validate-{}", std::process::id()));
    let probe = config(&a, &root.join("probe"), &[])?;
    let d = &probe.data;
    ensure_dataset(
        &d.path,
        d.build.as_deref(),
        None,
        d.demo.as_deref(),
        &mut |l| eprintln!("  {l}"),
    )
    .map_err(|e| e.to_string())?;
    let mcfg = braid_train::assemble::model_config(&probe).map_err(|e| e.to_string())?;
    let mut wcfg = probe.clone();
    wcfg.plan = Some(PlanSection {
        batches: a.batches,
        ..PlanSection::default()
    });
    let work = workload(&wcfg, &mcfg, Some(&d.path)).map_err(|e| e.to_string())?;
    let input_s = loader_seconds(&probe, &d.path, 2 * a.batches).map_err(|e| e.to_string())?;
    let problem = Problem {
        model: model_dims(&mcfg),
        cluster: cluster.clone(),
        frozen: Vec::<Module>::new(),
        input_s,
        // `braid train` on CPU ranks syncs gradients after the backward.
        overlap_sync: false,
        // Nor is its TP sequence-parallel.
        sequence_parallel: false,
    };
    // The cost model before this check added loader time and elementwise work: shown
    // next to the full one.
    let mut flops_only = problem.clone();
    flops_only.input_s = 0.0;
    flops_only.cluster.elementwise_ns = 0.0;
    eprintln!(
        "input: {:.4} device-seconds per rank per step (loader alone); elementwise {:.2} ns/value",
        input_s, cluster.elementwise_ns
    );
    let chosen: Vec<&(&str, &[&str])> = LAYOUTS
        .iter()
        .filter(|(name, _)| a.only.as_ref().is_none_or(|o| o.iter().any(|x| x == name)))
        .collect();
    let measured = match &a.measured {
        Some(path) => read_measured(path, &chosen)?,
        None => measure(&a, &root, &chosen)?,
    };
    if let Some(path) = &a.save {
        let text: String = chosen
            .iter()
            .zip(&measured)
            .map(|((name, _), m)| format!("{name}\t{m}\n"))
            .collect();
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let mut rows = Vec::new();
    for (i, (name, sets)) in chosen.iter().enumerate() {
        let cfg = config(&a, &root.join("plan"), sets)?;
        let plan = plan_of(&cfg, &problem.model);
        let predict = |p: &Problem| -> Res<f64> {
            let mut sum = 0.0;
            for k in 0..a.batches {
                sum += p.simulate(&plan, &work.batch(k))?.step_s;
            }
            Ok(sum / a.batches as f64)
        };
        let (predicted, base) = (predict(&problem)?, predict(&flops_only)?);
        let measured = measured[i];
        eprintln!("{name}: measured {measured:.4} s, predicted {predicted:.4} s");
        rows.push((name.to_string(), measured, predicted, base));
    }
    let _ = std::fs::remove_dir_all(&root);
    println!(
        "\n{:<32} {:>10} {:>10} {:>6} {:>12} {:>6}",
        "layout", "measured s", "predicted", "ratio", "FLOPs-only", "ratio"
    );
    for (n, m, p, b) in &rows {
        println!(
            "{n:<32} {m:>10.4} {p:>10.4} {:>6.2} {b:>12.4} {:>6.2}",
            p / m,
            b / m
        );
    }
    let ms: Vec<f64> = rows.iter().map(|r| r.1).collect();
    for (what, k) in [("full model", 2), ("FLOPs-only", 3)] {
        let ps: Vec<f64> = rows
            .iter()
            .map(|r| if k == 2 { r.2 } else { r.3 })
            .collect();
        let mare = ms
            .iter()
            .zip(&ps)
            .map(|(m, p)| (p / m - 1.0).abs())
            .sum::<f64>()
            / rows.len() as f64;
        println!(
            "{what}: Spearman rank correlation {:.3} over {} layouts; mean |predicted/measured - 1| = {:.1}%",
            spearman(&ms, &ps),
            rows.len(),
            100.0 * mare
        );
    }
    Ok(())
}

/// Trains every chosen layout `a.rounds` times, interleaved; each layout's median step.
fn measure(a: &Args, root: &Path, chosen: &[&(&str, &[&str])]) -> Res<Vec<f64>> {
    // Per layout: every timed step of every round.
    let mut timed: Vec<Vec<f64>> = vec![Vec::new(); chosen.len()];
    for round in 0..a.rounds.max(1) {
        for (i, (name, sets)) in chosen.iter().enumerate() {
            let dir = root.join(format!("run{i}"));
            let cfg = config(a, &dir, sets)?;
            eprintln!("{name}: round {round}, training {} steps ...", a.steps);
            let mut obs = Steps(Vec::new());
            train(cfg, false, &mut obs).map_err(|e| format!("{name}: {e}"))?;
            timed[i].extend(obs.0.iter().skip(2).copied());
            // Each run writes a final checkpoint; drop it before the next.
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    Ok(timed.iter().map(|t| median(t)).collect())
}

/// The measured steps a `--save` file holds, in the order of `chosen`.
fn read_measured(path: &Path, chosen: &[&(&str, &[&str])]) -> Res<Vec<f64>> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut found = std::collections::HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let (name, secs) = line.split_once('\t').ok_or(format!(
            "{}:{}: expected NAME<TAB>SECONDS",
            path.display(),
            n + 1
        ))?;
        let secs: f64 = secs
            .trim()
            .parse()
            .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
        found.insert(name.to_string(), secs);
    }
    chosen
        .iter()
        .map(|(name, _)| {
            found.get(*name).copied().ok_or(format!(
                "{}: no measurement of layout {name:?}",
                path.display()
            ))
        })
        .collect()
}
