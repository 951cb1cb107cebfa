//! The per-step straggler check: each rank's busy (compute) time against the median of the ranks doing the same work, the slowest named in `metrics.jsonl` and in the log when it stays behind.
//!
//! Ranks of different modules (or pipeline stages) do different work by design, so a rank
//! is compared only with its *peers*: the ranks holding the same modules at the same
//! stages (every replica and TP/CP rank of them).

use serde::{Deserialize, Serialize};

use crate::parallel::layout::Layouts;

/// A rank slower than its peers' median by more than this fraction is behind.
pub const BEHIND: f64 = 0.2;
/// Steps in a row a rank must be behind before the log says so.
pub const STEPS_IN_A_ROW: u32 = 3;

/// The step's slowest rank relative to its peers.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Straggler {
    pub slowest_rank: usize,
    /// Its compute seconds in the step, and the median of its peers' (itself included).
    pub busy_s: f64,
    pub median_busy_s: f64,
}

impl Straggler {
    /// How much slower than the median (0.25 = 25 % slower).
    pub fn behind(&self) -> f64 {
        if self.median_busy_s > 0.0 {
            self.busy_s / self.median_busy_s - 1.0
        } else {
            0.0
        }
    }
}

/// Each rank's peer group: ranks with equal keys do the same work (the modules they
/// hold, each with its pipeline stage).
pub fn peer_groups(layouts: &Layouts) -> Vec<Vec<(usize, usize)>> {
    let grids = [layouts.vision, layouts.audio, Some(layouts.llm)];
    (0..layouts.world)
        .map(|r| {
            grids
                .iter()
                .enumerate()
                .filter_map(|(m, g)| g.and_then(|g| g.coord(r)).map(|c| (m, c.pp)))
                .collect()
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => v[n / 2],
        _ => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// The rank furthest behind its peers' median (ties to the lowest rank); `None` with
/// fewer than two ranks.
pub fn slowest<K: PartialEq>(busy: &[f64], peers: &[K]) -> Option<Straggler> {
    if busy.len() < 2 || peers.len() != busy.len() {
        return None;
    }
    let mut best: Option<Straggler> = None;
    for (r, &b) in busy.iter().enumerate() {
        let group: Vec<f64> = (0..busy.len())
            .filter(|&q| peers[q] == peers[r])
            .map(|q| busy[q])
            .collect();
        let s = Straggler {
            slowest_rank: r,
            busy_s: b,
            median_busy_s: median(group),
        };
        if best.is_none_or(|x| s.behind() > x.behind()) {
            best = Some(s);
        }
    }
    best
}

/// Watches the slowest rank step after step.
#[derive(Debug, Default)]
pub struct Watch {
    /// The rank behind in the last steps, and for how many in a row.
    streak: Option<(usize, u32)>,
}

impl Watch {
    /// The log line to print for this step's straggler, if any: once a rank has been
    /// more than [`BEHIND`] slower than its peers [`STEPS_IN_A_ROW`] steps in a row.
    pub fn observe(&mut self, step: u64, s: Option<&Straggler>) -> Option<String> {
        let behind = s.filter(|s| s.behind() > BEHIND);
        self.streak = match (behind, self.streak) {
            (Some(s), Some((r, n))) if r == s.slowest_rank => Some((r, n + 1)),
            (Some(s), _) => Some((s.slowest_rank, 1)),
            (None, _) => None,
        };
        match (behind, self.streak) {
            (Some(s), Some((_, n))) if n == STEPS_IN_A_ROW => Some(format!(
                "step {step}: rank {} is a straggler: {:.3} s of compute against its peers' median {:.3} s ({:.0} % slower, {n} steps in a row)",
                s.slowest_rank,
                s.busy_s,
                s.median_busy_s,
                100.0 * s.behind()
            )),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_is_measured_against_its_peers() {
        // Ranks 0-1 encode (fast by design), 2-5 run the LLM; rank 4 is 50 % behind.
        let busy = [0.1, 0.1, 1.0, 1.0, 1.5, 1.0];
        let peers = [0, 0, 1, 1, 1, 1];
        let s = slowest(&busy, &peers).unwrap();
        assert_eq!(s.slowest_rank, 4);
        assert_eq!(s.median_busy_s, 1.0);
        assert!((s.behind() - 0.5).abs() < 1e-12);
        // Compared with everyone, the encoders would make every LLM rank look slow.
        assert!(slowest(&[1.0], &[0]).is_none());
    }

    #[test]
    fn the_log_names_a_rank_behind_for_several_steps_once() {
        let mut w = Watch::default();
        let behind = |r| Straggler {
            slowest_rank: r,
            busy_s: 1.3,
            median_busy_s: 1.0,
        };
        let even = Straggler {
            slowest_rank: 0,
            busy_s: 1.05,
            median_busy_s: 1.0,
        };
        assert!(w.observe(1, Some(&behind(2))).is_none());
        assert!(w.observe(2, Some(&behind(2))).is_none());
        let line = w.observe(3, Some(&behind(2))).unwrap();
        assert!(
            line.contains("rank 2") && line.contains("30 % slower"),
            "{line}"
        );
        assert!(w.observe(4, Some(&behind(2))).is_none(), "once per streak");
        // Another rank, or a step within 20 %, starts over.
        assert!(w.observe(5, Some(&behind(3))).is_none());
        assert!(w.observe(6, Some(&even)).is_none());
        assert!(w.observe(7, Some(&behind(3))).is_none());
    }
}
