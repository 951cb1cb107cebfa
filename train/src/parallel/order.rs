//! The overlapped step's global order, for ranks that hold several modules (colocated placement): every stage replica's passes in one sequence, each rank running its own in that order, so one rank interleaves its modules' 1F1B programs without deadlock.
//!
//! A *gang* is the ranks of one (module, pipeline stage, replica): they run the same
//! computes together (their TP and CP collectives). Each gang keeps its own 1F1B order
//! ([`Role::ops`]), exactly as under disjoint placement. The global sequence takes, round
//! after round, the next pass of every gang whose inputs earlier passes have made (the
//! LLM's gangs first, so a rank's encoder passes fill the rounds its LLM stage waits).
//! Each rank's program is its passes in that sequence, each preceded by one exchange of
//! the previous pass's sends and its own receives, as in [`Role::program`].
//!
//! Why no rank waits forever, with sends that never wait for the receiver (Braid's
//! transports): take the first pass of the sequence some rank has not finished. Every
//! member of its gang has finished its own earlier passes (they come earlier in the
//! sequence), so all of them reach it, and every input it needs was sent by an earlier
//! pass. Messages between two ranks may arrive in another order than the receiver uses
//! them (one rank's two modules talk to another's two), so [`RankProgram::incoming`]
//! gives, per peer, the order that peer sends in, and the receiver takes them in that
//! order, keeping the ones it needs later.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use super::graph::{Graph, Msg, Node, Role, Step, Xfer};
use super::schedule::Op;

/// One rank's part of the global order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankProgram {
    /// Its roles, one per module it holds (as [`Graph::roles`]).
    pub roles: Vec<Role>,
    pub steps: Vec<Step>,
    /// Per peer, the messages that peer sends this rank, in the order it sends them
    /// (`peer` of each is the sender). Empty under disjoint placement: a FIFO transport
    /// then delivers them in the order the program receives them.
    pub incoming: HashMap<usize, VecDeque<Xfer>>,
}

/// A message in flight: (sender, receiver, module, message).
type Sent = (usize, usize, Node, Msg);

/// The ranks of one (module, stage, replica) and their common pass order.
struct Gang {
    members: Vec<usize>,
    node: Node,
    ops: Vec<Op>,
}

/// Every rank's roles, the gangs, and the global sequence of passes `(gang, op)`.
type Sequence = (Vec<Vec<Role>>, Vec<Gang>, Vec<(usize, Op)>);

/// Every rank's roles, the gangs, and the global sequence of passes.
fn sequence(graph: &Graph, world: usize) -> Result<Sequence, String> {
    let roles: Vec<Vec<Role>> = (0..world)
        .map(|r| graph.roles(r))
        .collect::<Result<_, _>>()?;
    // Gangs, LLM first, then by module, stage and replica.
    let mut by_key: BTreeMap<(Node, usize, usize), Vec<usize>> = BTreeMap::new();
    for (r, rs) in roles.iter().enumerate() {
        for role in rs {
            by_key
                .entry((role.node, role.stage, role.replica))
                .or_default()
                .push(r);
        }
    }
    let role_of = |r: usize, node: Node| -> Result<&Role, String> {
        roles[r]
            .iter()
            .find(|x| x.node == node)
            .ok_or_else(|| format!("rank {r} has no {node:?} role"))
    };
    let mut gangs = Vec::new();
    for ((node, stage, replica), members) in by_key {
        let first = role_of(members[0], node)?;
        for &m in &members[1..] {
            let other = role_of(m, node)?;
            if (&other.chunks, other.depth, other.backward)
                != (&first.chunks, first.depth, first.backward)
            {
                return Err(format!(
                    "{node:?} stage {stage} replica {replica}: ranks {} and {m} disagree on their chunks",
                    members[0]
                ));
            }
        }
        gangs.push(Gang {
            ops: first.ops(),
            node,
            members,
        });
    }

    let io = |r: usize, node: Node, op: Op| -> Result<(&[Xfer], &[Xfer]), String> {
        let role = role_of(r, node)?;
        Ok(match op {
            Op::Forward(j) => (&role.fwd_in[j], &role.fwd_out[j]),
            Op::Backward(j) => (&role.bwd_in[j], &role.bwd_out[j]),
        })
    };
    let mut sent: HashSet<Sent> = HashSet::new();
    let mut next = vec![0usize; gangs.len()];
    let mut seq = Vec::new();
    let total: usize = gangs.iter().map(|g| g.ops.len()).sum();
    while seq.len() < total {
        let mut progressed = false;
        for (gi, g) in gangs.iter().enumerate() {
            let Some(&op) = g.ops.get(next[gi]) else {
                continue;
            };
            let mut ready = true;
            for &r in &g.members {
                let (inputs, _) = io(r, g.node, op)?;
                ready &= inputs
                    .iter()
                    .all(|x| sent.contains(&(x.peer, r, x.node, x.msg)));
            }
            if !ready {
                continue;
            }
            for &r in &g.members {
                for x in io(r, g.node, op)?.1 {
                    sent.insert((r, x.peer, x.node, x.msg));
                }
            }
            seq.push((gi, op));
            next[gi] += 1;
            progressed = true;
        }
        if !progressed {
            let waiting: Vec<String> = gangs
                .iter()
                .zip(&next)
                .filter_map(|(g, &n)| {
                    g.ops
                        .get(n)
                        .map(|op| format!("{:?} ranks {:?} at {op:?}", g.node, g.members))
                })
                .collect();
            return Err(format!(
                "the overlapped order is stuck: {}",
                waiting.join("; ")
            ));
        }
    }
    Ok((roles, gangs, seq))
}

/// Every rank's program under the global order (ranks `0..world`).
pub fn programs(graph: &Graph, world: usize) -> Result<Vec<RankProgram>, String> {
    let (roles, gangs, seq) = sequence(graph, world)?;
    let mut steps: Vec<Vec<Step>> = vec![Vec::new(); world];
    let mut pending: Vec<Vec<Xfer>> = vec![Vec::new(); world];
    for &(gi, op) in &seq {
        let g = &gangs[gi];
        for &r in &g.members {
            let role = roles[r]
                .iter()
                .find(|x| x.node == g.node)
                .ok_or_else(|| format!("rank {r} has no {:?} role", g.node))?;
            let (recv, out) = match op {
                Op::Forward(j) => (&role.fwd_in[j], &role.fwd_out[j]),
                Op::Backward(j) => (&role.bwd_in[j], &role.bwd_out[j]),
            };
            if !pending[r].is_empty() || !recv.is_empty() {
                steps[r].push(Step::Exchange {
                    send: std::mem::take(&mut pending[r]),
                    recv: recv.clone(),
                });
            }
            steps[r].push(Step::Run(g.node, op));
            pending[r] = out.clone();
        }
    }
    for (r, p) in pending.into_iter().enumerate() {
        if !p.is_empty() {
            steps[r].push(Step::Exchange {
                send: p,
                recv: Vec::new(),
            });
        }
    }
    // Per receiver, per sender: the sender's send order.
    let mut incoming: Vec<HashMap<usize, VecDeque<Xfer>>> = vec![HashMap::new(); world];
    for (r, p) in steps.iter().enumerate() {
        for s in p {
            if let Step::Exchange { send, .. } = s {
                for x in send.iter().filter(|x| x.peer != r) {
                    let to = incoming.get_mut(x.peer).ok_or_else(|| {
                        format!("rank {r} sends to rank {}, outside the world", x.peer)
                    })?;
                    to.entry(r).or_default().push_back(Xfer { peer: r, ..*x });
                }
            }
        }
    }
    Ok(roles
        .into_iter()
        .zip(steps)
        .zip(incoming)
        .map(|((roles, steps), incoming)| RankProgram {
            roles,
            steps,
            incoming,
        })
        .collect())
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
/// some rank holds several modules, every rank's part of [`programs`]: a peer's sends
/// then follow the global order, which this rank must know to receive them.
pub fn rank_program(graph: &Graph, world: usize, rank: usize) -> Result<RankProgram, String> {
    if !shares_ranks(graph) {
        let role = graph.role(rank)?;
        return Ok(RankProgram {
            steps: role.program(),
            roles: vec![role],
            incoming: HashMap::new(),
        });
    }
    let mut all = programs(graph, world)?;
    if rank >= all.len() {
        return Err(format!("rank {rank} is outside the world of {world}"));
    }
    Ok(all.swap_remove(rank))
}

#[cfg(test)]
#[path = "order_tests.rs"]
mod tests;
