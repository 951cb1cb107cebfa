//! Hugging Face import errors (missing tensor, shape mismatch, unknown architecture),
//! the report of unused tensors, and the export round trip.
//!
//! Set `BRAID_LLM_EXPORT_DIR` to keep the exported checkpoints
//! (`$BRAID_LLM_EXPORT_DIR/<case>`) for `tools/fixtures/check_export.py`, which loads
//! them with transformers' `from_pretrained` and compares logits with the fixture's.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use braid_kernels::{Device, Tensor};
use braid_llm::{Llm, LlmConfig};
use braid_nn::Error;
use braid_nn::hf::{WeightFiles, save_safetensors};
use common::{TestResult, fixture, tmpdir};

/// Copies `case`'s config.json into `dir` and writes its weights, edited by `edit`.
fn rewrite_case(
    case: &str,
    dir: &Path,
    edit: impl FnOnce(&mut Vec<(String, Tensor)>),
) -> TestResult {
    let src = fixture(case);
    std::fs::copy(src.join("config.json"), dir.join("config.json"))?;
    let files = WeightFiles::open_dir(&src)?;
    let mut tensors: Vec<(String, Tensor)> = files
        .names()
        .map(|n| Ok((n.to_string(), files.load_any(n, Device::Cpu)?)))
        .collect::<Result<_, Error>>()?;
    edit(&mut tensors);
    let refs: Vec<(String, &Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&dir.join("model.safetensors"), &refs)?;
    Ok(())
}

fn missing_tensor_is_named(dev: Device) -> TestResult {
    let dir = tmpdir("missing");
    let gone = "model.layers.1.mlp.up_proj.weight";
    rewrite_case("llama_gqa", &dir, |t| t.retain(|(n, _)| n != gone))?;
    let e = Llm::from_hf_dir(&dir, dev).unwrap_err();
    match &e {
        Error::Weights { tensor, msg, .. } => {
            assert_eq!(tensor, gone);
            assert!(msg.contains("no such tensor"), "{msg}");
        }
        other => panic!("expected a weights error, got {other:?}"),
    }
    Ok(())
}

fn shape_mismatch_names_both_shapes(dev: Device) -> TestResult {
    let dir = tmpdir("shape");
    rewrite_case("llama_gqa", &dir, |_| {})?;
    // The config now disagrees with the weights: intermediate 72 -> 80.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    cfg["intermediate_size"] = serde_json::json!(80);
    std::fs::write(dir.join("config.json"), cfg.to_string())?;
    let e = Llm::from_hf_dir(&dir, dev).unwrap_err();
    let msg = e.to_string();
    match &e {
        Error::Weights { tensor, .. } => {
            assert_eq!(tensor, "model.layers.0.mlp.gate_proj.weight")
        }
        other => panic!("expected a weights error, got {other:?}"),
    }
    assert!(
        msg.contains("[72, 48]") && msg.contains("[80, 48]"),
        "{msg}"
    );
    Ok(())
}

fn unknown_architecture_is_an_error(dev: Device) -> TestResult {
    let dir = tmpdir("arch");
    rewrite_case("llama_gqa", &dir, |_| {})?;
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    cfg["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    std::fs::write(dir.join("config.json"), cfg.to_string())?;
    let msg = Llm::from_hf_dir(&dir, dev).unwrap_err().to_string();
    assert!(
        msg.contains("MistralForCausalLM") && msg.contains("LlamaForCausalLM, Qwen2ForCausalLM"),
        "{msg}"
    );
    Ok(())
}

fn extra_tensors_are_reported_unused(dev: Device) -> TestResult {
    let dir = tmpdir("extra");
    let extra = "model.layers.0.self_attn.rotary_emb.inv_freq";
    // A tied checkpoint that also stores lm_head, and a rotary buffer: both unused.
    rewrite_case("qwen2_bias", &dir, |t| {
        let table = t
            .iter()
            .find(|(n, _)| n == "model.embed_tokens.weight")
            .map(|(_, w)| w.try_clone().unwrap())
            .unwrap();
        t.push(("lm_head.weight".into(), table));
        t.push((
            extra.into(),
            Tensor::from_vec(vec![1.0; 6], [6], dev).unwrap(),
        ));
    })?;
    let (_, report) = Llm::from_hf_dir(&dir, dev)?;
    assert_eq!(
        report.unused,
        vec!["lm_head.weight".to_string(), extra.into()]
    );
    assert_eq!(report.loaded.len(), 26);
    Ok(())
}

/// Export -> reload: the same tensors under the same names, a config that parses back
/// to the same `LlmConfig`, and identical logits.
fn export_round_trip(dev: Device) -> TestResult {
    for case in [
        "llama_gqa",
        "llama_tied_scaled",
        "qwen2_bias",
        "qwen2_linear_rope",
    ] {
        let src = fixture(case);
        let (llm, _) = Llm::from_hf_dir(&src, dev)?;
        let dir = match std::env::var_os("BRAID_LLM_EXPORT_DIR") {
            Some(d) => Path::new(&d).join(case),
            None => tmpdir(&format!("export-{case}")),
        };
        llm.export_hf(&dir)?;
        let orig = WeightFiles::open_dir(&src)?;
        let exported = WeightFiles::open_dir(&dir)?;
        let names: Vec<&str> = exported.names().collect();
        assert_eq!(
            names,
            orig.names().collect::<Vec<_>>(),
            "{case}: tensor names"
        );
        if llm.config().tie_embeddings {
            assert!(
                !exported.contains("lm_head.weight"),
                "{case}: tied head written"
            );
        }
        for n in names {
            let a = orig.load_any(n, dev)?.to_vec_f32()?;
            let b = exported.load_any(n, dev)?.to_vec_f32()?;
            assert_eq!(a, b, "{case}: {n}");
        }
        assert_eq!(&LlmConfig::from_hf_config(&dir)?, llm.config());
        let (again, report) = Llm::from_hf_dir(&dir, dev)?;
        assert!(report.unused.is_empty());
        let ids = Tensor::from_vec_u32(vec![1, 5, 9, 2, 7], [5], dev)?;
        let seq = braid_nn::SeqInfo::single(5);
        let (y1, _) = llm.forward(&ids, &seq, None)?;
        let (y2, _) = again.forward(&ids, &seq, None)?;
        assert_eq!(y1.to_vec_f32()?, y2.to_vec_f32()?, "{case}: logits");
    }
    Ok(())
}

/// Random tiny models with the rope types no fixture covers (YaRN; dynamic NTK with a
/// batch longer than max_position_embeddings), exported with Braid's own logits as
/// `outputs.safetensors` so that `check_export.py DIR DIR` compares transformers'
/// forward of the export against Braid's.
fn export_scaled_ropes_with_braid_logits(dev: Device) -> TestResult {
    use braid_llm::RopeScaling;
    let yarn = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 8,
        attention_factor: None,
        beta_fast: None,
        beta_slow: None,
        mscale: None,
        mscale_all_dim: None,
        truncate: None,
    };
    for (case, scaling, t) in [
        ("yarn_random", yarn, 24usize),
        ("dynamic_random", RopeScaling::Dynamic { factor: 2.0 }, 40),
    ] {
        let mut cfg = common::tiny_config(false, true);
        cfg.head_dim = 8;
        cfg.max_position_embeddings = 32;
        cfg.rope.scaling = scaling;
        let llm = Llm::new(&cfg, &braid_nn::Init::new(11, dev).with_std(0.2))?;
        let dir = match std::env::var_os("BRAID_LLM_EXPORT_DIR") {
            Some(d) => Path::new(&d).join(case),
            None => tmpdir(&format!("export-{case}")),
        };
        llm.export_hf(&dir)?;
        let ids: Vec<u32> = (0..t as u32)
            .map(|i| (i * 5 + 1) % cfg.vocab as u32)
            .collect();
        let (logits, _) = llm.forward(
            &Tensor::from_vec_u32(ids.clone(), [t], dev)?,
            &braid_nn::SeqInfo::single(t),
            None,
        )?;
        // input_ids as f32 (save_safetensors writes f32; the check casts them back).
        let idf = Tensor::from_vec(ids.iter().map(|&i| i as f32).collect(), [1, t], dev)?;
        save_safetensors(
            &dir.join("inputs.safetensors"),
            &[("input_ids".into(), &idf)],
        )?;
        let logits = logits.reshape([1, t, cfg.vocab])?;
        save_safetensors(
            &dir.join("outputs.safetensors"),
            &[("logits".into(), &logits)],
        )?;
        assert_eq!(&LlmConfig::from_hf_config(&dir)?, llm.config());
    }
    Ok(())
}

braid_kernels::test_on_devices!(
    export_scaled_ropes_with_braid_logits,
    missing_tensor_is_named,
    shape_mismatch_names_both_shapes,
    unknown_architecture_is_an_error,
    extra_tensors_are_reported_unused,
    export_round_trip,
);
