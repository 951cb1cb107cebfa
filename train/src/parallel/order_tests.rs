//! The global order on random graphs, colocated (every grid on one world) and disjoint: every rank's program run with buffered FIFO channels and a barrier per pass of a gang (its TP and CP collectives).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet, VecDeque};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::*;
use crate::parallel::graph::tests::{random_graph, world_of};
use crate::parallel::schedule::max_in_flight;

/// A message on the wire or in an inbox: (sender, module, message).
type Held = (usize, Node, Msg);

/// A gang's pass: (module, stage, replica) and the op.
type GangPass = ((Node, usize, usize), Op);

/// Runs `programs` to the end: sends go into FIFO channels at once, a receive takes
/// the sender's messages in the sender's order ([`RankProgram::incoming`]) until it
/// has its own, and a pass waits for every rank of its gang to reach it. Returns where
/// the ranks stop if they do not all finish.
fn run_buffered(programs: &[RankProgram]) -> Result<(), String> {
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
    let mut expect: Vec<HashMap<usize, VecDeque<Xfer>>> =
        programs.iter().map(|p| p.incoming.clone()).collect();
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
    let (mut cases, mut interleaved) = (0, 0);
    for max_pp in 1..=5 {
        for m in 1..=8 {
            for _ in 0..12 {
                let g = random_graph(&mut rng, max_pp, m, true);
                let world = world_of(&g);
                let programs = programs(&g, world).unwrap();
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
                        let n = role.chunks.len();
                        assert_eq!(ops.len(), n * (1 + usize::from(role.backward)));
                        if role.backward {
                            assert!(max_in_flight(&ops) <= role.depth.min(n.max(1)));
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
                let all = programs(&g, world).unwrap();
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
        msg: Msg::Act(k),
    };
    let role = |stage| Role {
        node: Node::Llm,
        stage,
        replica: 0,
        chunks: Vec::new(),
        of: 0,
        depth: 1,
        backward: false,
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
        incoming: HashMap::from([(peer, VecDeque::from([x(peer, 0)]))]),
    };
    assert!(run_buffered(&[waits_then_sends(0, 1), waits_then_sends(1, 0)]).is_err());
}
