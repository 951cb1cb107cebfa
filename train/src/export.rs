//! Export of a trained model to Hugging Face format: `llm/`, `vision/` and `audio/` each a
//! folder `from_pretrained` loads (config.json + model.safetensors), and the projectors'
//! weights in `projectors.safetensors` (`vision_projector.*`, `audio_projector.*`).

use std::path::Path;

use braid_nn::Module;
use braid_nn::hf::save_safetensors;

use crate::error::{Result, io_err};
use crate::mllm::Mllm;

pub fn export_hf(model: Mllm, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io_err(dir, "create"))?;
    let parts = model.into_parts();
    parts.llm.export_hf(&dir.join("llm"))?;
    if let Some(v) = &parts.vision {
        v.export_hf(&dir.join("vision"))?;
    }
    if let Some(a) = &parts.audio {
        a.export_hf(&dir.join("audio"))?;
    }
    let mut names = Vec::new();
    let mut tensors = Vec::new();
    if let Some(p) = &parts.vision_projector {
        p.visit_params(&mut |q| {
            names.push(format!("vision_projector.{}", q.name));
            tensors.push(&q.value);
        });
    }
    if let Some(p) = &parts.audio_projector {
        p.visit_params(&mut |q| {
            names.push(format!("audio_projector.{}", q.name));
            tensors.push(&q.value);
        });
    }
    if !tensors.is_empty() {
        let named: Vec<_> = names.into_iter().zip(tensors).collect();
        save_safetensors(&dir.join("projectors.safetensors"), &named)?;
    }
    Ok(())
}
