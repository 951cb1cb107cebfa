//! Parity with PyTorch/transformers 5.24 on the fixtures of `tests/fixtures/hf`: logits
//! (forward, <= 1e-4), every parameter grad and the grad of `inputs_embeds` (backward,
//! <= 1e-3), for loss = sum(logits * loss_weight). Errors are relative to the
//! reference's scale: `max |a - b| / max |b|` (see `common::rel_err`).
//!
//! HF batches (B, T) become B packed rows of T tokens, so these also check packing.

#![allow(clippy::unwrap_used)]

mod common;

use braid_kernels::{Device, ops};
use braid_llm::{Llm, hf_name};
use braid_nn::hf::WeightFiles;
use braid_nn::{Module, SeqInfo};
use common::{TestResult, fixture, grads, rel_err};

const FWD_TOL: f32 = 1e-4;
const BWD_TOL: f32 = 1e-3;

fn parity(case: &str, dev: Device) -> TestResult {
    let dir = fixture(case);
    let (mut llm, report) = Llm::from_hf_dir(&dir, dev)?;
    assert!(
        report.unused.is_empty(),
        "{case}: unused tensors {:?}",
        report.unused
    );
    let inputs = WeightFiles::open_files(&[dir.join("inputs.safetensors")])?;
    let ids = inputs.load_ids("input_ids", dev)?;
    let [b, t] = *ids.dims() else {
        return Err(format!("{case}: input_ids {:?} is not (B, T)", ids.dims()).into());
    };
    let ids = ids.reshape([b * t])?;
    let seq = SeqInfo::packed(&vec![t; b]);
    let outputs = WeightFiles::open_files(&[dir.join("outputs.safetensors")])?;
    let want = outputs.load_any("logits", dev)?.to_vec_f32()?;
    let (logits, cache) = llm.forward(&ids, &seq, None)?;
    let fwd = rel_err(&logits.to_vec_f32()?, &want);
    assert!(fwd <= FWD_TOL, "{case}: logits rel err {fwd:e}");
    let grads_path = dir.join("grads.safetensors");
    if !grads_path.is_file() {
        println!("parity {case}: logits {fwd:.2e} (forward-only fixture)");
        return Ok(());
    }
    // Backward of loss = sum(logits * loss_weight): dlogits = loss_weight.
    let v = llm.config().vocab;
    let lw = inputs.load_any("loss_weight", dev)?.reshape([b * t, v])?;
    llm.zero_grads()?;
    assert!(llm.backward(cache, &lw)?.is_none());
    let want_grads = WeightFiles::open_files(&[grads_path])?;
    let mut worst = (0.0f32, String::new());
    let mut checked = 0;
    for (name, g) in grads(&llm) {
        let hf = hf_name(&name);
        let want = want_grads.load_any(&hf, dev)?.to_vec_f32()?;
        let e = rel_err(&g, &want);
        assert!(e <= BWD_TOL, "{case}: grad of {hf}: rel err {e:e}");
        if e >= worst.0 {
            worst = (e, hf);
        }
        checked += 1;
    }
    // Every parameter grad in the fixture was compared (and nothing else exists).
    assert_eq!(
        checked + 1,
        want_grads.names().count(),
        "{case}: grad count"
    );
    // grad of inputs_embeds through forward_embeds.
    let embeds = ops::embedding_fwd(&ids, &llm.stage.embed_tokens.as_ref().unwrap().weight.value)?;
    let (logits2, cache2) = llm.forward_embeds(embeds, &seq)?;
    let fwd2 = rel_err(&logits2.to_vec_f32()?, &want);
    assert!(
        fwd2 <= FWD_TOL,
        "{case}: logits from embeds rel err {fwd2:e}"
    );
    let dx = llm.backward(cache2, &lw)?.ok_or("no inputs_embeds grad")?;
    let want_dx = want_grads
        .load_any("grad_inputs_embeds", dev)?
        .to_vec_f32()?;
    let ex = rel_err(&dx.to_vec_f32()?, &want_dx);
    assert!(ex <= BWD_TOL, "{case}: grad_inputs_embeds rel err {ex:e}");
    println!(
        "parity {case}: logits {fwd:.2e}, worst param grad {:.2e} ({}), inputs_embeds grad {ex:.2e}, {checked} param grads",
        worst.0, worst.1
    );
    Ok(())
}

fn llama_gqa(dev: Device) -> TestResult {
    parity("llama_gqa", dev)
}
fn llama_tied_scaled(dev: Device) -> TestResult {
    parity("llama_tied_scaled", dev)
}
fn qwen2_bias(dev: Device) -> TestResult {
    parity("qwen2_bias", dev)
}
fn qwen2_linear_rope(dev: Device) -> TestResult {
    parity("qwen2_linear_rope", dev)
}
/// bf16 weights on disk (upcast to f32), 4.x-style config (rope_scaling, llama3).
fn unseen_llama_bf16(dev: Device) -> TestResult {
    parity("unseen/llama", dev)
}
/// A checkpoint sharded over 12 files with an index.
fn unseen_qwen2_sharded(dev: Device) -> TestResult {
    parity("unseen/qwen2", dev)
}

braid_kernels::test_on_devices!(
    llama_gqa,
    llama_tied_scaled,
    qwen2_bias,
    qwen2_linear_rope,
    unseen_llama_bf16,
    unseen_qwen2_sharded,
);
