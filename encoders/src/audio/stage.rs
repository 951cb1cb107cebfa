//! Pipeline stages and context parallelism of the audio encoder: the stage forward /
//! backward pair, the CP split of the packed clips and its gather (the rules are in
//! the module doc of [`crate::audio`]).

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::{Tensor, ops};
use braid_nn::error::Context;
use braid_nn::norm::LayerNormCache;
use braid_nn::{BlockCache, CpPlan, Error, Result, SeqInfo};

use super::{AudioOutput, StemCache, WhisperEncoder};
use crate::util::{ids, zeros};

/// What a stage's forward starts from.
#[derive(Debug)]
pub enum AudioStageInput<'a> {
    /// First stage: the clips, each (n_mels, F_j); under CP every rank gets all of them.
    Clips(&'a [Tensor]),
    /// Other stages: the previous stage's output (T_local, D), this rank's tokens.
    Hidden(Tensor),
}

/// What a stage's forward returns.
#[derive(Debug)]
pub enum AudioStageOutput {
    /// Not the last stage: (T_local, D), this rank's tokens, for the next stage.
    Hidden(Tensor),
    /// Last stage: the full packed output (T, D), the same on every CP rank.
    Final(AudioOutput),
}

/// What a stage's backward returns: the grad of its input.
#[derive(Debug)]
pub enum AudioStageGrad {
    /// First stage: d clips, each (n_mels, F_j); under CP this rank's share (their
    /// sum over the CP ranks is the true grad).
    Clips(Vec<Tensor>),
    /// Other stages: d input hidden (T_local, D), for the previous stage.
    Hidden(Tensor),
}

/// This rank's place in the CP split of one batch.
#[derive(Debug)]
struct CpShare {
    plan: CpPlan,
    rank: usize,
    group: Arc<dyn Comm>,
}

/// Every activation a stage's backward needs (see [`super::AudioCache`]).
#[derive(Debug)]
pub(super) struct StageActs {
    /// First stage.
    stem: Option<StemCache>,
    layers: Vec<BlockCache>,
    /// Last stage; holds this rank's rows of the last block's output.
    ln: Option<LayerNormCache>,
    cp: Option<CpShare>,
    /// Rows of the stage's hidden states on this rank.
    t_local: usize,
}

impl WhisperEncoder {
    /// The encoder over the context-parallel group `cp` (see the module doc): with more
    /// than one rank, each rank runs the blocks on its tokens of the packed clips;
    /// a group of one is no CP.
    pub fn with_cp(mut self, cp: Arc<dyn Comm>) -> Self {
        let cp = (cp.size() > 1).then_some(cp);
        for b in &mut self.layers {
            b.self_attn.cp = cp.clone();
        }
        self.cp = cp;
        self
    }

    /// `forward` / `backward` take clips and return the output: the whole encoder.
    pub(super) fn check_whole(&self, what: &str) -> Result<()> {
        if self.is_first() && self.is_last() {
            Ok(())
        } else {
            Err(self.not_whole(what))
        }
    }

    /// The error of a whole-encoder call on a stage, naming the stage call to use.
    pub(super) fn not_whole(&self, what: &str) -> Error {
        Error::input(
            "audio",
            format!(
                "{what} needs the whole encoder, but this stage holds layers {:?} of {}: use {what}_stage",
                self.layer_range, self.config.encoder_layers
            ),
        )
    }

    /// The full packed rows of clips of `frames` mel frames each (checked).
    fn packed(&self, frames: &[usize]) -> Result<SeqInfo> {
        if frames.is_empty() {
            return Err(Error::input("audio", "no clips given"));
        }
        let lens = frames
            .iter()
            .enumerate()
            .map(|(i, &f)| self.check_frames(i, f))
            .collect::<Result<Vec<_>>>()?;
        Ok(SeqInfo::packed(&lens))
    }

    /// This rank's share of the CP split of the rows `cu_seqlens`, `None` without CP.
    fn cp_share(&self, cu_seqlens: &[usize]) -> Result<Option<CpShare>> {
        let Some(group) = &self.cp else {
            return Ok(None);
        };
        // Bidirectional: every token sees its whole clip, any split balances the work.
        let plan = CpPlan::new(cu_seqlens, group.size(), false)?;
        Ok(Some(CpShare {
            plan,
            rank: group.rank(),
            group: Arc::clone(group),
        }))
    }

    /// T_local: the rows of the hidden states (T_local, D) this rank sends to the next
    /// stage and receives from the previous one, for clips of `frames` mel frames: all
    /// T = sum of ceil(F_j / 2) tokens without CP, this rank's share under CP.
    pub fn hidden_tokens(&self, frames: &[usize]) -> Result<usize> {
        let full = self.packed(frames)?;
        match self.cp_share(&full.cu_seqlens)? {
            Some(s) => s.plan.num_tokens(s.rank),
            None => Ok(full.num_tokens()),
        }
    }

    /// [`Self::forward_stage`] keeping every activation.
    pub(super) fn forward_acts(
        &self,
        input: AudioStageInput<'_>,
        frames: &[usize],
    ) -> Result<(AudioStageOutput, StageActs)> {
        let d = self.config.d_model;
        let full = self.packed(frames)?;
        let cp = self.cp_share(&full.cu_seqlens)?;
        let local = match &cp {
            Some(s) => Some(s.plan.seq_info(s.rank, &full)?),
            None => None,
        };
        let seq = local.as_ref().unwrap_or(&full);
        let t_local = seq.num_tokens();
        let (mut h, stem_cache) = match input {
            AudioStageInput::Clips(clips) => {
                let stem = self.stem.as_ref().ok_or_else(|| {
                    Error::input(
                        "audio",
                        format!(
                            "clips given to the stage of layers {:?}, which has no conv stem (pass hidden states)",
                            self.layer_range
                        ),
                    )
                })?;
                if clips.len() != frames.len() {
                    return Err(Error::input(
                        "audio",
                        format!(
                            "{} clips given with the frame counts of {}",
                            clips.len(),
                            frames.len()
                        ),
                    ));
                }
                for (i, x) in clips.iter().enumerate() {
                    self.check_clip(i, x)?;
                    if x.dims()[1] != frames[i] {
                        return Err(Error::input(
                            "audio",
                            format!(
                                "clip {i} {} has {} frames, but frames[{i}] = {}",
                                x.shape(),
                                x.dims()[1],
                                frames[i]
                            ),
                        ));
                    }
                }
                let (h, sc) = stem.forward(&self.config, clips, &full)?; // (T, D)
                // Under CP the stem ran on the whole clips (replicated): keep this
                // rank's tokens.
                let h = match &cp {
                    Some(s) => s.plan.local_rows(s.rank, &h)?, // (T_local, D)
                    None => h,
                };
                (h, Some(sc))
            }
            AudioStageInput::Hidden(h) => {
                if self.stem.is_some() {
                    return Err(Error::input(
                        "audio",
                        "hidden states given to the first stage, which takes clips",
                    ));
                }
                if h.dims() != [t_local, d] {
                    return Err(Error::input(
                        "audio",
                        format!(
                            "hidden states must be (T_local = {t_local}, D = {d}) for the stage of layers {:?}, got {}",
                            self.layer_range,
                            h.shape()
                        ),
                    ));
                }
                (h, None)
            }
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let (y, c) = layer.forward_owned(h, seq)?; // (T_local, D)
            layers.push(c);
            h = y;
        }
        let (out, ln) = match &self.layer_norm {
            Some(norm) => {
                // Per token: on this rank's rows, then gathered (no replicated work).
                let (y, ln) = norm.forward_owned(h)?; // (T_local, D)
                let hidden = match &cp {
                    Some(s) => gather_fwd(s, &y)?, // (T, D)
                    None => y,
                };
                let out = AudioOutput {
                    hidden,
                    cu_seqlens: full.cu_seqlens.clone(),
                };
                (AudioStageOutput::Final(out), Some(ln))
            }
            None => (AudioStageOutput::Hidden(h), None),
        };
        Ok((
            out,
            StageActs {
                stem: stem_cache,
                layers,
                ln,
                cp,
                t_local,
            },
        ))
    }

    /// [`Self::backward_stage`] from every activation.
    pub(super) fn backward_acts(
        &mut self,
        cache: StageActs,
        dout: &Tensor,
    ) -> Result<AudioStageGrad> {
        let StageActs {
            stem,
            layers,
            ln,
            cp,
            t_local,
        } = cache;
        let d = self.config.d_model;
        if layers.len() != self.layers.len() || stem.is_some() != self.stem.is_some() {
            return Err(Error::input(
                "audio backward",
                format!(
                    "the cache is not from the stage of layers {:?}",
                    self.layer_range
                ),
            ));
        }
        let t_out = match (&ln, &cp) {
            (Some(_), Some(s)) => s.plan.total_tokens(),
            _ => t_local,
        };
        if dout.dims() != [t_out, d] {
            return Err(Error::input(
                "audio backward",
                format!(
                    "the output grad must be (T = {t_out}, D = {d}) for the stage of layers {:?}, got {}",
                    self.layer_range,
                    dout.shape()
                ),
            ));
        }
        // d hidden (T_local, D); `None` while it is still `dout` itself (no copy of it).
        let mut dh: Option<Tensor> = None;
        if let Some(c) = ln {
            let norm = self
                .layer_norm
                .as_mut()
                .ok_or_else(|| missing("layer_norm"))?;
            let dy = match &cp {
                Some(s) => Some(gather_bwd(s, dout)?), // (T_local, D)
                None => None,
            };
            dh = Some(norm.backward(c, dy.as_ref().unwrap_or(dout))?);
        }
        for (layer, c) in self.layers.iter_mut().zip(layers).rev() {
            dh = Some(layer.backward(c, dh.as_ref().unwrap_or(dout))?); // (T_local, D)
        }
        let dh = match dh {
            Some(g) => g,
            None => dout.try_clone().ctx("audio backward", "output grad")?,
        };
        let Some(sc) = stem else {
            return Ok(AudioStageGrad::Hidden(dh));
        };
        let st = self.stem.as_mut().ok_or_else(|| missing("conv stem"))?;
        // Under CP: this rank's token grads in a zero full-length buffer, so the
        // replicated stem's grads (and the clips') summed over the CP ranks are the
        // true ones.
        let dfull = match &cp {
            Some(s) => {
                let mut full = zeros(&[s.plan.total_tokens(), d], dh.dtype(), dh.device())?; // (T, D)
                let rows = s
                    .plan
                    .tokens(s.rank)?
                    .iter()
                    .map(|&g| u32::try_from(g))
                    .collect::<std::result::Result<Vec<u32>, _>>()
                    .map_err(|_| Error::input("audio backward", "token index exceeds u32"))?;
                ops::scatter_rows(&mut full, &ids(rows, dh.device())?, &dh)
                    .ctx("audio backward", "cp token grads")?;
                full
            }
            None => dh,
        };
        Ok(AudioStageGrad::Clips(st.backward(
            &self.config,
            sc,
            &dfull,
        )?))
    }
}

fn missing(what: &str) -> Error {
    Error::input(
        "audio backward",
        format!("the cache needs `{what}`, which this stage lacks"),
    )
}

// ---- the last stage's gather over the CP group, and its adjoint --------------------

/// Forward: this rank's rows (T_local, D) -> the full (T, D) in packed order, on
/// every rank (a ragged all-gather: one all-to-all-v sending `x` to every rank).
fn gather_fwd(s: &CpShare, x: &Tensor) -> Result<Tensor> {
    let parts = (0..s.plan.cp())
        .map(|_| x.try_clone())
        .collect::<braid_kernels::Result<Vec<_>>>()
        .ctx("audio cp gather", "forward")?;
    let got = s
        .group
        .all_to_all_v(parts)
        .ctx("audio cp gather", "forward all-to-all")?;
    s.plan.assemble(&got)
}

/// Backward: d full (T, D), identical on every rank (the downstream is replicated
/// over the CP group) -> this rank's rows (T_local, D). The adjoint of the all-gather
/// is a reduce-scatter of every rank's grad; with the grad counted once (not once
/// per rank) that is just the slice.
fn gather_bwd(s: &CpShare, dy: &Tensor) -> Result<Tensor> {
    s.plan.local_rows(s.rank, dy)
}
