//! The work-conserving bound of a step and how far a plan is from it.
//!
//! The bound is each module's busy GPU-seconds at its own cheapest layout (one GPU per
//! replica: no TP/CP/PP communication, no recomputation, memory ignored), on the plan's
//! chunks of the batch, summed over the modules and divided by the GPUs: a step with
//! no bubble, no waiting, no bridge and no gradient sync. A plan's step splits into the
//! bound and five parts (seconds of the step, i.e. GPU-seconds over the GPUs):
//!
//! - **memory-forced choices**: the plan's own busy work beyond the bound's (its TP, CP
//!   and PP communication, recomputation, smaller matmuls: what fitting in memory costs),
//!   taken as the rest of the step once the other parts are counted;
//! - **gradient sync**: the exposed part of each lane's gradient reduction;
//! - **imbalance**: the time a replica's lane waits for the busiest replica of its
//!   module and stage;
//! - **bridge**: the bridge transfers on the step's critical path (all of them in the
//!   phased schedule, a chunk's each way in the overlapped one), at most the idle time
//!   left;
//! - **bubbles**: the rest of the idle time (pipeline fill and drain, waiting on other
//!   modules).

use crate::dims::Module;
use crate::plan::lanes::module_load;
use crate::plan::layout::{Layout, Plan, Schedule};
use crate::plan::step::{Problem, StepSim};
use crate::workload::RowShape;

/// A plan's distance from the bound, split into its parts (seconds of the step).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Gap {
    pub bound_s: f64,
    pub memory_forced_s: f64,
    pub grad_sync_s: f64,
    pub imbalance_s: f64,
    pub bridge_s: f64,
    pub bubbles_s: f64,
}

impl Gap {
    /// The step time these parts add up to.
    pub fn step_s(&self) -> f64 {
        self.bound_s
            + self.memory_forced_s
            + self.grad_sync_s
            + self.imbalance_s
            + self.bridge_s
            + self.bubbles_s
    }
}

impl Problem {
    /// Module `m`'s busy GPU-seconds on `rows` at its cheapest one-GPU layout, its work
    /// cut into `chunks` equal pieces (the plan's microbatches over its replicas).
    fn least_work(&self, m: Module, rows: &[RowShape], chunks: usize) -> Option<f64> {
        let sc = self.cost(
            m,
            Layout {
                tp: 1,
                cp: 1,
                pp: 1,
                dp: 1,
            },
            false,
            true,
        )?;
        let (tokens, sq) = module_load(self, rows, m);
        let k = chunks.max(1) as f64;
        let (t, s) = (tokens / k, sq / k);
        let mut per = sc.forward(0, t, s).total();
        if !sc.frozen {
            per += sc.backward(0, t, s).total();
        }
        Some(k * per)
    }

    /// The work-conserving bound of `plan`'s step on the global batch `rows`, in
    /// seconds.
    pub fn work_bound(&self, plan: &Plan, rows: &[RowShape]) -> f64 {
        let modules = [Module::Llm, Module::Vision, Module::Audio];
        let gpu_s: f64 = modules
            .iter()
            .filter_map(|&m| {
                let dp = plan.layout(m)?.dp;
                self.least_work(m, rows, dp * plan.microbatches)
            })
            .sum();
        gpu_s / plan.gpus().max(1) as f64
    }

    /// `sim` (the simulated step of `plan`, the mean over `batches`) split into the
    /// bound and its parts.
    pub fn gap(&self, plan: &Plan, batches: &[Vec<RowShape>], sim: &StepSim) -> Gap {
        let g = plan.gpus().max(1) as f64;
        let n = batches.len().max(1) as f64;
        let bound_s = batches
            .iter()
            .map(|b| self.work_bound(plan, b))
            .sum::<f64>()
            / n;
        let idle = (g * sim.step_s - sim.busy_gpu_s).max(0.0) / g;
        let imbalance_s = (sim.imbalance_gpu_s / g).min(idle);
        let exposed_bridge = match plan.schedule {
            Schedule::Phased => sim.bridge_s,
            Schedule::Overlapped => sim.bridge_s / plan.microbatches.max(1) as f64,
        };
        let bridge_s = exposed_bridge.min(idle - imbalance_s);
        let grad_sync_s = sim.sync_gpu_s / g;
        // The plan's busy work beyond the bound's, taken as what is left so that the
        // parts add up to the step (lanes of colocated modules that overlap on shared
        // GPUs would otherwise count twice).
        Gap {
            bound_s,
            memory_forced_s: sim.step_s - bound_s - grad_sync_s - idle,
            grad_sync_s,
            imbalance_s,
            bridge_s,
            bubbles_s: idle - imbalance_s - bridge_s,
        }
    }
}
