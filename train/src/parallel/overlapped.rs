//! The overlapped step on one rank (`parallel.schedule = "overlapped"`, disjoint placement): this rank's program from [`super::graph`], run compute by compute, its messages moved in grouped exchanges.
//!
//! Encoder replicas encode microbatch `k`'s images and clips as their chunk `k`, each
//! chunk's embeddings go point to point to the LLM's first-stage ranks that hold its
//! placeholders (only those ranks take part), their grads come back per chunk, and each
//! encoder's backward of chunk `k` runs between its forwards of later chunks, while the
//! LLM pipeline works on earlier ones. The results are those of the phased step: the
//! same computations on the same rows, only in another order.

use std::collections::HashMap;

use braid_bridge::Routes;
use braid_comm::Comm;
use braid_dataloader::loader::Row;
use braid_kernels::{Shape, Tensor};

use super::encode::{
    AudioWork, GradIn, Handed, VisionWork, audio_hidden, audio_stage_backward, audio_stage_forward,
    clip_frames, vision_hidden, vision_stage_backward, vision_stage_forward,
};
use super::graph::{EncoderNode, Graph, Msg, Role, Step, Xfer};
use super::layout::Layouts;
use super::llm_stage::{LlmIn, LlmStageRun, placeholders};
use super::model::{ModuleGroups, RankModel};
use super::plan::{ItemKind, StepPlan};
use super::schedule::Op;
use crate::error::{Result, TrainError};
use crate::mllm::{Freeze, trainable};
use crate::trace::Tracer;

/// The step's graph: chunks, who runs which, and each chunk's bridge routes.
pub(crate) fn step_graph(
    layouts: &Layouts,
    plan: &StepPlan,
    routes: &Routes,
    freeze: Freeze,
) -> Result<Graph> {
    let chunks = plan
        .microbatches
        .iter()
        .map(|m| m.mb + 1)
        .chain(plan.items.iter().map(|it| it.mb + 1))
        .max()
        .unwrap_or(0);
    let bridges = (0..chunks)
        .map(|k| {
            let items: Vec<usize> = (0..plan.items.len())
                .filter(|&i| plan.items[i].mb == k)
                .collect();
            if items.is_empty() {
                return Ok(None);
            }
            routes
                .subset(&items)
                .map(Some)
                .map_err(|e| TrainError::Other(format!("chunk {k}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let llm = layouts.llm;
    let llm_chunks = (0..llm.dims.dp)
        .map(|d| plan.microbatches_of(d).iter().map(|m| m.mb).collect())
        .collect();
    let mut encoders = Vec::new();
    let mut encoder_chunks = Vec::new();
    let branches = [
        (
            layouts.vision,
            ItemKind::Image,
            freeze.vision,
            freeze.vision_projector,
        ),
        (
            layouts.audio,
            ItemKind::Clip,
            freeze.audio,
            freeze.audio_projector,
        ),
    ];
    for (grid, kind, enc_frozen, proj_frozen) in branches {
        let Some(grid) = grid else { continue };
        encoders.push(EncoderNode {
            grid,
            trains: !enc_frozen,
            branch_trains: !(enc_frozen && proj_frozen),
        });
        encoder_chunks.push(
            (0..grid.dims.dp)
                .map(|r| {
                    let mut c: Vec<usize> = plan
                        .items
                        .iter()
                        .filter(|it| it.kind == kind && it.enc_dp == r)
                        .map(|it| it.mb)
                        .collect();
                    c.sort_unstable();
                    c.dedup();
                    c
                })
                .collect(),
        );
    }
    Ok(Graph {
        llm,
        encoders,
        llm_chunks,
        encoder_chunks,
        bridges,
    })
}

/// Messages in flight on this rank: made by a compute and not yet sent, or received and
/// not yet used.
#[derive(Default)]
struct Mail {
    outbox: HashMap<Xfer, Tensor>,
    inbox: HashMap<Xfer, Tensor>,
}

impl Mail {
    fn put(&mut self, to: Xfer, t: Tensor) -> Result<()> {
        if self.outbox.insert(to, t).is_some() {
            return Err(TrainError::Other(format!("{to:?} was made twice")));
        }
        Ok(())
    }

    fn take(&mut self, from: Xfer) -> Result<Tensor> {
        self.inbox
            .remove(&from)
            .ok_or_else(|| TrainError::Other(format!("{from:?} was never received")))
    }

    /// The bridge messages `xs` (from their peers), as (peer, tensor).
    fn take_all(&mut self, xs: &[Xfer]) -> Result<Vec<(usize, Tensor)>> {
        xs.iter().map(|&x| Ok((x.peer, self.take(x)?))).collect()
    }

    /// Files a compute's bridge messages: each must be one the program expects.
    fn put_all(&mut self, expected: &[Xfer], msg: Msg, sends: Vec<(usize, Tensor)>) -> Result<()> {
        if sends.len() != expected.len() {
            return Err(TrainError::Other(format!(
                "the bridge made {} messages of {msg:?} but the schedule expects {}",
                sends.len(),
                expected.len()
            )));
        }
        for (peer, t) in sends {
            let x = Xfer { peer, msg };
            if !expected.contains(&x) {
                return Err(TrainError::Other(format!("unexpected message {x:?}")));
            }
            self.put(x, t)?;
        }
        Ok(())
    }
}

/// What a module's computes need from the executor: the shape of each hidden-state
/// message, and the forward and backward of a chunk (at its position in the role).
trait Chunks {
    fn hidden_shape(&self, j: usize) -> Result<Shape>;
    fn forward(&mut self, j: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()>;
    fn backward(&mut self, j: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()>;
    /// The loss sum this rank contributes (the LLM's last stage).
    fn loss(&self) -> f64 {
        0.0
    }
}

/// The shape of message `x` on this rank.
fn shape_of(x: &Xfer, role: &Role, graph: &Graph, rank: usize, m: &dyn Chunks) -> Result<Shape> {
    let (k, bridge_rows) = match x.msg {
        Msg::Act(k) | Msg::Grad(k) => {
            let j = role.chunks.binary_search(&k).map_err(|_| {
                TrainError::Other(format!("rank {rank}: {x:?} is for a chunk it does not run"))
            })?;
            return m.hidden_shape(j);
        }
        Msg::Embed(k) => (
            k,
            graph.bridges[k].as_ref().map(|b| b.forward_sources(rank)),
        ),
        Msg::EmbedGrad(k) => (
            k,
            graph.bridges[k].as_ref().map(|b| b.backward_sources(rank)),
        ),
    };
    let b = graph.bridges[k]
        .as_ref()
        .ok_or_else(|| TrainError::Other(format!("chunk {k} has no bridge routes")))?;
    let n = bridge_rows
        .unwrap_or_default()
        .into_iter()
        .find(|s| s.0 == x.peer)
        .map_or(0, |s| s.1);
    Ok(Shape::new([n, b.width()]))
}

/// Runs this rank's part of the overlapped step; returns the loss sum it contributes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_overlapped(
    model: &mut RankModel,
    world: &dyn Comm,
    layouts: &Layouts,
    rows: &[Row],
    plan: &StepPlan,
    routes: &Routes,
    freeze: Freeze,
    norm: usize,
    trace: &mut Tracer,
) -> Result<f64> {
    let rank = world.rank();
    let graph = step_graph(layouts, plan, routes, freeze)?;
    let role = graph
        .role(rank)
        .map_err(|e| TrainError::Other(format!("overlapped schedule: {e}")))?;
    let c = routes.width();
    let RankModel { vision, audio, llm } = model;
    let mut module: Box<dyn Chunks + '_> = if let Some(part) = llm.as_mut() {
        let run = LlmStageRun::new(part, rows, plan, norm);
        let got: Vec<usize> = run.mbs.iter().map(|m| m.mb).collect();
        if got != role.chunks {
            return Err(TrainError::Other(format!(
                "rank {rank}: llm microbatches {got:?} but the schedule's chunks are {:?}",
                role.chunks
            )));
        }
        Box::new(LlmChunks {
            run,
            plan,
            rank,
            role: &role,
            graph: &graph,
        })
    } else if let Some(part) = vision.as_mut() {
        check_trains(&part.groups, trainable(&part.encoder), freeze.vision)?;
        let items = chunk_items(plan, ItemKind::Image, part.groups.coord.dp, &role.chunks);
        Box::new(EncoderChunks {
            part,
            rows,
            plan,
            rank,
            c,
            role: &role,
            graph: &graph,
            works: (0..items.len()).map(|_| None).collect(),
            items,
        })
    } else if let Some(part) = audio.as_mut() {
        check_trains(&part.groups, trainable(&part.encoder), freeze.audio)?;
        let items = chunk_items(plan, ItemKind::Clip, part.groups.coord.dp, &role.chunks);
        Box::new(EncoderChunks {
            part,
            rows,
            plan,
            rank,
            c,
            role: &role,
            graph: &graph,
            works: (0..items.len()).map(|_| None).collect(),
            items,
        })
    } else {
        return Err(TrainError::Other(format!("rank {rank} holds no module")));
    };

    let mut mail = Mail::default();
    for step in role.program() {
        match step {
            Step::Exchange { send, recv } => {
                let t0 = trace.start();
                for x in &send {
                    let t = mail
                        .outbox
                        .remove(x)
                        .ok_or_else(|| TrainError::Other(format!("{x:?} was never made")))?;
                    world.send(&t, x.peer)?;
                }
                for x in &recv {
                    let shape = shape_of(x, &role, &graph, rank, module.as_ref())?;
                    mail.inbox.insert(*x, world.recv(&shape, x.peer)?);
                }
                let bridge = send
                    .iter()
                    .chain(&recv)
                    .any(|x| matches!(x.msg, Msg::Embed(_) | Msg::EmbedGrad(_)));
                let what = recv.first().or(send.first()).map(|x| x.msg);
                let name = match what {
                    Some(Msg::Embed(k)) | Some(Msg::Act(k)) => format!("wait fwd mb{k}"),
                    Some(Msg::EmbedGrad(k)) | Some(Msg::Grad(k)) => format!("wait bwd mb{k}"),
                    None => "exchange".into(),
                };
                trace.end(t0, name, if bridge { "bridge" } else { "comm" })?;
            }
            Step::Run(Op::Forward(j)) => module.forward(j, &mut mail, trace)?,
            Step::Run(Op::Backward(j)) => module.backward(j, &mut mail, trace)?,
        }
    }
    if let Some(x) = mail.outbox.keys().chain(mail.inbox.keys()).next() {
        return Err(TrainError::Other(format!(
            "rank {rank}: {x:?} was left over at the end of the step"
        )));
    }
    Ok(module.loss())
}

/// An encoder rank's trainable state must be what the schedule was built from (the
/// run's `train.freeze`, known on every rank).
fn check_trains(g: &ModuleGroups, trains: bool, frozen: bool) -> Result<()> {
    if trains == frozen {
        return Err(TrainError::Other(format!(
            "the {} encoder's weights {} but train.freeze says {}",
            g.kind.key(),
            if trains { "train" } else { "are frozen" },
            if frozen { "frozen" } else { "trained" }
        )));
    }
    Ok(())
}

/// Per chunk of `chunks`: the plan items of `kind` encoder replica `dp` encodes in it.
fn chunk_items(plan: &StepPlan, kind: ItemKind, dp: usize, chunks: &[usize]) -> Vec<Vec<usize>> {
    chunks
        .iter()
        .map(|&k| {
            (0..plan.items.len())
                .filter(|&i| {
                    let it = &plan.items[i];
                    it.kind == kind && it.enc_dp == dp && it.mb == k
                })
                .collect()
        })
        .collect()
}

/// The plan items of chunk `k`, ascending: item `j` of the chunk's routes is `[j]`.
fn items_of_chunk(plan: &StepPlan, k: usize) -> Vec<usize> {
    (0..plan.items.len())
        .filter(|&i| plan.items[i].mb == k)
        .collect()
}

fn bridge_of(graph: &Graph, k: usize) -> Result<&Routes> {
    graph
        .bridges
        .get(k)
        .and_then(Option::as_ref)
        .ok_or_else(|| TrainError::Other(format!("chunk {k} has no bridge routes")))
}

/// The one message of `xs` (a pipeline neighbour's).
fn single(xs: &[Xfer], what: &str) -> Result<Xfer> {
    match xs {
        [x] => Ok(*x),
        _ => Err(TrainError::Other(format!(
            "the schedule gives {} messages for {what}, not one",
            xs.len()
        ))),
    }
}

/// An encoder stage, vision or audio, as the executor drives it.
trait EncoderStage {
    type Work;
    const NAME: &'static str;
    fn groups(&self) -> &ModuleGroups;
    fn hidden(&self, rows: &[Row], plan: &StepPlan, items: &[usize]) -> Result<Shape>;
    fn stage_forward(
        &self,
        rank: usize,
        rows: &[Row],
        plan: &StepPlan,
        items: Vec<usize>,
        hidden: Option<Tensor>,
    ) -> Result<(Handed, Self::Work)>;
    fn stage_backward(
        &mut self,
        work: Self::Work,
        grad: GradIn<'_>,
        c: usize,
    ) -> Result<Option<Tensor>>;
    fn wants_next_grad(work: &Self::Work) -> bool;
}

impl EncoderStage for super::model::VisionPart {
    type Work = VisionWork;
    const NAME: &'static str = "vision";
    fn groups(&self) -> &ModuleGroups {
        &self.groups
    }
    fn hidden(&self, _rows: &[Row], _plan: &StepPlan, items: &[usize]) -> Result<Shape> {
        vision_hidden(self, items.len())
    }
    fn stage_forward(
        &self,
        rank: usize,
        rows: &[Row],
        plan: &StepPlan,
        items: Vec<usize>,
        hidden: Option<Tensor>,
    ) -> Result<(Handed, VisionWork)> {
        vision_stage_forward(self, rank, rows, plan, items, hidden)
    }
    fn stage_backward(
        &mut self,
        work: VisionWork,
        grad: GradIn<'_>,
        c: usize,
    ) -> Result<Option<Tensor>> {
        vision_stage_backward(self, work, grad, c)
    }
    fn wants_next_grad(work: &VisionWork) -> bool {
        work.wants_next_grad()
    }
}

impl EncoderStage for super::model::AudioPart {
    type Work = AudioWork;
    const NAME: &'static str = "audio";
    fn groups(&self) -> &ModuleGroups {
        &self.groups
    }
    fn hidden(&self, rows: &[Row], plan: &StepPlan, items: &[usize]) -> Result<Shape> {
        audio_hidden(self, &clip_frames(rows, plan, items))
    }
    fn stage_forward(
        &self,
        rank: usize,
        rows: &[Row],
        plan: &StepPlan,
        items: Vec<usize>,
        hidden: Option<Tensor>,
    ) -> Result<(Handed, AudioWork)> {
        audio_stage_forward(self, rank, rows, plan, items, hidden)
    }
    fn stage_backward(
        &mut self,
        work: AudioWork,
        grad: GradIn<'_>,
        c: usize,
    ) -> Result<Option<Tensor>> {
        audio_stage_backward(self, work, grad, c)
    }
    fn wants_next_grad(work: &AudioWork) -> bool {
        work.wants_next_grad()
    }
}

/// An encoder rank's chunks.
struct EncoderChunks<'a, P: EncoderStage> {
    part: &'a mut P,
    rows: &'a [Row],
    plan: &'a StepPlan,
    rank: usize,
    /// The bridge's row width (the LLM hidden size).
    c: usize,
    role: &'a Role,
    graph: &'a Graph,
    /// Per chunk (position in the role): its items, and what its forward kept.
    items: Vec<Vec<usize>>,
    works: Vec<Option<P::Work>>,
}

impl<P: EncoderStage> Chunks for EncoderChunks<'_, P> {
    fn hidden_shape(&self, j: usize) -> Result<Shape> {
        self.part.hidden(self.rows, self.plan, &self.items[j])
    }

    fn forward(&mut self, j: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()> {
        let k = self.role.chunks[j];
        let pp = self.part.groups().coord.pp;
        let hidden = match self.role.fwd_in[j].as_slice() {
            [] => None,
            xs => Some(mail.take(single(xs, "a stage's input")?)?),
        };
        let t0 = trace.start();
        let (handed, work) = self.part.stage_forward(
            self.rank,
            self.rows,
            self.plan,
            self.items[j].clone(),
            hidden,
        )?;
        trace.end(t0, format!("{} fwd s{pp} mb{k}", P::NAME), P::NAME)?;
        self.works[j] = Some(work);
        match handed {
            Handed::Next(h) => mail.put(single(&self.role.fwd_out[j], "a stage's output")?, h),
            Handed::Embeds(embeds) => {
                let of_chunk = items_of_chunk(self.plan, k);
                let produced = embeds
                    .iter()
                    .map(|(i, t)| {
                        let j = of_chunk.binary_search(i).map_err(|_| {
                            TrainError::Other(format!("item {i} is not of microbatch {k}"))
                        })?;
                        Ok((j, t))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let sends = bridge_of(self.graph, k)?.forward_sends(self.rank, &produced)?;
                mail.put_all(&self.role.fwd_out[j], Msg::Embed(k), sends)
            }
        }
    }

    fn backward(&mut self, j: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()> {
        let k = self.role.chunks[j];
        let pp = self.part.groups().coord.pp;
        let work = self.works[j]
            .take()
            .ok_or_else(|| TrainError::Other(format!("{} chunk {k} has no cache", P::NAME)))?;
        let t0 = trace.start();
        let dx = if P::wants_next_grad(&work) {
            let dh = mail.take(single(&self.role.bwd_in[j], "a stage's output grad")?)?;
            self.part.stage_backward(work, GradIn::Next(dh), self.c)?
        } else {
            let got = mail.take_all(&self.role.bwd_in[j])?;
            let of_chunk = items_of_chunk(self.plan, k);
            let grads: Vec<(usize, Tensor)> = bridge_of(self.graph, k)?
                .backward_gather(self.rank, got)?
                .into_iter()
                .map(|(j, t)| (of_chunk[j], t))
                .collect();
            self.part
                .stage_backward(work, GradIn::Bridge(&grads), self.c)?
        };
        trace.end(t0, format!("{} bwd s{pp} mb{k}", P::NAME), P::NAME)?;
        match (dx, self.role.bwd_out[j].as_slice()) {
            (Some(dx), xs) => mail.put(single(xs, "a stage's input grad")?, dx),
            (None, []) => Ok(()),
            (None, _) => Err(TrainError::Other(format!(
                "{} stage {pp} chunk {k}: no input grad for the previous stage",
                P::NAME
            ))),
        }
    }
}

/// An LLM rank's chunks (its replica's microbatches).
struct LlmChunks<'a> {
    run: LlmStageRun<'a>,
    plan: &'a StepPlan,
    rank: usize,
    role: &'a Role,
    graph: &'a Graph,
}

impl Chunks for LlmChunks<'_> {
    fn hidden_shape(&self, j: usize) -> Result<Shape> {
        self.run.hidden_shape(j)
    }

    fn forward(&mut self, j: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()> {
        let k = self.role.chunks[j];
        let input = if self.run.stage().0 > 0 {
            LlmIn::Hidden(mail.take(single(&self.role.fwd_in[j], "a stage's input")?)?)
        } else if self.role.fwd_in[j].is_empty() {
            LlmIn::Tokens(None)
        } else {
            let bridge = bridge_of(self.graph, k)?;
            let rows = bridge.forward_gather(self.rank, mail.take_all(&self.role.fwd_in[j])?)?; // (M_k, C)
            let of_chunk = items_of_chunk(self.plan, k);
            let received: Vec<(usize, u32)> = bridge
                .received(self.rank)
                .into_iter()
                .map(|(j, r)| (of_chunk[j], r))
                .collect();
            let cp = self.run.cp();
            let mut fill = placeholders(self.plan, &self.run.mbs[j..=j], cp, &received)?;
            let (idx, pos) = fill.pop().unwrap_or_default();
            // Every row received for this chunk is one of its placeholders, in order.
            if idx.iter().enumerate().any(|(n, &i)| i as usize != n) || idx.len() != rows.dims()[0]
            {
                return Err(TrainError::Other(format!(
                    "rank {}: microbatch {k}'s rows do not match its placeholders",
                    self.rank
                )));
            }
            LlmIn::Tokens(Some((rows, pos)))
        };
        if let Some(out) = self.run.forward(j, input, trace)? {
            mail.put(single(&self.role.fwd_out[j], "a stage's output")?, out)?;
        }
        Ok(())
    }

    fn backward(&mut self, j: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()> {
        let k = self.role.chunks[j];
        let (stage, stages) = self.run.stage();
        let dout = if stage + 1 == stages {
            None
        } else {
            Some(mail.take(single(&self.role.bwd_in[j], "a stage's output grad")?)?)
        };
        let dx = self.run.backward(j, dout, trace)?;
        let no_grad =
            || TrainError::Other(format!("llm stage {stage} microbatch {k}: no input grad"));
        if stage > 0 {
            return mail.put(
                single(&self.role.bwd_out[j], "a stage's input grad")?,
                dx.ok_or_else(no_grad)?,
            );
        }
        if self.role.fwd_in[j].is_empty() {
            return Ok(());
        }
        // The modality rows' grads, in the order they came: back over the bridge.
        let dmod = dx.ok_or_else(no_grad)?;
        let sends = bridge_of(self.graph, k)?.backward_sends(self.rank, &dmod)?;
        mail.put_all(&self.role.bwd_out[j], Msg::EmbedGrad(k), sends)
    }

    fn loss(&self) -> f64 {
        self.run.loss
    }
}
