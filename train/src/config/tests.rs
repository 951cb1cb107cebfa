//! Run-config parsing and validation: every bad key is named.

use super::*;

/// A complete small config; tests change one thing at a time.
pub(crate) const BASE: &str = r#"
[run]
name = "t"
dir = "runs/t"
seed = 7

[data]
path = "data/packed"

[model.llm]
family = "llama"
vocab = 261
hidden = 32
intermediate = 64
layers = 2
heads = 4
kv_heads = 2
head_dim = 8
rms_norm_eps = 1e-5
max_position_embeddings = 512
rope = { theta = 10000.0 }
tie_embeddings = false
qkv_bias = false

[train]
steps = 10
batch_rows = 4
"#;

fn err(sets: &[&str]) -> String {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    RunConfig::from_toml(BASE, "base.toml", &sets)
        .unwrap_err()
        .to_string()
}

#[test]
fn the_base_config_parses_with_defaults() {
    let c = RunConfig::from_toml(BASE, "base.toml", &[]).unwrap();
    assert_eq!(c.train.microbatches, 1);
    assert_eq!(c.parallel.world_size, 1);
    assert_eq!(c.checkpoint.keep, 3);
    // The resolved config parses back to the same config.
    let again = RunConfig::from_toml(&c.to_toml().unwrap(), "resolved", &[]).unwrap();
    assert_eq!(again, c);
}

#[test]
fn set_overrides_reach_every_section() {
    let sets: Vec<String> = [
        "train.steps=3",
        "optim.lr=0.01",
        "model.llm.layers=1",
        "run.dir=elsewhere",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let c = RunConfig::from_toml(BASE, "base.toml", &sets).unwrap();
    assert_eq!(c.train.steps, 3);
    assert_eq!(c.optim.lr, 0.01);
    assert_eq!(c.run.dir, std::path::PathBuf::from("elsewhere"));
    match &c.model.llm {
        ModuleSpec::Sizes(l) => assert_eq!(l.layers, 1),
        ModuleSpec::Hf(_) => panic!("sizes expected"),
    }
}

#[test]
fn typos_and_bad_values_name_the_key() {
    for (sets, needle) in [
        (&["train.stpes=3"][..], "stpes"),
        (&["optim.lrr=3"][..], "lrr"),
        (&["model.llm.hiden=3"][..], "hiden"),
        (&["train.steps=0"][..], "train.steps"),
        (&["optim.lr=-1"][..], "optim.lr"),
        (&["optim.beta2=1.5"][..], "optim.beta2"),
        (&["optim.warmup_steps=50"][..], "optim.warmup_steps"),
        (&["optim.schedule=\"cosin\""][..], "cosin"),
        (&["plan.placement=\"disjiont\""][..], "disjiont"),
        (&["train.microbatches=9"][..], "train.microbatches"),
        (&["train.freeze=[\"visoin\"]"][..], "visoin"),
        (&["parallel.world_size=0"][..], "parallel.world_size"),
        (&["data.workers=100000"][..], "data.workers"),
        (&["data.workers=0"][..], "data.workers"),
        (&["data.prefetch=100000"][..], "data.prefetch"),
        (&["parallel.timeout_s=0"][..], "parallel.timeout_s"),
        (&["parallel.llm.tp=0"][..], "parallel.llm.tp"),
        (
            &["parallel.llm.virtual_stages=0"][..],
            "parallel.llm.virtual_stages",
        ),
        (
            &["parallel.llm.virtual_stages=2"][..],
            "at least two pipeline stages",
        ),
        (
            &["parallel.vision.virtual_stages=2"][..],
            "parallel.vision.virtual_stages",
        ),
        (
            &["parallel.llm.reverse_stages=true"][..],
            "parallel.llm.reverse_stages",
        ),
        (
            &["parallel.audio.reverse_stages=true"][..],
            "parallel.audio.pp = 1): nothing to reverse",
        ),
        (
            &["parallel.vision.zero_bubble=true"][..],
            "parallel.vision.zero_bubble",
        ),
        (
            &["parallel.llm.zero_bubble=true"][..],
            "parallel.llm.pp = 1 and virtual_stages = 1",
        ),
        (
            &[
                "parallel.llm.zero_bubble=true",
                "parallel.llm.pp=2",
                "parallel.llm.virtual_stages=2",
            ][..],
            "virtual_stages = 2",
        ),
        (
            &[
                "parallel.llm.zero_bubble=true",
                "parallel.llm.pp=2",
                "parallel.placement=\"centric\"",
            ][..],
            "\"centric\" placement",
        ),
        (&["checkpoint.keep=0"][..], "checkpoint.keep"),
        (
            &["train.batch_tokens=100"][..],
            "batch_rows or batch_tokens",
        ),
        (&["model.llm.init=\"hf:x\""][..], "init"),
        (
            &["model.projector.vision.in_dim=4"][..],
            "model.projector.vision",
        ),
        (&["surprise.key=1"][..], "surprise"),
    ] {
        let e = err(sets);
        assert!(e.contains(needle), "{sets:?}: {e}");
    }
}

#[test]
fn hf_init_takes_no_sizes() {
    let text = BASE.replace(
        "[model.llm]\nfamily",
        "[model.llm]\ninit = \"hf:/models/x\"\n[model.unused]\nfamily",
    );
    // Sizes moved out of [model.llm]: the unknown table is named.
    let e = RunConfig::from_toml(&text, "x", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("unused"), "{e}");
    let only_init = r#"
[run]
name = "t"
dir = "d"
[data]
path = "p"
[model.llm]
init = "hf:/models/x"
[train]
steps = 1
batch_rows = 1
"#;
    let c = RunConfig::from_toml(only_init, "x", &[]).unwrap();
    assert_eq!(
        c.model.llm.hf_path(),
        Some(std::path::Path::new("/models/x"))
    );
    let e = RunConfig::from_toml(&only_init.replace("hf:/models/x", "/models/x"), "x", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("hf:PATH"), "{e}");
}

#[test]
fn schema_errors_in_the_file_give_line_and_column() {
    // An unknown key and a wrong type, each on a known line of the file.
    let typo = BASE.replace("steps = 10", "stpes = 10");
    let line = typo.lines().position(|l| l.starts_with("stpes")).unwrap() + 1;
    let e = RunConfig::from_toml(&typo, "typo.toml", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("typo.toml"), "{e}");
    assert!(e.contains(&format!("line {line}, column 1")), "{e}");
    assert!(e.contains("stpes"), "{e}");

    let wrong = BASE.replace("seed = 7", "seed = \"seven\"");
    let line = wrong.lines().position(|l| l.starts_with("seed")).unwrap() + 1;
    let e = RunConfig::from_toml(&wrong, "wrong.toml", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains(&format!("line {line}, column 8")), "{e}");

    // A mistake that only a --set makes has no line in the file; it says so.
    let e = err(&["train.stpes=3"]);
    assert!(e.contains("stpes") && e.contains("--set"), "{e}");
    assert!(!e.contains("line "), "{e}");
}

/// A `"cuda"` config reads anywhere (`braid plan` on a login node, `braid generate` of a
/// GPU run's checkpoint on a CPU); running it is refused, naming the key, where this
/// machine has no usable GPU.
#[test]
fn a_cuda_config_reads_anywhere_and_runs_only_with_a_gpu() {
    let c = RunConfig::from_toml(BASE, "base.toml", &["parallel.device=\"cuda\"".into()]).unwrap();
    assert_eq!(c.parallel.device, Device::Cuda);
    match braid_kernels::Device::Cuda(0).unavailable_reason() {
        Some(_) => {
            let e = c.parallel.check_device().unwrap_err().to_string();
            assert!(
                e.contains("parallel.device") && e.contains("no usable GPU"),
                "{e}"
            );
        }
        None => c.parallel.check_device().unwrap(),
    }
    let cpu = RunConfig::from_toml(BASE, "base.toml", &[]).unwrap();
    cpu.parallel.check_device().unwrap();
}
