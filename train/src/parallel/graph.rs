//! The overlapped step's schedule: 1F1B across the module graph (encoders -> LLM), as each rank's program of computes and grouped exchanges.
//!
//! A step's *chunks* are the LLM microbatch indices: an LLM replica runs its
//! microbatches, an encoder replica runs, as its chunk `k`, the images (or clips) of
//! microbatch `k` it encodes. Every stage runs its chunks in 1F1B with a warm-up as deep
//! as the stages left to the end of the graph: the LLM's stage `s` of `P` runs `P - s - 1`
//! forwards ahead (Megatron's 1F1B), an encoder's stage `s` of `E` runs `E - s - 1 + P`, so
//! an encoder encodes later chunks while the LLM works on earlier ones, and a stage holds
//! at most `depth` chunks' activations (what the planner counts).
//!
//! Messages go in grouped exchanges: the sends a compute produced are posted together
//! with the receives the next compute needs (Megatron's `send_forward_recv_backward`).
//! The tests run every program with *rendezvous* sends (a send completes only when its
//! receive is posted), so the order cannot deadlock on a transport that needs an
//! exchange posted as one group (NCCL's `ncclGroupStart/End`), and check that each pair
//! of ranks exchanges its messages in one order. Today's executor
//! ([`super::overlapped`]) runs an exchange as its sends, then its receives: the same
//! thing on Braid's transports, whose sends never wait for the receiver.
//!
//! That is a rank's program under disjoint placement, where it holds one module. A
//! colocated rank holds a stage of every module; [`super::order`] merges their programs
//! into one global order.

use braid_bridge::Routes;
use braid_comm::grid::Grid;

use super::schedule::{Op, one_f_one_b};

/// What a message carries, and of which chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Msg {
    /// A stage's output to the next stage of its module.
    Act(usize),
    /// The grad of that output, back to the stage that sent it.
    Grad(usize),
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
    /// A forward or backward of module `Node`'s chunk at this position of its role's
    /// [`Role::chunks`].
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
    /// Stages from this one to the end of the graph (1 on the LLM's last stage).
    pub depth: usize,
    /// Whether this stage runs backwards (a frozen encoder's stages do not).
    pub backward: bool,
    /// Per chunk (as in `chunks`): what its forward receives and sends, what its
    /// backward receives and sends.
    pub fwd_in: Vec<Vec<Xfer>>,
    pub fwd_out: Vec<Vec<Xfer>>,
    pub bwd_in: Vec<Vec<Xfer>>,
    pub bwd_out: Vec<Vec<Xfer>>,
}

impl Role {
    /// The order of this stage's computes, as positions in `chunks`: 1F1B over all the
    /// step's chunk ids with `depth - 1` warm-up forwards (or forwards only), keeping
    /// the chunks this rank runs.
    pub fn ops(&self) -> Vec<Op> {
        pass_order(&self.chunks, self.of, self.depth, self.backward)
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
        let (recv, out) = match op {
            Op::Forward(j) => (&role.fwd_in[j], &role.fwd_out[j]),
            Op::Backward(j) => (&role.bwd_in[j], &role.bwd_out[j]),
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

/// A stage's computes over `chunks` (ascending ids below `of`), as positions in
/// `chunks`: 1F1B over all `of` chunk ids with `depth - 1` warm-up forwards (or forwards
/// only without `backward`), keeping the chunks it runs.
pub fn pass_order(chunks: &[usize], of: usize, depth: usize, backward: bool) -> Vec<Op> {
    let all = if backward {
        one_f_one_b(0, depth, of)
    } else {
        (0..of).map(Op::Forward).collect()
    };
    let pos = |k: usize| chunks.binary_search(&k).ok();
    all.into_iter()
        .filter_map(|op| match op {
            Op::Forward(k) => pos(k).map(Op::Forward),
            Op::Backward(k) => pos(k).map(Op::Backward),
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

/// The graph of one step: the modules' grids, which chunks each replica runs, and the
/// bridge's routes of each chunk's items.
#[derive(Clone, Debug)]
pub struct Graph {
    pub llm: Grid,
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
            backward: true,
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
        let neighbor = |d: isize| neighbor(g, rank, d);
        let (first, last) = (c.pp == 0, c.pp + 1 == g.dims.pp);
        let mut role = self.empty_role(node, c.pp, c.dp);
        role.chunks = self.llm_chunks.get(c.dp).cloned().unwrap_or_default();
        role.depth = g.dims.pp - c.pp;
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
            role.fwd_in.push(if first {
                bridge(true)
            } else {
                xfers([neighbor(-1)?], node, Msg::Act(k))
            });
            role.fwd_out.push(if last {
                Vec::new()
            } else {
                xfers([neighbor(1)?], node, Msg::Act(k))
            });
            role.bwd_in.push(if last {
                Vec::new()
            } else {
                xfers([neighbor(1)?], node, Msg::Grad(k))
            });
            role.bwd_out.push(if first {
                bridge(false)
            } else {
                xfers([neighbor(-1)?], node, Msg::Grad(k))
            });
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
        role.depth = stages - c.pp + self.llm.dims.pp;
        role.backward = if last { enc.branch_trains } else { enc.trains };
        for &k in &role.chunks {
            let b = self.bridge(k, e);
            role.fwd_in.push(if first {
                Vec::new()
            } else {
                xfers([neighbor(-1)?], node, Msg::Act(k))
            });
            role.fwd_out.push(if last {
                let to = b.map(|b| b.forward_targets(rank)).unwrap_or_default();
                xfers(to, node, Msg::Embed(k))
            } else {
                xfers([neighbor(1)?], node, Msg::Act(k))
            });
            role.bwd_in.push(match (role.backward, last) {
                (false, _) => Vec::new(),
                (true, true) => {
                    let src = b.map(|b| b.backward_sources(rank)).unwrap_or_default();
                    xfers(src.into_iter().map(|p| p.0), node, Msg::EmbedGrad(k))
                }
                (true, false) => xfers([neighbor(1)?], node, Msg::Grad(k)),
            });
            role.bwd_out.push(if role.backward && enc.trains && !first {
                xfers([neighbor(-1)?], node, Msg::Grad(k))
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
