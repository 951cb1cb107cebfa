//! A timeline of every rank (`log.trace = true`): spans of a step's work (each forward
//! and backward per module, stage and microbatch; the bridge; point-to-point waits and
//! collectives; the optimizer; waiting for data; checkpoints) as Chrome trace event JSON.
//! Each rank writes `<run.dir>/trace/rank-NNNNN.json`; rank 0 merges them into
//! `<run.dir>/trace/trace.json`, which Perfetto (ui.perfetto.dev) and `chrome://tracing`
//! open with a row per rank (`pid` = rank) and a lane per kind of work (`tid`).
//!
//! Times are wall-clock microseconds since the Unix epoch, so the files of processes on
//! one host line up (processes on several hosts line up as well as their clocks do). On a
//! GPU a span ends by synchronizing the device, so it measures the work, not its launch:
//! tracing costs the overlap of host and device, and is meant for looking, not for timing
//! the fastest run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use braid_kernels::Device;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError, io_err};

/// The lanes of a rank's row, in display order: what kind of work a span is.
pub const LANES: [&str; 8] = [
    "data",
    "vision",
    "audio",
    "bridge",
    "llm",
    "comm",
    "optim",
    "checkpoint",
];

/// One Chrome trace event: a complete span (`ph` = "X", `ts` and `dur` in microseconds)
/// or a name for a row or lane (`ph` = "M").
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    pub name: String,
    #[serde(default)]
    pub cat: String,
    pub ph: String,
    #[serde(default)]
    pub ts: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    pub pid: usize,
    pub tid: usize,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub args: BTreeMap<String, serde_json::Value>,
}

/// A trace file: what Perfetto and `chrome://tracing` read.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TraceFile {
    pub trace_events: Vec<TraceEvent>,
    #[serde(default)]
    pub display_time_unit: String,
}

/// The spans of one rank.
#[derive(Debug)]
pub struct Tracer {
    rank: usize,
    device: Device,
    enabled: bool,
    /// Steps recorded at most, from the first one set (spans are kept until the end).
    limit: u64,
    first: Option<u64>,
    recording: bool,
    /// Unix time of `origin`, µs.
    origin_us: f64,
    origin: Instant,
    step: u64,
    events: Vec<TraceEvent>,
    /// Seconds spent in compute spans (the module and optimizer lanes) since the last
    /// [`Tracer::take_busy`], measured whether or not spans are recorded.
    busy_s: f64,
}

impl Tracer {
    /// A tracer of `rank` whose spans end on `device`'s work; records nothing unless
    /// `enabled`, and then the first `limit` steps.
    pub fn new(rank: usize, device: Device, enabled: bool, limit: u64) -> Self {
        let origin_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6);
        Tracer {
            rank,
            device,
            enabled,
            limit,
            first: None,
            recording: enabled,
            origin_us,
            origin: Instant::now(),
            step: 0,
            events: Vec::new(),
            busy_s: 0.0,
        }
    }

    /// A tracer that records nothing.
    pub fn off() -> Self {
        Self::new(0, Device::Cpu, false, 0)
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The step the next spans belong to (an argument of each span); past the first
    /// `limit` steps nothing more is recorded.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
        let first = *self.first.get_or_insert(step);
        self.recording = self.enabled && step < first.saturating_add(self.limit);
    }

    /// The start of a span (always measured: compute spans count as busy time).
    pub fn start(&self) -> Option<Instant> {
        Some(Instant::now())
    }

    /// Compute seconds since the last call (the straggler check's busy time). While
    /// spans are recorded they end after the device's queued work; otherwise on the
    /// host, which on a GPU counts launches rather than kernels.
    pub fn take_busy(&mut self) -> f64 {
        std::mem::take(&mut self.busy_s)
    }

    /// Ends the span begun at `start` (after the device's queued work): `name` is what
    /// ran ("llm fwd s0 mb3"), `lane` one of [`LANES`].
    pub fn end(
        &mut self,
        start: Option<Instant>,
        name: impl Into<String>,
        lane: &str,
    ) -> Result<()> {
        Ok(self.end_on_device(start, name, lane)?)
    }

    /// [`Tracer::end`] for the model's own forward and backward, below the trainer's
    /// error type: it fails only as the device's synchronization does.
    pub fn end_on_device(
        &mut self,
        start: Option<Instant>,
        name: impl Into<String>,
        lane: &str,
    ) -> std::result::Result<(), braid_kernels::Error> {
        let Some(start) = start else {
            return Ok(());
        };
        if self.recording {
            self.device.synchronize()?;
        }
        let end = Instant::now();
        if matches!(lane, "vision" | "audio" | "llm" | "optim") {
            self.busy_s += end.duration_since(start).as_secs_f64();
        }
        if !self.recording {
            return Ok(());
        }
        let at = |t: Instant| self.origin_us + t.duration_since(self.origin).as_secs_f64() * 1e6;
        let event = TraceEvent {
            name: name.into(),
            cat: lane.to_string(),
            ph: "X".into(),
            ts: at(start),
            dur: Some(end.duration_since(start).as_secs_f64() * 1e6),
            pid: self.rank,
            tid: lane_index(lane),
            args: BTreeMap::from([("step".to_string(), self.step.into())]),
        };
        self.events.push(event);
        Ok(())
    }

    /// The spans recorded so far.
    pub fn events(&self) -> &[TraceEvent] {
        &self.events
    }

    /// Writes this rank's spans to `dir/rank-NNNNN.json` (with the names of its row and
    /// lanes); returns the file.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).map_err(io_err(dir, "create"))?;
        let mut events = names(self.rank);
        events.extend(self.events.iter().cloned());
        let path = dir.join(rank_file(self.rank));
        write_file(&path, events)?;
        Ok(path)
    }
}

fn lane_index(lane: &str) -> usize {
    LANES.iter().position(|l| *l == lane).unwrap_or(LANES.len())
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.json")
}

/// The metadata events naming rank `rank`'s row and lanes.
fn names(rank: usize) -> Vec<TraceEvent> {
    let meta = |name: &str, tid: usize, value: String| TraceEvent {
        name: name.to_string(),
        cat: String::new(),
        ph: "M".into(),
        ts: 0.0,
        dur: None,
        pid: rank,
        tid,
        args: BTreeMap::from([("name".to_string(), value.into())]),
    };
    let mut out = vec![meta("process_name", 0, format!("rank {rank}"))];
    out.push(TraceEvent {
        args: BTreeMap::from([("sort_index".to_string(), rank.into())]),
        ..meta("process_sort_index", 0, String::new())
    });
    for (tid, lane) in LANES.iter().enumerate() {
        out.push(meta("thread_name", tid, lane.to_string()));
    }
    out
}

fn write_file(path: &Path, events: Vec<TraceEvent>) -> Result<()> {
    let file = TraceFile {
        trace_events: events,
        display_time_unit: "ms".into(),
    };
    let json = serde_json::to_vec(&file).map_err(|e| TrainError::Other(e.to_string()))?;
    braid_nn::hf::write_atomic(path, |tmp| {
        std::fs::write(tmp, &json).map_err(|e| braid_nn::Error::io(tmp, "write", e))
    })?;
    Ok(())
}

/// Writes the simulator's predicted timeline of a plan's step to `path`, in the format of
/// a run's: a row per lane (a pipeline stage of a replica, its TP x CP GPUs acting as
/// one; the bridge's transfers on rows of their own), spans named as the trainer names
/// them and coloured by module, from time 0.
pub fn write_plan(path: &Path, timeline: &braid_balancer::plan::step::PlanTimeline) -> Result<()> {
    let mut events = Vec::new();
    for (pid, (label, ranks)) in timeline.lanes.iter().enumerate() {
        let mut meta = names(pid);
        meta[0].args.insert(
            "name".into(),
            match ranks {
                0 => label.clone(),
                n => format!("{label} ({n} GPUs)"),
            }
            .into(),
        );
        events.extend(meta);
    }
    for (lane, name, start, end) in &timeline.spans {
        let kind = match name.split(' ').next().unwrap_or("") {
            "grad" => "comm",
            "" => "comm",
            k => k,
        };
        events.push(TraceEvent {
            name: name.clone(),
            cat: kind.to_string(),
            ph: "X".into(),
            ts: start * 1e6,
            dur: Some((end - start) * 1e6),
            pid: *lane,
            tid: lane_index(kind),
            args: BTreeMap::new(),
        });
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io_err(dir, "create"))?;
    }
    write_file(path, events)
}

/// Reads a trace file (a rank's, the merged one, or a plan's). Every span must start at
/// a finite time and last a finite, non-negative time: a hostile or corrupt file is an
/// error naming the span, not a picture stretched to 1e308 µs.
pub fn read(path: &Path) -> Result<TraceFile> {
    // A device (`/dev/zero`), a FIFO or a runaway file would be read until memory ran
    // out: only a regular file, and one a run could have written.
    const MAX_BYTES: u64 = 4 << 30;
    let meta = std::fs::metadata(path).map_err(io_err(path, "read"))?;
    if !meta.is_file() {
        return Err(TrainError::Other(format!(
            "{}: not a regular file (a trace is a JSON file)",
            path.display()
        )));
    }
    if meta.len() > MAX_BYTES {
        return Err(TrainError::Other(format!(
            "{}: {} bytes, more than a trace of {MAX_BYTES} bytes this reads",
            path.display(),
            meta.len()
        )));
    }
    let text = std::fs::read_to_string(path).map_err(io_err(path, "read"))?;
    let file: TraceFile = serde_json::from_str(&text)
        .map_err(|e| TrainError::Other(format!("{}: not a Chrome trace: {e}", path.display())))?;
    // Runs stamp µs since the Unix epoch (~1.8e15 today), plans µs since the step's
    // start: 1e17 µs is ~3,000 years either way. No span lasts more than a year.
    const START_US: f64 = 1e17;
    const YEAR_US: f64 = 3.2e13;
    // 1e308 printed in full is 309 digits: huge values in scientific notation.
    let num = |x: f64| {
        if x.abs() < 1e12 {
            format!("{x}")
        } else {
            format!("{x:e}")
        }
    };
    for (i, e) in file.trace_events.iter().enumerate() {
        let dur = e.dur.unwrap_or(0.0);
        let start_ok = e.ts.is_finite() && e.ts.abs() <= START_US;
        if !start_ok || !dur.is_finite() || !(0.0..=YEAR_US).contains(&dur) {
            return Err(TrainError::Other(format!(
                "{}: event {i} (`{}`, pid {}) starts at {} µs and lasts {} µs: a span needs a start within 1e17 µs of 0 and a duration from 0 to a year",
                path.display(),
                e.name,
                e.pid,
                num(e.ts),
                num(dur)
            )));
        }
    }
    Ok(file)
}

/// Merges the rank files of `dir` (ranks `0..world`) into `dir/trace.json`.
pub fn merge(dir: &Path, world: usize) -> Result<PathBuf> {
    let mut events = Vec::new();
    for rank in 0..world {
        events.extend(read(&dir.join(rank_file(rank)))?.trace_events);
    }
    let path = dir.join("trace.json");
    write_file(&path, events)?;
    Ok(path)
}
