//! The overlapped step on one rank (`parallel.schedule = "overlapped"`, disjoint or colocated placement): this rank's program from [`super::graph`] (or, colocated, its part of [`super::order`]'s global order), run compute by compute, its messages moved in grouped exchanges.
//!
//! Encoder replicas encode microbatch `k`'s images and clips as their chunk `k`, each
//! chunk's embeddings go point to point to the LLM's first-stage ranks that hold its
//! placeholders (only those ranks take part), their grads come back per chunk, and each
//! encoder's backward of chunk `k` runs between its forwards of later chunks, while the
//! LLM pipeline works on earlier ones. The results are those of the phased step: the
//! same computations on the same rows, only in another order.

use std::collections::{HashMap, VecDeque};

use braid_bridge::Routes;
use braid_comm::Comm;
use braid_dataloader::loader::Row;
use braid_kernels::{Shape, Tensor};

use super::chunks::{Chunks, EncoderChunks, LlmChunks, items_of_kind};
use super::encode::EncoderStage;
use super::graph::{EncoderNode, Graph, Msg, Node, Role, Step, Xfer};
use super::layout::Layouts;
use super::llm_stage::LlmStageRun;
use super::model::{ModuleGroups, RankModel};
use super::order::rank_program;
use super::plan::{ItemKind, StepPlan};
use super::schedule::Op;
use crate::error::{Result, TrainError};
use crate::mllm::Freeze;
use crate::trace::Tracer;

/// The step's graph (chunks, who runs which, each chunk's bridge routes per encoder),
/// and what each of its encoders encodes.
pub(crate) fn step_graph(
    layouts: &Layouts,
    plan: &StepPlan,
    routes: &Routes,
    freeze: Freeze,
) -> Result<(Graph, Vec<ItemKind>)> {
    let chunks = plan
        .microbatches
        .iter()
        .map(|m| m.mb + 1)
        .chain(plan.items.iter().map(|it| it.mb + 1))
        .max()
        .unwrap_or(0);
    let llm = layouts.llm;
    let llm_chunks = (0..llm.dims.dp)
        .map(|d| plan.microbatches_of(d).iter().map(|m| m.mb).collect())
        .collect();
    let mut encoders = Vec::new();
    let mut encoder_chunks = Vec::new();
    let mut kinds = Vec::new();
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
        kinds.push(kind);
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
    let bridges = (0..chunks)
        .map(|k| {
            kinds
                .iter()
                .map(|&kind| {
                    let items = items_of_kind(plan, k, kind);
                    if items.is_empty() {
                        return Ok(None);
                    }
                    routes
                        .subset(&items)
                        .map(Some)
                        .map_err(|e| TrainError::Other(format!("chunk {k}: {e}")))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let graph = Graph {
        llm,
        llm_model_chunks: layouts.llm_chunks.max(1),
        llm_split_backward: layouts.llm_zero_bubble,
        encoders,
        llm_chunks,
        encoder_chunks,
        bridges,
    };
    Ok((graph, kinds))
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

    /// Files a received message (`peer` its sender).
    pub fn put_in(&mut self, from: Xfer, t: Tensor) -> Result<()> {
        if self.inbox.insert(from, t).is_some() {
            return Err(TrainError::Other(format!("{from:?} came twice")));
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
        node: Node,
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
            let x = Xfer { peer, node, msg };
            if !expected.contains(&x) {
                return Err(TrainError::Other(format!("unexpected message {x:?}")));
            }
            self.put(x, t)?;
        }
        Ok(())
    }
}

/// A module's chunks on this rank, with its role.
type Module<'a> = (&'a Role, Box<dyn Chunks + 'a>);

/// The module of `node` among this rank's.
fn module_of<'m, 'a>(modules: &'m mut [Module<'a>], node: Node) -> Result<&'m mut Module<'a>> {
    modules
        .iter_mut()
        .find(|m| m.0.node == node)
        .ok_or_else(|| TrainError::Other(format!("this rank runs no {node:?} stage")))
}

/// The shape of message `x` on this rank.
fn shape_of(x: &Xfer, graph: &Graph, rank: usize, modules: &mut [Module<'_>]) -> Result<Shape> {
    let (k, e, bridge_rows) = match (x.msg, x.node) {
        (Msg::Act(k, _) | Msg::Grad(k, _), node) => {
            let (role, m) = module_of(modules, node)?;
            let j = role.chunks.binary_search(&k).map_err(|_| {
                TrainError::Other(format!("rank {rank}: {x:?} is for a chunk it does not run"))
            })?;
            return m.hidden_shape(j);
        }
        (Msg::Embed(k), Node::Encoder(e)) => {
            (k, e, graph.bridge(k, e).map(|b| b.forward_sources(rank)))
        }
        (Msg::EmbedGrad(k), Node::Encoder(e)) => {
            (k, e, graph.bridge(k, e).map(|b| b.backward_sources(rank)))
        }
        (_, Node::Llm) => {
            return Err(TrainError::Other(format!(
                "rank {rank}: {x:?} is a bridge message without its encoder"
            )));
        }
    };
    let b = graph.bridge(k, e).ok_or_else(|| {
        TrainError::Other(format!("chunk {k} has no bridge routes for encoder {e}"))
    })?;
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
    let (graph, kinds) = step_graph(layouts, plan, routes, freeze)?;
    let mut prog = rank_program(&graph, world.size(), rank)
        .map_err(|e| TrainError::Other(format!("overlapped schedule: {e}")))?;
    let roles = std::mem::take(&mut prog.roles);
    let c = routes.width();
    let RankModel { vision, audio, llm } = model;
    let (mut vision, mut audio, mut llm) = (vision.as_mut(), audio.as_mut(), llm.as_mut());
    let missing = |what: &str| TrainError::Other(format!("rank {rank} holds no {what}"));
    let mut modules: Vec<Module<'_>> = Vec::new();
    for role in &roles {
        let m: Box<dyn Chunks + '_> = match role.node {
            Node::Llm => {
                let part = llm.take().ok_or_else(|| missing("LLM stage"))?;
                let run = LlmStageRun::new(part, rows, plan, norm);
                let got: Vec<usize> = run.mbs.iter().map(|m| m.mb).collect();
                if got != role.chunks {
                    return Err(TrainError::Other(format!(
                        "rank {rank}: llm microbatches {got:?} but the schedule's chunks are {:?}",
                        role.chunks
                    )));
                }
                if run.chunks() != role.model_chunks {
                    return Err(TrainError::Other(format!(
                        "rank {rank}: the llm stage holds {} model chunks but the schedule runs {}",
                        run.chunks(),
                        role.model_chunks
                    )));
                }
                Box::new(LlmChunks {
                    took: vec![Vec::new(); role.chunks.len()],
                    run,
                    plan,
                    rank,
                    role,
                    graph: &graph,
                    kinds: kinds.clone(),
                })
            }
            Node::Encoder(e) => {
                let ctx = (rows, plan, rank, c, role, &graph);
                match kinds.get(e) {
                    Some(ItemKind::Image) => {
                        let part = vision.take().ok_or_else(|| missing("vision stage"))?;
                        encoder_chunks(part, e, freeze.vision, ctx)?
                    }
                    Some(ItemKind::Clip) => {
                        let part = audio.take().ok_or_else(|| missing("audio stage"))?;
                        encoder_chunks(part, e, freeze.audio, ctx)?
                    }
                    None => return Err(missing(&format!("encoder {e}"))),
                }
            }
        };
        modules.push((role, m));
    }

    let mut mail = Mail::default();
    let steps = std::mem::take(&mut prog.steps);
    let incoming = &mut prog.incoming;
    for step in &steps {
        match step {
            Step::Exchange { send, recv } => {
                let t0 = trace.start();
                for x in send {
                    let t = mail
                        .outbox
                        .remove(x)
                        .ok_or_else(|| TrainError::Other(format!("{x:?} was never made")))?;
                    if x.peer == rank {
                        // One module of this rank to another (colocated bridge).
                        mail.put_in(*x, t)?;
                    } else {
                        world.send(&t, x.peer)?;
                    }
                }
                for x in recv {
                    receive(x, incoming, &mut mail, world, &graph, &mut modules)?;
                }
                let bridge = send
                    .iter()
                    .chain(recv)
                    .any(|x| matches!(x.msg, Msg::Embed(_) | Msg::EmbedGrad(_)));
                let what = recv.first().or(send.first()).map(|x| x.msg);
                // The model chunk where an LLM stage has several, as its passes name it.
                let chunk = |c: usize| match graph.llm_model_chunks {
                    1 => String::new(),
                    _ => format!(" c{c}"),
                };
                let name = match what {
                    Some(Msg::Embed(k)) => format!("wait fwd mb{k}"),
                    Some(Msg::Act(k, c)) => format!("wait fwd{} mb{k}", chunk(c)),
                    Some(Msg::EmbedGrad(k)) => format!("wait bwd mb{k}"),
                    Some(Msg::Grad(k, c)) => format!("wait bwd{} mb{k}", chunk(c)),
                    None => "exchange".into(),
                };
                trace.end(t0, name, if bridge { "bridge" } else { "comm" })?;
            }
            Step::Run(node, Op::Forward(j)) => {
                module_of(&mut modules, *node)?
                    .1
                    .forward(*j, &mut mail, trace)?;
            }
            Step::Run(node, Op::Backward(j)) => {
                module_of(&mut modules, *node)?
                    .1
                    .backward(*j, &mut mail, trace)?;
            }
            Step::Run(node, Op::Weight(j)) => {
                module_of(&mut modules, *node)?.1.weight(*j, trace)?;
            }
        }
    }
    for m in &modules {
        m.1.finish()?;
    }
    let unread = incoming.iter().flat_map(|i| i.values().flatten()).next();
    if let Some(x) = mail
        .outbox
        .keys()
        .chain(mail.inbox.keys())
        .chain(unread)
        .next()
    {
        return Err(TrainError::Other(format!(
            "rank {rank}: {x:?} was left over at the end of the step"
        )));
    }
    Ok(modules.iter().map(|m| m.1.loss()).sum())
}

/// Receives message `x` into the inbox. Under disjoint placement it is the next message
/// from its peer. When ranks hold several modules, a peer sends in the step's global
/// order, which may differ from the order this rank uses them: its messages are taken
/// in that order ([`super::order::RankProgram::incoming`]) until `x` has come, the others kept.
fn receive(
    x: &Xfer,
    incoming: &mut Option<HashMap<usize, VecDeque<Xfer>>>,
    mail: &mut Mail,
    world: &dyn Comm,
    graph: &Graph,
    modules: &mut [Module<'_>],
) -> Result<()> {
    let rank = world.rank();
    if mail.inbox.contains_key(x) {
        return Ok(());
    }
    if x.peer == rank {
        return Err(TrainError::Other(format!(
            "rank {rank}: {x:?} was never made"
        )));
    }
    let Some(incoming) = incoming else {
        let shape = shape_of(x, graph, rank, modules)?;
        return mail.put_in(*x, world.recv(&shape, x.peer)?);
    };
    loop {
        let next = incoming
            .get_mut(&x.peer)
            .and_then(VecDeque::pop_front)
            .ok_or_else(|| {
                TrainError::Other(format!(
                    "rank {rank}: rank {} never sends {x:?} in the step's order",
                    x.peer
                ))
            })?;
        let shape = shape_of(&next, graph, rank, modules)?;
        mail.put_in(next, world.recv(&shape, next.peer)?)?;
        if next == *x {
            return Ok(());
        }
    }
}

/// What an encoder rank's chunks run with: the batch, its plan, the rank, the bridge's
/// row width, its role and the step's graph.
type Ctx<'a> = (&'a [Row], &'a StepPlan, usize, usize, &'a Role, &'a Graph);

/// An encoder rank's chunks (encoder `e` of the graph), after checking its weights
/// train as the schedule assumes.
fn encoder_chunks<'a, P: EncoderStage>(
    part: &'a mut P,
    e: usize,
    frozen: bool,
    (rows, plan, rank, c, role, graph): Ctx<'a>,
) -> Result<Box<dyn Chunks + 'a>> {
    check_trains(part.groups(), part.encoder_trains(), frozen)?;
    let items = chunk_items(plan, P::KIND, part.groups().coord.dp, &role.chunks);
    Ok(Box::new(EncoderChunks {
        part,
        e,
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
