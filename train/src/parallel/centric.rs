//! The LLM-centric placement's encoders (`parallel.placement = "centric"`, Megatron's layout): on the LLM's first pipeline stage, each microbatch's images and clips encoded inside that microbatch's first forward there and their backward inside its last backward, the embeddings moved point to point among the stage's ranks of one LLM replica.
//!
//! The LLM's 1F1B drives everything: [`super::llm_stage::run_pipeline`] calls
//! [`CentricEncoders::forward`] for the modality rows of a microbatch just before its
//! first chunk's forward on stage 0, and [`CentricEncoders::backward`] with their grads
//! just after that chunk's backward. The ranks of one LLM replica's first stage run its
//! microbatches in the same order and its items never leave it (the centric assignment,
//! [`braid_balancer::Centric`]), so each exchange is among ranks at the same point of
//! the same program; its sends go first and never wait on Braid's transports. A stage
//! holds at most the schedule's in-flight microbatches' encoder activations, as the
//! planner counts them for its LLM-centric baseline.

use std::collections::HashMap;

use braid_bridge::Routes;
use braid_comm::Comm;
use braid_dataloader::loader::Row;
use braid_kernels::{Shape, Tensor};

use super::chunks::items_of_chunk;
use super::encode::{AudioWork, EncoderStage, GradIn, Handed, VisionWork};
use super::llm_stage::microbatch_placeholders;
use super::model::{AudioPart, VisionPart};
use super::plan::{Microbatch, StepPlan};
use crate::error::{Result, TrainError};
use crate::trace::Tracer;

/// The encoders of one first-stage rank and what each microbatch's forward kept.
pub(crate) struct CentricEncoders<'a> {
    pub vision: Option<&'a mut VisionPart>,
    pub audio: Option<&'a mut AudioPart>,
    pub world: &'a dyn Comm,
    pub rows: &'a [Row],
    pub plan: &'a StepPlan,
    /// The whole step's bridge routes; each microbatch uses its items' subset.
    pub routes: &'a Routes,
    /// The bridge's row width (the LLM hidden size).
    pub c: usize,
    /// Per microbatch id: its routes, and what its encoders' forwards kept.
    subsets: HashMap<usize, Routes>,
    works: HashMap<usize, (Option<VisionWork>, Option<AudioWork>)>,
}

/// This rank's forward of `part` over its items of microbatch `k`; its embeddings (on the
/// sender rank) go to `produced` as `(index among the microbatch's items, rows)`.
fn encode_mine<P: EncoderStage>(
    part: &P,
    cx: (&[Row], &StepPlan, usize, &[usize]),
    k: usize,
    produced: &mut Vec<(usize, Tensor)>,
    trace: &mut Tracer,
) -> Result<Option<P::Work>> {
    let (rows, plan, rank, of_mb) = cx;
    let dp = part.groups().coord.dp;
    let mine: Vec<usize> = of_mb
        .iter()
        .copied()
        .filter(|&i| plan.items[i].kind == P::KIND && plan.items[i].enc_dp == dp)
        .collect();
    if mine.is_empty() {
        return Ok(None);
    }
    let t0 = trace.start();
    let (handed, work) = part.stage_forward(rank, rows, plan, mine, None)?;
    trace.end(t0, format!("{} fwd s0 mb{k}", P::NAME), P::NAME)?;
    match handed {
        Handed::Embeds(e) => {
            for (item, t) in e {
                let j = of_mb.binary_search(&item).map_err(|_| {
                    TrainError::Other(format!("item {item} is not of microbatch {k}"))
                })?;
                produced.push((j, t));
            }
            Ok(Some(work))
        }
        Handed::Next(_) => Err(TrainError::Other(format!(
            "the {} encoder has pipeline stages, which \"centric\" placement does not run",
            P::NAME
        ))),
    }
}

/// The backward of [`encode_mine`], given the bridge's grads of the microbatch.
fn backward_mine<P: EncoderStage>(
    part: &mut P,
    work: Option<P::Work>,
    grads: &[(usize, Tensor)],
    c: usize,
    k: usize,
    trace: &mut Tracer,
) -> Result<()> {
    let Some(work) = work else { return Ok(()) };
    let t0 = trace.start();
    part.stage_backward(work, GradIn::Bridge(grads), c)?;
    trace.end(t0, format!("{} bwd s0 mb{k}", P::NAME), P::NAME)?;
    Ok(())
}

impl<'a> CentricEncoders<'a> {
    pub fn new(
        vision: Option<&'a mut VisionPart>,
        audio: Option<&'a mut AudioPart>,
        world: &'a dyn Comm,
        rows: &'a [Row],
        plan: &'a StepPlan,
        routes: &'a Routes,
        c: usize,
    ) -> Self {
        CentricEncoders {
            vision,
            audio,
            world,
            rows,
            plan,
            routes,
            c,
            subsets: HashMap::new(),
            works: HashMap::new(),
        }
    }

    fn subset(&mut self, k: usize) -> Result<Routes> {
        if let Some(r) = self.subsets.get(&k) {
            return Ok(r.clone());
        }
        let r = self
            .routes
            .subset(&items_of_chunk(self.plan, k))
            .map_err(|e| TrainError::Other(format!("microbatch {k}: {e}")))?;
        self.subsets.insert(k, r.clone());
        Ok(r)
    }

    /// Moves `sends` (`(peer, tensor)`) and receives `sources` (`(peer, rows)`): a message
    /// to this rank itself stays here. Returns what arrived, as `(peer, tensor)`.
    fn exchange(
        &self,
        sends: Vec<(usize, Tensor)>,
        sources: &[(usize, usize)],
        what: &str,
        trace: &mut Tracer,
    ) -> Result<Vec<(usize, Tensor)>> {
        let rank = self.world.rank();
        let t0 = trace.start();
        let mut got = Vec::new();
        for (peer, t) in sends {
            if peer == rank {
                got.push((peer, t));
            } else {
                self.world.send(&t, peer)?;
            }
        }
        for &(peer, n) in sources {
            if peer != rank {
                got.push((peer, self.world.recv(&Shape::new([n, self.c]), peer)?));
            }
        }
        trace.end(t0, what.to_string(), "bridge")?;
        Ok(got)
    }

    /// Microbatch `mb`'s modality rows on this rank (CP rank `cp` of its replica): its
    /// encoders' forward over their items of it, then the bridge among the stage's
    /// ranks. `(rows (M_mb, C), local placeholder positions)`, or `None` without any.
    pub fn forward(
        &mut self,
        mb: &Microbatch,
        cp: usize,
        trace: &mut Tracer,
    ) -> Result<Option<(Tensor, Vec<u32>)>> {
        let k = mb.mb;
        let (rows, plan, rank) = (self.rows, self.plan, self.world.rank());
        let sub = self.subset(k)?;
        let of_mb = items_of_chunk(plan, k);
        let mut produced: Vec<(usize, Tensor)> = Vec::new();
        let cx = (rows, plan, rank, of_mb.as_slice());
        let vision = match self.vision.as_deref() {
            Some(v) => encode_mine(v, cx, k, &mut produced, trace)?,
            None => None,
        };
        let audio = match self.audio.as_deref() {
            Some(a) => encode_mine(a, cx, k, &mut produced, trace)?,
            None => None,
        };
        if self.works.insert(k, (vision, audio)).is_some() {
            return Err(TrainError::Other(format!(
                "rank {rank}: microbatch {k}'s encoders ran forward twice"
            )));
        }
        let refs: Vec<(usize, &Tensor)> = produced.iter().map(|(j, t)| (*j, t)).collect();
        let sends = sub.forward_sends(rank, &refs)?;
        drop(refs);
        drop(produced);
        let sources = sub.forward_sources(rank);
        let got = self.exchange(sends, &sources, &format!("bridge fwd mb{k}"), trace)?;
        if sources.is_empty() {
            return Ok(None);
        }
        let modality = sub.forward_gather(rank, got)?; // (M_mb, C)
        let rows = modality.dims()[0];
        let pos = microbatch_placeholders(plan, mb, cp, &sub, &of_mb, rank, rows)?;
        Ok(Some((modality, pos)))
    }

    /// Microbatch `mb`'s encoder backward, given the grads of the modality rows its
    /// forward returned on this rank (`None` where it returned none): the bridge back
    /// among the stage's ranks, then each encoder's backward over its items.
    pub fn backward(&mut self, mb: usize, dmod: Option<Tensor>, trace: &mut Tracer) -> Result<()> {
        let rank = self.world.rank();
        let sub = self.subset(mb)?;
        let sends = match &dmod {
            Some(d) => sub.backward_sends(rank, d)?,
            None => Vec::new(),
        };
        drop(dmod);
        let sources = sub.backward_sources(rank);
        let got = self.exchange(sends, &sources, &format!("bridge bwd mb{mb}"), trace)?;
        let of_mb = items_of_chunk(self.plan, mb);
        let grads: Vec<(usize, Tensor)> = if sources.is_empty() {
            Vec::new()
        } else {
            sub.backward_gather(rank, got)?
                .into_iter()
                .map(|(j, t)| (of_mb[j], t))
                .collect()
        };
        let (vision, audio) = self.works.remove(&mb).ok_or_else(|| {
            TrainError::Other(format!(
                "rank {rank}: microbatch {mb}'s encoders have no forward to go back through"
            ))
        })?;
        if let Some(v) = self.vision.as_deref_mut() {
            backward_mine(v, vision, &grads, self.c, mb, trace)?;
        }
        if let Some(a) = self.audio.as_deref_mut() {
            backward_mine(a, audio, &grads, self.c, mb, trace)?;
        }
        Ok(())
    }

    /// Every microbatch's forward went back through: nothing is left held.
    pub fn finish(&self) -> Result<()> {
        match self.works.keys().min() {
            Some(k) => Err(TrainError::Other(format!(
                "rank {}: microbatch {k}'s encoder activations were left at the end of the step",
                self.world.rank()
            ))),
            None => Ok(()),
        }
    }
}
