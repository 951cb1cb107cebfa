//! Greedy generation from a checkpoint (`braid generate`): the prompt and its image or clip
//! laid out with the same chat template, tokenizer and preprocessing the model was trained
//! with (the data config stored next to the weights), then one token at a time until the
//! assistant turn ends.
//!
//! Each new token re-runs the whole sequence (no KV cache): fine for the short answers of
//! small checkpoints this is meant to inspect.

use std::path::{Path, PathBuf};

use braid_dataloader::config::DataConfig;
use braid_dataloader::job::load_tokenizer;
use braid_dataloader::media::audio::AudioDecoder;
use braid_dataloader::media::image::decode_image;
use braid_dataloader::media::mel::MelExtractor;
use braid_dataloader::tokenize::files::TOKENIZER_JSON;
use braid_dataloader::tokenize::{
    CompiledTemplate, HfTokenizer, Message, Part, PlaceholderCounts, Role, Tokenizer, audio_tokens,
    vision_tokens,
};
use braid_kernels::{Device, Tensor};
use braid_llm::IGNORE_INDEX;
use braid_nn::error::Context;
use braid_nn::{Init, SeqInfo};

use crate::assemble::model_config;
use crate::checkpoint::{self, CONFIG_FILE, DATA_FILE};
use crate::config::RunConfig;
use crate::error::{Result, TrainError, io_err};
use crate::eval::argmax;
use crate::mllm::{Mllm, MllmBatch};

/// A trained model with what it needs to read a prompt.
#[derive(Debug)]
pub struct Generator {
    pub model: Mllm,
    pub data: DataConfig,
    tokenizer: Box<dyn Tokenizer>,
    pub checkpoint: PathBuf,
}

fn gen_err(msg: String) -> TrainError {
    TrainError::Other(format!("generate: {msg}"))
}

/// A checkpoint folder, or the newest checkpoint of a run folder.
pub fn resolve_checkpoint(dir: &Path) -> Result<PathBuf> {
    if dir.is_file() {
        return Err(gen_err(format!(
            "--checkpoint {}: a file; give a checkpoint folder (with state.json) or a run folder",
            dir.display()
        )));
    }
    if dir.join(checkpoint::STATE_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    for root in [dir.join("checkpoints"), dir.to_path_buf()] {
        if let Some((_, p)) = checkpoint::latest(&root)? {
            return Ok(p);
        }
    }
    // Checkpoint folders, none complete: say which and why, not that there are none.
    for root in [dir.join("checkpoints"), dir.to_path_buf()] {
        if let Some((path, _, why)) = checkpoint::unusable(&root)?.into_iter().last() {
            return Err(gen_err(format!(
                "{}: no complete checkpoint; {} is not one ({why})",
                dir.display(),
                path.display()
            )));
        }
    }
    Err(gen_err(format!(
        "{}: neither a checkpoint folder (with state.json) nor a run folder with checkpoints/",
        dir.display()
    )))
}

/// The tokenizer the checkpoint carries (`tokenizer.json`); for a checkpoint written
/// before tokenizers travelled with it, the data config's `tokenizer.path`; the byte
/// tokenizer needs no file.
fn checkpoint_tokenizer(ckpt: &Path, data: &DataConfig) -> Result<Box<dyn Tokenizer>> {
    let Some(orig) = &data.tokenizer.path else {
        let (t, _) = load_tokenizer(data).map_err(|e| gen_err(e.to_string()))?;
        return Ok(t);
    };
    let carried = ckpt.join(TOKENIZER_JSON);
    if carried.is_file() {
        let bytes = std::fs::read(&carried).map_err(io_err(&carried, "read"))?;
        let t = HfTokenizer::from_bytes(&bytes, &carried.display().to_string())
            .map_err(|e| gen_err(e.to_string()))?;
        return Ok(Box::new(t));
    }
    if orig.is_file() {
        let (t, _) = load_tokenizer(data).map_err(|e| gen_err(e.to_string()))?;
        return Ok(t);
    }
    Err(gen_err(format!(
        "no tokenizer: {} does not exist (the checkpoint predates tokenizers kept with checkpoints) and neither does the data config's tokenizer.path {}",
        carried.display(),
        orig.display()
    )))
}

impl Generator {
    /// Loads the weights, run config and data config of a checkpoint (or of a run
    /// folder's newest checkpoint).
    pub fn load(dir: &Path) -> Result<Self> {
        let ckpt = resolve_checkpoint(dir)?;
        let cfg_path = ckpt.join(CONFIG_FILE);
        let text = std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path, "read"))?;
        let cfg = RunConfig::from_toml(&text, &cfg_path.display().to_string(), &[])?;
        let data_path = ckpt.join(DATA_FILE);
        let data_text = std::fs::read_to_string(&data_path).map_err(io_err(&data_path, "read"))?;
        let data: DataConfig = serde_json::from_str(&data_text)
            .map_err(|e| gen_err(format!("{}: {e}", data_path.display())))?;
        let mut model = Mllm::new(model_config(&cfg)?, &Init::for_loading(Device::Cpu))?;
        checkpoint::load_weights(&ckpt, &mut model, Device::Cpu)?;
        let tokenizer = checkpoint_tokenizer(&ckpt, &data)?;
        Ok(Generator {
            model,
            data,
            tokenizer,
            checkpoint: ckpt,
        })
    }

    /// The greedy answer to `prompt` about an optional image and an optional clip (files
    /// in any format the data pipeline reads), at most `max_new_tokens` tokens.
    pub fn generate(
        &self,
        prompt: &str,
        image: Option<&Path>,
        audio: Option<&Path>,
        max_new_tokens: usize,
    ) -> Result<String> {
        let dev = Device::Cpu;
        // The data config's byte limits of one image or clip (what `braid pack` holds media
        // to), before decoding.
        let s = &self.data;
        let limit = s.image.max_bytes.max(s.audio.decode.max_bytes as u64);
        let read = |p: &Path| braid_nn::files::read_limited(p, limit).map_err(io_err(p, "read"));
        let mut parts = Vec::new();
        let mut counts = PlaceholderCounts::default();
        let mut images = None;
        if let Some(p) = image {
            let px = decode_image(&read(p)?, &p.display().to_string(), &s.image.image_config())
                .map_err(|e| gen_err(e.to_string()))?;
            counts.images.push(
                vision_tokens(
                    px.h,
                    px.w,
                    s.image.patch,
                    s.image.merge,
                    s.image.class_token,
                )
                .map_err(|e| gen_err(e.to_string()))?,
            );
            images = Some(
                Tensor::from_vec(px.data, [1, px.c, px.h, px.w], dev).ctx("generate", "pixels")?,
            );
            parts.push(Part::Image(0));
        }
        let mut clips = Vec::new();
        if let Some(p) = audio {
            let mut dec =
                AudioDecoder::new(s.audio.decode.clone()).map_err(|e| gen_err(e.to_string()))?;
            let pcm = dec
                .decode(&read(p)?, &p.display().to_string())
                .map_err(|e| gen_err(e.to_string()))?;
            let (mel, frames) = MelExtractor::new(s.audio.decode.n_mels)
                .and_then(|mut m| m.compute(&pcm))
                .map_err(|e| gen_err(e.to_string()))?;
            counts.audio.push(
                audio_tokens(frames, s.audio.conv_stride, s.audio.pool_stride)
                    .map_err(|e| gen_err(e.to_string()))?,
            );
            clips.push(
                Tensor::from_vec(mel, [s.audio.decode.n_mels, frames], dev)
                    .ctx("generate", "mel")?,
            );
            parts.push(Part::Audio(0));
        }
        parts.push(Part::Text(prompt.to_string()));
        // An empty assistant turn: everything before its first loss token is the prompt,
        // and that token (the turn's end marker) is where generation stops.
        let messages = [
            Message {
                role: Role::User,
                parts,
            },
            Message::text(Role::Assistant, ""),
        ];
        let template = CompiledTemplate::new(&s.template, self.tokenizer.as_ref())
            .map_err(|e| gen_err(e.to_string()))?;
        let sample = template
            .tokenize(&messages, &counts)
            .map_err(|e| gen_err(e.to_string()))?;
        let cut = sample
            .loss_mask
            .iter()
            .position(|&m| m != 0)
            .ok_or_else(|| gen_err("the chat template marks no assistant token".into()))?;
        let stop = sample.ids[cut];
        let mut ids = sample.ids[..cut].to_vec();
        let span = |&(start, len): &(usize, usize)| {
            (start as u32..(start + len) as u32).collect::<Vec<u32>>()
        };
        let image_positions: Vec<Vec<u32>> = sample.image_spans.iter().map(span).collect();
        let clip_positions: Vec<Vec<u32>> = sample.audio_spans.iter().map(span).collect();
        let vocab = self.model.config.llm.vocab;
        // One batch; each new token only replaces the ids, the sequence info and targets
        // (the pixels and mels are not copied again).
        let mut batch = MllmBatch {
            ids: Tensor::from_vec_u32(ids.clone(), [ids.len()], dev).ctx("generate", "ids")?,
            seq: SeqInfo::single(ids.len()),
            targets: vec![IGNORE_INDEX; ids.len()],
            images,
            image_positions,
            clips,
            clip_positions,
        };
        // The positions the model knows bound the whole sequence: checked before any work
        // (each new token reruns the whole sequence, so an unbounded ask runs for hours).
        let room = self.model.config.llm.max_position_embeddings;
        // Saturating: an ask near usize::MAX must not wrap around past the check.
        if ids.len() > room || (ids.len() == room && max_new_tokens > 0) {
            return Err(gen_err(format!(
                "the prompt alone takes {} tokens of the model's {room} positions (model.llm.max_position_embeddings), leaving none to generate: shorten the prompt",
                ids.len()
            )));
        }
        if ids.len().saturating_add(max_new_tokens) > room {
            return Err(gen_err(format!(
                "the prompt takes {} tokens and --max-new-tokens asks {max_new_tokens} more, past the model's {room} positions (model.llm.max_position_embeddings): ask for at most {} or shorten the prompt",
                ids.len(),
                room.saturating_sub(ids.len())
            )));
        }
        let mut out = Vec::new();
        for _ in 0..max_new_tokens {
            let t = ids.len();
            let logits = self
                .model
                .logits(&batch, false)?
                .to_vec_f32()
                .ctx("generate", "logits")?; // (T, V)
            let last = &logits[(t - 1) * vocab..t * vocab];
            // A NaN or infinite logit means the weights are (a diverged run's checkpoint):
            // an argmax over them would answer garbage as if it were text.
            if let Some(bad) = last.iter().find(|x| !x.is_finite()) {
                return Err(gen_err(format!(
                    "the model's logits are not finite ({bad}) at token {}: the checkpoint's weights hold NaN or infinity (a diverged run?)",
                    out.len()
                )));
            }
            let next = argmax(last) as u32;
            if next == stop {
                break;
            }
            ids.push(next);
            out.push(next);
            batch.ids = Tensor::from_vec_u32(ids.clone(), [t + 1], dev).ctx("generate", "ids")?;
            batch.seq = SeqInfo::single(t + 1);
            batch.targets.push(IGNORE_INDEX);
        }
        self.tokenizer
            .decode(&out)
            .map_err(|e| gen_err(e.to_string()))
    }
}
