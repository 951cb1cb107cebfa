//! Packing statistics: counts, fill, per-modality length histograms, per-pack encoder load balance.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cost::SampleMeta;

/// Log2 histogram: bucket 0 counts zeros, bucket `k >= 1` counts values in `[2^(k-1), 2^k)`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Histogram {
    pub counts: Vec<u64>,
    pub count: u64,
    pub sum: u64,
    pub min: u64,
    pub max: u64,
}

impl Histogram {
    pub fn record(&mut self, v: u64) {
        let k = (u64::BITS - v.leading_zeros()) as usize;
        if self.counts.len() <= k {
            self.counts.resize(k + 1, 0);
        }
        if let Some(c) = self.counts.get_mut(k) {
            *c += 1;
        }
        self.min = if self.count == 0 { v } else { self.min.min(v) };
        self.max = self.max.max(v);
        self.count += 1;
        self.sum = self.sum.saturating_add(v);
    }

    /// `[lo, hi)` of bucket `k`.
    pub fn bucket_bounds(k: usize) -> (u64, u64) {
        match k {
            0 => (0, 1),
            k if k >= 64 => (1 << 63, u64::MAX),
            k => (1 << (k - 1), 1 << k),
        }
    }

    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }
}

/// Length histograms of the packed samples (after truncation).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Histograms {
    pub text_tokens: Histogram,
    /// Image placeholder tokens per sample (0 for samples without images).
    pub image_tokens: Histogram,
    /// Audio placeholder tokens per sample.
    pub audio_tokens: Histogram,
    pub llm_len: Histogram,
    /// Samples per pack.
    pub pack_samples: Histogram,
}

impl Histograms {
    pub(crate) fn record_sample(&mut self, m: &SampleMeta) {
        self.text_tokens.record(m.text_tokens as u64);
        self.image_tokens.record(m.image_tokens());
        self.audio_tokens.record(m.audio_tokens());
        self.llm_len.record(m.llm_len as u64);
    }
}

/// Distribution of one encoder's cost over packs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadSummary {
    pub max: f64,
    pub mean: f64,
    /// Standard deviation over packs.
    pub std: f64,
    /// `max / mean` (1 = perfectly even; 0 when the modality is absent).
    pub max_over_mean: f64,
}

/// Per-pack load of one encoder before and after the modality-balancing pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Imbalance {
    pub before: LoadSummary,
    pub after: LoadSummary,
}

/// Streaming accumulator of a per-pack load.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LoadAcc {
    n: u64,
    sum: f64,
    sum_sq: f64,
    max: f64,
}

impl LoadAcc {
    pub(crate) fn add(&mut self, v: f64) {
        self.n += 1;
        self.sum += v;
        self.sum_sq += v * v;
        self.max = self.max.max(v);
    }

    pub(crate) fn summary(&self) -> LoadSummary {
        if self.n == 0 {
            return LoadSummary::default();
        }
        let mean = self.sum / self.n as f64;
        let var = (self.sum_sq / self.n as f64 - mean * mean).max(0.0);
        let max_over_mean = if mean > 0.0 { self.max / mean } else { 0.0 };
        LoadSummary {
            max: self.max,
            mean,
            std: var.sqrt(),
            max_over_mean,
        }
    }
}

/// Everything `dataset.json` needs to say about packing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PackStats {
    /// Input samples seen.
    pub samples: usize,
    /// Samples placed in packs (truncated ones included).
    pub packed_samples: usize,
    pub rejected: usize,
    /// Rejections per reason kind (`empty`, `invalid_meta`, `too_long`, `span_cut`).
    pub rejected_by_reason: BTreeMap<String, usize>,
    pub truncated: usize,
    pub packs: usize,
    pub max_seq_len: usize,
    /// Non-padding tokens in packs.
    pub tokens: u64,
    /// `tokens / (packs * max_seq_len)`.
    pub fill: f64,
    pub histograms: Histograms,
    /// Per-pack vision-encoder cost (forward FLOPs).
    pub vision: Imbalance,
    /// Per-pack audio-encoder cost (forward FLOPs).
    pub audio: Imbalance,
}
