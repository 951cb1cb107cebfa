//! Held-out evaluation: teacher-forced accuracy of the answer tokens (the loss targets) on
//! a packed held-out set, with the encoders' embeddings and with them zeroed, so the gain
//! of the media over the text alone is one subtraction.

use std::collections::BTreeMap;
use std::path::Path;

use braid_dataloader::loader::{Loader, LoaderConfig};
use braid_kernels::Device;
use braid_llm::IGNORE_INDEX;
use braid_nn::error::Context;
use serde::{Deserialize, Serialize};

use crate::data::rows_to_batch;
use crate::error::{Result, TrainError};
use crate::mllm::{Mllm, MllmBatch};

/// `eval.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    /// What `heldout` and `text_only` measure.
    pub metric: String,
    /// Answer-token accuracy with the media.
    pub heldout: f64,
    /// The same with every image and clip embedding zeroed.
    pub text_only: f64,
    /// Fraction of samples whose every answer token is right (teacher forced).
    pub exact_match: f64,
    pub exact_match_text_only: f64,
    /// Mean cross-entropy of the answer tokens.
    pub loss: f64,
    pub loss_text_only: f64,
    pub samples: u64,
    pub targets: u64,
    pub step: u64,
    /// The answer-token accuracy split by what the samples hold: `image` (an image and no
    /// clip), `audio` (a clip and no image), `both`, `text` (neither).
    pub by_modality: BTreeMap<String, ModalityScore>,
}

/// Answer-token accuracy of one kind of sample, with and without the media.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModalityScore {
    pub heldout: f64,
    pub text_only: f64,
    pub samples: u64,
}

/// Counts of one pass.
#[derive(Default, Clone, Copy)]
struct Tally {
    correct: u64,
    targets: u64,
    exact: u64,
    samples: u64,
    loss_sum: f64,
}

/// Index of the largest logit (the first of equal ones).
pub(crate) fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bx), (i, &x)| {
            if x > bx { (i, x) } else { (bi, bx) }
        })
        .0
}

/// What sample `s` of the batch holds: "image", "audio", "both" or "text".
fn sample_kinds(batch: &MllmBatch) -> Vec<&'static str> {
    let cu = &batch.seq.cu_seqlens;
    let owner = |p: u32| cu.partition_point(|&c| c <= p as usize).saturating_sub(1);
    let mut has = vec![(false, false); cu.len().saturating_sub(1)];
    for pos in batch.image_positions.iter().filter_map(|p| p.first()) {
        if let Some(h) = has.get_mut(owner(*pos)) {
            h.0 = true;
        }
    }
    for pos in batch.clip_positions.iter().filter_map(|p| p.first()) {
        if let Some(h) = has.get_mut(owner(*pos)) {
            h.1 = true;
        }
    }
    has.into_iter()
        .map(|h| match h {
            (true, false) => "image",
            (false, true) => "audio",
            (true, true) => "both",
            (false, false) => "text",
        })
        .collect()
}

/// Compares the argmax of each target position with the target; also sums the loss. Each
/// sample is tallied in `t` and in `per_kind` under its kind.
fn score(
    logits: &[f32],
    vocab: usize,
    batch: &MllmBatch,
    t: &mut Tally,
    per_kind: &mut BTreeMap<&'static str, Tally>,
) {
    let kinds = sample_kinds(batch);
    for (s, w) in batch.seq.cu_seqlens.windows(2).enumerate() {
        let before = *t;
        let mut any = false;
        let mut all = true;
        for pos in w[0]..w[1] {
            let target = batch.targets[pos];
            if target == IGNORE_INDEX {
                continue;
            }
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let arg = argmax(row);
            let max = row[arg];
            let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
            t.loss_sum += f64::from(lse - row[target as usize]);
            any = true;
            t.targets += 1;
            if arg == target as usize {
                t.correct += 1;
            } else {
                all = false;
            }
        }
        if any {
            t.samples += 1;
            t.exact += u64::from(all);
        }
        let k = per_kind.entry(kinds[s]).or_default();
        k.correct += t.correct - before.correct;
        k.targets += t.targets - before.targets;
        k.samples += t.samples - before.samples;
    }
}

/// Evaluates `model` (its weights on `device`) on every pack of the dataset at `dir` (in stored order).
pub fn evaluate(
    model: &Mllm,
    device: Device,
    dir: &Path,
    rows_per_forward: usize,
    workers: usize,
    step: u64,
) -> Result<EvalReport> {
    let cfg = LoaderConfig {
        seed: 0,
        batch_rows: 1,
        workers,
        prefetch: 2,
        shuffle: false,
    };
    let mut loader = Loader::open(dir, &cfg, 0, 1, None)
        .map_err(|e| TrainError::Data(format!("{}: {e}", dir.display())))?;
    let packs = loader.batches_per_epoch();
    let vocab = model.config.llm.vocab;
    let (mut with, mut without) = (Tally::default(), Tally::default());
    let (mut with_kind, mut without_kind) = (BTreeMap::new(), BTreeMap::new());
    let mut rows = Vec::new();
    for i in 0..packs {
        let b = loader
            .next_batch()
            .map_err(|e| TrainError::Data(e.to_string()))?;
        rows.extend(b.rows);
        if rows.len() < rows_per_forward && i + 1 < packs {
            continue;
        }
        let refs: Vec<_> = rows.iter().collect();
        let batch = rows_to_batch(&refs, device)?;
        for (zero, tally, kinds) in [
            (false, &mut with, &mut with_kind),
            (true, &mut without, &mut without_kind),
        ] {
            let logits = model
                .logits(&batch, zero)?
                .to_vec_f32()
                .ctx("eval", "logits to host")?; // (T, V)
            score(&logits, vocab, &batch, tally, kinds);
        }
        rows.clear();
    }
    let frac = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Ok(EvalReport {
        metric: "answer_token_accuracy".into(),
        heldout: frac(with.correct, with.targets),
        text_only: frac(without.correct, without.targets),
        exact_match: frac(with.exact, with.samples),
        exact_match_text_only: frac(without.exact, without.samples),
        loss: with.loss_sum / with.targets.max(1) as f64,
        loss_text_only: without.loss_sum / without.targets.max(1) as f64,
        samples: with.samples,
        targets: with.targets,
        step,
        by_modality: with_kind
            .iter()
            .map(|(k, w)| {
                let wo = without_kind.get(k).copied().unwrap_or_default();
                let score = ModalityScore {
                    heldout: frac(w.correct, w.targets),
                    text_only: frac(wo.correct, wo.targets),
                    samples: w.samples,
                };
                (k.to_string(), score)
            })
            .collect(),
    })
}
