//! `MllmBatch`: one packed row of text with the images and audio clips whose projected
//! embeddings fill its placeholder tokens, and its validation against the model.

use braid_kernels::{DType, Tensor};
use braid_llm::IGNORE_INDEX;
use braid_nn::{Error, Result, SeqInfo};

use super::config::MllmConfig;

/// A microbatch: several samples packed into one row of T tokens.
///
/// Image `i` fills the tokens `image_positions[i]`: its k-th projected embedding (raster
/// order, merged blocks in raster order with spatial merge) replaces the embedding of
/// token `image_positions[i][k]`. Clip `j` likewise fills `clip_positions[j]` in frame
/// order. Every position is distinct and < T; the token ids there are placeholders
/// whose own embeddings are never used (and get no grad).
#[derive(Debug)]
pub struct MllmBatch {
    /// (T) u32 token ids, on the model's device.
    pub ids: Tensor,
    /// Samples of the row; positions restart at 0 in each.
    pub seq: SeqInfo,
    /// (T) next-token targets on the host, [`IGNORE_INDEX`] where there is no loss
    /// (see [`braid_llm::next_token_targets`]).
    pub targets: Vec<u32>,
    /// (B_img, C, H, W) pixel values, `None` when the row has no image.
    pub images: Option<Tensor>,
    /// B_img lists of LLM token positions, one per image.
    pub image_positions: Vec<Vec<u32>>,
    /// Audio clips, each (n_mels, F_j) mel features.
    pub clips: Vec<Tensor>,
    /// One list of LLM token positions per clip.
    pub clip_positions: Vec<Vec<u32>>,
}

fn bad(msg: String) -> Error {
    Error::input("MllmBatch", msg)
}

/// Which image or clip a placeholder position belongs to (for error messages).
#[derive(Clone, Copy)]
enum Owner {
    Image(usize),
    Clip(usize),
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Image(i) => write!(f, "image {i}"),
            Owner::Clip(j) => write!(f, "clip {j}"),
        }
    }
}

impl MllmBatch {
    /// T
    pub fn num_tokens(&self) -> usize {
        self.seq.num_tokens()
    }

    /// Targets that are not [`IGNORE_INDEX`] (the loss's denominator).
    pub fn num_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_INDEX).count()
    }

    /// B_img
    pub fn num_images(&self) -> usize {
        self.images.as_ref().map_or(0, |x| x.dims()[0])
    }

    /// Total modality rows M: the image tokens then the clip tokens.
    pub fn num_modality_tokens(&self) -> usize {
        self.image_positions.iter().map(Vec::len).sum::<usize>()
            + self.clip_positions.iter().map(Vec::len).sum::<usize>()
    }

    /// Checks everything the model's forward relies on, before any work: ids (T) u32
    /// matching `seq`, targets (T) within the vocabulary, one position list per image
    /// and per clip holding exactly the number of tokens it gives after projection,
    /// every position < T and used once across both modalities, and no image or clip
    /// for a model without that encoder. Pixel and mel shapes are checked here as far as
    /// the token counts need them; the encoders check the rest.
    pub fn validate(&self, config: &MllmConfig) -> Result<()> {
        let t = self.seq.num_tokens();
        self.seq.validate(t)?;
        if self.ids.dims() != [t] || self.ids.dtype() != DType::U32 {
            return Err(bad(format!(
                "ids must be (T = {t}) u32 to match seq, got {} {}",
                self.ids.shape(),
                self.ids.dtype()
            )));
        }
        if self.targets.len() != t {
            return Err(bad(format!(
                "targets has {} entries for T = {t} tokens",
                self.targets.len()
            )));
        }
        let v = config.llm.vocab;
        if let Some((i, &x)) = self
            .targets
            .iter()
            .enumerate()
            .find(|&(_, &x)| x != IGNORE_INDEX && x as usize >= v)
        {
            return Err(bad(format!(
                "targets[{i}] = {x} is out of range for a vocabulary of {v} (use IGNORE_INDEX for no loss)"
            )));
        }
        let mut owner: Vec<Option<Owner>> = vec![None; t];
        let mut claim = |who: Owner, positions: &[u32]| -> Result<()> {
            for (k, &p) in positions.iter().enumerate() {
                let slot = owner.get_mut(p as usize).ok_or_else(|| {
                    bad(format!(
                        "{who}: position[{k}] = {p} is out of range for T = {t} tokens"
                    ))
                })?;
                if let Some(prev) = *slot {
                    return Err(bad(format!(
                        "{who}: position[{k}] = {p} is already filled by {prev} (positions must be distinct)"
                    )));
                }
                *slot = Some(who);
            }
            Ok(())
        };

        let b_img = self.num_images();
        if self.images.is_none() && !self.image_positions.is_empty() {
            return Err(bad(format!(
                "image_positions holds {} lists but there are no images",
                self.image_positions.len()
            )));
        }
        if let Some(images) = &self.images {
            let per_image = config.tokens_per_image().ok_or_else(|| {
                bad("the batch has images but the model has no vision encoder".into())
            })?;
            if images.dims().len() != 4 || b_img == 0 {
                return Err(bad(format!(
                    "images must be (B_img > 0, C, H, W), got {}",
                    images.shape()
                )));
            }
            if self.image_positions.len() != b_img {
                return Err(bad(format!(
                    "{b_img} images but {} image_positions lists (one per image)",
                    self.image_positions.len()
                )));
            }
            for (i, pos) in self.image_positions.iter().enumerate() {
                if pos.len() != per_image {
                    return Err(bad(format!(
                        "image {i}: {} positions given, but an image gives {per_image} tokens after projection",
                        pos.len()
                    )));
                }
                claim(Owner::Image(i), pos)?;
            }
        }

        if self.clip_positions.len() != self.clips.len() {
            return Err(bad(format!(
                "{} clips but {} clip_positions lists (one per clip)",
                self.clips.len(),
                self.clip_positions.len()
            )));
        }
        if !self.clips.is_empty() && config.audio.is_none() {
            return Err(bad(
                "the batch has audio clips but the model has no audio encoder".into(),
            ));
        }
        for (j, (clip, pos)) in self.clips.iter().zip(&self.clip_positions).enumerate() {
            let &[_, frames] = clip.dims() else {
                return Err(bad(format!(
                    "clip {j} must be (n_mels, frames), got {}",
                    clip.shape()
                )));
            };
            let n = config.tokens_per_clip(frames).unwrap_or(0);
            if pos.len() != n {
                return Err(bad(format!(
                    "clip {j}: {} positions given, but its {frames} frames give {n} tokens after projection",
                    pos.len()
                )));
            }
            claim(Owner::Clip(j), pos)?;
        }
        Ok(())
    }
}
