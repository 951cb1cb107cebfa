//! `braid trace PATH`: a run's timeline (written with `log.trace = true`) summed up per
//! rank (time per kind of work), and with `--png` drawn as a picture: a band per rank, a
//! box per span, coloured by kind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use braid_train::trace::{LANES, TraceFile, read};

use crate::plot::Chart;
use crate::plot::timeline::{Span, Timeline};

/// A labelled row of spans (a rank's).
type Row = (String, Vec<Span>);

#[derive(Debug, clap::Args)]
pub struct TraceArgs {
    /// A run folder (its `trace/trace.json`), a trace folder, or a Chrome trace file.
    pub path: PathBuf,
    /// Draw the timeline to this PNG.
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Only this step's spans (default: every step in the file).
    #[arg(long)]
    pub step: Option<u64>,
    /// Picture width in pixels (160-8192).
    #[arg(long, default_value_t = 1600, value_parser = clap::value_parser!(u32).range(160..=8192))]
    pub width: u32,
}

/// The trace file `path` names: itself, `path/trace.json` or `path/trace/trace.json`.
fn trace_file(path: &Path) -> PathBuf {
    for candidate in [
        path.join("trace").join("trace.json"),
        path.join("trace.json"),
    ] {
        if candidate.is_file() {
            return candidate;
        }
    }
    path.to_path_buf()
}

/// Whether `a` and `b` name one existing file (two spellings, a link).
fn same_file(a: &Path, b: &Path) -> bool {
    matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}

/// Per rank (or a plan's lane): `(label, spans in seconds with their lane)`, in order;
/// labelled by the file's process names where it has them.
fn rows(file: &TraceFile, step: Option<u64>) -> Vec<Row> {
    let mut by_rank: BTreeMap<usize, Vec<Span>> = BTreeMap::new();
    let mut labels: BTreeMap<usize, String> = BTreeMap::new();
    for e in &file.trace_events {
        if e.ph == "M"
            && e.name == "process_name"
            && let Some(name) = e.args.get("name").and_then(serde_json::Value::as_str)
        {
            labels.insert(e.pid, printable(name));
        }
        let Some(dur) = e.dur.filter(|_| e.ph == "X") else {
            continue;
        };
        let in_step = e.args.get("step").and_then(serde_json::Value::as_u64);
        if step.is_some() && in_step != step {
            continue;
        }
        let start = e.ts * 1e-6;
        by_rank
            .entry(e.pid)
            .or_default()
            .push((start, start + dur * 1e-6, e.tid));
    }
    by_rank
        .into_iter()
        .map(|(rank, spans)| {
            let label = labels
                .remove(&rank)
                .unwrap_or_else(|| format!("rank {rank}"));
            (label, spans)
        })
        .collect()
}

/// A name from a trace file as it may be printed: control characters (a terminal's
/// escape sequences, a right-to-left override) as `?`, at most 80 characters.
fn printable(name: &str) -> String {
    let mut out: String = name
        .chars()
        .take(80)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if name.chars().nth(80).is_some() {
        out.push_str("...");
    }
    out
}

/// The time covered by `spans` (start, end), overlaps counted once: nested or
/// overlapping spans on one lane (a trace from another tool) never add up past the wall.
fn covered(mut spans: Vec<(f64, f64)>) -> f64 {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut total, mut end) = (0.0, f64::NEG_INFINITY);
    for (a, b) in spans {
        if b > end {
            total += b - a.max(end);
            end = b;
        }
    }
    total
}

/// One line per rank: its span of time and each kind's share of it (lanes the file
/// numbers beyond Braid's own as "other").
fn summary(rows: &[Row]) -> Vec<String> {
    rows.iter()
        .map(|(label, spans)| {
            let t0 = spans.iter().map(|s| s.0).fold(f64::INFINITY, f64::min);
            let t1 = spans.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
            let wall = (t1 - t0).max(1e-9);
            let mut by_lane = vec![Vec::new(); LANES.len() + 1];
            for s in spans {
                by_lane[s.2.min(LANES.len())].push((s.0, s.1));
            }
            let parts: Vec<String> = LANES
                .iter()
                .chain(&["other"])
                .zip(by_lane)
                .map(|(lane, spans)| (lane, covered(spans)))
                .filter(|(_, t)| *t > 0.0)
                .map(|(lane, t)| format!("{lane} {:.0} %", 100.0 * t / wall))
                .collect();
            format!(
                "{label}: {:.1} ms from first to last span; {}",
                wall * 1e3,
                parts.join(", ")
            )
        })
        .collect()
}

pub fn run(args: TraceArgs) -> ExitCode {
    let path = trace_file(&args.path);
    if path.is_dir() {
        eprintln!(
            "braid trace: error: {}: a folder without trace/trace.json or trace.json (a run writes them with `--set log.trace=true`)",
            path.display()
        );
        return ExitCode::from(2);
    }
    let file = match read(&path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("braid trace: error: {e} (write one with `--set log.trace=true`)");
            return ExitCode::from(2);
        }
    };
    if let Some(png) = &args.png
        && same_file(png, &path)
    {
        eprintln!(
            "braid trace: error: --png {} is the trace being read: writing there would replace it",
            png.display()
        );
        return ExitCode::from(2);
    }
    let rows = rows(&file, args.step);
    if rows.is_empty() {
        eprintln!(
            "braid trace: error: {} holds no spans{} (a span is a complete event: \"ph\": \"X\" with \"ts\" and \"dur\")",
            path.display(),
            args.step
                .map(|s| format!(" of step {s}"))
                .unwrap_or_default()
        );
        return ExitCode::from(2);
    }
    println!("{}: {} ranks", path.display(), rows.len());
    for line in summary(&rows) {
        println!("  {line}");
    }
    if let Some(png) = &args.png {
        let chart = Timeline {
            title: match args.step {
                Some(s) => format!("timeline of step {s}"),
                None => "timeline".into(),
            },
            kinds: LANES.iter().map(|l| l.to_string()).collect(),
            rows,
        };
        let height = (100 + 36 * chart.rows.len() as u32).clamp(160, 8192);
        if let Err(e) = chart.write_png_sized(png, args.width, height) {
            eprintln!("braid trace: error: {e}");
            return ExitCode::FAILURE;
        }
        println!("timeline picture: {}", png.display());
    }
    ExitCode::SUCCESS
}
