//! The sizes of one transformer module as the cost model needs them: parameters, forward
//! FLOPs per token and per attended pair, and activation bytes per token and layer.

use serde::{Deserialize, Serialize};

use crate::balance::TokenCost;

/// Which module of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Module {
    Vision,
    Audio,
    Llm,
}

impl Module {
    pub const ALL: [Module; 3] = [Module::Vision, Module::Audio, Module::Llm];

    pub fn name(self) -> &'static str {
        match self {
            Module::Vision => "vision",
            Module::Audio => "audio",
            Module::Llm => "llm",
        }
    }
}

/// A transformer stack: `layers` blocks of width `hidden`, `heads` query heads and
/// `kv_heads` key/value heads of `head_dim`, an MLP of width `ffn` with `mlp_mats` weight
/// matrices (2 for GELU, 3 for SwiGLU); the LLM adds a vocabulary (embedding and head).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleDims {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub mlp_mats: usize,
    pub causal: bool,
    /// LLM: vocabulary size (embedding and head); 0 for encoders.
    #[serde(default)]
    pub vocab: usize,
    /// LLM: the head shares the embedding table.
    #[serde(default)]
    pub tied: bool,
    /// Parameters outside the blocks and the vocabulary: stems, position tables, the
    /// projector into the LLM (on an encoder's last stage).
    #[serde(default)]
    pub extra_params: u64,
    /// Encoders: forward FLOPs per encoder token outside the blocks on the first stage
    /// (the patch embedding; Whisper's conv stem, two mel frames per token).
    #[serde(default)]
    pub stem_flops_per_token: f64,
    /// Encoders: forward FLOPs per encoder token of the projector into the LLM, on the
    /// last stage (its input merges several tokens, so this is its FLOPs per output
    /// token over the merge).
    #[serde(default)]
    pub projector_flops_per_token: f64,
}

impl ModuleDims {
    /// Matmul weights of one block (biases and norms are negligible).
    pub fn layer_params(&self) -> u64 {
        let (h, q, kv) = (
            self.hidden as u64,
            (self.heads * self.head_dim) as u64,
            (self.kv_heads * self.head_dim) as u64,
        );
        h * q + 2 * h * kv + q * h + self.mlp_mats as u64 * h * self.ffn as u64
    }

    /// Embedding plus head parameters.
    pub fn vocab_params(&self) -> u64 {
        let table = (self.vocab * self.hidden) as u64;
        if self.tied { table } else { 2 * table }
    }

    pub fn params(&self) -> u64 {
        self.layers as u64 * self.layer_params() + self.vocab_params() + self.extra_params
    }

    /// Forward FLOPs per token (blocks and head) and per attended (query, key) pair.
    pub fn token_cost(&self) -> TokenCost {
        let l = self.layers as f64;
        let attn_width = (self.heads * self.head_dim) as f64;
        TokenCost {
            per_token: 2.0 * (l * self.layer_params() as f64 + (self.vocab * self.hidden) as f64),
            per_pair: 4.0 * l * attn_width * if self.causal { 0.5 } else { 1.0 },
        }
    }

    /// Forward FLOPs of the blocks only, per token (no head).
    pub fn layer_flops_per_token(&self) -> f64 {
        2.0 * self.layer_params() as f64
    }

    /// Attention FLOPs of one block per attended pair (causal pairs already halved by the
    /// caller's pair count).
    pub fn attention_flops_per_pair(&self) -> f64 {
        4.0 * (self.heads * self.head_dim) as f64 * if self.causal { 0.5 } else { 1.0 }
    }

    /// Bytes of activations one block keeps per token for its backward, bf16, over `tp`
    /// ranks: the norm inputs, q/k/v, the attention output and its LSE, the MLP input and
    /// its `mlp_mats - 1` intermediates plus the activation. The four hidden-size ones
    /// (the norms' inputs and outputs) are split by TP only with sequence parallelism;
    /// without it (`braid train`'s TP) every TP rank holds them whole. Recomputation
    /// keeps only the block's input (and recomputes the rest one block at a time).
    pub fn act_bytes_per_token(&self, tp: usize, recompute: bool, sequence_parallel: bool) -> f64 {
        let h = self.hidden as f64;
        let tp = tp.max(1) as f64;
        let h_share = if sequence_parallel { h / tp } else { h };
        if recompute {
            return 2.0 * h_share;
        }
        let q = (self.heads * self.head_dim) as f64;
        let kv = (self.kv_heads * self.head_dim) as f64;
        let f = self.ffn as f64;
        2.0 * (4.0 * h_share + (2.0 * q + 2.0 * kv + self.mlp_mats as f64 * f) / tp)
    }

    /// The divisibility a layout needs: TP must divide heads, KV heads and the MLP (and
    /// the vocabulary); PP must divide the layers.
    pub fn fits(&self, tp: usize, pp: usize) -> Result<(), String> {
        if !self.heads.is_multiple_of(tp) || !self.kv_heads.is_multiple_of(tp) {
            return Err(format!(
                "tp {tp} does not divide heads {} / kv heads {}",
                self.heads, self.kv_heads
            ));
        }
        if !self.ffn.is_multiple_of(tp) || (self.vocab > 0 && !self.vocab.is_multiple_of(tp)) {
            return Err(format!(
                "tp {tp} does not divide the MLP width {} or the vocabulary {}",
                self.ffn, self.vocab
            ));
        }
        if !self.layers.is_multiple_of(pp) {
            return Err(format!("pp {pp} does not divide {} layers", self.layers));
        }
        Ok(())
    }
}

/// The model: an LLM and optional encoders, plus how encoder tokens become LLM tokens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelDims {
    pub llm: ModuleDims,
    #[serde(default)]
    pub vision: Option<ModuleDims>,
    #[serde(default)]
    pub audio: Option<ModuleDims>,
    /// LLM tokens per vision-encoder token (1 / the projector's spatial merge squared).
    #[serde(default = "one")]
    pub vision_llm_ratio: f64,
    /// LLM tokens per mel frame (Whisper's stem halves the frames, the projector's
    /// stride divides them further).
    #[serde(default = "eighth")]
    pub audio_llm_ratio: f64,
}

fn one() -> f64 {
    1.0
}
fn eighth() -> f64 {
    0.125
}

impl ModelDims {
    pub fn module(&self, m: Module) -> Option<&ModuleDims> {
        match m {
            Module::Llm => Some(&self.llm),
            Module::Vision => self.vision.as_ref(),
            Module::Audio => self.audio.as_ref(),
        }
    }

    /// The modules present, encoders first.
    pub fn modules(&self) -> Vec<Module> {
        Module::ALL
            .into_iter()
            .filter(|&m| self.module(m).is_some())
            .collect()
    }

    /// The per-item cost model of the data-aware assignment.
    pub fn balanced(&self) -> crate::Balanced {
        let none = TokenCost {
            per_token: 0.0,
            per_pair: 0.0,
        };
        crate::Balanced {
            llm: self.llm.token_cost(),
            vision: self.vision.as_ref().map_or(none, ModuleDims::token_cost),
            audio: self.audio.as_ref().map_or(none, ModuleDims::token_cost),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Llama-2-7B's sizes.
    pub(crate) fn llama_7b() -> ModuleDims {
        ModuleDims {
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 32,
            head_dim: 128,
            ffn: 11008,
            mlp_mats: 3,
            causal: true,
            vocab: 32000,
            tied: false,
            extra_params: 0,
            stem_flops_per_token: 0.0,
            projector_flops_per_token: 0.0,
        }
    }

    /// Llama-2-7B: 6.74 B parameters.
    #[test]
    fn llama_7b_has_its_published_parameter_count() {
        let d = llama_7b();
        let p = d.params() as f64 / 1e9;
        assert!((p - 6.74).abs() < 0.01, "{p}");
        assert!(d.fits(8, 4).is_ok());
        assert!(d.fits(3, 1).is_err());
        assert!(d.fits(1, 3).is_err());
        // Recomputation keeps far less.
        assert!(
            d.act_bytes_per_token(1, true, true) * 10.0 < d.act_bytes_per_token(1, false, true)
        );
    }

    /// Without sequence parallelism every TP rank holds the four hidden-size activations
    /// (and recomputation's block input) whole: what `braid train`'s TP keeps.
    #[test]
    fn tp_without_sequence_parallelism_keeps_the_hidden_size_activations_whole() {
        let d = llama_7b();
        let h = d.hidden as f64;
        for recompute in [false, true] {
            let at = |tp, sp| d.act_bytes_per_token(tp, recompute, sp);
            assert_eq!(at(1, true), at(1, false));
            for tp in [2, 4, 8] {
                let per_h = if recompute { 2.0 } else { 8.0 };
                let extra = per_h * h * (1.0 - 1.0 / tp as f64);
                assert!(
                    (at(tp, false) - at(tp, true) - extra).abs() < 1e-6,
                    "tp {tp}"
                );
            }
        }
        // 7B at TP 4: 4 h whole, 2 q + 2 kv + 3 ff over 4 (q = kv = h = 4096).
        let full = 2.0 * (4.0 * h + (4.0 * h + 3.0 * 11008.0) / 4.0);
        assert_eq!(d.act_bytes_per_token(4, false, false), full);
    }
}
