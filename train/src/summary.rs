//! The end of a run: what it reports ([`RunSummary`]), what is kept of its steps for
//! that ([`LossTrail`]), and the evaluation and export that close it.

use std::path::PathBuf;

use crate::error::Result;
use crate::eval::EvalReport;
use crate::metrics::StepMetrics;
use crate::trainer::Trainer;

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub steps: u64,
    pub skipped_steps: u64,
    /// Mean loss of the last (up to) 10 steps run in this process.
    pub final_loss: f64,
    pub first_loss: Option<f64>,
    pub tokens: u64,
    /// Training time of this process (set-up excluded).
    pub train_s: f64,
    pub eval: Option<EvalReport>,
    pub checkpoint: Option<PathBuf>,
    pub export: Option<PathBuf>,
    /// Median seconds of this process's steps (`None` without steps).
    pub median_step_s: Option<f64>,
    /// What the plan (`parallel.plan`) predicted a step would take, and on which cluster.
    pub predicted: Option<crate::planning::Predicted>,
    /// On a GPU: the largest per-step peak of device memory, GiB.
    pub peak_mem_gib: Option<f64>,
    /// A world of processes: how many, started by what, on which hosts, over what.
    pub world: Option<String>,
}

impl Trainer {
    /// The end of a run: evaluation (`eval.json`), the Hugging Face export and the summary.
    pub(crate) fn finish(
        self,
        trail: LossTrail,
        train_s: f64,
        last_ckpt: Option<PathBuf>,
    ) -> Result<RunSummary> {
        let eval = self.evaluate()?;
        if let Some(r) = &eval {
            braid_nn::hf::write_json(&self.cfg.run.dir.join("eval.json"), r)?;
        }
        let export = self.cfg.run.dir.join("hf");
        let mut summary = self.summary_parts(trail, train_s, last_ckpt);
        let model = self.model.ok_or_else(|| {
            crate::error::TrainError::Other(
                "the export needs the whole model, but this process holds only its share".into(),
            )
        })?;
        let max_len = model.config.llm.max_position_embeddings;
        crate::export::export_hf(model, &export)?;
        crate::tokenizer::write_export(&self.tokenizer_files, &export.join("llm"), max_len)?;
        summary.eval = eval;
        summary.export = Some(export);
        Ok(summary)
    }

    /// The summary without evaluation or export: [`Trainer::finish`] adds those; a rank
    /// other than 0 of a world of processes returns it as is.
    pub(crate) fn summary_parts(
        &self,
        trail: LossTrail,
        train_s: f64,
        last_ckpt: Option<PathBuf>,
    ) -> RunSummary {
        let LossTrail {
            recent,
            first: first_loss,
            tokens,
            step_times,
            peak_mem_gib,
        } = trail;
        // The median `braid profile` and `validate_plan` report too.
        let median_step_s =
            (!step_times.is_empty()).then(|| braid_balancer::plan::check::median(&step_times));
        RunSummary {
            steps: self.state.step,
            skipped_steps: self.state.skipped_steps,
            final_loss: if recent.is_empty() {
                f64::NAN
            } else {
                recent.iter().sum::<f64>() / recent.len() as f64
            },
            first_loss,
            tokens,
            train_s,
            eval: None,
            checkpoint: last_ckpt,
            export: None,
            median_step_s,
            peak_mem_gib,
            predicted: self.predicted.clone(),
            world: None,
        }
    }
}

/// What a run's summary keeps of its steps: tokens, the first loss and the last 10, and
/// every step's time (for the median).
#[derive(Debug, Default)]
pub(crate) struct LossTrail {
    recent: Vec<f64>,
    first: Option<f64>,
    tokens: u64,
    step_times: Vec<f64>,
    peak_mem_gib: Option<f64>,
}

impl LossTrail {
    pub(crate) fn record(&mut self, m: &StepMetrics) {
        self.tokens += m.tokens;
        if let Some(p) = m.peak_mem_gib {
            self.peak_mem_gib = Some(self.peak_mem_gib.map_or(p, |q| q.max(p)));
        }
        self.step_times.push(m.step_time_s);
        if !m.skipped {
            self.first.get_or_insert(m.loss);
            self.recent.push(m.loss);
            if self.recent.len() > 10 {
                self.recent.remove(0);
            }
        }
    }
}
