//! `WhisperEncoder`: Whisper's audio encoder over clips of any length up to the
//! position table, packed as variable-length sequences.
//!
//! Per clip (n_mels, F): conv1 (k3, p1) -> GELU -> conv2 (k3, stride 2, p1) -> GELU ->
//! (F' = ceil(F/2), D) + embed_positions[:F']. The clips are then packed back to back
//! (`cu_seqlens`) through the pre-norm blocks and the final layer_norm. Clips of equal
//! length go through the conv stem as one batch. Unlike
//! transformers (which requires exactly 2 * max_source_positions frames, i.e. 30 s
//! padded), short clips are NOT padded: a clip's output is what the same computation
//! on its own frames gives, and attention never crosses clips.
//!
//! **Tensor parallelism** ([`WhisperEncoder::with_group`]): the blocks split their heads
//! and MLP columns over the TP group. The conv stem (two small convolutions over
//! n_mels and D channels, run once per clip), the position table and the LayerNorms
//! are replicated: every rank holds the blocks' outputs in full, so they get the same
//! full grads on every rank, with nothing to reduce.
//!
//! **Pipeline stages** ([`WhisperEncoder::stage`]): a stage holds the blocks of a
//! contiguous layer range (names unchanged, `layers.{i}.*`), the conv stem and the
//! position table when the range starts at 0, the final layer_norm when it ends at
//! `encoder_layers`. Stages run through [`WhisperEncoder::forward_stage`] /
//! [`WhisperEncoder::backward_stage`]; every stage knows the clips' mel frame counts
//! (batch metadata), from which it derives the packed `cu_seqlens` and positions.
//!
//! **Context parallelism** ([`WhisperEncoder::with_cp`], a CP group of `cp > 1`
//! ranks, all fed the same clips): the packed tokens are split with
//! `CpPlan::new(cu_seqlens, cp, false)` (zigzag chunks of every clip, bidirectional).
//! - First stage: the conv stem runs on the whole clips on every CP rank (it is
//!   cheap and needs neighbouring frames), then each rank keeps its own tokens' rows.
//! - Blocks run on this rank's tokens only (attention all-gathers K/V, nn's CP).
//! - Last stage: the final layer_norm (per token) runs on this rank's tokens, then a
//!   ragged all-gather (one all-to-all-v sending the rows to every rank) assembles the
//!   full packed (T, D): every CP rank returns the same, full [`AudioOutput`].
//! - Between stages travel this rank's rows (T_local, D), [`WhisperEncoder::hidden_tokens`].
//!
//! Backward is the adjoint, under the contract that the downstream of the encoder is
//! replicated over the CP group, so the full output grad (T, D) arrives identical on
//! every CP rank: the adjoint of the all-gather is then the slice of this rank's rows
//! (a caller whose output grad differs between CP ranks must sum it over the group
//! first). The layer_norm and blocks run backward on those rows; on the first stage
//! this rank's token grads are scattered into a zero (T, D) buffer and the position
//! table and conv stem run backward on that.
//!
//! **Grad-summing rule under CP**: every parameter grad a CP rank accumulates covers
//! its own tokens only, so the true grad is the SUM over the CP ranks, for every
//! parameter (blocks, final layer_norm, position table, conv stem alike: they are all
//! linear in the per-token grads, and the tokens are partitioned). The trainer
//! all-reduces every audio parameter grad over CP x DP, as it does over DP. Likewise
//! the clip grads [`AudioStageGrad::Clips`] of one CP rank are partial: their sum over
//! the CP ranks is the true grad. With no CP group (or one of one rank) the stages
//! compute exactly what [`WhisperEncoder::forward`] / [`WhisperEncoder::backward`] do,
//! bit for bit.

mod conv;
mod recompute;
mod stage;

use std::ops::Range;
use std::sync::Arc;

use braid_comm::{Comm, SingleRank};
use braid_kernels::ops::{self, Conv1dSpec};
use braid_kernels::{Device, Tensor};
use braid_nn::error::Context;
use braid_nn::{
    AttentionConfig, AttentionDims, BlockConfig, Error, Init, InitKind, LayerNorm, MlpConfig,
    MlpKind, Module, NormKind, Param, Result, SeqInfo, Shard, TransformerBlock,
};

use crate::config::WhisperEncoderConfig;
use crate::util::{ids, zeros};
use crate::weights::{Shards, block_shards};

pub use conv::Conv1d;
pub use recompute::{AudioCache, AudioStageCache};
pub use stage::{AudioStageGrad, AudioStageInput, AudioStageOutput};

/// The conv stem and the position table: the first stage's input layers.
#[derive(Debug)]
pub struct AudioStem {
    pub conv1: Conv1d,
    pub conv2: Conv1d,
    /// (MAXPOS, D)
    pub embed_positions: Param,
}

/// The encoder, or one pipeline stage of it. Braid parameter names (HF names in
/// [`crate::audio_hf`]): `conv1.*`, `conv2.*`, `embed_positions.weight` (MAXPOS, D),
/// `layers.{i}.*` (nn's block names; k_proj has no bias, as in Whisper),
/// `layer_norm.*`.
#[derive(Debug)]
pub struct WhisperEncoder {
    pub config: WhisperEncoderConfig,
    /// The layers this stage holds; `0..encoder_layers` for the whole encoder.
    pub layer_range: Range<usize>,
    /// First stage (`layer_range.start == 0`) only.
    pub stem: Option<AudioStem>,
    /// Blocks `layer_range`, in order.
    pub layers: Vec<TransformerBlock>,
    /// Last stage (`layer_range.end == encoder_layers`) only.
    pub layer_norm: Option<LayerNorm>,
    /// The context-parallel group when it has more than one rank (see the module doc).
    pub cp: Option<Arc<dyn Comm>>,
    /// Activation recomputation of the whole stage from its input ([`AudioCache`]); off by default.
    pub recompute: bool,
}

/// The packed output: clip i is rows `cu_seqlens[i] .. cu_seqlens[i+1]` of `hidden`.
#[derive(Debug)]
pub struct AudioOutput {
    /// (T, D), T = sum of ceil(F_i / 2)
    pub hidden: Tensor,
    /// [0, F'_0, F'_0 + F'_1, ..., T]
    pub cu_seqlens: Vec<usize>,
}

/// The stem's activations for the clips of one length.
#[derive(Debug)]
struct StemGroup {
    /// (N, M, F) the group's clips, conv1 output (pre-GELU), its GELU, conv2 output
    /// (pre-GELU)
    x: Tensor,
    c1: Tensor,
    g1: Tensor,
    c2: Tensor,
    /// (F' * N) u32 packed-sequence rows of the stem's output rows, frame-major: row
    /// `f * N + c` is frame f of the group's clip c
    rows: Tensor,
    /// The group's clips, as indices into the forward's `clips`
    clips: Vec<usize>,
}

/// What the stem's backward needs.
#[derive(Debug)]
struct StemCache {
    groups: Vec<StemGroup>,
    /// (T) u32
    pos_ids: Tensor,
}

impl AudioStem {
    fn new(init: &Init, config: &WhisperEncoderConfig) -> Result<Self> {
        let d = config.d_model;
        Ok(AudioStem {
            conv1: Conv1d::new(
                init,
                "conv1",
                config.num_mel_bins,
                d,
                Conv1dSpec {
                    stride: 1,
                    padding: 1,
                },
            )?,
            conv2: Conv1d::new(
                init,
                "conv2",
                d,
                d,
                Conv1dSpec {
                    stride: 2,
                    padding: 1,
                },
            )?,
            embed_positions: init.param(
                "embed_positions.weight",
                &[config.max_source_positions, d],
                InitKind::Normal(init.std),
                Shard::Full,
            )?,
        })
    }

    /// clips, each (n_mels, F_i) (checked), packed as `seq` -> (T, D) with positions.
    fn forward(
        &self,
        cfg: &WhisperEncoderConfig,
        clips: &[Tensor],
        seq: &SeqInfo,
    ) -> Result<(Tensor, StemCache)> {
        let Some(first) = clips.first() else {
            return Err(Error::input("audio", "no clips given"));
        };
        let dev = first.device();
        let (d, m) = (cfg.d_model, cfg.num_mel_bins);
        let mut h = zeros(
            &[seq.num_tokens(), d],
            self.conv1.weight.compute_dtype(),
            dev,
        )?; // (T, D)
        // Clips of equal length share one batched conv stem (the demo's and most batches'
        // clips are all 30 s or all one length): one kernel call per op instead of one per clip.
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new(); // (F, clip indices)
        for (i, x) in clips.iter().enumerate() {
            let f = x.dims()[1];
            match groups.iter_mut().find(|g| g.0 == f) {
                Some(g) => g.1.push(i),
                None => groups.push((f, vec![i])),
            }
        }
        let act = cfg.act.kernel();
        let mut stems = Vec::with_capacity(groups.len());
        for (f, members) in groups {
            let n = members.len();
            let fo = WhisperEncoderConfig::out_frames(f);
            let x = if n == 1 {
                clips[members[0]]
                    .try_clone()
                    .and_then(|x| x.reshape([1, m, f]))
            } else {
                let mut x = zeros(&[n, m * f], first.dtype(), dev)?; // (N, M*F)
                let mut res = Ok(());
                for (c, &i) in members.iter().enumerate() {
                    res = res
                        .and_then(|()| clips[i].try_clone())
                        .and_then(|clip| clip.reshape([1, m * f]))
                        .and_then(|clip| {
                            let row = Tensor::from_vec_u32(vec![c as u32], [1], dev)?;
                            ops::scatter_rows(&mut x, &row, &clip)
                        });
                }
                res.and_then(|()| x.reshape([n, m, f]))
            }
            .and_then(|x| ops::into_dtype(x, self.conv1.weight.compute_dtype()))
            .ctx("audio", "clips")?; // (N, M, F)
            let c1 = self.conv1.forward(&x)?; // (N, D, F)
            let g1 = ops::activation_fwd(&c1, act).ctx("audio", "conv1 gelu")?;
            let c2 = self.conv2.forward(&g1)?; // (N, D, F')
            // (N, D, F') -> (N*D, F', 1) -> transpose -> (F', N*D, 1) -> (F'*N, D)
            let g2 = ops::activation_fwd(&c2, act)
                .and_then(|g| g.reshape([n * d, fo, 1]))
                .and_then(|g| ops::transpose01(&g))
                .and_then(|g| g.reshape([fo * n, d]))
                .ctx("audio", "conv2 gelu")?;
            let rows: Vec<u32> = (0..fo)
                .flat_map(|t| members.iter().map(move |&i| (i, t)))
                .map(|(i, t)| (seq.cu_seqlens[i] + t) as u32)
                .collect();
            let rows = ids(rows, dev)?;
            ops::scatter_rows(&mut h, &rows, &g2).ctx("audio", "pack clips")?;
            stems.push(StemGroup {
                x,
                c1,
                g1,
                c2,
                rows,
                clips: members,
            });
        }
        let pos_ids = ids(seq.positions.clone(), dev)?;
        let pos =
            ops::gather_rows(self.embed_positions.compute(), &pos_ids).ctx("audio", "positions")?; // (T, D)
        ops::add_assign(&mut h, &pos).ctx("audio", "add positions")?;
        Ok((
            h,
            StemCache {
                groups: stems,
                pos_ids,
            },
        ))
    }

    /// dh (T, D) -> the grad of each clip (n_mels, F_i); adds into the stem's grads.
    fn backward(
        &mut self,
        cfg: &WhisperEncoderConfig,
        cache: StemCache,
        dh: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let StemCache { groups, pos_ids } = cache;
        let (d, m) = (cfg.d_model, cfg.num_mel_bins);
        let act = cfg.act.kernel();
        if let Some(g) = self.embed_positions.grad.as_mut() {
            ops::embedding_bwd(dh, &pos_ids, g).ctx("audio backward", "positions")?;
        }
        let n_clips: usize = groups.iter().map(|s| s.clips.len()).sum();
        let mut dclips: Vec<Option<Tensor>> = (0..n_clips).map(|_| None).collect();
        for s in groups {
            let &[n, _, f] = s.x.dims() else {
                return Err(Error::input(
                    "audio backward",
                    "stem cache is not (N, M, F)",
                ));
            };
            let fo = s.rows.dims()[0] / n;
            // (F'*N, D) -> (F', N*D, 1) -> transpose -> (N*D, F', 1) -> (N, D, F')
            let dg2 = ops::gather_rows(dh, &s.rows)
                .and_then(|g| g.reshape([fo, n * d, 1]))
                .and_then(|g| ops::transpose01(&g))
                .and_then(|g| g.reshape([n, d, fo]))
                .ctx("audio backward", "unpack clips")?;
            let dc2 = ops::activation_bwd(&dg2, &s.c2, act).ctx("audio backward", "gelu2")?;
            let dg1 = self.conv2.backward(&s.g1, &dc2)?;
            let dc1 = ops::activation_bwd(&dg1, &s.c1, act).ctx("audio backward", "gelu1")?;
            let dx = self.conv1.backward(&s.x, &dc1)?; // (N, M, F)
            if n == 1 {
                dclips[s.clips[0]] = Some(dx.reshape([m, f]).ctx("audio backward", "clip grad")?);
                continue;
            }
            let dx = dx.reshape([n, m * f]).ctx("audio backward", "clip grads")?; // (N, M*F)
            for (c, &i) in s.clips.iter().enumerate() {
                let row = ids(vec![c as u32], dx.device())?;
                let g = ops::gather_rows(&dx, &row)
                    .and_then(|g| g.reshape([m, f]))
                    .ctx("audio backward", "clip grad")?;
                dclips[i] = Some(g);
            }
        }
        dclips
            .into_iter()
            .enumerate()
            .map(|(i, g)| {
                g.ok_or_else(|| Error::input("audio backward", format!("clip {i} has no stem")))
            })
            .collect()
    }
}

impl WhisperEncoder {
    /// A randomly initialized encoder on one rank.
    pub fn new(init: &Init, config: WhisperEncoderConfig) -> Result<Self> {
        Self::with_group(init, config, Arc::new(SingleRank))
    }

    /// This rank's shard of the encoder over the tensor-parallel group `tp` (see the
    /// module doc for what is split): the shards of the `tp` ranks together hold
    /// exactly the weights [`Self::new`] draws from the same `init`.
    pub fn with_group(
        init: &Init,
        config: WhisperEncoderConfig,
        tp: Arc<dyn Comm>,
    ) -> Result<Self> {
        let layers = 0..config.encoder_layers;
        Self::stage(init, config, layers, tp)
    }

    /// The pipeline stage of blocks `layers` over the tensor-parallel group `tp`: with
    /// the conv stem and position table when `layers.start == 0`, the final layer_norm
    /// when `layers.end == encoder_layers`. Its parameters are exactly the same-named
    /// ones [`Self::with_group`] draws from the same `init`.
    pub fn stage(
        init: &Init,
        config: WhisperEncoderConfig,
        layers: Range<usize>,
        tp: Arc<dyn Comm>,
    ) -> Result<Self> {
        config.validate()?;
        if layers.start >= layers.end || layers.end > config.encoder_layers {
            return Err(Error::config(
                "audio encoder",
                format!(
                    "stage layers {layers:?} must be a non-empty range within 0..{} (encoder_layers)",
                    config.encoder_layers
                ),
            ));
        }
        crate::vision::check_tp(
            "audio encoder",
            config.encoder_attention_heads,
            config.encoder_ffn_dim,
            tp.size(),
        )?;
        let d = config.d_model;
        let nh = config.encoder_attention_heads;
        let block = BlockConfig {
            attn: AttentionConfig {
                dims: AttentionDims {
                    c: d,
                    nh,
                    nkv: nh,
                    hs: d / nh,
                },
                causal: false,
                qkv_bias: true,
                o_bias: true,
                rope: None,
            },
            mlp: MlpConfig {
                c: d,
                ff: config.encoder_ffn_dim,
                kind: MlpKind::Gelu(config.act.kernel()),
                bias: true,
            },
            norm: NormKind::LayerNorm,
            norm_eps: config.layer_norm_eps,
        };
        let blocks = layers
            .clone()
            .map(|i| {
                let mut b =
                    TransformerBlock::new(init, &format!("layers.{i}"), block, Arc::clone(&tp))?;
                // Whisper's k_proj has no bias (a key bias adds the same score to every
                // key of a query and cancels in the softmax).
                b.self_attn.k_proj.linear.bias = None;
                Ok(b)
            })
            .collect::<Result<Vec<_>>>()?;
        let stem = if layers.start == 0 {
            Some(AudioStem::new(init, &config)?)
        } else {
            None
        };
        let layer_norm = if layers.end == config.encoder_layers {
            Some(LayerNorm::new(
                init,
                "layer_norm",
                d,
                config.layer_norm_eps,
                true,
            )?)
        } else {
            None
        };
        Ok(WhisperEncoder {
            layer_range: layers,
            stem,
            layers: blocks,
            layer_norm,
            cp: None,
            recompute: false,
            config,
        })
    }

    /// The first stage: it holds the conv stem and takes clips.
    pub fn is_first(&self) -> bool {
        self.layer_range.start == 0
    }

    /// The last stage: it holds the final layer_norm and returns the [`AudioOutput`].
    pub fn is_last(&self) -> bool {
        self.layer_range.end == self.config.encoder_layers
    }

    /// The size of the tensor-parallel group the blocks are split over.
    pub fn tp_size(&self) -> usize {
        self.layers.first().map_or(1, |b| b.self_attn.group.size())
    }

    /// The parameters this rank holds a slice of (the blocks'), for loading full
    /// checkpoint tensors into a shard; empty for a group of one.
    pub fn tp_shards(&self) -> Shards {
        let mut out = Shards::new();
        for b in &self.layers {
            block_shards(b, &mut out);
        }
        out
    }

    /// Checks a clip of `f` mel frames (clip `i`) and returns F' = ceil(F / 2).
    fn check_frames(&self, i: usize, f: usize) -> Result<usize> {
        let maxpos = self.config.max_source_positions;
        let fo = WhisperEncoderConfig::out_frames(f);
        if f == 0 || fo > maxpos {
            return Err(Error::input(
                "audio",
                format!(
                    "clip {i} has {f} frames -> {fo} positions; allowed 1 ..= {} frames (max_source_positions = {maxpos})",
                    2 * maxpos
                ),
            ));
        }
        Ok(fo)
    }

    /// Checks clip `i` (n_mels, F) and returns F' = ceil(F / 2).
    fn check_clip(&self, i: usize, x: &Tensor) -> Result<usize> {
        let m = self.config.num_mel_bins;
        let &[xm, f] = x.dims() else {
            return Err(Error::input(
                "audio",
                format!("clip {i} must be (n_mels, frames), got {}", x.shape()),
            ));
        };
        if xm != m {
            return Err(Error::input(
                "audio",
                format!(
                    "clip {i} {} has {xm} mel bins, the model expects num_mel_bins = {m}",
                    x.shape()
                ),
            ));
        }
        self.check_frames(i, f)
    }

    /// clips, each (n_mels, F_i), all on one device -> packed (T, D). Needs the whole
    /// encoder (a stage runs [`Self::forward_stage`]); under CP every rank returns the
    /// full output (see the module doc).
    pub fn forward(&self, clips: &[Tensor]) -> Result<(AudioOutput, AudioCache)> {
        self.check_whole("forward")?;
        // Malformed clips are reported by forward_stage's checks.
        let frames: Vec<usize> = clips
            .iter()
            .map(|x| x.dims().get(1).copied().unwrap_or(0))
            .collect();
        match self.forward_stage(AudioStageInput::Clips(clips), &frames)? {
            (AudioStageOutput::Final(out), cache) => Ok((out, cache)),
            (AudioStageOutput::Hidden(_), _) => Err(self.not_whole("forward")),
        }
    }

    /// dy (T, D) -> the grad of each clip (n_mels, F_i); adds into the parameter grads.
    /// Under CP both are this rank's share (summed over the CP ranks: the true grads).
    pub fn backward(&mut self, cache: AudioCache, dy: &Tensor) -> Result<Vec<Tensor>> {
        self.check_whole("backward")?;
        match self.backward_stage(cache, dy)? {
            AudioStageGrad::Clips(d) => Ok(d),
            AudioStageGrad::Hidden(_) => Err(self.not_whole("backward")),
        }
    }

    /// Splits a batch (B, n_mels, F) of equal-length clips into B clips (n_mels, F),
    /// through the host (for tests and tools; a data pipeline builds clips directly).
    pub fn split_batch(x: &Tensor, device: Device) -> Result<Vec<Tensor>> {
        let &[b, m, f] = x.dims() else {
            return Err(Error::input(
                "audio",
                format!("batch must be (B, n_mels, F), got {}", x.shape()),
            ));
        };
        let v = x.to_vec_f32().ctx("audio", "batch to host")?;
        (0..b)
            .map(|i| {
                Tensor::from_vec(v[i * m * f..(i + 1) * m * f].to_vec(), [m, f], device)
                    .ctx("audio", "clip")
            })
            .collect()
    }
}

impl Module for WhisperEncoder {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        if let Some(s) = &self.stem {
            f(&s.conv1.weight);
            f(&s.conv1.bias);
            f(&s.conv2.weight);
            f(&s.conv2.bias);
            f(&s.embed_positions);
        }
        for l in &self.layers {
            l.visit_params(f);
        }
        if let Some(n) = &self.layer_norm {
            n.visit_params(f);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some(s) = &mut self.stem {
            f(&mut s.conv1.weight);
            f(&mut s.conv1.bias);
            f(&mut s.conv2.weight);
            f(&mut s.conv2.bias);
            f(&mut s.embed_positions);
        }
        for l in &mut self.layers {
            l.visit_params_mut(f);
        }
        if let Some(n) = &mut self.layer_norm {
            n.visit_params_mut(f);
        }
    }
}
