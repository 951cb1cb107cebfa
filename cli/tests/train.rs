//! `braid train` end to end on a tiny model: the run folder's contents, bit-exact resume after
//! `kill -9` at random moments and after a crash inside a checkpoint write, skipped non-finite
//! steps, and config errors that name the key before any work.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn braid() -> Command {
    Command::new(env!("CARGO_BIN_EXE_braid"))
}

fn run(args: &[&str]) -> Output {
    braid().args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A tiny run config over a small demo dataset, made once per test binary.
fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("braid-train-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let demo = dir.join("demo");
        let o = run(&[
            "demo-data",
            "--output",
            demo.to_str().unwrap(),
            "--train",
            "60",
            "--heldout",
            "12",
        ]);
        assert!(o.status.success(), "{}", text(&o));
        std::fs::write(
            dir.join("data.toml"),
            r#"
[input]
path = "demo/train.jsonl"
format = "jsonl"
[image]
preset = "siglip"
size = 32
patch = 8
[audio]
pool_stride = 4
[pack]
max_seq_len = 192
"#,
        )
        .unwrap();
        let cfg = format!(
            r#"
[run]
name = "tiny"
dir = "{dir}/runs/ref"
seed = 5
[data]
path = "{dir}/packed"
build = "{dir}/data.toml"
workers = 1
[eval]
path = "{dir}/packed-heldout"
input = "{dir}/demo/heldout.jsonl"
[model.llm]
family = "llama"
vocab = 261
hidden = 32
intermediate = 64
layers = 1
heads = 2
kv_heads = 1
head_dim = 16
rms_norm_eps = 1e-5
max_position_embeddings = 256
rope = {{ theta = 10000.0 }}
tie_embeddings = true
qkv_bias = false
[model.vision]
family = "siglip"
hidden_size = 16
intermediate_size = 32
num_layers = 1
num_heads = 2
num_channels = 3
image_size = 32
patch_size = 8
act = "gelu_pytorch_tanh"
layer_norm_eps = 1e-6
[model.audio]
num_mel_bins = 80
d_model = 16
encoder_layers = 1
encoder_attention_heads = 2
encoder_ffn_dim = 32
max_source_positions = 1500
act = "gelu"
layer_norm_eps = 1e-5
[model.projector.vision]
in_dim = 16
out_dim = 32
act = "gelu"
[model.projector.audio]
in_dim = 16
out_dim = 32
stride = 4
act = "gelu"
[train]
steps = 12
batch_rows = 4
microbatches = 2
[optim]
lr = 3e-3
warmup_steps = 2
[checkpoint]
interval = 2
keep = 2
[log]
interval = 1
"#,
            dir = dir.display()
        );
        std::fs::write(dir.join("run.toml"), cfg).unwrap();
        dir
    })
}

fn config() -> String {
    fixture().join("run.toml").display().to_string()
}

fn train(run_dir: &Path, extra: &[&str]) -> Command {
    let mut c = braid();
    c.args(["train", "--config", &config(), "--set"])
        .arg(format!("run.dir={}", run_dir.display()))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// (step, loss bits, grad-norm bits, lr bits) of one step.
type StepBits = (u64, u64, u64, u32);

/// Every line of metrics.jsonl as [`StepBits`].
fn losses(run_dir: &Path) -> Vec<StepBits> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap().to_bits(),
                v["grad_norm"].as_f64().unwrap().to_bits(),
                (v["lr"].as_f64().unwrap() as f32).to_bits(),
            )
        })
        .collect()
}

/// The fields of a metrics.jsonl line that measure time: free to differ between runs.
const TIMINGS: [&str; 2] = ["step_time_s", "data_time_s"];

/// Every line of metrics.jsonl as written, minus the timings (and the straggler object,
/// which is made of them): every other number is compared as the text braid wrote (its
/// exact bits), not as parsed back.
fn logged(run_dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let mut l = line.to_string();
            for key in TIMINGS {
                let field = format!("\"{key}\":");
                let at = l.find(&field).unwrap_or_else(|| panic!("no {key}: {line}"));
                let len = l[at + field.len()..]
                    .find([',', '}'])
                    .unwrap_or_else(|| panic!("{line}"));
                let mut end = at + field.len() + len;
                if l[end..].starts_with(',') {
                    end += 1;
                }
                l.replace_range(at..end, "");
            }
            if let Some(at) = l.find(",\"straggler\":{") {
                let end = at + l[at..].find('}').unwrap_or_else(|| panic!("{line}")) + 1;
                l.replace_range(at..end, "");
            }
            l
        })
        .collect()
}

/// The uninterrupted run, made once.
struct Reference {
    losses: Vec<StepBits>,
    /// metrics.jsonl without timings ([`logged`]).
    logged: Vec<String>,
    took: Duration,
}

fn reference() -> &'static Reference {
    static REF: OnceLock<Reference> = OnceLock::new();
    REF.get_or_init(|| {
        let dir = fixture().join("runs/ref");
        let t = Instant::now();
        let o = train(&dir, &["--set", "eval.interval=6"]).output().unwrap();
        let took = t.elapsed();
        assert!(o.status.success(), "{}", text(&o));
        Reference {
            losses: losses(&dir),
            logged: logged(&dir),
            took,
        }
    })
}

#[test]
fn a_run_writes_metrics_checkpoints_eval_plot_and_export() {
    let ref_losses = &reference().losses;
    let dir = fixture().join("runs/ref");
    assert_eq!(ref_losses.len(), 12);
    assert_eq!(
        ref_losses.iter().map(|l| l.0).collect::<Vec<_>>(),
        (1..=12).collect::<Vec<_>>()
    );
    let first = f64::from_bits(ref_losses[0].1);
    let last = f64::from_bits(ref_losses[11].1);
    assert!(last < first, "loss did not fall: {first} -> {last}");
    // keep = 2: steps 10 and 12 remain.
    let mut ckpts: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    ckpts.sort();
    assert_eq!(ckpts, ["step-00000010", "step-00000012"]);
    for f in [
        "model.safetensors",
        "optim.safetensors",
        "state.json",
        "config.toml",
    ] {
        assert!(
            dir.join("checkpoints/step-00000012").join(f).is_file(),
            "{f}"
        );
    }
    let eval: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("eval.json")).unwrap()).unwrap();
    assert_eq!(eval["metric"], "answer_token_accuracy");
    for k in ["heldout", "text_only"] {
        let x = eval[k].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&x), "{k} = {x}");
        assert!(
            eval["by_modality"]
                .as_object()
                .is_some_and(|m| !m.is_empty()),
            "{eval}"
        );
    }
    // The mid-run evaluation (eval.interval = 6) is a line of eval.jsonl; the final one is eval.json.
    let mid = std::fs::read_to_string(dir.join("eval.jsonl")).unwrap();
    assert_eq!(mid.lines().count(), 1);
    assert!(mid.contains("\"step\":6"), "{mid}");
    assert!(dir.join("loss.png").is_file());
    assert!(dir.join("config.toml").is_file());
    for f in [
        "hf/llm/config.json",
        "hf/llm/model.safetensors",
        "hf/vision/config.json",
        "hf/audio/config.json",
        "hf/projectors.safetensors",
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    // A second start without --resume refuses to touch the run.
    let o = train(&dir, &[]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--resume"), "{}", text(&o));
}

/// A reader that goes away (`braid train ... 2>&1 | head -1`) does not end the run: it
/// trains to the end and logs every step, the same bits as the run whose output was read.
#[test]
fn a_closed_output_pipe_does_not_stop_the_run() {
    let want = reference();
    let dir = fixture().join("runs/closed-pipe");
    let _ = std::fs::remove_dir_all(&dir);
    let mut child = train(&dir, &["--set", "eval.interval=6"]).spawn().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let mut first = [0u8; 1];
    std::io::Read::read_exact(&mut stderr, &mut first).unwrap();
    drop(stderr);
    drop(child.stdout.take());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(losses(&dir), want.losses);
    // What the run writes after its last step is there too.
    assert!(dir.join("eval.json").is_file() && dir.join("loss.png").is_file());
}

#[test]
fn non_finite_steps_are_skipped_then_stop_the_run() {
    let dir = fixture().join("runs/nan");
    let _ = std::fs::remove_dir_all(&dir);
    let o = train(
        &dir,
        &["--set", "fault.nan_grad_at=[3]", "--set", "train.steps=4"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let text_m = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let skipped: Vec<bool> = text_m
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["skipped"]
                .as_bool()
                .unwrap()
        })
        .collect();
    assert_eq!(skipped, [false, false, true, false]);

    // The skipped step's null grad norm reads back (resume and the loss plot use it).
    let o = train(
        &dir,
        &[
            "--resume",
            "--set",
            "fault.nan_grad_at=[3]",
            "--set",
            "train.steps=5",
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count(),
        5
    );

    let dir = fixture().join("runs/nan-stop");
    let _ = std::fs::remove_dir_all(&dir);
    let o = train(
        &dir,
        &[
            "--set",
            "fault.nan_grad_at=[2,3]",
            "--set",
            "train.max_nonfinite_in_a_row=2",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("non-finite"), "{}", text(&o));
}

#[test]
fn generate_reads_a_checkpoint_and_an_image_or_clip() {
    let _ = reference();
    let run_dir = fixture().join("runs/ref");
    let demo = fixture().join("demo");
    let first_of = |dir: &str| {
        let mut v: Vec<PathBuf> = std::fs::read_dir(demo.join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v.remove(0)
    };
    for (flag, file) in [
        ("--image", first_of("images")),
        ("--audio", first_of("audio")),
    ] {
        let o = run(&[
            "generate",
            "--checkpoint",
            run_dir.to_str().unwrap(),
            flag,
            file.to_str().unwrap(),
            "--prompt",
            "What is it?",
            "--max-new-tokens",
            "6",
        ]);
        assert!(o.status.success(), "{}", text(&o));
        assert!(text(&o).contains("step-00000012"), "{}", text(&o));
    }
    let o = run(&["generate", "--checkpoint", "/nonexistent", "--prompt", "x"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("/nonexistent"), "{}", text(&o));
    // More tokens than the model has positions: refused at once, saying how many fit;
    // also an ask that would wrap the prompt's length round usize::MAX (it used to pass
    // the check and run unbounded).
    let huge = (usize::MAX - 5).to_string();
    for (prompt, ask) in [
        ("x", "100000"),
        ("a prompt of more than five tokens", &huge),
    ] {
        let t = std::time::Instant::now();
        let o = run(&[
            "generate",
            "--checkpoint",
            run_dir.to_str().unwrap(),
            "--prompt",
            prompt,
            "--max-new-tokens",
            ask,
        ]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(
            text(&o).contains("max_position_embeddings") && text(&o).contains("at most"),
            "{}",
            text(&o)
        );
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "{:?}",
            t.elapsed()
        );
    }
}

#[test]
fn modules_start_from_a_hugging_face_export() {
    let ref_losses = &reference().losses;
    let hf = fixture().join("runs/ref/hf");
    let dir = fixture().join("runs/from-hf");
    let _ = std::fs::remove_dir_all(&dir);
    let init = |m: &str| format!("model.{m}={{ init = \"hf:{}\" }}", hf.join(m).display());
    let o = train(
        &dir,
        &[
            "--set",
            &init("llm"),
            "--set",
            &init("vision"),
            "--set",
            &init("audio"),
            "--set",
            "train.steps=2",
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let from_hf = f64::from_bits(losses(&dir)[0].1);
    let scratch = f64::from_bits(ref_losses[0].1);
    // The exported LLM has learned the template: its first loss is far below a fresh model's.
    assert!(
        from_hf < scratch - 0.5,
        "from HF {from_hf} vs from scratch {scratch}"
    );
    let resolved = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    assert!(resolved.contains("init = \"hf:"), "{resolved}");
}

#[path = "train/bad_configs.rs"]
mod bad_configs;
#[path = "train/damaged_checkpoints.rs"]
mod damaged_checkpoints;
#[path = "train/demo_resume.rs"]
mod demo_resume;
/// The multi-rank runs: in their own file, in this test binary (one fixture, one
/// reference run).
#[path = "train/devices.rs"]
mod devices;
#[path = "train/kill_resume.rs"]
mod kill_resume;
#[path = "train/memory.rs"]
mod memory;
#[path = "train/proc_failures.rs"]
mod proc_failures;
#[path = "train/procs.rs"]
mod procs;
#[path = "train/ranks.rs"]
mod ranks;
#[path = "train/signal.rs"]
mod signal;
#[path = "train/tokenizer.rs"]
mod tokenizer;
