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
//! Tensor parallelism ([`WhisperEncoder::with_group`]): the blocks split their heads
//! and MLP columns over the TP group. The conv stem (two small convolutions over
//! n_mels and D channels, run once per clip), the position table and the LayerNorms
//! are replicated: every rank holds the blocks' outputs in full, so they get the same
//! full grads on every rank, with nothing to reduce.

use std::sync::Arc;

use braid_comm::{Comm, SingleRank};
use braid_kernels::ops::{self, Conv1dSpec};
use braid_kernels::{Device, Tensor};
use braid_nn::error::Context;
use braid_nn::norm::LayerNormCache;
use braid_nn::{
    AttentionConfig, AttentionDims, BlockCache, BlockConfig, Error, Init, InitKind, LayerNorm,
    MlpConfig, MlpKind, Module, NormKind, Param, Result, SeqInfo, Shard, TransformerBlock,
};

use crate::config::WhisperEncoderConfig;
use crate::util::{ids, zeros};
use crate::weights::{Shards, block_shards};

/// A `Conv1d` with bias: weight (CO, CI, K), bias (CO).
#[derive(Debug)]
pub struct Conv1d {
    pub weight: Param,
    pub bias: Param,
    pub spec: Conv1dSpec,
}

impl Conv1d {
    fn new(init: &Init, name: &str, ci: usize, co: usize, spec: Conv1dSpec) -> Result<Self> {
        Ok(Conv1d {
            weight: init.param(
                &format!("{name}.weight"),
                &[co, ci, 3],
                InitKind::Normal(init.std),
                Shard::Full,
            )?,
            bias: init.param(
                &format!("{name}.bias"),
                &[co],
                InitKind::Constant(0.0),
                Shard::Full,
            )?,
            spec,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::conv1d_fwd(x, &self.weight.value, Some(&self.bias.value), &self.spec)
            .ctx(&self.weight.name, "forward")
    }

    fn backward(&mut self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        ops::conv1d_bwd(
            dy,
            x,
            &self.weight.value,
            &self.spec,
            self.weight.grad.as_mut(),
            self.bias.grad.as_mut(),
        )
        .ctx(&self.weight.name, "backward")
    }
}

/// The encoder. Braid parameter names (HF names in [`crate::audio_hf`]): `conv1.*`,
/// `conv2.*`, `embed_positions.weight` (MAXPOS, D), `layers.{i}.*` (nn's block names;
/// k_proj has no bias, as in Whisper), `layer_norm.*`.
#[derive(Debug)]
pub struct WhisperEncoder {
    pub config: WhisperEncoderConfig,
    pub conv1: Conv1d,
    pub conv2: Conv1d,
    /// (MAXPOS, D)
    pub embed_positions: Param,
    pub layers: Vec<TransformerBlock>,
    pub layer_norm: LayerNorm,
}

/// The packed output: clip i is rows `cu_seqlens[i] .. cu_seqlens[i+1]` of `hidden`.
#[derive(Debug)]
pub struct AudioOutput {
    /// (T, D), T = sum of ceil(F_i / 2)
    pub hidden: Tensor,
    /// [0, F'_0, F'_0 + F'_1, ..., T]
    pub cu_seqlens: Vec<usize>,
}

/// One clip's stem activations.
#[derive(Debug)]
struct StemCache {
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

/// What [`WhisperEncoder::backward`] needs.
#[derive(Debug)]
pub struct AudioCache {
    stems: Vec<StemCache>,
    /// (T) u32
    pos_ids: Tensor,
    layers: Vec<BlockCache>,
    ln: LayerNormCache,
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
        config.validate()?;
        crate::vision::check_tp(
            "audio encoder",
            config.encoder_attention_heads,
            config.encoder_ffn_dim,
            tp.size(),
        )?;
        let group = tp;
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
        let layers = (0..config.encoder_layers)
            .map(|i| {
                let mut b =
                    TransformerBlock::new(init, &format!("layers.{i}"), block, Arc::clone(&group))?;
                // Whisper's k_proj has no bias (a key bias adds the same score to every
                // key of a query and cancels in the softmax).
                b.self_attn.k_proj.linear.bias = None;
                Ok(b)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(WhisperEncoder {
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
            layers,
            layer_norm: LayerNorm::new(init, "layer_norm", d, config.layer_norm_eps, true)?,
            config,
        })
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

    /// Checks clip `i` (n_mels, F) and returns F' = ceil(F / 2).
    fn check_clip(&self, i: usize, x: &Tensor) -> Result<usize> {
        let (m, maxpos) = (self.config.num_mel_bins, self.config.max_source_positions);
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

    /// clips, each (n_mels, F_i), all on one device -> packed (T, D).
    pub fn forward(&self, clips: &[Tensor]) -> Result<(AudioOutput, AudioCache)> {
        let Some(first) = clips.first() else {
            return Err(Error::input("audio", "no clips given"));
        };
        let dev = first.device();
        let d = self.config.d_model;
        let m = self.config.num_mel_bins;
        let lens = clips
            .iter()
            .enumerate()
            .map(|(i, x)| self.check_clip(i, x))
            .collect::<Result<Vec<_>>>()?;
        let seq = SeqInfo::packed(&lens);
        let t = seq.num_tokens();
        let mut h = zeros(&[t, d], dev)?; // (T, D)
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
        let act = self.config.act.kernel();
        let mut stems = Vec::with_capacity(groups.len());
        for (f, members) in groups {
            let n = members.len();
            let fo = lens[members[0]];
            let x = if n == 1 {
                clips[members[0]]
                    .try_clone()
                    .and_then(|x| x.reshape([1, m, f]))
            } else {
                let mut x = zeros(&[n, m * f], dev)?; // (N, M*F)
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
            stems.push(StemCache {
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
            ops::gather_rows(&self.embed_positions.value, &pos_ids).ctx("audio", "positions")?; // (T, D)
        ops::add_assign(&mut h, &pos).ctx("audio", "add positions")?;
        let mut caches = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let (y, c) = layer.forward_owned(h, &seq)?;
            caches.push(c);
            h = y;
        }
        let (hidden, ln) = self.layer_norm.forward_owned(h)?;
        Ok((
            AudioOutput {
                hidden,
                cu_seqlens: seq.cu_seqlens,
            },
            AudioCache {
                stems,
                pos_ids,
                layers: caches,
                ln,
            },
        ))
    }

    /// dy (T, D) -> the grad of each clip (n_mels, F_i); adds into the parameter grads.
    pub fn backward(&mut self, cache: AudioCache, dy: &Tensor) -> Result<Vec<Tensor>> {
        let AudioCache {
            stems,
            pos_ids,
            layers,
            ln,
        } = cache;
        let d = self.config.d_model;
        let m = self.config.num_mel_bins;
        let act = self.config.act.kernel();
        if dy.dims() != ln.x.dims() {
            return Err(Error::input(
                "audio backward",
                format!("dy {} must match the output {}", dy.shape(), ln.x.shape()),
            ));
        }
        let mut dh = self.layer_norm.backward(ln, dy)?;
        for (layer, c) in self.layers.iter_mut().zip(layers).rev() {
            dh = layer.backward(c, &dh)?;
        }
        if let Some(g) = self.embed_positions.grad.as_mut() {
            ops::embedding_bwd(&dh, &pos_ids, g).ctx("audio backward", "positions")?;
        }
        let n_clips: usize = stems.iter().map(|s| s.clips.len()).sum();
        let mut dclips: Vec<Option<Tensor>> = (0..n_clips).map(|_| None).collect();
        for s in stems {
            let &[n, _, f] = s.x.dims() else {
                return Err(Error::input(
                    "audio backward",
                    "stem cache is not (N, M, F)",
                ));
            };
            let fo = s.rows.dims()[0] / n;
            // (F'*N, D) -> (F', N*D, 1) -> transpose -> (N*D, F', 1) -> (N, D, F')
            let dg2 = ops::gather_rows(&dh, &s.rows)
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
        f(&self.conv1.weight);
        f(&self.conv1.bias);
        f(&self.conv2.weight);
        f(&self.conv2.bias);
        f(&self.embed_positions);
        for l in &self.layers {
            l.visit_params(f);
        }
        self.layer_norm.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.conv1.weight);
        f(&mut self.conv1.bias);
        f(&mut self.conv2.weight);
        f(&mut self.conv2.bias);
        f(&mut self.embed_positions);
        for l in &mut self.layers {
            l.visit_params_mut(f);
        }
        self.layer_norm.visit_params_mut(f);
    }
}
