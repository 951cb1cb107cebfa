//! The global order on random graphs, colocated (every grid on one world) and disjoint: every rank's program run with buffered FIFO channels and a barrier per pass of a gang (its TP and CP collectives).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::parallel::graph::assemble;
use crate::parallel::graph::tests::{random_graph, world_of};
use braid_balancer::pipeline::warmup;

use crate::parallel::schedule::max_in_flight;

/// A message in flight: (sender, receiver, module, message).
type Sent = (usize, usize, Node, Msg);

/// The ranks of one (module, stage, replica) and their common pass order.
struct RankGang {
    members: Vec<usize>,
    node: Node,
    ops: Vec<Op>,
}

/// Every rank's roles, the gangs, and the global sequence of passes `(gang, op)`.
type RankSequence = (Vec<Vec<Role>>, Vec<RankGang>, Vec<(usize, Op)>);

/// Every rank's roles, the gangs, and the global sequence of passes.
fn rank_sequence(graph: &Graph, world: usize) -> Result<RankSequence, String> {
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
            if (
                &other.chunks,
                other.depth,
                other.model_chunks,
                other.backward,
            ) != (
                &first.chunks,
                first.depth,
                first.model_chunks,
                first.backward,
            ) {
                return Err(format!(
                    "{node:?} stage {stage} replica {replica}: ranks {} and {m} disagree on their chunks",
                    members[0]
                ));
            }
        }
        gangs.push(RankGang {
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
            Op::Weight(_) => (&[], &[]),
        })
    };
    let mut sent: HashSet<Sent> = HashSet::new();
    let mut sent_now: Vec<Sent> = Vec::new();
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
                    sent_now.push((r, x.peer, x.node, x.msg));
                }
            }
            seq.push((gi, op));
            next[gi] += 1;
            progressed = true;
        }
        // Received in the next round.
        sent.extend(sent_now.drain(..));
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

/// Every rank's program under the global order (ranks `0..world`), sequenced from every
/// rank's own messages: the reference [`rank_program`]'s gang-level sequence must equal.
fn reference_programs(graph: &Graph, world: usize) -> Result<Vec<RankProgram>, String> {
    let (roles, gangs, seq) = rank_sequence(graph, world)?;
    // Each rank's passes in the sequence, assembled as the trainer assembles them.
    let mut passes: Vec<Vec<(&Role, Op)>> = vec![Vec::new(); world];
    for &(gi, op) in &seq {
        let g = &gangs[gi];
        for &r in &g.members {
            let role = roles[r]
                .iter()
                .find(|x| x.node == g.node)
                .ok_or_else(|| format!("rank {r} has no {:?} role", g.node))?;
            passes[r].push((role, op));
        }
    }
    let steps: Vec<Vec<Step>> = passes.into_iter().map(assemble).collect();
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
            incoming: Some(incoming),
        })
        .collect())
}

/// A message on the wire or in an inbox: (sender, module, message).
type Held = (usize, Node, Msg);

/// A gang's pass: (module, stage, replica) and the op.
type GangPass = ((Node, usize, usize), Op);

/// Runs `programs` to the end: sends go into FIFO channels at once, a receive takes
/// the sender's messages in the sender's order ([`RankProgram::incoming`]) until it
/// has its own, and a pass waits for every rank of its gang to reach it. Returns where
/// the ranks stop if they do not all finish.
pub(crate) fn run_buffered(programs: &[RankProgram]) -> Result<(), String> {
    let n = programs.len();
    let gang = |r: usize, node: Node| {
        let role = programs[r].roles.iter().find(|x| x.node == node).unwrap();
        (node, role.stage, role.replica)
    };
    let mut pc = vec![0usize; n];
    // Per rank: whether the current exchange's sends went out, and receives done.
    let mut sent_now = vec![false; n];
    let mut recv_now = vec![0usize; n];
    let mut wire: HashMap<(usize, usize), VecDeque<(Node, Msg)>> = HashMap::new();
    let mut inbox: Vec<HashSet<Held>> = vec![HashSet::new(); n];
    let mut expect: Vec<HashMap<usize, VecDeque<Xfer>>> = programs
        .iter()
        .map(|p| p.incoming.clone().unwrap_or_default())
        .collect();
    loop {
        let mut progressed = false;
        for r in 0..n {
            let Some(Step::Exchange { send, recv }) = programs[r].steps.get(pc[r]) else {
                continue;
            };
            if !sent_now[r] {
                for x in send {
                    if x.peer == r {
                        assert!(inbox[r].insert((r, x.node, x.msg)), "rank {r}: {x:?} twice");
                    } else {
                        wire.entry((r, x.peer))
                            .or_default()
                            .push_back((x.node, x.msg));
                    }
                }
                sent_now[r] = true;
                progressed = true;
            }
            while let Some(x) = recv.get(recv_now[r]) {
                let key = (x.peer, x.node, x.msg);
                if x.peer != r && !inbox[r].contains(&key) {
                    // Take the sender's messages in its order until this one came.
                    let ch = wire.entry((x.peer, r)).or_default();
                    while let Some((node, msg)) = ch.pop_front() {
                        let want = expect[r].get_mut(&x.peer).and_then(VecDeque::pop_front);
                        let got = Xfer {
                            peer: x.peer,
                            node,
                            msg,
                        };
                        if want != Some(got) {
                            return Err(format!(
                                "rank {r}: rank {} sent {got:?}, the order says {want:?}",
                                x.peer
                            ));
                        }
                        inbox[r].insert((x.peer, node, msg));
                        if (x.peer, node, msg) == key {
                            break;
                        }
                    }
                }
                if !inbox[r].remove(&key) {
                    break;
                }
                recv_now[r] += 1;
                progressed = true;
            }
            if recv_now[r] == recv.len() {
                pc[r] += 1;
                (sent_now[r], recv_now[r]) = (false, 0);
                progressed = true;
            }
        }
        // Passes: a gang's pass runs once all its ranks stand at it.
        let mut at: HashMap<GangPass, Vec<usize>> = HashMap::new();
        for r in 0..n {
            if let Some(Step::Run(node, op)) = programs[r].steps.get(pc[r]) {
                at.entry((gang(r, *node), *op)).or_default().push(r);
            }
        }
        for ((g, _), ranks) in at {
            let size = (0..n)
                .filter(|&r| programs[r].roles.iter().any(|x| gang(r, x.node) == g))
                .count();
            if ranks.len() == size {
                for r in ranks {
                    pc[r] += 1;
                }
                progressed = true;
            }
        }
        if (0..n).all(|r| pc[r] == programs[r].steps.len()) {
            let left: Vec<_> = wire.iter().filter(|(_, q)| !q.is_empty()).collect();
            if !left.is_empty() || inbox.iter().any(|b| !b.is_empty()) {
                return Err(format!("messages left over: {left:?}"));
            }
            return Ok(());
        }
        if !progressed {
            return Err((0..n)
                .filter(|&r| pc[r] < programs[r].steps.len())
                .map(|r| format!("rank {r} at {}: {:?}", pc[r], programs[r].steps[pc[r]]))
                .collect::<Vec<_>>()
                .join("\n"));
        }
    }
}

#[test]
fn colocated_programs_finish_in_order_with_bounded_memory() {
    let mut rng = ChaCha8Rng::seed_from_u64(0xc010);
    let (mut cases, mut interleaved, mut virtual_stages, mut splits) = (0, 0, 0, 0);
    for max_pp in 1..=5 {
        for m in 1..=8 {
            for _ in 0..12 {
                let g = random_graph(&mut rng, max_pp, m, true);
                virtual_stages += usize::from(g.llm_model_chunks > 1);
                let world = world_of(&g);
                let programs = reference_programs(&g, world).unwrap();
                // Each rank's own program, from the gangs' sequence and its own roles, is
                // its part of the reference (under one module, without the peers' order).
                for (r, p) in programs.iter().enumerate() {
                    let mine = rank_program(&g, world, r).unwrap();
                    assert_eq!(mine.steps, p.steps, "rank {r} of {g:?}");
                    if shares_ranks(&g) {
                        assert_eq!(mine.incoming, p.incoming, "rank {r} of {g:?}");
                    }
                }
                for (r, p) in programs.iter().enumerate() {
                    for role in &p.roles {
                        // This module's passes, in the program's order, are its 1F1B.
                        let ops: Vec<Op> = p
                            .steps
                            .iter()
                            .filter_map(|s| match s {
                                Step::Run(node, op) if *node == role.node => Some(*op),
                                _ => None,
                            })
                            .collect();
                        assert_eq!(ops, role.ops(), "rank {r} {:?}", role.node);
                        let (n, v) = (role.chunks.len(), role.model_chunks);
                        let split = usize::from(role.backward && role.split_backward);
                        assert_eq!(ops.len(), n * v * (1 + usize::from(role.backward) + split));
                        splits += split;
                        let cap = match v {
                            1 => role.depth,
                            _ => warmup(role.stage, role.stage + role.depth, v) + 1,
                        };
                        if role.backward {
                            assert!(max_in_flight(&ops) <= cap.min((n * v).max(1)));
                        }
                    }
                    // An encoder pass between two of the LLM's: the rank interleaves.
                    let nodes: Vec<Node> = p
                        .steps
                        .iter()
                        .filter_map(|s| match s {
                            Step::Run(node, _) => Some(*node),
                            Step::Exchange { .. } => None,
                        })
                        .collect();
                    let first = nodes.iter().position(|&x| x == Node::Llm);
                    let last = nodes.iter().rposition(|&x| x == Node::Llm);
                    if let (Some(a), Some(b)) = (first, last) {
                        interleaved += usize::from(nodes[a..b].iter().any(|&x| x != Node::Llm));
                    }
                }
                if let Err(at) = run_buffered(&programs) {
                    panic!("graph {g:?}\nstuck or out of order:\n{at}");
                }
                cases += 1;
            }
        }
    }
    assert!(
        interleaved > 100,
        "only {interleaved} ranks of {cases} graphs interleave encoder passes with the LLM's"
    );
    assert!(
        virtual_stages > 50,
        "only {virtual_stages} of {cases} graphs have LLM stages of several model chunks"
    );
    assert!(
        splits > 50,
        "only {splits} LLM roles of {cases} graphs split their backward"
    );
}

/// Under disjoint placement the global order gives every rank its own role's program,
/// and those run the same way.
#[test]
fn disjoint_programs_are_the_roles_own() {
    let mut rng = ChaCha8Rng::seed_from_u64(0xd15);
    for max_pp in 1..=4 {
        for m in 1..=6 {
            for _ in 0..6 {
                let g = random_graph(&mut rng, max_pp, m, false);
                let world = world_of(&g);
                assert!(!shares_ranks(&g));
                let all = reference_programs(&g, world).unwrap();
                for (r, p) in all.iter().enumerate() {
                    assert_eq!(p.steps, g.role(r).unwrap().program(), "rank {r}");
                    assert_eq!(rank_program(&g, world, r).unwrap().steps, p.steps);
                }
                run_buffered(&all).unwrap();
            }
        }
    }
}

/// The check can fail: two ranks that each wait for the other's message first.
#[test]
fn crossed_receives_are_caught() {
    let x = |peer, k| Xfer {
        peer,
        node: Node::Llm,
        msg: Msg::Act(k, 0),
    };
    let role = |stage| Role {
        node: Node::Llm,
        stage,
        replica: 0,
        chunks: Vec::new(),
        of: 0,
        depth: 1,
        model_chunks: 1,
        backward: false,
        split_backward: false,
        fwd_in: Vec::new(),
        fwd_out: Vec::new(),
        bwd_in: Vec::new(),
        bwd_out: Vec::new(),
    };
    let waits_then_sends = |me: usize, peer: usize| RankProgram {
        roles: vec![role(me)],
        steps: vec![
            Step::Exchange {
                send: Vec::new(),
                recv: vec![x(peer, 0)],
            },
            Step::Exchange {
                send: vec![x(peer, 0)],
                recv: Vec::new(),
            },
        ],
        incoming: Some(HashMap::from([(peer, VecDeque::from([x(peer, 0)]))])),
    };
    assert!(run_buffered(&[waits_then_sends(0, 1), waits_then_sends(1, 0)]).is_err());
}

/// At 1,024 ranks (a 16-replica LLM of 8 stages, two pipelined encoders, 64 chunks and
/// 16,384 items each), a rank's program from the gangs' sequence and its own roles is its
/// part of the reference, sequenced from every rank's messages (the reference reads
/// every rank's routes: about 1 s here against 0.06 s).
#[test]
fn the_gang_order_is_the_rank_order_at_a_thousand_ranks() {
    use braid_comm::grid::GridDims;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let d = |tp, cp, pp, dp| GridDims { tp, cp, pp, dp };
    let g = crate::parallel::graph::tests::graph_of(
        &mut rng,
        d(2, 4, 8, 16),
        &[(d(1, 2, 8, 64), true, true), (d(2, 2, 16, 16), false, true)],
        64,
        true,
        16 * 1024,
    );
    let all = reference_programs(&g, 1024).unwrap();
    for r in [0, 1, 7, 64, 513, 1023] {
        let mine = rank_program(&g, 1024, r).unwrap();
        assert_eq!(mine.steps, all[r].steps, "rank {r}");
        assert_eq!(mine.incoming, all[r].incoming, "rank {r}");
    }
}
