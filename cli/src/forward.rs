//! `braid forward`: load a Hugging Face checkpoint, run one f32 forward pass on CPU, and
//! write the outputs under Hugging Face's names, so a conversion can be checked against
//! `transformers` on the same input.

use std::error::Error;
use std::path::Path;
use std::time::Instant;

use braid_encoders::config::{AUDIO_ARCHITECTURES, VISION_ARCHITECTURES};
use braid_encoders::{VisionEncoder, WhisperEncoder};
use braid_kernels::{Device, Tensor};
use braid_llm::{Llm, SUPPORTED_ARCHITECTURES};
use braid_nn::SeqInfo;
use braid_nn::hf::{WeightFiles, read_json, save_safetensors};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

/// What kind of module a checkpoint holds, from `architectures[0]` of its config.json.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Llm,
    Vision,
    Audio,
}

fn kind_of(model: &Path) -> Result<(Kind, String)> {
    let config: serde_json::Value = read_json(&model.join("config.json"))?;
    let arch = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|a| a.as_str())
        .ok_or_else(|| {
            format!(
                "{}: config.json has no `architectures` list",
                model.display()
            )
        })?
        .to_string();
    let kind = if SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
        Kind::Llm
    } else if VISION_ARCHITECTURES.contains(&arch.as_str()) {
        Kind::Vision
    } else if AUDIO_ARCHITECTURES.contains(&arch.as_str()) {
        Kind::Audio
    } else {
        let all: Vec<&str> = SUPPORTED_ARCHITECTURES
            .iter()
            .chain(&VISION_ARCHITECTURES)
            .chain(&AUDIO_ARCHITECTURES)
            .copied()
            .collect();
        return Err(format!(
            "{}: architecture `{arch}` is not supported; supported: {}",
            model.display(),
            all.join(", ")
        )
        .into());
    };
    Ok((kind, arch))
}

fn input_tensor(inputs: &WeightFiles, input: &Path, name: &str) -> Result<Tensor> {
    if !inputs.contains(name) {
        let have: Vec<&str> = inputs.names().collect();
        return Err(format!(
            "{}: no `{name}` tensor (this model needs it); the file has: {}",
            input.display(),
            have.join(", ")
        )
        .into());
    }
    Ok(if name == "input_ids" {
        inputs.load_ids(name, Device::Cpu)?
    } else {
        inputs.load_any(name, Device::Cpu)?
    })
}

/// Runs the forward of the checkpoint in `model` on `input`, writing `output`.
pub fn run(model: &Path, input: &Path, output: &Path) -> Result<()> {
    let (kind, arch) = kind_of(model)?;
    let inputs = WeightFiles::open_files(&[input.to_path_buf()])?;
    let t0 = Instant::now();
    let (outputs, unused): (Vec<(String, Tensor)>, Vec<String>) = match kind {
        Kind::Llm => {
            let (llm, report) = Llm::from_hf_dir(model, Device::Cpu)?;
            let ids = input_tensor(&inputs, input, "input_ids")?;
            let &[b, t] = ids.dims() else {
                return Err(format!("input_ids must be (B, T), got {}", ids.shape()).into());
            };
            // The (B T, V) f32 logits must fit in this machine's memory (64 GiB where it
            // cannot be read): checked before any work.
            let logits_bytes = (b as u128) * (t as u128) * (llm.config().vocab as u128) * 4;
            let memory = braid_train::assemble::mem_total_bytes().unwrap_or(64 << 30);
            if logits_bytes > u128::from(memory) {
                return Err(format!(
                    "input_ids of shape ({b}, {t}) makes {:.0} GiB of f32 logits over {} tokens of vocabulary, more than this machine's {:.0} GiB: run fewer rows at a time",
                    logits_bytes as f64 / (1u64 << 30) as f64,
                    llm.config().vocab,
                    memory as f64 / (1u64 << 30) as f64
                )
                .into());
            }
            // Each row of the batch is its own sequence, packed into one call.
            let seq = SeqInfo::packed(&vec![t; b]);
            let flat = ids.reshape([b * t])?;
            let (logits, _) = llm.forward(&flat, &seq, None)?; // (B T, V)
            let v = logits.dims()[1];
            (
                vec![("logits".into(), logits.reshape([b, t, v])?)],
                report.unused,
            )
        }
        Kind::Vision => {
            let import = VisionEncoder::from_hf_dir(model, Device::Cpu)?;
            let pixels = input_tensor(&inputs, input, "pixel_values")?;
            let (out, _) = import.model.forward(&pixels)?;
            let mut outs = vec![("last_hidden_state".to_string(), out.last_hidden_state)];
            if let Some(p) = out.pooler_output {
                outs.push(("pooler_output".into(), p));
            }
            (outs, import.unused)
        }
        Kind::Audio => {
            let import = WhisperEncoder::from_hf_dir(model, Device::Cpu)?;
            let features = input_tensor(&inputs, input, "input_features")?;
            let b = features.dims().first().copied().unwrap_or(0);
            let clips = WhisperEncoder::split_batch(&features, Device::Cpu)?;
            let (out, _) = import.model.forward(&clips)?; // (B T', D) packed
            let d = out.hidden.dims()[1];
            let t = out.hidden.dims()[0] / b.max(1);
            let hidden = out.hidden.reshape([b, t, d])?;
            (vec![("last_hidden_state".into(), hidden)], import.unused)
        }
    };
    let elapsed = t0.elapsed();
    let named: Vec<(String, &Tensor)> = outputs.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(output, &named)?;
    eprintln!("braid forward: {arch} from {}", model.display());
    for (name, t) in &outputs {
        eprintln!("  {name}: {}", t.shape());
    }
    if !unused.is_empty() {
        eprintln!(
            "  {} checkpoint tensors not used by this module (e.g. {})",
            unused.len(),
            unused[0]
        );
    }
    eprintln!(
        "  load + forward: {:.2} s; wrote {}",
        elapsed.as_secs_f64(),
        output.display()
    );
    Ok(())
}
