//! The 1F1B pipeline schedule (PipeDream-flush, as in Megatron-LM): stage `s` of `P`
//! runs `P - s - 1` warm-up forwards, then alternates one forward and one backward, then
//! drains the remaining backwards. At most `P - s` microbatches are in flight on stage
//! `s`, so it holds that many activation caches instead of all of them (GPipe).
//!
//! Sends are buffered (they never block), so the order below cannot deadlock: every
//! receive waits on a message the neighbour sends earlier in its own order.

/// One unit of pipeline work on a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Forward(usize),
    Backward(usize),
    /// Zero-bubble pipelining's weight-gradient pass of a backward already run.
    Weight(usize),
}

/// The order of forwards and backwards of `n` microbatches on stage `stage` of `stages`
/// (the one-chunk case of [`braid_balancer::pipeline::interleaved_1f1b`], the order the
/// planner simulates).
pub fn one_f_one_b(stage: usize, stages: usize, n: usize) -> Vec<Op> {
    braid_balancer::pipeline::interleaved_1f1b(stage, stages, 1, n, true)
        .into_iter()
        .map(|p| {
            if p.forward {
                Op::Forward(p.mb)
            } else {
                Op::Backward(p.mb)
            }
        })
        .collect()
}

/// The most microbatches in flight (forward done, backward not yet) in `ops`.
pub fn max_in_flight(ops: &[Op]) -> usize {
    let (mut now, mut max) = (0usize, 0usize);
    for op in ops {
        match op {
            Op::Forward(_) => now += 1,
            Op::Backward(_) => now = now.saturating_sub(1),
            Op::Weight(_) => {}
        }
        max = max.max(now);
    }
    max
}

#[cfg(test)]
mod tests {
    use super::*;
    use Op::{Backward as B, Forward as F};

    #[test]
    fn last_stage_alternates_first_stage_warms_up() {
        assert_eq!(
            one_f_one_b(1, 2, 3),
            vec![F(0), B(0), F(1), B(1), F(2), B(2)]
        );
        assert_eq!(
            one_f_one_b(0, 2, 3),
            vec![F(0), F(1), B(0), F(2), B(1), B(2)]
        );
        // Fewer microbatches than stages: all forwards, then all backwards.
        assert_eq!(one_f_one_b(0, 4, 2), vec![F(0), F(1), B(0), B(1)]);
        assert_eq!(one_f_one_b(0, 1, 0), vec![]);
    }

    #[test]
    fn every_microbatch_once_forward_before_backward_bounded_memory() {
        for stages in 1..6 {
            for stage in 0..stages {
                for n in 0..9 {
                    let ops = one_f_one_b(stage, stages, n);
                    assert_eq!(ops.len(), 2 * n);
                    for i in 0..n {
                        let f = ops.iter().position(|&o| o == F(i)).unwrap();
                        let b = ops.iter().position(|&o| o == B(i)).unwrap();
                        assert!(f < b);
                    }
                    assert!(max_in_flight(&ops) <= (stages - stage).min(n.max(1)));
                }
            }
        }
    }

    /// Simulates the stages with buffered sends: every stage must make progress to the
    /// end (no deadlock) for any stage count and microbatch count.
    #[test]
    fn the_schedule_cannot_deadlock() {
        for stages in 1..6 {
            for n in 0..9 {
                let orders: Vec<Vec<Op>> = (0..stages).map(|s| one_f_one_b(s, stages, n)).collect();
                let mut pc = vec![0usize; stages];
                // acts[s] = forwards sent downstream; grads[s] = backwards sent upstream.
                let mut fwd_sent = vec![0usize; stages];
                let mut bwd_sent = vec![0usize; stages];
                loop {
                    let mut progressed = false;
                    for s in 0..stages {
                        let Some(&op) = orders[s].get(pc[s]) else {
                            continue;
                        };
                        let ready = match op {
                            F(i) => s == 0 || fwd_sent[s - 1] > i,
                            B(i) => s == stages - 1 || bwd_sent[s + 1] > i,
                            Op::Weight(_) => true,
                        };
                        if ready {
                            match op {
                                F(_) => fwd_sent[s] += 1,
                                B(_) => bwd_sent[s] += 1,
                                Op::Weight(_) => {}
                            }
                            pc[s] += 1;
                            progressed = true;
                        }
                    }
                    if !progressed {
                        break;
                    }
                }
                assert!(
                    (0..stages).all(|s| pc[s] == orders[s].len()),
                    "stages {stages} n {n}: stuck at {pc:?}"
                );
            }
        }
    }
}
