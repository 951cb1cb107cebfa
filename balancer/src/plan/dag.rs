//! The event-driven core of the simulator: tasks on lanes (a lane is one pipeline stage
//! of one replica: a TP × CP block of GPUs acting in lockstep), each lane running its
//! tasks in a fixed order (the schedule's), a task starting once its lane is free and
//! its dependencies are done. On GPUs every lane has its own devices; on a CPU
//! (`shared`) the ranks computing at the same moment share one device's rate.

use crate::plan::cost::Cost;

/// One unit of work.
#[derive(Clone, Debug)]
pub struct Task {
    pub lane: usize,
    pub cost: Cost,
}

/// A lane and the GPUs (ranks) it stands for; 0 ranks for the network (the bridge).
#[derive(Clone, Debug)]
pub struct Lane {
    pub ranks: usize,
    pub label: String,
}

/// Tasks in per-lane schedule order.
#[derive(Clone, Debug, Default)]
pub struct Dag {
    pub tasks: Vec<Task>,
    pub lanes: Vec<Lane>,
    order: Vec<Vec<usize>>,
    /// (task, the task it waits for): one flat list (steps have ~10^5 tasks).
    edges: Vec<(u32, u32)>,
    /// Each task's name ("llm fwd s0 mb3"), kept only by [`Dag::named`] (for a predicted
    /// timeline; the search's simulations skip the strings).
    names: Option<Vec<String>>,
}

/// [`Dag::share_devices`]'s sequence as it grows: each task's position, each lane's next
/// task, each task's unsequenced dependencies.
struct Sequence {
    dependents: Dependents,
    pending: Vec<usize>,
    next: Vec<usize>,
    pos: Vec<usize>,
    placed: usize,
    stacked: Vec<bool>,
}

impl Sequence {
    fn new(g: &Dag) -> Sequence {
        let (dependents, pending) = g.dependents();
        let n = g.tasks.len();
        Sequence {
            dependents,
            pending,
            next: vec![0; g.lanes.len()],
            pos: vec![usize::MAX; n],
            placed: 0,
            stacked: vec![false; n],
        }
    }

    /// Sequences task `t` (ready, its lane's next), then every network task that makes
    /// ready, at once.
    fn place(&mut self, g: &Dag, t: usize) {
        self.mark(g, t);
        self.release(g, t);
    }

    /// Takes `t` into the sequence; its dependents learn of it at [`Sequence::release`].
    fn mark(&mut self, g: &Dag, t: usize) {
        self.stacked[t] = true;
        self.pos[t] = self.placed;
        self.placed += 1;
        self.next[g.tasks[t].lane] += 1;
    }

    /// `t`'s dependents learn of it; network tasks it makes ready join at once.
    fn release(&mut self, g: &Dag, t: usize) {
        let mut stack = vec![t];
        let mut first = true;
        while let Some(t) = stack.pop() {
            let l = g.tasks[t].lane;
            if !first {
                self.mark(g, t);
            }
            first = false;
            for u in self.dependents.of(t) {
                self.pending[u] -= 1;
            }
            let after = g.order[l].get(self.next[l]).copied();
            for u in self.dependents.of(t).chain(after) {
                let ul = g.tasks[u].lane;
                if g.lanes[ul].ranks == 0
                    && self.pending[u] == 0
                    && !self.stacked[u]
                    && g.order[ul].get(self.next[ul]) == Some(&u)
                {
                    self.stacked[u] = true;
                    stack.push(u);
                }
            }
        }
    }
}

/// Compressed adjacency: the tasks waiting on each task.
struct Dependents {
    start: Vec<u32>,
    out: Vec<u32>,
}

impl Dependents {
    fn of(&self, t: usize) -> impl Iterator<Item = usize> + '_ {
        self.out[self.start[t] as usize..self.start[t + 1] as usize]
            .iter()
            .map(|&u| u as usize)
    }
}

/// When every task ran.
#[derive(Clone, Debug)]
pub struct Timeline {
    pub start: Vec<f64>,
    pub end: Vec<f64>,
    pub makespan: f64,
    /// Seconds each lane was busy, and busy computing.
    pub busy: Vec<f64>,
    pub compute: Vec<f64>,
}

impl Dag {
    fn compute_per_lane(&self) -> Vec<f64> {
        let mut c = vec![0.0; self.lanes.len()];
        for t in &self.tasks {
            c[t.lane] += t.cost.compute;
        }
        c
    }
}

impl Dag {
    /// A DAG that keeps its tasks' names.
    pub fn named() -> Dag {
        Dag {
            names: Some(Vec::new()),
            ..Dag::default()
        }
    }

    /// Names task `id` (when names are kept; `name` runs only then).
    pub fn name(&mut self, id: usize, name: impl FnOnce() -> String) {
        if let Some(slot) = self.names.as_mut().and_then(|n| n.get_mut(id)) {
            *slot = name();
        }
    }

    /// The name of task `id` ("" when unnamed or names are not kept).
    pub fn name_of(&self, id: usize) -> &str {
        self.names
            .as_ref()
            .and_then(|n| n.get(id))
            .map_or("", String::as_str)
    }

    pub fn lane(&mut self, ranks: usize, label: impl Into<String>) -> usize {
        self.lanes.push(Lane {
            ranks,
            label: label.into(),
        });
        self.order.push(Vec::new());
        self.lanes.len() - 1
    }

    /// Appends a task to `lane`'s order.
    pub fn push(&mut self, lane: usize, cost: Cost, deps: &[usize]) -> usize {
        let id = self.tasks.len();
        self.tasks.push(Task { lane, cost });
        if let Some(n) = self.names.as_mut() {
            n.push(String::new());
        }
        self.order[lane].push(id);
        for &d in deps {
            self.wait(id, d);
        }
        id
    }

    /// Task `t` starts after task `dep` ends.
    pub fn wait(&mut self, t: usize, dep: usize) {
        self.edges.push((t as u32, dep as u32));
    }

    /// Makes lanes that share devices take turns in one order global to the step, the
    /// one `braid train`'s colocated overlapped step runs (`train/src/parallel/order.rs`):
    /// round after round, every device lane's next task whose dependencies earlier rounds
    /// sequenced joins it (the lanes of `first` first, in that order, then the rest), a
    /// task of the network's lanes (no devices: the bridge) joining at the end of the
    /// round that makes it ready, as a message sent in one round is received in the
    /// next; the lanes of each group of `groups` (those one device holds) then run their
    /// tasks in the sequence's order. An error names a lane stuck waiting.
    pub fn share_devices(&mut self, first: &[usize], groups: &[Vec<usize>]) -> Result<(), String> {
        let lanes = self.lanes.len();
        let mut lane_order: Vec<usize> = first.iter().copied().filter(|&l| l < lanes).collect();
        let mut listed = vec![false; lanes];
        lane_order.iter().for_each(|&l| listed[l] = true);
        lane_order.extend((0..lanes).filter(|&l| !listed[l]));
        lane_order.retain(|&l| self.lanes[l].ranks > 0);
        let mut seq = Sequence::new(self);
        // Network tasks that wait on nothing.
        for l in (0..lanes).filter(|&l| self.lanes[l].ranks == 0) {
            if let Some(&t) = self.order[l].first()
                && seq.pending[t] == 0
            {
                seq.place(self, t);
            }
        }
        while seq.placed < self.tasks.len() {
            let before = seq.placed;
            // A round sees only what earlier rounds sequenced.
            let mut round = Vec::new();
            for &l in &lane_order {
                if let Some(&t) = self.order[l].get(seq.next[l])
                    && seq.pending[t] == 0
                {
                    seq.mark(self, t);
                    round.push(t);
                }
            }
            for t in round {
                seq.release(self, t);
            }
            if seq.placed == before {
                return Err(self.stuck(&seq.next));
            }
        }
        let pos = seq.pos;
        for group in groups {
            let mut tasks: Vec<usize> = group
                .iter()
                .filter(|&&l| l < lanes)
                .flat_map(|&l| self.order[l].iter().copied())
                .collect();
            tasks.sort_unstable_by_key(|&t| pos[t]);
            for w in tasks.windows(2) {
                self.wait(w[1], w[0]);
            }
        }
        Ok(())
    }

    /// Runs the schedule; an error names a lane stuck waiting (a schedule that deadlocks).
    pub fn simulate(&self, shared: bool) -> Result<Timeline, String> {
        if shared {
            self.simulate_shared()
        } else {
            self.simulate_dedicated()
        }
    }

    /// Who waits on each task (CSR: `out[start[t]..start[t + 1]]`) and how many tasks
    /// each task waits on.
    fn dependents(&self) -> (Dependents, Vec<usize>) {
        let n = self.tasks.len();
        let mut start = vec![0u32; n + 1];
        let mut pending = vec![0; n];
        for &(t, d) in &self.edges {
            start[d as usize + 1] += 1;
            pending[t as usize] += 1;
        }
        for i in 0..n {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut out = vec![0u32; self.edges.len()];
        for &(t, d) in &self.edges {
            out[fill[d as usize] as usize] = t;
            fill[d as usize] += 1;
        }
        (Dependents { start, out }, pending)
    }

    fn stuck(&self, next: &[usize]) -> String {
        let lane = (0..self.lanes.len()).find(|&l| next[l] < self.order[l].len());
        match lane {
            Some(l) => format!(
                "the schedule deadlocks: lane {} waits at task {} of {}",
                self.lanes[l].label,
                next[l],
                self.order[l].len()
            ),
            None => "the schedule deadlocks".to_string(),
        }
    }

    /// Each task's end is known when it starts: O(tasks + edges).
    fn simulate_dedicated(&self) -> Result<Timeline, String> {
        let n = self.tasks.len();
        let (dependents, mut pending) = self.dependents();
        let (mut start, mut end, mut ready) = (vec![0.0; n], vec![0.0; n], vec![0.0f64; n]);
        let mut next = vec![0usize; self.lanes.len()];
        let mut free = vec![0.0f64; self.lanes.len()];
        let mut busy = vec![0.0; self.lanes.len()];
        let mut queue: Vec<usize> = (0..self.lanes.len()).collect();
        let mut done = 0;
        while let Some(l) = queue.pop() {
            while let Some(&t) = self.order[l].get(next[l]) {
                if pending[t] > 0 {
                    break;
                }
                let d = self.tasks[t].cost.total();
                start[t] = free[l].max(ready[t]);
                end[t] = start[t] + d;
                free[l] = end[t];
                busy[l] += d;
                next[l] += 1;
                done += 1;
                for u in dependents.of(t) {
                    ready[u] = ready[u].max(end[t]);
                    pending[u] -= 1;
                    let ul = self.tasks[u].lane;
                    if pending[u] == 0 && ul != l && self.order[ul].get(next[ul]) == Some(&u) {
                        queue.push(ul);
                    }
                }
            }
        }
        if done < n {
            return Err(self.stuck(&next));
        }
        let makespan = end.iter().copied().fold(0.0, f64::max);
        Ok(Timeline {
            start,
            end,
            makespan,
            busy,
            compute: self.compute_per_lane(),
        })
    }

    /// Processor sharing: a task's compute advances at 1 / (ranks computing now) of a
    /// device per rank; its comm part then runs at full speed.
    fn simulate_shared(&self) -> Result<Timeline, String> {
        let n = self.tasks.len();
        let (dependents, mut pending) = self.dependents();
        let (mut start, mut end) = (vec![0.0; n], vec![0.0; n]);
        let mut next = vec![0usize; self.lanes.len()];
        let mut busy = vec![0.0; self.lanes.len()];
        // Per running lane: (task, compute left, comm left).
        let mut running: Vec<(usize, f64, f64)> = Vec::new();
        let mut now = 0.0f64;
        let mut done = 0;
        loop {
            for (l, &at) in next.iter().enumerate() {
                if running.iter().any(|r| self.tasks[r.0].lane == l) {
                    continue;
                }
                if let Some(&t) = self.order[l].get(at)
                    && pending[t] == 0
                {
                    start[t] = now;
                    running.push((t, self.tasks[t].cost.compute, self.tasks[t].cost.comm));
                }
            }
            if running.is_empty() {
                break;
            }
            let computing: usize = running
                .iter()
                .filter(|r| r.1 > 0.0)
                .map(|r| self.lanes[self.tasks[r.0].lane].ranks)
                .sum();
            let slow = (computing as f64).max(1.0);
            // Time until the first running task changes phase or finishes.
            let step = running
                .iter()
                .map(|r| if r.1 > 0.0 { r.1 * slow } else { r.2 })
                .fold(f64::INFINITY, f64::min);
            now += step;
            let mut finished = Vec::new();
            for r in running.iter_mut() {
                if r.1 > 0.0 {
                    r.1 -= step / slow;
                    if r.1 <= 1e-15 {
                        r.1 = 0.0;
                    }
                } else {
                    r.2 -= step;
                    if r.2 <= 1e-15 {
                        finished.push(r.0);
                    }
                }
            }
            running.retain(|r| !finished.contains(&r.0));
            for t in finished {
                let l = self.tasks[t].lane;
                end[t] = now;
                busy[l] += now - start[t];
                next[l] += 1;
                done += 1;
                for u in dependents.of(t) {
                    pending[u] -= 1;
                }
            }
        }
        if done < n {
            return Err(self.stuck(&next));
        }
        Ok(Timeline {
            start,
            end,
            makespan: now,
            busy,
            compute: self.compute_per_lane(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(compute: f64) -> Cost {
        Cost { compute, comm: 0.0 }
    }

    #[test]
    fn a_two_stage_pipeline_overlaps_and_a_shared_device_does_not() {
        let mut g = Dag::default();
        let (a, b) = (g.lane(1, "s0"), g.lane(1, "s1"));
        let f0 = g.push(a, c(1.0), &[]);
        let f1 = g.push(a, c(1.0), &[]);
        g.push(b, c(1.0), &[f0]);
        g.push(b, c(1.0), &[f1]);
        let t = g.simulate(false).unwrap();
        assert_eq!(t.makespan, 3.0);
        assert_eq!(t.busy, vec![2.0, 2.0]);
        // One device for both ranks: the 4 s of work take 4 s.
        let s = g.simulate(true).unwrap();
        assert!((s.makespan - 4.0).abs() < 1e-9, "{}", s.makespan);
    }

    #[test]
    fn a_cycle_is_reported() {
        let mut g = Dag::default();
        let (a, b) = (g.lane(1, "a"), g.lane(1, "b"));
        // a runs x then y; b runs z; y needs z, z needs y: stuck.
        g.push(a, c(1.0), &[]);
        let y = 1;
        let z = 2;
        g.push(a, c(1.0), &[z]);
        g.push(b, c(1.0), &[y]);
        assert!(g.simulate(false).unwrap_err().contains("deadlocks"));
        assert!(g.simulate(true).unwrap_err().contains("deadlocks"));
    }

    /// Two lanes on one device (an LLM stage and an encoder stage, colocated) take
    /// turns in round-robin order, the first lane's task first in each round; a lane on
    /// another device runs on.
    #[test]
    fn lanes_sharing_a_device_take_turns_in_rounds() {
        let mut g = Dag::default();
        let (llm, enc, other) = (g.lane(1, "llm"), g.lane(1, "enc"), g.lane(1, "other"));
        // The encoder's two passes feed the LLM's two; the other device's one pass.
        let e0 = g.push(enc, c(1.0), &[]);
        let e1 = g.push(enc, c(1.0), &[]);
        let l0 = g.push(llm, c(2.0), &[e0]);
        let l1 = g.push(llm, c(2.0), &[e1]);
        let o = g.push(other, c(5.0), &[]);
        // Without turns the encoder's second pass runs beside the LLM's first.
        let free = g.simulate(false).unwrap();
        assert!(free.start[e1] < free.end[l0] && free.start[l0] < free.end[e1]);
        g.share_devices(&[llm], &[vec![llm, enc], vec![other]])
            .unwrap();
        let t = g.simulate(false).unwrap();
        // Rounds: e0 | l0, e1 | l1: on the shared device e0, l0, e1, l1 one at a time.
        let order = [e0, l0, e1, l1];
        for w in order.windows(2) {
            assert!(t.start[w[1]] >= t.end[w[0]] - 1e-12, "{w:?}: {:?}", t.start);
        }
        assert_eq!(t.makespan, 6.0);
        assert_eq!(t.start[o], 0.0);
    }

    /// A message sent in one round is received in the next, over the network's lanes too
    /// (the bridge takes no round of its own), as the trainer's order has it.
    #[test]
    fn a_message_is_received_the_round_after_it_is_sent() {
        let mut g = Dag::default();
        let (llm, enc) = (g.lane(1, "llm"), g.lane(1, "enc"));
        let (fwd, back) = (g.lane(0, "bridge 0"), g.lane(0, "bridge back 0"));
        // The encoder two chunks ahead (F0 F1 B0 B1), the LLM alternating (F0 B0 F1 B1).
        let ef0 = g.push(enc, c(1.0), &[]);
        let ef1 = g.push(enc, c(1.0), &[]);
        let b0 = g.push(fwd, c(0.0), &[ef0]);
        let lf0 = g.push(llm, c(1.0), &[b0]);
        let lb0 = g.push(llm, c(1.0), &[]);
        let lf1 = g.push(llm, c(1.0), &[]);
        let lb1 = g.push(llm, c(1.0), &[]);
        let bb0 = g.push(back, c(0.0), &[lb0]);
        let eb0 = g.push(enc, c(1.0), &[bb0]);
        let eb1 = g.push(enc, c(1.0), &[]);
        g.share_devices(&[llm], &[vec![llm, enc]]).unwrap();
        let t = g.simulate(false).unwrap();
        // Rounds: ef0 | lf0 ef1 | lb0 | lf1 eb0 | lb1 eb1.
        let order = [ef0, lf0, ef1, lb0, lf1, eb0, lb1, eb1];
        for w in order.windows(2) {
            assert!(t.start[w[1]] >= t.end[w[0]] - 1e-12, "{w:?}: {:?}", t.start);
        }
        assert_eq!(t.makespan, 8.0);
    }

    #[test]
    fn sharing_devices_reports_a_cycle() {
        let mut g = Dag::default();
        let (a, b) = (g.lane(1, "a"), g.lane(1, "b"));
        g.push(a, c(1.0), &[]);
        g.push(a, c(1.0), &[2]);
        g.push(b, c(1.0), &[1]);
        let e = g.share_devices(&[a], &[vec![a, b]]).unwrap_err();
        assert!(e.contains("deadlocks"), "{e}");
    }
}
