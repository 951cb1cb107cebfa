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

use super::chunks::{Chunks, EncoderChunks, LlmChunks};
use super::encode::EncoderStage;
use super::graph::{EncoderNode, Graph, Msg, Role, Step, Xfer};
use super::layout::Layouts;
use super::llm_stage::LlmStageRun;
use super::model::{ModuleGroups, RankModel};
use super::plan::{ItemKind, StepPlan};
use super::schedule::Op;
use crate::error::{Result, TrainError};
use crate::mllm::Freeze;
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
pub(super) struct Mail {
    outbox: HashMap<Xfer, Tensor>,
    inbox: HashMap<Xfer, Tensor>,
}

impl Mail {
    pub fn put(&mut self, to: Xfer, t: Tensor) -> Result<()> {
        if self.outbox.insert(to, t).is_some() {
            return Err(TrainError::Other(format!("{to:?} was made twice")));
        }
        Ok(())
    }

    pub fn take(&mut self, from: Xfer) -> Result<Tensor> {
        self.inbox
            .remove(&from)
            .ok_or_else(|| TrainError::Other(format!("{from:?} was never received")))
    }

    /// The bridge messages `xs` (from their peers), as (peer, tensor).
    pub fn take_all(&mut self, xs: &[Xfer]) -> Result<Vec<(usize, Tensor)>> {
        xs.iter().map(|&x| Ok((x.peer, self.take(x)?))).collect()
    }

    /// Files a compute's bridge messages: each must be one the program expects.
    pub fn put_all(
        &mut self,
        expected: &[Xfer],
        msg: Msg,
        sends: Vec<(usize, Tensor)>,
    ) -> Result<()> {
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
        let ctx = (rows, plan, rank, c, &role, &graph);
        encoder_chunks(part, freeze.vision, ctx)?
    } else if let Some(part) = audio.as_mut() {
        let ctx = (rows, plan, rank, c, &role, &graph);
        encoder_chunks(part, freeze.audio, ctx)?
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

/// What an encoder rank's chunks run with: the batch, its plan, the rank, the bridge's
/// row width, its role and the step's graph.
type Ctx<'a> = (&'a [Row], &'a StepPlan, usize, usize, &'a Role, &'a Graph);

/// An encoder rank's chunks, after checking its weights train as the schedule assumes.
fn encoder_chunks<'a, P: EncoderStage>(
    part: &'a mut P,
    frozen: bool,
    (rows, plan, rank, c, role, graph): Ctx<'a>,
) -> Result<Box<dyn Chunks + 'a>> {
    check_trains(part.groups(), part.encoder_trains(), frozen)?;
    let items = chunk_items(plan, P::KIND, part.groups().coord.dp, &role.chunks);
    Ok(Box::new(EncoderChunks {
        part,
        rows,
        plan,
        rank,
        c,
        role,
        graph,
        works: (0..items.len()).map(|_| None).collect(),
        items,
    }))
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
