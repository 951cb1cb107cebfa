//! The overlapped step's schedule: 1F1B across the module graph (encoders -> LLM), as each rank's program of computes and grouped exchanges.
//!
//! A step's *chunks* are the LLM microbatch indices: an LLM replica runs its
//! microbatches, an encoder replica runs, as its chunk `k`, the images (or clips) of
//! microbatch `k` it encodes. Every stage runs its chunks in 1F1B with a warm-up as deep
//! as the stages left to the end of the graph: the LLM's stage `s` of `P` runs `P - s - 1`
//! forwards ahead (Megatron's 1F1B), an encoder's stage `s` of `E` runs `E - s - 1 + L`
//! (`L`: the LLM's lead, `P` here), so an encoder encodes later chunks while the LLM
//! works on earlier ones, and a stage holds at most `depth` chunks' activations (what
//! the planner counts).
//!
//! With `V` model chunks per LLM stage (`parallel.llm.virtual_stages`), the LLM's stages
//! run the interleaved 1F1B of [`braid_balancer::pipeline`], messages name the receiving
//! stage's model chunk, and the last stage's chunk `c` feeds the first stage's `c + 1`.
//! A stage holds at most its warm-up and one chunks' activations. The order is the
//! phased step's over the step's chunk ids, with the ids a replica does not run left
//! out (the phased step numbers a replica's own microbatches; the two differ only where
//! a replica skips an id, and both are deadlock-free). The first stage takes about
//! `2 P` chunks' embeddings before it sends a grad back, so an encoder's lead `L` is
//! that ([`braid_balancer::pipeline::feeder_lead`]); with less it would wait for a grad
//! the LLM sends only after an embedding the encoder has not made.
//!
//! Messages go in grouped exchanges: the sends a compute produced are posted together
//! with the receives the next compute needs (Megatron's `send_forward_recv_backward`).
//! The tests run every program of one model chunk per stage with *rendezvous* sends (a
//! send completes only when its receive is posted), so the order cannot deadlock on a
//! transport that needs an exchange posted as one group (NCCL's
//! `ncclGroupStart/End`), and check that each pair of ranks exchanges its messages in
//! one order. Interleaved stages need buffered sends, as the phased interleaved step
//! does (a rendezvous would need Megatron's four-way exchange of a forward's and a
//! backward's messages at once); the tests run those with buffered sends. Today's
//! executor ([`super::overlapped`]) runs an exchange as its sends, then its receives:
//! Braid's transports never make a send wait for the receiver (NCCL's through a thread
//! per channel, `braid_comm`'s `nccl/p2p.rs`).
//!
//! That is a rank's program under disjoint placement, where it holds one module. A
//! colocated rank holds a stage of every module; [`super::order`] merges their programs
//! into one global order.

use braid_bridge::Routes;
use braid_comm::grid::Grid;

use braid_balancer::pipeline::{feeder_lead, interleaved_1f1b};
use braid_balancer::zero_bubble::{SplitPass, zero_bubble};

use super::schedule::Op;

/// What a message carries, and of which chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Msg {
    /// A stage's output to the next stage of its module: (chunk, the receiving stage's
    /// model chunk). Model chunks are the LLM's interleaved virtual stages (0 elsewhere):
    /// the last stage's chunk `c` feeds the first stage's `c + 1`.
    Act(usize, usize),
    /// The grad of that output, back to the stage that sent it: (chunk, the receiving
    /// stage's model chunk).
    Grad(usize, usize),
    /// The chunk's embedding rows, an encoder's last stage -> the LLM's first (bridge).
    Embed(usize),
    /// Their grads, the LLM's first stage -> the encoder's last.
    EmbedGrad(usize),
}

/// A module of the graph: the LLM, or encoder `e` of [`Graph::encoders`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Node {
    Llm,
    Encoder(usize),
}

/// One message to or from `peer` (a world rank). `node` tells apart what one pair of
/// ranks exchanges for two modules when a rank holds several (colocated placement): a
/// stage's activations and grads are its module's, a bridge message its encoder's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Xfer {
    pub peer: usize,
    pub node: Node,
    pub msg: Msg,
}

/// One step of a rank's program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Sends and receives posted together (one NCCL group): the previous compute's
    /// outputs and the next compute's inputs.
    Exchange { send: Vec<Xfer>, recv: Vec<Xfer> },
    /// A forward or backward of module `Node`'s pass `p` ([`Role::pass`]).
    Run(Node, Op),
}

/// One rank's place in the graph for one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Role {
    /// The module, and this rank's pipeline stage and replica in its grid: the ranks of
    /// one (module, stage, replica) run the same computes, together (their TP and CP
    /// collectives).
    pub node: Node,
    pub stage: usize,
    pub replica: usize,
    /// The chunks this rank runs, ascending (ids below `of`).
    pub chunks: Vec<usize>,
    /// The step's chunk count: every rank orders its work by the same chunk ids, those it
    /// does not run taken as empty (no compute, no messages), so that all ranks' 1F1B
    /// orders line up however the items fall (without it an encoder with few chunks
    /// runs far ahead and a rendezvous send can deadlock).
    pub of: usize,
    /// Stages from this one to the end of the graph (1 on the LLM's last stage); an
    /// encoder's counts the microbatches the LLM needs ahead
    /// ([`braid_balancer::pipeline::feeder_lead`]) as its stages.
    pub depth: usize,
    /// Model chunks on this stage: the LLM's virtual stages
    /// (`parallel.llm.virtual_stages`, interleaved 1F1B), 1 on an encoder's.
    pub model_chunks: usize,
    /// Whether this stage runs backwards (a frozen encoder's stages do not).
    pub backward: bool,
    /// The LLM's backward split for zero-bubble pipelining (`parallel.llm.zero_bubble`):
    /// its weight gradients in passes of their own ([`Op::Weight`]).
    pub split_backward: bool,
    /// Per pass `p = c * chunks.len() + j` (model chunk `c`, chunk `chunks[j]`): what its
    /// forward receives and sends, what its backward receives and sends.
    pub fwd_in: Vec<Vec<Xfer>>,
    pub fwd_out: Vec<Vec<Xfer>>,
    pub bwd_in: Vec<Vec<Xfer>>,
    pub bwd_out: Vec<Vec<Xfer>>,
}

impl Role {
    /// The order of this stage's passes ([`Role::pass`] numbers): over all the step's
    /// chunk ids, keeping the chunks this rank runs, the LLM's stage in (interleaved)
    /// 1F1B, an encoder's stage in 1F1B with `depth - 1` warm-up forwards (or forwards
    /// only).
    pub fn ops(&self) -> Vec<Op> {
        match self.node {
            Node::Llm if self.backward => llm_pass_order(
                &self.chunks,
                self.of,
                (self.stage, self.stage + self.depth),
                self.model_chunks,
                self.split_backward,
            ),
            Node::Llm => pass_order(
                &self.chunks,
                self.of,
                (self.stage, self.stage + self.depth),
                self.model_chunks,
                false,
            ),
            Node::Encoder(_) => {
                pass_order(&self.chunks, self.of, (0, self.depth), 1, self.backward)
            }
        }
    }

    /// The pass number of model chunk `c` on chunk position `j` (into `fwd_in` and the
    /// others, and what [`Op`] carries).
    pub fn pass(&self, c: usize, j: usize) -> usize {
        c * self.chunks.len() + j
    }

    /// Pass `p`'s (model chunk, position in `chunks`).
    pub fn unpass(&self, p: usize) -> (usize, usize) {
        let n = self.chunks.len().max(1);
        (p / n, p % n)
    }

    /// The program: each compute preceded by one exchange of the previous compute's
    /// sends and its own receives; a last exchange sends what the last compute made.
    pub fn program(&self) -> Vec<Step> {
        assemble(self.ops().into_iter().map(|op| (self, op)))
    }
}

/// A rank's program from its computes in order, each `(role, op)` of one of its roles:
/// each compute preceded by one exchange of the previous compute's sends and its own
/// receives; a last exchange sends what the last compute made.
pub fn assemble<'a>(passes: impl IntoIterator<Item = (&'a Role, Op)>) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut pending: Vec<Xfer> = Vec::new();
    for (role, op) in passes {
        const NONE: &Vec<Xfer> = &Vec::new();
        let (recv, out) = match op {
            Op::Forward(j) => (&role.fwd_in[j], &role.fwd_out[j]),
            Op::Backward(j) => (&role.bwd_in[j], &role.bwd_out[j]),
            // A weight pass neither receives nor sends.
            Op::Weight(_) => (NONE, NONE),
        };
        if !pending.is_empty() || !recv.is_empty() {
            steps.push(Step::Exchange {
                send: std::mem::take(&mut pending),
                recv: recv.clone(),
            });
        }
        steps.push(Step::Run(role.node, op));
        pending = out.clone();
    }
    if !pending.is_empty() {
        steps.push(Step::Exchange {
            send: pending,
            recv: Vec::new(),
        });
    }
    steps
}

/// A stage's passes over `chunks` (ascending ids below `of`) with `v` model chunks, as
/// pass numbers `c * chunks.len() + j` ([`Role::pass`]): stage `stage` of `stages`'
/// (interleaved) 1F1B over all `of` chunk ids (forwards only without `backward`),
/// keeping the chunks it runs. Every stage of a pipeline keeps the same ids, so their
/// orders still line up.
pub fn pass_order(
    chunks: &[usize],
    of: usize,
    (stage, stages): (usize, usize),
    v: usize,
    backward: bool,
) -> Vec<Op> {
    let n = chunks.len();
    interleaved_1f1b(stage, stages, v, of, backward)
        .into_iter()
        .filter_map(|p| {
            let j = chunks.binary_search(&p.mb).ok()?;
            let i = p.chunk * n + j;
            Some(if p.forward {
                Op::Forward(i)
            } else {
                Op::Backward(i)
            })
        })
        .collect()
}

/// The LLM stage's passes as [`pass_order`] gives them, or with `split` in the
/// zero-bubble order ([`zero_bubble`], one model chunk a stage) over all `of` chunk ids,
/// keeping the chunks it runs.
pub fn llm_pass_order(
    chunks: &[usize],
    of: usize,
    (stage, stages): (usize, usize),
    v: usize,
    split: bool,
) -> Vec<Op> {
    if !split {
        return pass_order(chunks, of, (stage, stages), v, true);
    }
    split_ops(chunks, &zero_bubble(stage, stages, of))
}

/// A stage's zero-bubble `order` over all the step's chunk ids
/// ([`braid_balancer::zero_bubble`]), keeping the `chunks` it runs, as passes.
pub fn split_ops(chunks: &[usize], order: &[SplitPass]) -> Vec<Op> {
    order
        .iter()
        .filter_map(|&p| {
            let (k, op): (usize, fn(usize) -> Op) = match p {
                SplitPass::Forward(k) => (k, Op::Forward),
                SplitPass::Backward(k) => (k, Op::Backward),
                SplitPass::Weight(k) => (k, Op::Weight),
            };
            chunks.binary_search(&k).ok().map(op)
        })
        .collect()
}

/// An encoder of the graph.
#[derive(Clone, Debug)]
pub struct EncoderNode {
    pub grid: Grid,
    /// The encoder's own weights train: every stage runs backward.
    pub trains: bool,
    /// The encoder or its projector trains: the last stage runs backward.
    pub branch_trains: bool,
}

impl EncoderNode {
    /// Whether pipeline stage `stage` runs backwards: the last (with the projector) when
    /// the branch trains, the others when the encoder's own weights do.
    pub fn backward_at(&self, stage: usize) -> bool {
        if stage + 1 == self.grid.dims.pp {
            self.branch_trains
        } else {
            self.trains
        }
    }
}

/// The graph of one step: the modules' grids, which chunks each replica runs, and the
/// bridge's routes of each chunk's items.
#[derive(Clone, Debug)]
pub struct Graph {
    pub llm: Grid,
    /// Model chunks per LLM stage (`parallel.llm.virtual_stages`; 1: plain 1F1B).
    pub llm_model_chunks: usize,
    /// The LLM's backward split for zero-bubble pipelining (`parallel.llm.zero_bubble`).
    pub llm_split_backward: bool,
    pub encoders: Vec<EncoderNode>,
    /// Per LLM replica, its chunks ascending.
    pub llm_chunks: Vec<Vec<usize>>,
    /// Per encoder, per replica, its chunks ascending.
    pub encoder_chunks: Vec<Vec<Vec<usize>>>,
    /// Per chunk id (`0..` the step's chunk count), per encoder: the routes of that
    /// encoder's items of the chunk ([`Routes::subset`]); `None` without items. One
    /// table per encoder, so that a rank holding two encoders' last stages (colocated)
    /// sends each encoder's rows after its own compute.
    pub bridges: Vec<Vec<Option<Routes>>>,
}

fn xfers(peers: impl IntoIterator<Item = usize>, node: Node, msg: Msg) -> Vec<Xfer> {
    peers
        .into_iter()
        .map(|peer| Xfer { peer, node, msg })
        .collect()
}

impl Graph {
    /// Encoder `e`'s routes of chunk `k`, if it has items there.
    pub fn bridge(&self, k: usize, e: usize) -> Option<&Routes> {
        self.bridges
            .get(k)
            .and_then(|b| b.get(e))
            .and_then(Option::as_ref)
    }

    /// The chunks an encoder's last stage runs ahead of the LLM's first: what the LLM's
    /// first stage forwards through its chunk 0 before each backward
    /// ([`feeder_lead`]; its 1F1B's stages, about twice that interleaved), or it would
    /// wait on an encoder that waits for its grads.
    pub fn encoder_lead(&self) -> usize {
        feeder_lead(
            self.llm.dims.pp,
            self.llm_model_chunks.max(1),
            self.bridges.len(),
        )
    }

    /// `rank`'s one role (disjoint placement: one module per rank).
    pub fn role(&self, rank: usize) -> Result<Role, String> {
        let mut roles = self.roles(rank)?;
        match roles.len() {
            1 => Ok(roles.remove(0)),
            n => Err(format!(
                "rank {rank} holds {n} modules; its program comes from the step's global order"
            )),
        }
    }

    /// `rank`'s roles: the LLM's first, then each encoder's, for the modules it holds
    /// (one under disjoint placement, several colocated).
    pub fn roles(&self, rank: usize) -> Result<Vec<Role>, String> {
        let mut roles = Vec::new();
        if self.llm.coord(rank).is_some() {
            roles.push(self.llm_role(rank)?);
        }
        for e in 0..self.encoders.len() {
            if self.encoders[e].grid.coord(rank).is_some() {
                roles.push(self.encoder_role(rank, e)?);
            }
        }
        if roles.is_empty() {
            return Err(format!("rank {rank} holds no module of the graph"));
        }
        Ok(roles)
    }

    fn empty_role(&self, node: Node, stage: usize, replica: usize) -> Role {
        Role {
            node,
            stage,
            replica,
            chunks: Vec::new(),
            of: self.bridges.len(),
            depth: 0,
            model_chunks: 1,
            backward: true,
            split_backward: false,
            fwd_in: Vec::new(),
            fwd_out: Vec::new(),
            bwd_in: Vec::new(),
            bwd_out: Vec::new(),
        }
    }

    fn llm_role(&self, rank: usize) -> Result<Role, String> {
        let g = &self.llm;
        let c = g
            .coord(rank)
            .ok_or_else(|| format!("rank {rank} holds no LLM stage"))?;
        let node = Node::Llm;
        let (stages, v) = (g.dims.pp, self.llm_model_chunks.max(1));
        // The stage `d` steps away round the ring (the model's chunks go round it `v`
        // times: the last stage's chunk `c` feeds the first stage's `c + 1`).
        let ring = |d: isize| {
            let to = (c.pp as isize + d).rem_euclid(stages as isize);
            neighbor(g, rank, to - c.pp as isize)
        };
        let (first, last) = (c.pp == 0, c.pp + 1 == stages);
        let mut role = self.empty_role(node, c.pp, c.dp);
        role.chunks = self.llm_chunks.get(c.dp).cloned().unwrap_or_default();
        role.depth = stages - c.pp;
        role.model_chunks = v;
        role.split_backward = self.llm_split_backward;
        for m in 0..v {
            let (model_first, model_last) = (first && m == 0, last && m + 1 == v);
            // The model chunk a message to the next (previous) stage feeds there.
            let (next_chunk, prev_chunk) =
                (m + usize::from(last), m.wrapping_sub(usize::from(first)));
            for &k in &role.chunks {
                // The bridge's messages, encoder by encoder.
                let bridge = |to_llm: bool| -> Vec<Xfer> {
                    (0..self.encoders.len())
                        .flat_map(|e| {
                            let b = self.bridge(k, e);
                            let peers: Vec<usize> = match (b, to_llm) {
                                (None, _) => Vec::new(),
                                (Some(b), true) => {
                                    b.forward_sources(rank).into_iter().map(|p| p.0).collect()
                                }
                                (Some(b), false) => b.backward_targets(rank),
                            };
                            let msg = if to_llm {
                                Msg::Embed(k)
                            } else {
                                Msg::EmbedGrad(k)
                            };
                            xfers(peers, Node::Encoder(e), msg)
                        })
                        .collect()
                };
                role.fwd_in.push(if model_first {
                    bridge(true)
                } else {
                    xfers([ring(-1)?], node, Msg::Act(k, m))
                });
                role.fwd_out.push(if model_last {
                    Vec::new()
                } else {
                    xfers([ring(1)?], node, Msg::Act(k, next_chunk))
                });
                role.bwd_in.push(if model_last {
                    Vec::new()
                } else {
                    xfers([ring(1)?], node, Msg::Grad(k, m))
                });
                role.bwd_out.push(if model_first {
                    bridge(false)
                } else {
                    xfers([ring(-1)?], node, Msg::Grad(k, prev_chunk))
                });
            }
        }
        Ok(role)
    }

    fn encoder_role(&self, rank: usize, e: usize) -> Result<Role, String> {
        let enc = &self.encoders[e];
        let g = &enc.grid;
        let c = g
            .coord(rank)
            .ok_or_else(|| format!("rank {rank} holds no stage of encoder {e}"))?;
        let node = Node::Encoder(e);
        let neighbor = |d: isize| neighbor(g, rank, d);
        let stages = g.dims.pp;
        let (first, last) = (c.pp == 0, c.pp + 1 == stages);
        let mut role = self.empty_role(node, c.pp, c.dp);
        role.chunks = self.encoder_chunks[e]
            .get(c.dp)
            .cloned()
            .unwrap_or_default();
        role.depth = stages - c.pp + self.encoder_lead();
        role.backward = enc.backward_at(c.pp);
        for &k in &role.chunks {
            let b = self.bridge(k, e);
            role.fwd_in.push(if first {
                Vec::new()
            } else {
                xfers([neighbor(-1)?], node, Msg::Act(k, 0))
            });
            role.fwd_out.push(if last {
                let to = b.map(|b| b.forward_targets(rank)).unwrap_or_default();
                xfers(to, node, Msg::Embed(k))
            } else {
                xfers([neighbor(1)?], node, Msg::Act(k, 0))
            });
            role.bwd_in.push(match (role.backward, last) {
                (false, _) => Vec::new(),
                (true, true) => {
                    let src = b.map(|b| b.backward_sources(rank)).unwrap_or_default();
                    xfers(src.into_iter().map(|p| p.0), node, Msg::EmbedGrad(k))
                }
                (true, false) => xfers([neighbor(1)?], node, Msg::Grad(k, 0)),
            });
            role.bwd_out.push(if role.backward && enc.trains && !first {
                xfers([neighbor(-1)?], node, Msg::Grad(k, 0))
            } else {
                Vec::new()
            });
        }
        Ok(role)
    }
}

/// `rank`'s pipeline neighbour `d` stages on in grid `g`.
fn neighbor(g: &Grid, rank: usize, d: isize) -> Result<usize, String> {
    g.pp_neighbor(rank, d)
        .ok_or_else(|| format!("rank {rank} has no pipeline neighbour {d}"))
}

#[cfg(test)]
#[path = "graph_tests.rs"]
pub(crate) mod tests;
