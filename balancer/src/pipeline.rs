//! The interleaved 1F1B pipeline order (Megatron-LM's virtual pipeline stages): the one
//! order `braid train` runs and `braid plan` simulates.
//!
//! With `P` stages of `V` model chunks each, stage `s` holds chunks `s, s + P, ...,
//! s + (V - 1) P` of the `V P` equal slices of the layers, so a microbatch goes round the
//! ring of stages `V` times. A stage then idles for `(P - 1) / V` of a stage-pass at each
//! end of the step instead of `P - 1` of them: the bubble shrinks by `V`, for `V` times
//! as many point-to-point sends and a little more activation memory on the first stages.
//!
//! Every stage walks the same sequence of (chunk, microbatch) forwards: microbatches in
//! groups of `P`, each group through chunk 0, then chunk 1, ...; backwards the same with
//! the chunks reversed. Stage `s` runs `2 (P - s - 1) + (V - 1) P` forwards ahead, then
//! alternates one forward and one backward, then drains. A count of microbatches that
//! leaves a partial last group is run as the next whole number of groups with the
//! missing microbatches' passes left out (a partial group run as is would cross the
//! next group's sends: out of order on two stages, a deadlock on more); leaving passes
//! out keeps the order of everything else, so it stays deadlock-free and in order.
//! Because every stage sends and
//! receives in that one sequence, the messages on each pair of stages arrive in the
//! order they are received (the transports match a receive to the next message from
//! that peer, with no tags); the tests check this, and that no order deadlocks when
//! sends are buffered (as on Braid's transports; a send that waits for its receive needs
//! the send and the next receive posted as one group, as 1F1B always has).

/// One pass of a stage: a forward or backward of model chunk `chunk` (0..V, this
/// stage's) on the microbatch at position `mb` of the replica's microbatches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkPass {
    pub forward: bool,
    pub chunk: usize,
    pub mb: usize,
}

/// The (chunk, microbatch) sequence every stage walks, forward (`chunks` ascending per
/// group) or backward (descending): groups of `stages` microbatches, the last group
/// what is left.
fn sequence(stages: usize, chunks: usize, n: usize, forward: bool) -> Vec<(usize, usize)> {
    let group = stages.max(1);
    let mut out = Vec::with_capacity(chunks * n);
    for start in (0..n).step_by(group) {
        let mbs = start..start.saturating_add(group).min(n);
        for c in 0..chunks {
            let chunk = if forward { c } else { chunks - 1 - c };
            out.extend(mbs.clone().map(|j| (chunk, j)));
        }
    }
    out
}

/// Forwards stage `stage` of `stages` runs ahead of its first backward with `chunks`
/// model chunks a stage (before the step's microbatches cap it): 1F1B's `stages - stage -
/// 1`, the interleaved order's `2 (stages - stage - 1) + (chunks - 1) stages`. A stage
/// holds at most this and one more chunk's activations.
pub fn warmup(stage: usize, stages: usize, chunks: usize) -> usize {
    let ahead = stages.saturating_sub(stage + 1);
    if chunks <= 1 {
        ahead
    } else {
        (2 * ahead).saturating_add((chunks - 1).saturating_mul(stages))
    }
}

/// Whether `layers` split into `stages` stages of `chunks` equal model chunks each (what
/// `parallel.llm.virtual_stages` and a plan's `llm_virtual_stages` need): one chunk
/// wherever the stages split the layers; more only over two stages or more.
pub fn chunks_split_evenly(layers: usize, stages: usize, chunks: usize) -> bool {
    let n = stages * chunks;
    chunks >= 1
        && stages >= 1
        && n <= layers
        && layers.is_multiple_of(n)
        && (chunks == 1 || stages >= 2)
}

/// Stage `stage` of `stages`' passes over `n` microbatches with `chunks` model chunks
/// each (`chunks = 1`: plain 1F1B, `stages - stage - 1` forwards ahead). Forward-only
/// (`backward = false`, a frozen module): every forward in sequence order.
pub fn interleaved_1f1b(
    stage: usize,
    stages: usize,
    chunks: usize,
    n: usize,
    backward: bool,
) -> Vec<ChunkPass> {
    let chunks = chunks.max(1);
    if chunks > 1 && !n.is_multiple_of(stages.max(1)) {
        let whole = n.div_ceil(stages.max(1)) * stages.max(1);
        let mut out = interleaved_1f1b(stage, stages, chunks, whole, backward);
        out.retain(|p| p.mb < n);
        return out;
    }
    let fwd = sequence(stages, chunks, n, true);
    let pass = |forward: bool, (chunk, mb): (usize, usize)| ChunkPass { forward, chunk, mb };
    if !backward {
        return fwd.into_iter().map(|x| pass(true, x)).collect();
    }
    let bwd = sequence(stages, chunks, n, false);
    let total = fwd.len();
    let warmup = warmup(stage, stages, chunks).min(total);
    let mut out = Vec::with_capacity(2 * total);
    out.extend(fwd[..warmup].iter().map(|&x| pass(true, x)));
    for i in 0..total - warmup {
        out.push(pass(true, fwd[warmup + i]));
        out.push(pass(false, bwd[i]));
    }
    out.extend(bwd[total - warmup..].iter().map(|&x| pass(false, x)));
    out
}

/// How many microbatches a module feeding stage 0 (an encoder whose embeddings enter
/// the LLM's first chunk, overlapped) must forward before it first needs a grad back:
/// the most, over microbatches `i`, of the chunk-0 forwards stage 0 of `stages` runs
/// (with `chunks` model chunks over `n` microbatches) before microbatch `i`'s chunk-0
/// backward, less the `i` earlier backwards. A feeder running 1F1B with fewer forwards
/// ahead waits for a grad the LLM sends only after an input the feeder has not yet made:
/// a deadlock. 1F1B's lead is `stages` (its warm-up and one); the interleaved order's
/// about `2 stages`, since its warm-up runs two groups through chunk 0. At least 1.
pub fn feeder_lead(stages: usize, chunks: usize, n: usize) -> usize {
    let (mut seen, mut lead, mut backwards) = (0usize, 1usize, 0usize);
    for p in interleaved_1f1b(0, stages.max(1), chunks, n, true) {
        match (p.chunk, p.forward) {
            (0, true) => seen = seen.max(p.mb + 1),
            (0, false) => {
                lead = lead.max(seen.saturating_sub(backwards));
                backwards += 1;
            }
            _ => {}
        }
    }
    lead
}

/// The most chunk activations held at once (forwards done, their backwards not yet).
pub fn max_in_flight(passes: &[ChunkPass]) -> usize {
    let (mut now, mut max) = (0usize, 0usize);
    for p in passes {
        if p.forward {
            now += 1;
            max = max.max(now);
        } else {
            now = now.saturating_sub(1);
        }
    }
    max
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, VecDeque};

    use super::*;

    #[test]
    fn a_feeder_leads_by_the_chunk0_forwards_before_each_backward() {
        // 1F1B: stage 0 runs `stages` forwards before its first backward, then one
        // more per backward.
        for stages in 1..6 {
            for n in stages..12 {
                assert_eq!(feeder_lead(stages, 1, n), stages, "p {stages} n {n}");
            }
        }
        // Interleaved: two groups through chunk 0 in the warm-up.
        assert_eq!(feeder_lead(2, 2, 8), 4);
        assert_eq!(feeder_lead(4, 3, 16), 8);
        // Never more than the microbatches, never below one.
        assert_eq!(feeder_lead(4, 2, 3), 3);
        assert_eq!(feeder_lead(3, 1, 0), 1);
        // A feeder in 1F1B with `lead` forwards before its first backward runs every
        // pipeline to the end; with one fewer it waits for a grad the pipeline sends
        // only after an input the feeder has not made, wherever the lead binds.
        let mut binds = 0;
        for stages in 1..6 {
            for chunks in 1..4 {
                if chunks > 1 && stages < 2 {
                    continue;
                }
                for n in 0..14 {
                    let lead = feeder_lead(stages, chunks, n);
                    assert!(lead <= n.max(1));
                    let at = format!("p {stages} v {chunks} n {n} lead {lead}");
                    assert!(fed(stages, chunks, n, lead), "{at}: stuck");
                    if lead >= 2 && lead < n {
                        assert!(!fed(stages, chunks, n, lead - 1), "{at}: one fewer ran");
                        binds += 1;
                    }
                }
            }
        }
        assert!(binds > 50, "the lead binds in {binds} cases");
    }

    /// Whether a feeder (one stage, 1F1B with `lead` forwards before its first backward)
    /// in front of a pipeline of `p` stages of `v` chunks runs `n` microbatches to the
    /// end with buffered sends: the first stage's chunk-0 forward of a microbatch takes
    /// the feeder's forward of it, the feeder's backward takes that chunk's backward.
    fn fed(p: usize, v: usize, n: usize, lead: usize) -> bool {
        let feeder: Vec<ChunkPass> = interleaved_1f1b(0, lead, 1, n, true);
        let mut orders: Vec<Vec<ChunkPass>> =
            (0..p).map(|s| interleaved_1f1b(s, p, v, n, true)).collect();
        orders.push(feeder);
        let f = p; // the feeder's index
        let mut pc = vec![0usize; p + 1];
        // done[s][(backward, chunk, mb)]
        let mut done: Vec<std::collections::HashSet<(bool, usize, usize)>> =
            vec![Default::default(); p + 1];
        loop {
            let mut progressed = false;
            for s in 0..=p {
                let Some(&x) = orders[s].get(pc[s]) else {
                    continue;
                };
                let need = if s == f {
                    // The feeder's backward waits for the first stage's chunk 0.
                    (!x.forward).then_some((0, (false, 0, x.mb)))
                } else if x.forward && s == 0 && x.chunk == 0 {
                    Some((f, (true, 0, x.mb)))
                } else {
                    upstream(s, x.chunk, p, v, x.forward)
                        .map(|(src, c)| (src, (x.forward, c, x.mb)))
                };
                let ready =
                    need.is_none_or(|(src, (fwd, c, mb))| done[src].contains(&(!fwd, c, mb)));
                if ready {
                    done[s].insert((!x.forward, x.chunk, x.mb));
                    pc[s] += 1;
                    progressed = true;
                }
            }
            if !progressed {
                return (0..=p).all(|s| pc[s] == orders[s].len());
            }
        }
    }

    /// A message between stages: (forward?, chunk of the receiver, microbatch).
    type Msg = (bool, usize, usize);

    /// The stage and chunk a pass's input comes from (`None`: the step's own input, or
    /// the loss) and where its output goes, in a ring of `p` stages of `v` chunks.
    fn upstream(s: usize, c: usize, p: usize, v: usize, forward: bool) -> Option<(usize, usize)> {
        // Global chunk index g = c p + s; forward input from g - 1, backward from g + 1.
        let g = c * p + s;
        let other = if forward {
            g.checked_sub(1)?
        } else {
            Some(g + 1).filter(|&x| x < v * p)?
        };
        Some((other % p, other / p))
    }

    /// Runs every stage's order with buffered sends. Panics on a deadlock or a message
    /// taken out of order.
    fn run(p: usize, v: usize, n: usize) {
        let orders: Vec<Vec<ChunkPass>> =
            (0..p).map(|s| interleaved_1f1b(s, p, v, n, true)).collect();
        let mut pc = vec![0usize; p];
        // Messages in flight on each (from, to) pair, in send order.
        let mut wire: HashMap<(usize, usize), VecDeque<Msg>> = HashMap::new();
        let mut done: Vec<Vec<bool>> = vec![vec![false; 2 * v * n]; p];
        let key = |x: &ChunkPass| (usize::from(!x.forward) * v + x.chunk) * n + x.mb;
        loop {
            let mut progressed = false;
            for s in 0..p {
                let Some(&x) = orders[s].get(pc[s]) else {
                    continue;
                };
                // Its input: a message from upstream, or (the first forward, the last
                // backward) none; a backward also needs its own forward.
                let from = upstream(s, x.chunk, p, v, x.forward);
                let want: Msg = (x.forward, x.chunk, x.mb);
                if let Some((src, _)) = from {
                    let q = wire.entry((src, s)).or_default();
                    match q.front() {
                        Some(&m) if m == want => {
                            q.pop_front();
                        }
                        Some(_) if q.contains(&want) => {
                            panic!("p {p} v {v} n {n}: stage {s} takes {want:?} out of order")
                        }
                        _ => continue,
                    }
                } else if !x.forward {
                    let f = ChunkPass { forward: true, ..x };
                    assert!(done[s][key(&f)], "backward before forward");
                }
                done[s][key(&x)] = true;
                pc[s] += 1;
                progressed = true;
                let down = upstream(s, x.chunk, p, v, !x.forward);
                if let Some((dst, dc)) = down {
                    wire.entry((s, dst))
                        .or_default()
                        .push_back((x.forward, dc, x.mb));
                }
            }
            if !progressed {
                break;
            }
        }
        let stuck: Vec<_> = (0..p).filter(|&s| pc[s] < orders[s].len()).collect();
        assert!(stuck.is_empty(), "p {p} v {v} n {n}: stuck at {pc:?}");
    }

    #[test]
    fn one_chunk_is_plain_1f1b() {
        let f = |c, mb| ChunkPass {
            forward: true,
            chunk: c,
            mb,
        };
        let b = |c, mb| ChunkPass {
            forward: false,
            chunk: c,
            mb,
        };
        assert_eq!(
            interleaved_1f1b(0, 2, 1, 3, true),
            vec![f(0, 0), f(0, 1), b(0, 0), f(0, 2), b(0, 1), b(0, 2)]
        );
        // Two stages of two chunks, four microbatches: stage 0 runs group 0 through
        // both its chunks (2 + 2 forwards ahead), then alternates.
        assert_eq!(
            interleaved_1f1b(0, 2, 2, 4, true)[..6],
            [f(0, 0), f(0, 1), f(1, 0), f(1, 1), f(0, 2), b(1, 0)]
        );
        assert_eq!(interleaved_1f1b(1, 3, 2, 0, true), vec![]);
        // A pipeline as deep as the step is long (a phased encoder: every forward first).
        assert_eq!(
            interleaved_1f1b(0, usize::MAX, 1, 2, true),
            vec![f(0, 0), f(0, 1), b(0, 0), b(0, 1)]
        );
        assert_eq!(
            interleaved_1f1b(1, 2, 2, 2, false),
            vec![f(0, 0), f(0, 1), f(1, 0), f(1, 1)]
        );
    }

    #[test]
    fn every_pass_once_forward_before_backward_memory_bounded() {
        for p in 1..6 {
            for v in 1..5 {
                for n in 0..10 {
                    for s in 0..p {
                        let ops = interleaved_1f1b(s, p, v, n, true);
                        assert_eq!(ops.len(), 2 * v * n);
                        for c in 0..v {
                            for j in 0..n {
                                let at = |forward| {
                                    ops.iter()
                                        .position(|&x| {
                                            x == ChunkPass {
                                                forward,
                                                chunk: c,
                                                mb: j,
                                            }
                                        })
                                        .unwrap()
                                };
                                assert!(at(true) < at(false), "p {p} v {v} n {n} s {s}");
                            }
                        }
                        // Held chunk activations: at most the warm-up and one more, and
                        // never more than 1F1B's stages' worth of whole-stage passes
                        // plus (P - 1) / V of one.
                        let warm = if v == 1 {
                            p - s - 1
                        } else {
                            2 * (p - s - 1) + (v - 1) * p
                        };
                        assert_eq!(warmup(s, p, v), warm);
                        assert!(max_in_flight(&ops) <= (warm + 1).min(v * n));
                    }
                }
            }
        }
    }

    /// No deadlock and every message taken in the order sent, for 1-7 stages, 1-5
    /// chunks and 0 to four groups and one of microbatches (partial groups included).
    #[test]
    fn no_deadlock_and_messages_in_order() {
        for p in 1..8 {
            for v in 1..6 {
                if p == 1 && v > 1 {
                    continue; // a ring of one stage: the trainer refuses it
                }
                for n in 0..=4 * p + 1 {
                    run(p, v, n);
                }
            }
        }
    }

    /// A partial last group is the whole group with the missing microbatches left out.
    #[test]
    fn a_partial_group_is_a_whole_one_less_the_missing() {
        let whole = interleaved_1f1b(0, 2, 2, 4, true);
        let part = interleaved_1f1b(0, 2, 2, 3, true);
        assert_eq!(part.len(), 2 * 2 * 3);
        let kept: Vec<ChunkPass> = whole.into_iter().filter(|x| x.mb < 3).collect();
        assert_eq!(part, kept);
    }
}
