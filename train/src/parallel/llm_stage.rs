//! One rank's LLM stage over its replica's microbatches: each microbatch's forward (with its modality rows on the first stage, the loss on the last) and backward, and the phased step's 1F1B loop over them.
//!
//! [`LlmStageRun`] holds what a stage keeps between a microbatch's forward and its
//! backward (at most the schedule's in-flight caches). It moves no messages itself: the
//! phased loop ([`run_pipeline`]) and the overlapped executor each pass inputs in and
//! take outputs out.

use braid_bridge::Routes;
use braid_comm::Comm;
use braid_dataloader::loader::Row;
use braid_kernels::{Device, Shape, Tensor, ops};
use braid_llm::{ModalityEmbeds, StageCache, StageInput, vocab_parallel_loss};
use braid_nn::SeqInfo;
use braid_nn::wgrad::{DeferredGrads, apply_deferred, defer_weight_grads, take_deferred};

use super::centric::CentricEncoders;
use super::graph::llm_pass_order;
use super::model::{LlmPart, device_of};
use super::plan::{Microbatch, StepPlan};
use super::schedule::Op;
use crate::data::rows_to_text;
use crate::error::{Result, TrainError};
use crate::trace::Tracer;

/// A microbatch as this CP rank sees it: token ids, sample layout, next-token targets.
struct LocalBatch {
    ids: Tensor, // (T) u32 on the device
    /// The same ids on the host (the vocab-parallel embedding picks its range here).
    host_ids: Vec<u32>,
    seq: SeqInfo,
    targets: Vec<u32>,
}

fn local_batch(rows: &[Row], mb: &Microbatch, cp_rank: usize, dev: Device) -> Result<LocalBatch> {
    let refs: Vec<&Row> = mb.rows.iter().map(|&r| &rows[r]).collect();
    // Text only: the LLM never reads this microbatch's pixels or mel frames.
    let text = rows_to_text(&refs)?;
    let Some(plan) = &mb.split.plan else {
        let t = text.ids.len();
        return Ok(LocalBatch {
            ids: Tensor::from_vec_u32(text.ids.clone(), [t], dev)?,
            host_ids: text.ids,
            seq: text.seq,
            targets: text.targets,
        });
    };
    // Targets look one token ahead (possibly on another CP rank): taken on the whole
    // microbatch, then this rank's tokens kept.
    let mine = plan.tokens(cp_rank)?;
    let local_ids: Vec<u32> = mine.iter().map(|&i| text.ids[i]).collect();
    Ok(LocalBatch {
        ids: Tensor::from_vec_u32(local_ids.clone(), [mine.len()], dev)?,
        host_ids: local_ids,
        seq: plan.seq_info(cp_rank, &text.seq)?,
        targets: mine.iter().map(|&i| text.targets[i]).collect(),
    })
}

/// Where each received modality row goes: for every row of `received` (`(plan item,
/// row of the item)`, in the order of the tensor holding them), its microbatch among
/// `mbs` and its position among this CP rank's tokens. Per microbatch: (indices into
/// the tensor, local placeholder positions).
pub(crate) fn placeholders(
    plan: &StepPlan,
    mbs: &[&Microbatch],
    cp: usize,
    received: &[(usize, u32)],
) -> Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let mut fill: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); mbs.len()];
    for (k, &(item, row)) in received.iter().enumerate() {
        let it = &plan.items[item];
        let j = mbs.iter().position(|m| m.mb == it.mb).ok_or_else(|| {
            TrainError::Other(format!("received a row of item {item} for no microbatch"))
        })?;
        let (cpr, local) = mbs[j].split.owner[it.start + row as usize];
        if cpr != cp {
            return Err(TrainError::Other(format!(
                "item {item} row {row} was routed to cp rank {cp} but belongs to {cpr}"
            )));
        }
        fill[j].0.push(k as u32);
        fill[j].1.push(local as u32);
    }
    Ok(fill)
}

/// The local placeholder positions of microbatch `mb`'s `rows` modality rows that one
/// microbatch's bridge `routes` (over the plan items `of_mb`, ascending) brought to `rank`
/// (CP rank `cp`): every row received is one of its placeholders, in order, or an error.
pub(crate) fn microbatch_placeholders(
    plan: &StepPlan,
    mb: &Microbatch,
    cp: usize,
    routes: &Routes,
    of_mb: &[usize],
    rank: usize,
    rows: usize,
) -> Result<Vec<u32>> {
    let received: Vec<(usize, u32)> = routes
        .received(rank)
        .into_iter()
        .map(|(j, r)| (of_mb[j], r))
        .collect();
    let mut fill = placeholders(plan, &[mb], cp, &received)?;
    let (idx, pos) = fill.pop().unwrap_or_default();
    if idx.iter().enumerate().any(|(n, &i)| i as usize != n) || idx.len() != rows {
        return Err(TrainError::Other(format!(
            "rank {rank}: microbatch {}'s rows do not match its placeholders",
            mb.mb
        )));
    }
    Ok(pos)
}

/// A stage's input for one microbatch.
pub(crate) enum LlmIn {
    /// The first stage: the microbatch's modality rows `(M_mb, C)` and their local
    /// placeholder positions, if it has any.
    Tokens(Option<(Tensor, Vec<u32>)>),
    /// Another stage: the previous stage's output (T, C).
    Hidden(Tensor),
}

/// One rank's LLM stage over one step's microbatches of its replica.
pub(crate) struct LlmStageRun<'a> {
    part: &'a mut LlmPart,
    rows: &'a [Row],
    pub mbs: Vec<&'a Microbatch>,
    /// The loss normalizer: valid targets of the whole global batch.
    norm: usize,
    dev: Device,
    /// What each (chunk, microbatch) keeps for its backward, at `chunk * n + j`.
    caches: Vec<Option<(StageCache, Option<Tensor>)>>,
    /// Each microbatch as this CP rank sees it, built by its first forward and kept for
    /// the stage's other chunks until its last backward (chunk 0's).
    batches: Vec<Option<LocalBatch>>,
    /// Loss sum this rank contributes (last stage, TP rank 0; 0 elsewhere).
    pub loss: f64,
    /// Zero-bubble pipelining: each microbatch's weight gradients from its backward (B),
    /// held for its W pass ([`LlmStageRun::weight`]).
    deferred: Vec<Option<DeferredGrads>>,
}

impl<'a> LlmStageRun<'a> {
    pub fn new(part: &'a mut LlmPart, rows: &'a [Row], plan: &'a StepPlan, norm: usize) -> Self {
        let mbs = plan.microbatches_of(part.groups.coord.dp);
        let dev = part.chunks.first().map_or(Device::Cpu, device_of);
        let n = mbs.len();
        let v = part.chunks.len();
        LlmStageRun {
            part,
            rows,
            mbs,
            norm,
            dev,
            caches: (0..v * n).map(|_| None).collect(),
            batches: (0..n).map(|_| None).collect(),
            loss: 0.0,
            deferred: (0..n).map(|_| None).collect(),
        }
    }

    /// This rank's CP index.
    pub fn cp(&self) -> usize {
        self.part.groups.coord.cp
    }

    pub fn stage(&self) -> (usize, usize) {
        (self.part.groups.coord.pp, self.part.groups.grid.dims.pp)
    }

    /// Model chunks on this stage (`parallel.llm.virtual_stages`).
    pub fn chunks(&self) -> usize {
        self.part.chunks.len()
    }

    /// Whether chunk `k` of this stage ends the model (takes the loss).
    pub fn ends_model(&self, k: usize) -> bool {
        let (stage, stages) = self.stage();
        stage + 1 == stages && k + 1 == self.chunks()
    }

    /// A pass's name on the timeline: "llm fwd s1 mb3", with the chunk where a stage
    /// has several ("llm fwd s1 c0 mb3").
    fn pass_name(&self, what: &str, k: usize, j: usize) -> String {
        let (stage, mb) = (self.stage().0, self.mbs[j].mb);
        if self.chunks() > 1 {
            format!("llm {what} s{stage} c{k} mb{mb}")
        } else {
            format!("llm {what} s{stage} mb{mb}")
        }
    }

    /// The shape of the hidden states (and their grads) between stages of microbatch
    /// `j`: (T_local, C).
    pub fn hidden_shape(&self, j: usize) -> Result<Shape> {
        let t = self.mbs[j]
            .split
            .tokens
            .get(self.part.groups.coord.cp)
            .map_or(0, Vec::len);
        let hidden = self.part.chunks.first().map_or(0, |c| c.config.hidden);
        Ok(Shape::new([t, hidden]))
    }

    /// Microbatch `j`'s forward through chunk `k`; returns the output for the next
    /// chunk (`None` where the model ends: the loss is taken and its grad kept).
    pub fn forward(
        &mut self,
        k: usize,
        j: usize,
        input: LlmIn,
        trace: &mut Tracer,
    ) -> Result<Option<Tensor>> {
        if self.batches[j].is_none() {
            let b = local_batch(self.rows, self.mbs[j], self.part.groups.coord.cp, self.dev)?;
            self.batches[j] = Some(b);
        }
        let b = self.batches[j]
            .as_ref()
            .ok_or_else(|| TrainError::Other(format!("microbatch {j} has no batch")))?;
        let n = self.mbs.len();
        let name = self.pass_name("fwd", k, j);
        let chunk = self.part.chunks.get(k).ok_or_else(|| {
            TrainError::Other(format!("llm chunk {k} of {}", self.part.chunks.len()))
        })?;
        let t0 = trace.start();
        let (out, cache) = match input {
            LlmIn::Tokens(modality) => {
                let modality = match modality {
                    Some((embeds, pos)) => Some(ModalityEmbeds {
                        positions: Tensor::from_vec_u32(pos.clone(), [pos.len()], self.dev)?,
                        embeds: embeds.into_device(self.dev)?, // (M_mb, C)
                    }),
                    None => None,
                };
                let input = StageInput::Tokens {
                    ids: &b.ids,
                    host_ids: Some(&b.host_ids),
                    modality: modality.as_ref(),
                };
                chunk.forward(input, &b.seq)?
            }
            LlmIn::Hidden(h) => {
                chunk.forward(StageInput::Hidden(h.into_device(self.dev)?), &b.seq)?
            }
        };
        trace.end(t0, name, "llm")?;
        if self.ends_model(k) {
            let t0 = trace.start();
            let l = vocab_parallel_loss(
                chunk.tp_group().as_ref(),
                &out,
                chunk.vocab_range().start,
                &b.targets,
                Some(self.norm),
            )?;
            trace.end(t0, format!("llm loss mb{}", self.mbs[j].mb), "llm")?;
            if self.part.groups.coord.tp == 0 {
                self.loss += l.loss_sum;
            }
            self.caches[k * n + j] = Some((cache, Some(l.dlogits)));
            Ok(None)
        } else {
            self.caches[k * n + j] = Some((cache, None));
            Ok(Some(out))
        }
    }

    /// Microbatch `j`'s backward through chunk `k`, given the grad of its output
    /// (`None` where the model ends: the grad is the loss's); returns the grad of its
    /// input: the previous chunk's hidden states, or on the model's first chunk the
    /// modality rows' grads (in the order they came in; `None` without any).
    pub fn backward(
        &mut self,
        k: usize,
        j: usize,
        dout: Option<Tensor>,
        trace: &mut Tracer,
    ) -> Result<Option<Tensor>> {
        let stage = self.stage().0;
        let n = self.mbs.len();
        let (cache, dlogits) = self.caches[k * n + j].take().ok_or_else(|| {
            TrainError::Other(format!("llm chunk {k} microbatch {j} has no cache"))
        })?;
        let dout = match (dlogits, dout) {
            (Some(d), _) => d,
            (None, Some(d)) => d.into_device(self.dev)?, // (T, C)
            (None, None) => {
                return Err(TrainError::Other(format!(
                    "llm stage {stage} chunk {k} microbatch {j}: no output grad"
                )));
            }
        };
        let name = self.pass_name("bwd", k, j);
        let t0 = trace.start();
        let chunks = self.part.chunks.len();
        let chunk = self
            .part
            .chunks
            .get_mut(k)
            .ok_or_else(|| TrainError::Other(format!("llm chunk {k} of {chunks}")))?;
        let split = self.part.split_backward;
        defer_weight_grads(chunk, split);
        let dx = chunk.backward(cache, &dout);
        if split {
            defer_weight_grads(chunk, false);
            self.deferred[j] = Some(take_deferred(chunk));
        }
        let dx = dx?;
        trace.end(t0, name, "llm")?;
        if k == 0 {
            // Chunk 0's backward is the microbatch's last pass on this stage.
            self.batches[j] = None;
        }
        Ok(dx)
    }

    /// After the stage's last pass: an error if a backward's weight gradients were left
    /// without their W pass (they would be lost to the gradient sync).
    pub fn check_weights_done(&self) -> Result<()> {
        match self.deferred.iter().position(Option::is_some) {
            Some(j) => Err(TrainError::Other(format!(
                "llm stage {} microbatch {j}: its weight gradients had no W pass",
                self.stage().0
            ))),
            None => Ok(()),
        }
    }

    /// Microbatch `j`'s W pass under zero-bubble pipelining: the weight gradients its
    /// backward left (one model chunk a stage).
    pub fn weight(&mut self, j: usize, trace: &mut Tracer) -> Result<()> {
        let stage = self.stage().0;
        let held = self
            .deferred
            .get_mut(j)
            .and_then(Option::take)
            .ok_or_else(|| {
                TrainError::Other(format!(
                    "llm stage {stage} microbatch {j}: a weight-gradient pass before its backward"
                ))
            })?;
        let name = self.pass_name("wgt", 0, j);
        let t0 = trace.start();
        let chunk = self
            .part
            .chunks
            .first_mut()
            .ok_or_else(|| TrainError::Other("llm stage without a model chunk".into()))?;
        apply_deferred(chunk, held)?;
        trace.end(t0, name, "llm")
    }
}

/// Where the first stage's modality rows come from.
pub(crate) enum Modality<'r, 'e> {
    /// The whole step's, from one bridge exchange before the LLM (`(M_r, C)`), their
    /// grads scattered into the second (same shape) for one exchange after it.
    Received(&'r Tensor, &'r mut Tensor),
    /// Encoded microbatch by microbatch on this stage ("centric" placement).
    Centric(&'r mut CentricEncoders<'e>),
}

/// The phased step: this rank's stage over its replica's microbatches in 1F1B order
/// (interleaved over its chunks where it has several, split for zero-bubble pipelining
/// where asked: [`llm_pass_order`]), every
/// microbatch's modality rows taken from `modality`. Returns the loss sum this rank
/// contributes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_pipeline(
    part: &mut LlmPart,
    world: &dyn Comm,
    rows: &[Row],
    plan: &StepPlan,
    routes: &Routes,
    mut modality: Modality<'_, '_>,
    norm: usize,
    trace: &mut Tracer,
) -> Result<f64> {
    let g = part.groups.clone();
    let rank = world.rank();
    let (stage, stages) = (g.coord.pp, g.grid.dims.pp);
    let first = stage == 0;
    // The stage a step `delta` away round the ring (the chunks go round it
    // `virtual_stages` times: the last stage's chunk k feeds the first's k + 1).
    let peer = |delta: isize| {
        let to = (stage as isize + delta).rem_euclid(stages as isize);
        g.grid
            .pp_neighbor(rank, to - stage as isize)
            .ok_or_else(|| TrainError::Other(format!("no pipeline stage {to}")))
    };
    let split = part.split_backward;
    let mut run = LlmStageRun::new(part, rows, plan, norm);
    let dev = run.dev;
    // Stage 0: which received rows fill which local placeholder of each microbatch.
    let fill = match &modality {
        Modality::Received(..) if first => {
            placeholders(plan, &run.mbs, g.coord.cp, &routes.received(rank))?
        }
        _ => vec![(Vec::new(), Vec::new()); run.mbs.len()],
    };
    // Centric: which microbatches' first forward took modality rows.
    let mut took = vec![false; run.mbs.len()];
    let index = |v: &[u32]| Tensor::from_vec_u32(v.to_vec(), [v.len()], dev);
    let v = run.chunks();
    // The stage's order over its own microbatches (pass `k * n + j`: chunk k of
    // microbatch j), as the overlapped executor's LLM roles take it.
    let n = run.mbs.len();
    let own: Vec<usize> = (0..n).collect();
    for op in llm_pass_order(&own, n, (stage, stages), v, split) {
        let (p, forward) = match op {
            Op::Forward(p) => (p, true),
            Op::Backward(p) => (p, false),
            Op::Weight(p) => {
                run.weight(p % n.max(1), trace)?;
                continue;
            }
        };
        let (k, j) = (p / n.max(1), p % n.max(1));
        let mb = run.mbs[j].mb;
        // Message spans name the chunk where a stage has several, as the passes do.
        let of = |what: &str| match v {
            1 => format!("recv {what} mb{mb}"),
            _ => format!("recv {what} c{k} mb{mb}"),
        };
        if forward {
            let input = if first && k == 0 {
                let (idx, pos) = &fill[j];
                LlmIn::Tokens(match &mut modality {
                    Modality::Centric(enc) => {
                        let rows = enc.forward(run.mbs[j], g.coord.cp, trace)?;
                        took[j] = rows.is_some();
                        rows
                    }
                    Modality::Received(..) if idx.is_empty() => None,
                    Modality::Received(received, _) => {
                        Some((ops::gather_rows(received, &index(idx)?)?, pos.clone())) // (M_mb, C)
                    }
                })
            } else {
                let t0 = trace.start();
                let h = world.recv(&run.hidden_shape(j)?, peer(-1)?)?; // (T, C)
                trace.end(t0, of("act"), "comm")?;
                LlmIn::Hidden(h)
            };
            if let Some(out) = run.forward(k, j, input, trace)? {
                world.send(&out, peer(1)?)?;
            }
        } else {
            let dout = if run.ends_model(k) {
                None
            } else {
                let t0 = trace.start();
                let d = world.recv(&run.hidden_shape(j)?, peer(1)?)?; // (T, C)
                trace.end(t0, of("grad"), "comm")?;
                Some(d)
            };
            let dx = run.backward(k, j, dout, trace)?;
            if !(first && k == 0) {
                let dh = dx.ok_or_else(|| TrainError::Other("stage gave no input grad".into()))?;
                world.send(&dh, peer(-1)?)?;
            } else {
                match &mut modality {
                    Modality::Centric(enc) => {
                        let dmod = if took[j] { dx } else { None };
                        enc.backward(mb, dmod, trace)?;
                    }
                    Modality::Received(_, dreceived) => {
                        if let Some(dmod) = dx
                            && !fill[j].0.is_empty()
                        {
                            ops::scatter_rows(dreceived, &index(&fill[j].0)?, &dmod)?;
                        }
                    }
                }
            }
        }
    }
    if let Modality::Centric(enc) = &modality {
        enc.finish()?;
    }
    run.check_weights_done()?;
    Ok(run.loss)
}
