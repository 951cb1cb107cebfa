//! Zero-bubble pipelining (ZB-H1, Qi et al. 2023): the order `braid train` runs and
//! `braid plan` simulates when a pipeline's backward is split in two.
//!
//! A stage's backward becomes B, the input gradient the stage before waits for, and W,
//! the weight gradient nothing waits for but the optimizer. 1F1B idles each stage for
//! `P - 1` forward-and-backward times over a step, waiting to fill and to drain; run W
//! late, where a stage would otherwise wait, and some of the waits fill. Here a
//! microbatch holds its activations until its W, and a stage holds no more microbatches
//! than under 1F1B, so the memory is 1F1B's; where F, B and W take as long, the idle time
//! is two thirds of 1F1B's (the paper's ZB-H1 reaches a third by letting the last stages
//! hold more microbatches' W inputs).
//!
//! Each stage's order is the one a greedy run in unit time gives, every pass one tick:
//! each tick, each stage runs a B whose gradient has come, else a forward while fewer
//! than `P - s` microbatches hold activations (forward done, W not: 1F1B's in-flight
//! bound, so no more memory than 1F1B), else its oldest W. The run is a schedule every
//! stage keeps, so the orders cannot deadlock with buffered sends; every stage runs its
//! forwards and its B's in microbatch order, so the messages between two stages arrive in
//! the order they are received.

/// One pass of a stage under the split backward, on the microbatch it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SplitPass {
    Forward(usize),
    /// The input gradient (and every gradient but the linear layers' weights').
    Backward(usize),
    /// The linear layers' weight gradients.
    Weight(usize),
}

/// Stage `stage` of `stages`' passes over `n` microbatches (one model chunk a stage).
pub fn zero_bubble(stage: usize, stages: usize, n: usize) -> Vec<SplitPass> {
    zero_bubble_orders(stages, n)
        .into_iter()
        .nth(stage)
        .unwrap_or_default()
}

/// Every stage's order at once, from the greedy run in unit time (see the module docs):
/// what [`zero_bubble`] gives stage by stage, each call running the whole pipeline.
pub fn zero_bubble_orders(stages: usize, n: usize) -> Vec<Vec<SplitPass>> {
    let p = stages.max(1);
    const NOT_YET: usize = usize::MAX;
    let mut out: Vec<Vec<SplitPass>> = vec![Vec::with_capacity(3 * n); p];
    // The tick each stage's forward / B of each microbatch ran.
    let (mut f_at, mut b_at) = (vec![vec![NOT_YET; n]; p], vec![vec![NOT_YET; n]; p]);
    let (mut nf, mut nb, mut nw) = (vec![0; p], vec![0; p], vec![0; p]);
    let mut tick = 0usize;
    while (0..p).any(|s| nw[s] < n) {
        for s in 0..p {
            // A pass sees what ran in earlier ticks only.
            let came = |at: usize| at < tick;
            let b_ready = nb[s] < nf[s]
                && came(if s + 1 == p {
                    f_at[s][nb[s]]
                } else {
                    b_at[s + 1][nb[s]]
                });
            let f_ready =
                nf[s] < n && nf[s] - nw[s] < p - s && (s == 0 || came(f_at[s - 1][nf[s]]));
            if b_ready {
                b_at[s][nb[s]] = tick;
                out[s].push(SplitPass::Backward(nb[s]));
                nb[s] += 1;
            } else if f_ready {
                f_at[s][nf[s]] = tick;
                out[s].push(SplitPass::Forward(nf[s]));
                nf[s] += 1;
            } else if nw[s] < nb[s] {
                out[s].push(SplitPass::Weight(nw[s]));
                nw[s] += 1;
            }
        }
        tick += 1;
    }
    out
}

/// The most microbatches holding activations at once in `passes` (forward done, W not).
pub fn max_in_flight(passes: &[SplitPass]) -> usize {
    let (mut now, mut max) = (0usize, 0usize);
    for p in passes {
        match p {
            SplitPass::Forward(_) => {
                now += 1;
                max = max.max(now);
            }
            SplitPass::Weight(_) => now = now.saturating_sub(1),
            SplitPass::Backward(_) => {}
        }
    }
    max
}

#[cfg(test)]
mod tests {
    use super::SplitPass::{Backward as B, Forward as F, Weight as W};
    use super::*;

    /// Runs every stage's order with the given pass times, each pass waiting for its
    /// input (a forward for the stage before's, a B for the stage after's, the last
    /// stage's B for its own forward); returns the step's end, or `None` if stuck.
    fn run(p: usize, n: usize, time: impl Fn(SplitPass, usize) -> f64) -> Option<f64> {
        let orders: Vec<Vec<SplitPass>> = (0..p).map(|s| zero_bubble(s, p, n)).collect();
        let (mut f_end, mut b_end) = (vec![vec![None; n]; p], vec![vec![None; n]; p]);
        let (mut next, mut free) = (vec![0usize; p], vec![0.0f64; p]);
        loop {
            let mut moved = false;
            for s in 0..p {
                let Some(&pass) = orders[s].get(next[s]) else {
                    continue;
                };
                let input = match pass {
                    F(j) if s > 0 => f_end[s - 1][j],
                    B(j) if s + 1 < p => b_end[s + 1][j],
                    B(j) => f_end[s][j],
                    _ => Some(0.0),
                };
                let Some(ready) = input else { continue };
                let end = free[s].max(ready) + time(pass, s);
                match pass {
                    F(j) => f_end[s][j] = Some(end),
                    B(j) => b_end[s][j] = Some(end),
                    W(_) => {}
                }
                free[s] = end;
                next[s] += 1;
                moved = true;
            }
            if (0..p).all(|s| next[s] == orders[s].len()) {
                return Some(free.iter().fold(0.0, |a, &b| a.max(b)));
            }
            if !moved {
                return None;
            }
        }
    }

    #[test]
    fn every_pass_once_in_order_within_1f1b_memory() {
        for p in 1..=6 {
            for n in 1..=10 {
                for s in 0..p {
                    let o = zero_bubble(s, p, n);
                    let at = |x: SplitPass| o.iter().position(|&y| y == x).unwrap();
                    assert_eq!(o.len(), 3 * n, "p{p} n{n} s{s}: {o:?}");
                    for j in 0..n {
                        assert!(at(F(j)) < at(B(j)) && at(B(j)) < at(W(j)), "p{p} n{n} s{s}");
                        if j > 0 {
                            // Forwards and B's in microbatch order: messages in order.
                            assert!(at(F(j - 1)) < at(F(j)) && at(B(j - 1)) < at(B(j)));
                        }
                    }
                    assert!(max_in_flight(&o) <= (p - s).min(n), "p{p} n{n} s{s}: {o:?}");
                }
            }
        }
        assert_eq!(
            zero_bubble(0, 1, 2),
            vec![F(0), B(0), W(0), F(1), B(1), W(1)]
        );
        assert_eq!(zero_bubble(3, 2, 2), vec![]);
    }

    /// An encoder feeding the first stage runs 1F1B's lead ahead of it
    /// ([`crate::pipeline::feeder_lead`]): the split order never needs more, or the
    /// encoder would wait for a gradient the LLM sends only after an input it lacks.
    #[test]
    fn the_first_stage_needs_no_more_lead_than_1f1b() {
        for p in 1..=6 {
            for n in 1..=12 {
                let (mut seen, mut lead, mut backwards) = (0usize, 1usize, 0usize);
                for pass in zero_bubble(0, p, n) {
                    match pass {
                        F(j) => seen = seen.max(j + 1),
                        B(_) => {
                            lead = lead.max(seen - backwards);
                            backwards += 1;
                        }
                        W(_) => {}
                    }
                }
                let plain = crate::pipeline::feeder_lead(p, 1, n);
                assert!(lead <= plain, "p{p} n{n}: {lead} > {plain}");
            }
        }
    }

    #[test]
    fn no_deadlock_under_any_pass_times_and_two_thirds_of_the_idle_time() {
        // Unit passes: 3n + 2 (P - 1) ticks, where 1F1B with a backward of 2 takes
        // 3n + 3 (P - 1): the idle time two thirds of 1F1B's.
        for p in 1..=5 {
            for n in p..=12 {
                let end = run(p, n, |_, _| 1.0).unwrap();
                assert_eq!(end, (3 * n + 2 * (p - 1)) as f64, "p{p} n{n}");
            }
        }
        // Uneven times (stages and passes): every order still runs to the end.
        for p in 1..=5 {
            for n in 1..=9 {
                let t = |x: SplitPass, s: usize| match x {
                    F(j) => 1.0 + 0.3 * ((s + j) % 3) as f64,
                    B(j) => 1.1 + 0.2 * ((s * 7 + j) % 4) as f64,
                    W(_) => 0.4 + 0.1 * s as f64,
                };
                assert!(run(p, n, t).is_some(), "p{p} n{n}");
            }
        }
    }
}
