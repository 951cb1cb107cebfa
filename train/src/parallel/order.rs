//! The overlapped step's global order, for ranks that hold several modules (colocated placement): every stage replica's passes in one sequence, each rank running its own in that order, so one rank interleaves its modules' 1F1B programs without deadlock.
//!
//! A *gang* is the ranks of one (module, pipeline stage, replica): they run the same
//! computes together (their TP and CP collectives). Each gang keeps its own 1F1B order
//! ([`Role::ops`]), exactly as under disjoint placement. The global sequence takes, round
//! after round, the next pass of every gang whose inputs earlier rounds made (the LLM's
//! gangs first, so a rank's encoder passes fill the rounds its LLM stage waits): a
//! message sent in one round is used in the next, so a round is like a tick of time,
//! each rank running about one pass of each of its modules per round. (Taking a message
//! in the round it is sent instead lets a microbatch's forward run through every stage
//! in one round; the planner's simulations of the reference workloads were up to 20 %
//! slower with it.)
//! It is built from the gangs' chunks and the bridge's routes alone, and a rank reads
//! only its own roles' messages: about 0.06 s a step at 1,024 ranks with 64 chunks,
//! where building every rank's roles took 1 s (the tests check the two agree).
//! Each rank's program is its passes in that sequence, each preceded by one exchange of
//! the previous pass's sends and its own receives, as in [`Role::program`].
//!
//! Why no rank waits forever. The premises: sends never wait for the receiver (Braid's
//! transports buffer them), an exchange posts its sends before its receives, messages
//! between two ranks arrive in the order sent, and a pass's collectives stay within its
//! gang (the gradient sync runs after the step). Take the first pass of the sequence some
//! rank has not finished. Every member of its gang has finished its own earlier passes
//! (they come earlier in the sequence), so all of them reach it; every input it needs
//! was made by an earlier pass and sent in the exchange after it, which its sender
//! reached without waiting. Messages between two ranks may arrive in another order than the receiver uses
//! them (one rank's two modules talk to another's two), so [`RankProgram::incoming`]
//! gives, per peer, the order that peer sends in, and the receiver takes them in that
//! order, keeping the ones it needs later.

use std::collections::{HashMap, HashSet, VecDeque};

use super::graph::{Graph, Msg, Node, Role, Step, Xfer, assemble, pass_order, split_ops};
use super::schedule::Op;
use braid_balancer::zero_bubble::zero_bubble_orders;

/// One rank's part of the global order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankProgram {
    /// Its roles, one per module it holds (as [`Graph::roles`]).
    pub roles: Vec<Role>,
    pub steps: Vec<Step>,
    /// When ranks hold several modules: per peer, the messages that peer sends this
    /// rank, in the order it sends them (`peer` of each is the sender). `None` under
    /// disjoint placement, where a FIFO transport delivers them in the order the program
    /// receives them.
    pub incoming: Option<HashMap<usize, VecDeque<Xfer>>>,
}

/// A gang: (module, pipeline stage, replica).
type GangKey = (Node, usize, usize);

/// What a pass computes: a forward, a backward, or (zero-bubble pipelining) the weight
/// gradients a backward left.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Dir {
    Fwd,
    Bwd,
    Wgt,
}

/// One pass: its gang, chunk id, model chunk (the LLM's virtual stage; 0 elsewhere) and
/// what it computes.
type Pass = (GangKey, usize, usize, Dir);

/// A gang's chunks (ascending ids) and its 1F1B order over them ([`Role::pass`]
/// numbers).
struct Gang {
    key: GangKey,
    chunks: Vec<usize>,
    ops: Vec<Op>,
}

/// Every gang of the graph, LLM first, then by module, stage and replica.
fn gangs(graph: &Graph) -> Vec<Gang> {
    let of = graph.bridges.len();
    let (llm_pp, v) = (graph.llm.dims.pp, graph.llm_model_chunks.max(1));
    let lead = graph.encoder_lead();
    let mut out = Vec::new();
    // Split, every stage's order from one run of the pipeline.
    let split = graph
        .llm_split_backward
        .then(|| zero_bubble_orders(llm_pp, of));
    for s in 0..llm_pp {
        for (d, chunks) in graph.llm_chunks.iter().enumerate() {
            let ops = match split.as_ref().and_then(|o| o.get(s)) {
                Some(order) => split_ops(chunks, order),
                None => pass_order(chunks, of, (s, llm_pp), v, true),
            };
            out.push(Gang {
                key: (Node::Llm, s, d),
                chunks: chunks.clone(),
                ops,
            });
        }
    }
    for (e, enc) in graph.encoders.iter().enumerate() {
        let pp = enc.grid.dims.pp;
        for s in 0..pp {
            let backward = enc.backward_at(s);
            for (r, chunks) in graph.encoder_chunks[e].iter().enumerate() {
                let ops = pass_order(chunks, of, (0, pp - s + lead), 1, backward);
                out.push(Gang {
                    key: (Node::Encoder(e), s, r),
                    chunks: chunks.clone(),
                    ops,
                });
            }
        }
    }
    out.sort_by_key(|g| g.key);
    out
}

/// The bridge's dependencies between gangs, per chunk: which encoder replicas' last-stage
/// forwards each LLM replica's first stage receives from (`fwd[k]`: (llm replica,
/// encoder, encoder replica)), and which LLM replicas' first-stage backwards send grads
/// to each encoder replica's last stage (`bwd[k]`: (encoder, encoder replica, llm
/// replica)), from the routes as [`braid_bridge::Routes::forward_sources`] and
/// [`braid_bridge::Routes::backward_targets`] read them.
type Links = Vec<HashSet<(usize, usize, usize)>>;

fn bridge_links(graph: &Graph) -> Result<(Links, Links), String> {
    let chunks = graph.bridges.len();
    let (mut fwd, mut bwd) = (vec![HashSet::new(); chunks], vec![HashSet::new(); chunks]);
    let llm_replica = |rank: usize| {
        graph
            .llm
            .coord(rank)
            .map(|c| c.dp)
            .ok_or_else(|| format!("bridge rank {rank} holds no LLM stage"))
    };
    for k in 0..chunks {
        for (e, enc) in graph.encoders.iter().enumerate() {
            let Some(routes) = graph.bridge(k, e) else {
                continue;
            };
            let replica = |rank: usize| {
                enc.grid
                    .coord(rank)
                    .map(|c| c.dp)
                    .ok_or_else(|| format!("bridge rank {rank} holds no stage of encoder {e}"))
            };
            for item in routes.items() {
                for dst in item.dst.iter().filter(|d| !d.rows.is_empty()) {
                    let d = llm_replica(dst.rank)?;
                    fwd[k].insert((d, e, replica(item.src)?));
                    if dst.grad {
                        for &g in &item.grad_to {
                            bwd[k].insert((e, replica(g)?, d));
                        }
                    }
                }
            }
        }
    }
    Ok((fwd, bwd))
}

/// The pass before `(key, k, c, dir)` in its module, round the LLM's ring of model
/// chunks: the stage before (forward) or after (backward), the last stage's chunk
/// `c - 1` before the first stage's `c` (forward; backward the other way); `None` at
/// the module's ends and for a weight pass (its backward is its own gang's).
fn module_neighbor(graph: &Graph, (key, k, c, dir): Pass) -> Option<Pass> {
    let (node, s, r) = key;
    let (stages, v) = match node {
        Node::Llm => (graph.llm.dims.pp, graph.llm_model_chunks.max(1)),
        Node::Encoder(e) => (graph.encoders.get(e).map_or(1, |x| x.grid.dims.pp), 1),
    };
    let (s, c) = match dir {
        Dir::Fwd if s > 0 => (s - 1, c),
        Dir::Fwd if c > 0 => (stages - 1, c - 1),
        Dir::Bwd if s + 1 < stages => (s + 1, c),
        Dir::Bwd if c + 1 < v => (0, c + 1),
        _ => return None,
    };
    Some(((node, s, r), k, c, dir))
}

/// The passes pass `(key, k, c, dir)` waits for: the same chunk on the stage before
/// (forward) or after (backward), round the ring of model chunks
/// ([`module_neighbor`]), and across the bridge (the LLM's first stage's chunk 0).
fn inputs(graph: &Graph, links: &(Links, Links), pass: Pass) -> Vec<Pass> {
    let ((node, s, r), k, c, dir) = pass;
    let stages = match node {
        Node::Llm => graph.llm.dims.pp,
        Node::Encoder(e) => graph.encoders.get(e).map_or(1, |x| x.grid.dims.pp),
    };
    let mut out: Vec<Pass> = module_neighbor(graph, pass).into_iter().collect();
    match (node, dir) {
        (Node::Llm, Dir::Fwd) if s == 0 && c == 0 => {
            let from = links.0.get(k).into_iter().flatten();
            out.extend(from.filter(|l| l.0 == r).map(|&(_, e, er)| {
                let last = graph.encoders[e].grid.dims.pp - 1;
                ((Node::Encoder(e), last, er), k, 0, Dir::Fwd)
            }));
        }
        (Node::Encoder(e), Dir::Bwd) if s + 1 == stages => {
            let from = links.1.get(k).into_iter().flatten();
            out.extend(
                from.filter(|l| l.0 == e && l.1 == r)
                    .map(|&(_, _, d)| ((Node::Llm, 0, d), k, 0, Dir::Bwd)),
            );
        }
        _ => {}
    }
    out
}

/// The step's global sequence of passes: round after round, every gang's next pass
/// whose inputs earlier rounds sequenced (gangs in [`gangs`]' order).
fn sequence(graph: &Graph) -> Result<Vec<Pass>, String> {
    let gangs = gangs(graph);
    let links = bridge_links(graph)?;
    let pass_of = |g: &Gang, op: Op| {
        let (p, dir) = match op {
            Op::Forward(p) => (p, Dir::Fwd),
            Op::Backward(p) => (p, Dir::Bwd),
            Op::Weight(p) => (p, Dir::Wgt),
        };
        let n = g.chunks.len().max(1);
        (g.key, g.chunks[p % n], p / n, dir)
    };
    let total: usize = gangs.iter().map(|g| g.ops.len()).sum();
    let mut done: HashSet<Pass> = HashSet::with_capacity(total);
    let mut next = vec![0usize; gangs.len()];
    let mut seq = Vec::with_capacity(total);
    while seq.len() < total {
        let before = seq.len();
        // A round sees only what earlier rounds sequenced: a message sent in one round is
        // received in the next.
        for (gi, g) in gangs.iter().enumerate() {
            let Some(&op) = g.ops.get(next[gi]) else {
                continue;
            };
            let pass = pass_of(g, op);
            if inputs(graph, &links, pass).iter().all(|p| done.contains(p)) {
                seq.push(pass);
                next[gi] += 1;
            }
        }
        done.extend(seq[before..].iter().copied());
        if seq.len() == before {
            let waiting: Vec<String> = gangs
                .iter()
                .zip(&next)
                .filter_map(|(g, &n)| g.ops.get(n).map(|op| format!("{:?} at {op:?}", g.key)))
                .collect();
            return Err(format!(
                "the overlapped order is stuck: {}",
                waiting.join("; ")
            ));
        }
    }
    Ok(seq)
}

/// The pass that sends message `x` to `role`'s rank (`x.peer` the sender).
fn producer(graph: &Graph, role: &Role, x: &Xfer) -> Result<Pass, String> {
    let replica_in = |grid: &braid_comm::grid::Grid| {
        grid.coord(x.peer)
            .map(|c| (c.pp, c.dp))
            .ok_or_else(|| format!("{x:?}: rank {} is outside its module", x.peer))
    };
    let along = |k: usize, c: usize, dir: Dir| {
        let this = ((x.node, role.stage, role.replica), k, c, dir);
        module_neighbor(graph, this).ok_or_else(|| format!("{x:?}: no stage sends it"))
    };
    Ok(match (x.msg, x.node) {
        (Msg::Act(k, c), _) => along(k, c, Dir::Fwd)?,
        (Msg::Grad(k, c), _) => along(k, c, Dir::Bwd)?,
        (Msg::Embed(k), Node::Encoder(e)) => {
            let grid = &graph.encoders.get(e).ok_or("no such encoder")?.grid;
            let (pp, dp) = replica_in(grid)?;
            ((Node::Encoder(e), pp, dp), k, 0, Dir::Fwd)
        }
        (Msg::EmbedGrad(k), Node::Encoder(_)) => {
            let (pp, dp) = replica_in(&graph.llm)?;
            ((Node::Llm, pp, dp), k, 0, Dir::Bwd)
        }
        (_, Node::Llm) => return Err(format!("{x:?}: a bridge message without its encoder")),
    })
}

/// `rank`'s program under the global order, built from the gangs' sequence and this
/// rank's own roles only (no other rank's routes are read).
fn colocated_program(graph: &Graph, rank: usize) -> Result<RankProgram, String> {
    let roles = graph.roles(rank)?;
    let seq = sequence(graph)?;
    let at: HashMap<Pass, usize> = seq.iter().enumerate().map(|(i, &p)| (p, i)).collect();
    let mine: HashMap<GangKey, usize> = roles
        .iter()
        .enumerate()
        .map(|(i, r)| ((r.node, r.stage, r.replica), i))
        .collect();
    let mut passes = Vec::new();
    for &(key, k, c, dir) in &seq {
        let Some(&i) = mine.get(&key) else {
            continue;
        };
        let role = &roles[i];
        let j = role
            .chunks
            .binary_search(&k)
            .map_err(|_| format!("rank {rank}: {key:?} chunk {k} is not in its role"))?;
        let p = role.pass(c, j);
        let op = match dir {
            Dir::Fwd => Op::Forward(p),
            Dir::Bwd => Op::Backward(p),
            Dir::Wgt => Op::Weight(p),
        };
        passes.push((role, op));
    }
    let steps = assemble(passes);
    // Each peer sends in the order its producing passes come in the sequence (one pass's
    // messages to this rank in its module order).
    let mut from: HashMap<usize, Vec<(usize, Node, Xfer)>> = HashMap::new();
    for role in &roles {
        for x in role.fwd_in.iter().chain(&role.bwd_in).flatten() {
            if x.peer == rank {
                continue;
            }
            let p = producer(graph, role, x)?;
            let i = *at
                .get(&p)
                .ok_or_else(|| format!("rank {rank}: {x:?} comes from {p:?}, which never runs"))?;
            from.entry(x.peer).or_default().push((i, x.node, *x));
        }
    }
    let incoming = from
        .into_iter()
        .map(|(peer, mut xs)| {
            xs.sort_by_key(|x| (x.0, x.1));
            (peer, xs.into_iter().map(|x| x.2).collect())
        })
        .collect();
    Ok(RankProgram {
        roles,
        steps,
        incoming: Some(incoming),
    })
}

/// Whether some rank holds several modules (their grids overlap: colocated placement).
pub fn shares_ranks(graph: &Graph) -> bool {
    let spans: Vec<(usize, usize)> = std::iter::once(&graph.llm)
        .chain(graph.encoders.iter().map(|e| &e.grid))
        .map(|g| (g.offset, g.offset + g.size()))
        .collect();
    spans
        .iter()
        .enumerate()
        .any(|(i, a)| spans[i + 1..].iter().any(|b| a.0 < b.1 && b.0 < a.1))
}

/// `rank`'s program. Under disjoint placement, its one role's own program (no global
/// order needed: each pair of ranks then exchanges its messages in one order). When
/// some rank holds several modules, its part of the global order: a peer's sends then
/// follow that order, which this rank must know to receive them.
pub fn rank_program(graph: &Graph, world: usize, rank: usize) -> Result<RankProgram, String> {
    if !shares_ranks(graph) {
        let role = graph.role(rank)?;
        return Ok(RankProgram {
            steps: role.program(),
            roles: vec![role],
            incoming: None,
        });
    }
    if rank >= world {
        return Err(format!("rank {rank} is outside the world of {world}"));
    }
    colocated_program(graph, rank)
}

#[cfg(test)]
#[path = "order_tests.rs"]
pub(crate) mod tests;
