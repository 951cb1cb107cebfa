//! The `braid` command: one subcommand per job (see DESIGN.md, "Who uses it, and how").
//!

// A reader that went away (`braid train ... 2>&1 | head`, a launcher's pipe closed) must
// not end a run: std's print macros panic on a failed write ("failed printing to stderr:
// Broken pipe") and training would stop between checkpoints with its metrics cut short.
// These shadow them in every module below: a failed write to the terminal is dropped, and
// the run, its metrics file and its log go on.
macro_rules! eprintln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
macro_rules! println {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod demo;
mod forward;
mod generate;
mod inspect;
mod launch;
mod pack;
mod plan;
mod plot;
mod profile;
mod trace;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's malloc: a training step allocates and frees many
/// multi-megabyte activations, which glibc serves with fresh, page-faulting mmaps. An A/B of
/// `cargo bench -p braid-train --bench step` (three runs each, alternating) gave medians of
/// 0.34-0.41 s against 0.43-0.45 s; see docs/benchmarks.md for what the full runs show.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "braid",
    version,
    about = "Train multimodal LLMs with a parallel layout per module"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// One forward pass of a Hugging Face checkpoint on CPU in f32, to check a conversion.
    ///
    /// Reads `input_ids` (LLMs), `pixel_values` (CLIP/SigLIP vision towers) or
    /// `input_features` (Whisper encoders) from INPUT and writes `logits` or
    /// `last_hidden_state` (and `pooler_output` where the model has one) to OUTPUT.
    Forward {
        /// Hugging Face model directory (config.json + model.safetensors or a sharded index).
        #[arg(long)]
        model: PathBuf,
        /// safetensors file with the HF-named input.
        #[arg(long)]
        input: PathBuf,
        /// safetensors file to write the outputs to.
        #[arg(long)]
        output: PathBuf,
    },
    /// Write a small multimodal demo dataset (shapes and tones) to train on.
    DemoData(demo::DemoArgs),
    /// Train a run config (default: the CPU demo, configs/demo.toml): progress, metrics.jsonl,
    /// checkpoints, held-out eval, Hugging Face export.
    Train(train::TrainArgs),
    /// Greedy answer of a trained checkpoint to a prompt about an image and/or a clip.
    Generate(generate::GenerateArgs),
    /// Pack raw multimodal data (JSONL chat, LLaVA, WebDataset, Parquet) into validated,
    /// tokenized, length-annotated Parquet shards; bad samples go to rejects.jsonl.
    Pack(pack::PackArgs),
    /// Statistics of a packed dataset; `--plots DIR` writes the histograms as PNG.
    Inspect(inspect::InspectArgs),
    /// Choose a layout per module for N GPUs: predicted step time and memory per GPU next
    /// to the LLM-centric layout; writes a plan file for `parallel.plan`.
    Plan(plan::PlanArgs),
    /// Measure this machine for the planner: achieved matmul rate by size, attention's
    /// share of it, per-block overhead, all-reduce latency and bandwidth between ranks.
    /// Writes a cluster TOML for `braid plan --cluster`. Measures the CPU (ranks are
    /// threads); GPUs come with the CUDA backend.
    Profile(profile::ProfileArgs),
    /// Start the processes of one machine of a multi-process world (like torchrun's static
    /// mode): `braid launch --nproc-per-node 4 -- train --config RUN.toml`. Each process gets
    /// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; output is prefixed by rank.
    Launch(launch::LaunchArgs),
    /// A run's timeline (written with `--set log.trace=true`): each rank's time per kind of
    /// work, and with `--png FILE` a picture with a band per rank, coloured by module.
    Trace(trace::TraceArgs),
}

fn main() -> ExitCode {
    // NCCL's kernels spin while they wait for a peer, and with CUDA's lazy module loading
    // (the default since 12.2) loading a kernel mid-step may synchronize the context and
    // deadlock against them (NCCL's guide). Braid loads its modules before a world of
    // GPU processes connects (NcclComm::world); eager loading has the driver load each
    // module's functions with it. A user's own setting is kept.
    if std::env::var_os("CUDA_MODULE_LOADING").is_none() {
        // SAFETY: the first thing in main, before any thread exists: nothing reads or
        // writes the environment concurrently.
        unsafe { std::env::set_var("CUDA_MODULE_LOADING", "EAGER") };
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Forward {
            model,
            input,
            output,
        } => match forward::run(&model, &input, &output) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("braid forward: error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::DemoData(args) => demo::run(&args),
        Command::Train(args) => train::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Pack(args) => ExitCode::from(pack::run(args)),
        Command::Inspect(args) => ExitCode::from(inspect::run(args)),
        Command::Plan(args) => ExitCode::from(plan::run(args)),
        Command::Profile(args) => ExitCode::from(profile::run(args)),
        Command::Launch(args) => launch::run(args),
        Command::Trace(args) => trace::run(args),
    }
}
