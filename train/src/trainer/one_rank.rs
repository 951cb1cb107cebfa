//! One optimizer step of a one-rank run ([`Trainer::step`]), each part of it a span of
//! the run's timeline when `log.trace` is set.

use std::time::Instant;

use braid_nn::Module;

use super::{Trainer, no_full_model};
use crate::data::{rows_to_batch, split_even};
use crate::error::{Result, TrainError};
use crate::metrics::StepMetrics;
use crate::mllm::MllmBatch;
use crate::optim::{clip_factor, grad_norm, scale_grads};

impl Trainer {
    /// One optimizer step: the next global batch, forward and backward over its
    /// microbatches (loss normalized by the step's target count, so accumulation gives the
    /// full-batch gradient), clipping, AdamW at the schedule's learning rate. A non-finite
    /// loss or grad norm skips the update; too many in a row is an error.
    pub fn step(&mut self) -> Result<StepMetrics> {
        let started = Instant::now();
        self.device.reset_peak_memory()?;
        let step = self.state.step + 1;
        let trace = &mut self.trace;
        trace.set_step(step);

        let t0 = trace.start();
        let batch = self
            .loader
            .next_batch()
            .map_err(|e| TrainError::Data(e.to_string()))?;
        let data_time_s = started.elapsed().as_secs_f64();
        trace.end(t0, "data", "data")?;
        let rows: Vec<_> = batch.rows.iter().collect();
        let micro = split_even(rows.len(), self.cfg.train.microbatches)
            .into_iter()
            .map(|r| rows_to_batch(&rows[r], self.device))
            .collect::<Result<Vec<_>>>()?;
        let targets: usize = micro.iter().map(MllmBatch::num_targets).sum();
        let tokens: usize = micro.iter().map(|b| b.num_tokens()).sum();
        let images: usize = micro.iter().map(|b| b.num_images()).sum();
        let clips: usize = micro.iter().map(|b| b.clips.len()).sum();

        let (Some(model), Some(optim)) = (self.model.as_mut(), self.optim.as_mut()) else {
            return Err(no_full_model("a one-rank step"));
        };
        model.zero_grads()?;
        let mut loss_sum = 0.0f64;
        for (k, mb) in micro.iter().enumerate() {
            let (loss, cache) = model.forward_traced(mb, Some(targets.max(1)), trace, k)?;
            loss_sum += loss.loss_sum;
            model.backward_traced(cache, trace, k)?;
        }
        drop(micro);
        let loss = loss_sum / targets.max(1) as f64;
        if self.cfg.fault.nan_grad_at.contains(&step) {
            scale_grads(model, f32::NAN)?;
        }

        let t0 = trace.start();
        let norm = grad_norm(model)?;
        trace.end(t0, "grad norm", "optim")?;
        let lr = self.cfg.optim.lr_at(step, self.cfg.train.steps);
        let skipped = !(loss.is_finite() && norm.is_finite());
        if skipped {
            self.state.skipped_steps += 1;
            self.state.nonfinite_in_a_row += 1;
            if self.state.nonfinite_in_a_row >= self.cfg.train.max_nonfinite_in_a_row {
                return Err(TrainError::NonFinite {
                    step,
                    count: self.state.nonfinite_in_a_row,
                    loss,
                    grad_norm: norm,
                });
            }
        } else {
            if let Some(f) = clip_factor(norm, self.cfg.optim.clip_grad) {
                scale_grads(model, f)?;
            }
            let t0 = trace.start();
            optim.update(model, lr)?;
            trace.end(t0, "adamw", "optim")?;
            self.state.nonfinite_in_a_row = 0;
        }
        self.state.step = step;
        self.state.optimizer_step = optim.step;
        self.state.loader = self.loader.state();
        self.state.tokens_seen = self.state.tokens_seen.saturating_add(tokens as u64);
        let step_time_s = started.elapsed().as_secs_f64();
        self.state.elapsed_s += step_time_s;
        let m = StepMetrics {
            step,
            loss,
            lr,
            grad_norm: norm,
            tokens: tokens as u64,
            targets: targets as u64,
            images: images as u64,
            clips: clips as u64,
            step_time_s,
            data_time_s,
            skipped,
            epoch: batch.epoch,
            balance: None,
            peak_mem_gib: self
                .device
                .peak_memory_bytes()?
                .map(|b| b as f64 / (1u64 << 30) as f64),
            straggler: None,
        };
        if let Some(w) = self.metrics.as_mut() {
            w.append(&m)?;
        }
        Ok(m)
    }
}
