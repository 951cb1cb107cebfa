//! The overlapped schedule's programs on random graphs: 1-5 stages per module, 1-8 microbatches, 1-3 model chunks per LLM stage (interleaved), random items, frozen encoders; run with rendezvous (unbuffered) sends, or buffered ones where the LLM interleaves.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use braid_bridge::{ItemPlacement, routes_for};
use braid_comm::grid::{Axis, Coord, Grid, GridDims};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;
use braid_balancer::pipeline::warmup;

use crate::parallel::order::RankProgram;
use crate::parallel::order::tests::run_buffered;
use crate::parallel::schedule::max_in_flight;

/// Random grid dims with TP and CP 1-2, PP 1-`max_pp`, DP 1-3.
fn random_dims(rng: &mut ChaCha8Rng, max_pp: usize) -> GridDims {
    GridDims {
        tp: rng.random_range(1..=2),
        cp: rng.random_range(1..=2),
        pp: rng.random_range(1..=max_pp),
        dp: rng.random_range(1..=3),
    }
}

/// Random grid dims of exactly `world` ranks (a colocated grid): PP 1-`max_pp`, TP and
/// CP 1-2, DP the rest, each dividing what is left.
fn dims_of_world(rng: &mut ChaCha8Rng, world: usize, max_pp: usize) -> GridDims {
    let mut left = world;
    let mut pick = |left: &mut usize, max: usize| {
        let d: Vec<usize> = (1..=max.min(*left))
            .filter(|d| left.is_multiple_of(*d))
            .collect();
        let x = d[rng.random_range(0..d.len())];
        *left /= x;
        x
    };
    let pp = pick(&mut left, max_pp);
    let tp = pick(&mut left, 2);
    let cp = pick(&mut left, 2);
    GridDims {
        tp,
        cp,
        pp,
        dp: left,
    }
}

/// A random graph: an LLM and 0-2 encoders, each with its own TP/CP/PP/DP, items of
/// random replicas and microbatches, and with two LLM stages or more half the time 2 or
/// 3 model chunks a stage (interleaved 1F1B). Disjoint: each module on its own ranks;
/// colocated: every grid spans one world of 1-12 ranks.
pub(crate) fn random_graph(
    rng: &mut ChaCha8Rng,
    max_pp: usize,
    m: usize,
    colocated: bool,
) -> Graph {
    let world = rng.random_range(1..=12);
    let dims = |rng: &mut ChaCha8Rng| {
        if colocated {
            dims_of_world(rng, world, max_pp)
        } else {
            random_dims(rng, max_pp)
        }
    };
    let n_enc = rng.random_range(0..=2);
    let encoders: Vec<(GridDims, bool, bool)> = (0..n_enc)
        .map(|_| {
            let d = dims(rng);
            let trains = rng.random_bool(0.7);
            (d, trains, trains || rng.random_bool(0.5))
        })
        .collect();
    let llm = dims(rng);
    let items = rng.random_range(0..=3 * m);
    let mut g = graph_of(rng, llm, &encoders, m, colocated, items);
    if g.llm.dims.pp >= 2 && rng.random_bool(0.5) {
        g.llm_model_chunks = rng.random_range(2..=3);
    } else if g.llm.dims.pp >= 2 && rng.random_bool(0.5) {
        // Zero-bubble pipelining: the LLM's weight gradients in passes of their own.
        g.llm_split_backward = true;
    }
    g
}

/// A graph of these grids (disjoint: one after another, encoders first; colocated: all
/// from rank 0), each encoder `(dims, trains, branch_trains)` with `n_items` items of
/// random replicas and chunks, each LLM replica running a random 70 % of the `m` chunks.
pub(crate) fn graph_of(
    rng: &mut ChaCha8Rng,
    llm: GridDims,
    encoders: &[(GridDims, bool, bool)],
    m: usize,
    colocated: bool,
    n_items: usize,
) -> Graph {
    let mut offset = 0;
    let mut nodes = Vec::new();
    for &(dims, trains, branch_trains) in encoders {
        let grid = Grid::new(dims, offset).unwrap();
        if !colocated {
            offset += grid.size();
        }
        nodes.push(EncoderNode {
            grid,
            trains,
            branch_trains,
        });
    }
    let encoders = nodes;
    let llm = Grid::new(llm, offset).unwrap();
    let world = offset + llm.size();
    let llm_chunks: Vec<Vec<usize>> = (0..llm.dims.dp)
        .map(|_| {
            loop {
                let c: Vec<usize> = (0..m).filter(|_| rng.random_bool(0.7)).collect();
                if !c.is_empty() {
                    break c;
                }
            }
        })
        .collect();
    // Items: (encoder, replica, llm replica, chunk).
    let mut items = Vec::new();
    for (e, node) in encoders.iter().enumerate() {
        for _ in 0..n_items {
            let d = rng.random_range(0..llm.dims.dp);
            let k = llm_chunks[d][rng.random_range(0..llm_chunks[d].len())];
            items.push((e, rng.random_range(0..node.grid.dims.dp), d, k));
        }
    }
    let placements: Vec<ItemPlacement> = items
        .iter()
        .map(|&(e, r, d, _)| {
            let g = &encoders[e].grid;
            let src = g.rank(Coord {
                tp: 0,
                cp: 0,
                dp: r,
                pp: g.dims.pp - 1,
            });
            let rows = rng.random_range(1..=4);
            ItemPlacement {
                encoder_ranks: g.group(src, &[Axis::Tp, Axis::Cp]).unwrap(),
                frozen: !encoders[e].branch_trains,
                row_cp: (0..rows)
                    .map(|_| rng.random_range(0..llm.dims.cp))
                    .collect(),
                llm_ranks: (0..llm.dims.cp)
                    .map(|cp| {
                        (0..llm.dims.tp)
                            .map(|tp| {
                                llm.rank(Coord {
                                    tp,
                                    cp,
                                    dp: d,
                                    pp: 0,
                                })
                            })
                            .collect()
                    })
                    .collect(),
            }
        })
        .collect();
    let routes = routes_for(&placements, 3, world).unwrap();
    let bridges = (0..m)
        .map(|k| {
            (0..encoders.len())
                .map(|e| {
                    let of: Vec<usize> = (0..items.len())
                        .filter(|&i| items[i].3 == k && items[i].0 == e)
                        .collect();
                    (!of.is_empty()).then(|| routes.subset(&of).unwrap())
                })
                .collect()
        })
        .collect();
    let encoder_chunks = encoders
        .iter()
        .enumerate()
        .map(|(e, node)| {
            (0..node.grid.dims.dp)
                .map(|r| {
                    let mut c: Vec<usize> = items
                        .iter()
                        .filter(|it| it.0 == e && it.1 == r)
                        .map(|it| it.3)
                        .collect();
                    c.sort_unstable();
                    c.dedup();
                    c
                })
                .collect()
        })
        .collect();
    Graph {
        llm,
        llm_model_chunks: 1,
        llm_split_backward: false,
        encoders,
        llm_chunks,
        encoder_chunks,
        bridges,
    }
}

pub(crate) fn world_of(g: &Graph) -> usize {
    g.llm.offset + g.llm.size()
}

/// Runs every rank's program where a send completes only when its peer has posted the
/// matching receive in its current exchange. Returns whether every program finished.
fn run_rendezvous(programs: &[Vec<Step>]) -> bool {
    stuck(programs).is_none()
}

/// Where the rendezvous run stops: each unfinished rank's step index and step.
fn stuck(programs: &[Vec<Step>]) -> Option<String> {
    let n = programs.len();
    let mut pc = vec![0usize; n];
    // Per rank, the done flags of its current exchange's sends and receives.
    let mut done: Vec<(Vec<bool>, Vec<bool>)> = vec![(Vec::new(), Vec::new()); n];
    let current = |pc: &[usize], r: usize| programs[r].get(pc[r]);
    let reset = |done: &mut Vec<(Vec<bool>, Vec<bool>)>, pc: &[usize], r: usize| {
        done[r] = match programs[r].get(pc[r]) {
            Some(Step::Exchange { send, recv }) => {
                (vec![false; send.len()], vec![false; recv.len()])
            }
            _ => (Vec::new(), Vec::new()),
        };
    };
    for r in 0..n {
        reset(&mut done, &pc, r);
    }
    loop {
        let mut progressed = false;
        for a in 0..n {
            // Match a's posted sends with receives its peers have posted.
            if let Some(Step::Exchange { send, .. }) = current(&pc, a) {
                for (si, x) in send.iter().enumerate() {
                    if done[a].0[si] {
                        continue;
                    }
                    let b = x.peer;
                    if let Some(Step::Exchange { recv, .. }) = current(&pc, b)
                        && let Some(ri) = recv.iter().enumerate().position(|(ri, y)| {
                            y.peer == a && y.node == x.node && y.msg == x.msg && !done[b].1[ri]
                        })
                    {
                        done[a].0[si] = true;
                        done[b].1[ri] = true;
                        progressed = true;
                    }
                }
            }
        }
        for r in 0..n {
            let finished_step = match current(&pc, r) {
                None => false,
                Some(Step::Run(..)) => true,
                Some(Step::Exchange { .. }) => {
                    done[r].0.iter().all(|&d| d) && done[r].1.iter().all(|&d| d)
                }
            };
            if finished_step {
                pc[r] += 1;
                reset(&mut done, &pc, r);
                progressed = true;
            }
        }
        if !progressed {
            let open: Vec<String> = (0..n)
                .filter(|&r| pc[r] < programs[r].len())
                .map(|r| format!("rank {r} at {}: {:?}", pc[r], programs[r][pc[r]]))
                .collect();
            return (!open.is_empty()).then(|| open.join("\n"));
        }
    }
}

/// Per ordered pair of ranks (sender, receiver), its messages in order.
type PairOrders = HashMap<(usize, usize), Vec<(Node, Msg)>>;

/// Per ordered pair of ranks, the messages in the order the sender sends them and in
/// the order the receiver receives them: a FIFO transport needs them equal.
fn pair_orders(programs: &[Vec<Step>]) -> (PairOrders, PairOrders) {
    let (mut sent, mut got) = (HashMap::new(), HashMap::new());
    for (r, p) in programs.iter().enumerate() {
        for s in p {
            if let Step::Exchange { send, recv } = s {
                for x in send {
                    sent.entry((r, x.peer))
                        .or_insert_with(Vec::new)
                        .push((x.node, x.msg));
                }
                for x in recv {
                    got.entry((x.peer, r))
                        .or_insert_with(Vec::new)
                        .push((x.node, x.msg));
                }
            }
        }
    }
    (sent, got)
}

#[test]
fn programs_are_complete_bounded_and_deadlock_free_without_buffering() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x0f1b);
    let (mut cases, mut overlapping, mut interleaved) = (0, 0, 0);
    for max_pp in 1..=5 {
        for m in 1..=8 {
            for _ in 0..20 {
                let g = random_graph(&mut rng, max_pp, m, false);
                let world = world_of(&g);
                let roles: Vec<Role> = (0..world).map(|r| g.role(r).unwrap()).collect();
                let programs: Vec<Vec<Step>> = roles.iter().map(Role::program).collect();
                for (r, (role, p)) in roles.iter().zip(&programs).enumerate() {
                    let ops: Vec<Op> = p
                        .iter()
                        .filter_map(|s| match s {
                            Step::Run(_, op) => Some(*op),
                            Step::Exchange { .. } => None,
                        })
                        .collect();
                    let (n, v) = (role.chunks.len(), role.model_chunks);
                    // Every pass (model chunk, chunk) forward once, backward once (when it
                    // trains), in order.
                    // Split (zero-bubble), each backward's weight pass after it.
                    let split = role.backward && role.split_backward;
                    for p in 0..n * v {
                        let f = ops.iter().position(|&o| o == Op::Forward(p));
                        let b = ops.iter().position(|&o| o == Op::Backward(p));
                        let w = ops.iter().position(|&o| o == Op::Weight(p));
                        assert!(f.is_some(), "rank {r}: no forward of pass {p}");
                        assert_eq!(b.is_some(), role.backward, "rank {r} pass {p}");
                        assert_eq!(w.is_some(), split, "rank {r} pass {p}");
                        if let (Some(f), Some(b)) = (f, b) {
                            assert!(f < b, "rank {r} pass {p}: backward before forward");
                        }
                        if let (Some(b), Some(w)) = (b, w) {
                            assert!(b < w, "rank {r} pass {p}: weight pass before backward");
                        }
                    }
                    let passes = 1 + usize::from(role.backward) + usize::from(split);
                    assert_eq!(ops.len(), n * v * passes);
                    // At most 1F1B's depth of chunks in flight, or interleaved, its
                    // warm-up and one (what the planner counts).
                    let cap = match v {
                        1 => role.depth,
                        _ => warmup(role.stage, role.stage + role.depth, v) + 1,
                    };
                    if role.backward {
                        assert!(max_in_flight(&ops) <= cap.min((n * v).max(1)), "rank {r}");
                    }
                }
                let (sent, got) = pair_orders(&programs);
                assert_eq!(
                    sent, got,
                    "every send has its receive, in one order per pair"
                );
                if g.llm_model_chunks > 1 {
                    // Interleaved stages need buffered sends (as the phased interleaved
                    // schedule does): run them so, each receiver taking a peer's messages
                    // in the one order the pair uses, and a pass waiting for its gang.
                    let ranks: Vec<RankProgram> = roles
                        .iter()
                        .zip(&programs)
                        .enumerate()
                        .map(|(r, (role, steps))| RankProgram {
                            roles: vec![role.clone()],
                            steps: steps.clone(),
                            incoming: Some(
                                sent.iter()
                                    .filter(|((_, to), _)| *to == r)
                                    .map(|(&(from, _), xs)| {
                                        let xs = xs.iter().map(|&(node, msg)| Xfer {
                                            peer: from,
                                            node,
                                            msg,
                                        });
                                        (from, xs.collect())
                                    })
                                    .collect(),
                            ),
                        })
                        .collect();
                    if let Err(at) = run_buffered(&ranks) {
                        panic!("interleaved, buffered: stuck:\n{at}\ngraph {g:?}");
                    }
                } else if let Some(at) = stuck(&programs) {
                    let roles: Vec<String> = roles
                        .iter()
                        .map(|r| {
                            format!("chunks {:?} depth {} bwd {}", r.chunks, r.depth, r.backward)
                        })
                        .collect();
                    panic!(
                        "deadlock:\n{at}\nroles:\n{}\nprograms: {programs:?}",
                        roles.join("\n")
                    );
                }
                // Encoders of this graph run some chunk's forward after an LLM rank
                // needs an earlier one: the overlap the schedule is for.
                overlapping += usize::from(
                    roles
                        .iter()
                        .any(|r| r.chunks.len() > 1 && r.depth > g.llm.dims.pp && r.backward),
                );
                interleaved += usize::from(g.llm_model_chunks > 1);
                cases += 1;
            }
        }
    }
    assert!(
        overlapping > 50,
        "only {overlapping} of {cases} graphs overlap"
    );
    assert!(
        interleaved > 100,
        "only {interleaved} of {cases} graphs interleave"
    );
}

/// The rendezvous check can fail: the naive order (send right after each compute, not
/// grouped with the next receive) deadlocks a two-stage 1F1B pipeline.
#[test]
fn ungrouped_sends_deadlock_under_rendezvous() {
    let llm = Grid::new(
        GridDims {
            tp: 1,
            cp: 1,
            pp: 2,
            dp: 1,
        },
        0,
    )
    .unwrap();
    let g = Graph {
        llm,
        llm_model_chunks: 1,
        llm_split_backward: false,
        encoders: Vec::new(),
        llm_chunks: vec![vec![0, 1, 2]],
        encoder_chunks: Vec::new(),
        bridges: vec![Vec::new(); 3],
    };
    let grouped: Vec<Vec<Step>> = (0..2).map(|r| g.role(r).unwrap().program()).collect();
    assert!(run_rendezvous(&grouped));
    // Split every exchange into its sends, then its receives, one at a time.
    let naive: Vec<Vec<Step>> = grouped
        .iter()
        .map(|p| {
            p.iter()
                .flat_map(|s| match s {
                    Step::Run(..) => vec![s.clone()],
                    Step::Exchange { send, recv } => send
                        .iter()
                        .map(|x| Step::Exchange {
                            send: vec![*x],
                            recv: Vec::new(),
                        })
                        .chain(recv.iter().map(|x| Step::Exchange {
                            send: Vec::new(),
                            recv: vec![*x],
                        }))
                        .collect(),
                })
                .collect()
        })
        .collect();
    assert!(!run_rendezvous(&naive));
}

#[test]
fn encoder_warm_up_spans_the_llm_pipeline() {
    let grid = |pp, offset| {
        Grid::new(
            GridDims {
                tp: 1,
                cp: 1,
                pp,
                dp: 1,
            },
            offset,
        )
        .unwrap()
    };
    let g = Graph {
        llm: grid(3, 2),
        llm_model_chunks: 1,
        llm_split_backward: false,
        encoders: vec![EncoderNode {
            grid: grid(2, 0),
            trains: true,
            branch_trains: true,
        }],
        llm_chunks: vec![(0..6).collect()],
        encoder_chunks: vec![vec![(0..6).collect()]],
        bridges: vec![vec![None]; 6],
    };
    // Encoder stage 0 of 2 before a 3-stage LLM: 2 - 0 - 1 + 3 = 4 forwards ahead.
    let ops = g.role(0).unwrap().ops();
    assert_eq!(
        &ops[..5],
        &[
            Op::Forward(0),
            Op::Forward(1),
            Op::Forward(2),
            Op::Forward(3),
            Op::Forward(4)
        ]
    );
    assert_eq!(ops[5], Op::Backward(0));
    assert_eq!(max_in_flight(&ops), 5);
    // The LLM's last stage alternates.
    assert_eq!(
        &g.role(4).unwrap().ops()[..2],
        &[Op::Forward(0), Op::Backward(0)]
    );
}
