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

/// One message to or from `peer` (a world rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Xfer {
    pub peer: usize,
    pub msg: Msg,
}

/// One step of a rank's program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Sends and receives posted together (one NCCL group): the previous compute's
    /// outputs and the next compute's inputs.
    Exchange { send: Vec<Xfer>, recv: Vec<Xfer> },
    /// A forward or backward of the chunk at this position of [`Role::chunks`].
    Run(Op),
}

/// One rank's place in the graph for one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Role {
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
        let all = if self.backward {
            one_f_one_b(0, self.depth, self.of)
        } else {
            (0..self.of).map(Op::Forward).collect()
        };
        let pos = |k: usize| self.chunks.binary_search(&k).ok();
        all.into_iter()
            .filter_map(|op| match op {
                Op::Forward(k) => pos(k).map(Op::Forward),
                Op::Backward(k) => pos(k).map(Op::Backward),
            })
            .collect()
    }

    /// The program: each compute preceded by one exchange of the previous compute's
    /// sends and its own receives; a last exchange sends what the last compute made.
    pub fn program(&self) -> Vec<Step> {
        let mut steps = Vec::new();
        let mut pending: Vec<Xfer> = Vec::new();
        for op in self.ops() {
            let (recv, out) = match op {
                Op::Forward(j) => (&self.fwd_in[j], &self.fwd_out[j]),
                Op::Backward(j) => (&self.bwd_in[j], &self.bwd_out[j]),
            };
            if !pending.is_empty() || !recv.is_empty() {
                steps.push(Step::Exchange {
                    send: std::mem::take(&mut pending),
                    recv: recv.clone(),
                });
            }
            steps.push(Step::Run(op));
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
    /// Per chunk id (`0..` the step's chunk count): the routes of its items
    /// ([`Routes::subset`]); `None` without items.
    pub bridges: Vec<Option<Routes>>,
}

fn xfers(peers: impl IntoIterator<Item = usize>, msg: Msg) -> Vec<Xfer> {
    peers.into_iter().map(|peer| Xfer { peer, msg }).collect()
}

impl Graph {
    fn bridge(&self, k: usize) -> Option<&Routes> {
        self.bridges.get(k).and_then(Option::as_ref)
    }

    /// `rank`'s role (disjoint placement: one module per rank).
    pub fn role(&self, rank: usize) -> Result<Role, String> {
        let llm_pp = self.llm.dims.pp;
        let neighbor = |g: &Grid, d: isize| {
            g.pp_neighbor(rank, d)
                .ok_or_else(|| format!("rank {rank} has no pipeline neighbour {d}"))
        };
        let mut role = Role {
            chunks: Vec::new(),
            of: self.bridges.len(),
            depth: 0,
            backward: true,
            fwd_in: Vec::new(),
            fwd_out: Vec::new(),
            bwd_in: Vec::new(),
            bwd_out: Vec::new(),
        };
        if let Some(c) = self.llm.coord(rank) {
            let (first, last) = (c.pp == 0, c.pp + 1 == llm_pp);
            role.chunks = self.llm_chunks.get(c.dp).cloned().unwrap_or_default();
            role.depth = llm_pp - c.pp;
            for &k in &role.chunks {
                let b = self.bridge(k);
                role.fwd_in.push(if first {
                    let src = b.map(|b| b.forward_sources(rank)).unwrap_or_default();
                    xfers(src.into_iter().map(|p| p.0), Msg::Embed(k))
                } else {
                    xfers([neighbor(&self.llm, -1)?], Msg::Act(k))
                });
                role.fwd_out.push(if last {
                    Vec::new()
                } else {
                    xfers([neighbor(&self.llm, 1)?], Msg::Act(k))
                });
                role.bwd_in.push(if last {
                    Vec::new()
                } else {
                    xfers([neighbor(&self.llm, 1)?], Msg::Grad(k))
                });
                role.bwd_out.push(if first {
                    let to = b.map(|b| b.backward_targets(rank)).unwrap_or_default();
                    xfers(to, Msg::EmbedGrad(k))
                } else {
                    xfers([neighbor(&self.llm, -1)?], Msg::Grad(k))
                });
            }
            return Ok(role);
        }
        for (e, node) in self.encoders.iter().enumerate() {
            let Some(c) = node.grid.coord(rank) else {
                continue;
            };
            let stages = node.grid.dims.pp;
            let (first, last) = (c.pp == 0, c.pp + 1 == stages);
            role.chunks = self.encoder_chunks[e]
                .get(c.dp)
                .cloned()
                .unwrap_or_default();
            role.depth = stages - c.pp + llm_pp;
            role.backward = if last {
                node.branch_trains
            } else {
                node.trains
            };
            for &k in &role.chunks {
                let b = self.bridge(k);
                role.fwd_in.push(if first {
                    Vec::new()
                } else {
                    xfers([neighbor(&node.grid, -1)?], Msg::Act(k))
                });
                role.fwd_out.push(if last {
                    let to = b.map(|b| b.forward_targets(rank)).unwrap_or_default();
                    xfers(to, Msg::Embed(k))
                } else {
                    xfers([neighbor(&node.grid, 1)?], Msg::Act(k))
                });
                role.bwd_in.push(match (role.backward, last) {
                    (false, _) => Vec::new(),
                    (true, true) => {
                        let src = b.map(|b| b.backward_sources(rank)).unwrap_or_default();
                        xfers(src.into_iter().map(|p| p.0), Msg::EmbedGrad(k))
                    }
                    (true, false) => xfers([neighbor(&node.grid, 1)?], Msg::Grad(k)),
                });
                role.bwd_out
                    .push(if role.backward && node.trains && !first {
                        xfers([neighbor(&node.grid, -1)?], Msg::Grad(k))
                    } else {
                        Vec::new()
                    });
            }
            return Ok(role);
        }
        Err(format!("rank {rank} holds no module of the graph"))
    }
}

#[cfg(test)]
#[path = "graph_tests.rs"]
mod tests;
