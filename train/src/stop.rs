//! A request to stop a run between steps (Ctrl-C, or the SIGTERM that SLURM sends before
//! preemption and torchrun forwards): a front end sets it from its signal handler, the
//! trainer checks it after every step, writes a checkpoint of that step and returns
//! [`crate::TrainError::Interrupted`]; on several ranks they first agree ([`agree`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use braid_comm::Comm;

use crate::error::Result;

/// Shared between the signal handler and every rank of the run; never reset once set.
#[derive(Clone, Debug, Default)]
pub struct StopFlag(Arc<AtomicUsize>);

impl StopFlag {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the run to stop after its current step; `signal` is what the user sent.
    pub fn request(&self, signal: i32) {
        self.0.store(signal.max(1) as usize, Ordering::SeqCst);
    }

    /// The signal that asked the run to stop, if any.
    pub fn requested(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            s => Some(i32::try_from(s).unwrap_or(i32::MAX)),
        }
    }

    /// The atomic a signal handler stores the signal number into (`signal_hook::flag::
    /// register_usize` needs the `Arc` itself: a handler may only touch atomics).
    pub fn atomic(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.0)
    }
}

/// `SIGINT`, `SIGTERM` or `signal N`, for messages.
pub fn signal_name(signal: i32) -> String {
    match signal {
        2 => "SIGINT".into(),
        15 => "SIGTERM".into(),
        1 => "SIGHUP".into(),
        s => format!("signal {s}"),
    }
}

/// Whether any rank has seen a stop request: every rank calls this after every step and
/// gets the same answer, so all stop after the same step (a signal reaches the ranks, or
/// the processes, at different moments).
pub(crate) fn agree(world: &dyn Comm, stop: &StopFlag) -> Result<Option<i32>> {
    // How many ranks saw each signal (1..=64; anything else counts as 64): a rank that saw
    // none yet names the one most ranks saw (the lowest on a tie), not a guess. The
    // kernel's parent-death SIGHUP reaches the ranks of a killed launcher moments apart,
    // and a rank that named it SIGTERM read as if someone had sent that.
    const SIGNALS: usize = 65;
    let mine = stop.requested();
    let mut seen = vec![0.0f32; SIGNALS]; // (65,)
    if let Some(s) = mine {
        seen[usize::try_from(s).map_or(SIGNALS - 1, |s| s.min(SIGNALS - 1))] = 1.0;
    }
    let mut t = braid_kernels::Tensor::from_vec(seen, [SIGNALS], braid_kernels::Device::Cpu)?;
    world.all_reduce_sum(&mut t)?;
    let counts = t.to_vec_f32()?;
    let most = (1..SIGNALS)
        .filter(|&s| counts[s] > 0.0)
        .max_by(|&a, &b| counts[a].total_cmp(&counts[b]).then(b.cmp(&a)));
    Ok(most.map(|s| mine.unwrap_or(s as i32)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_comm::local::{LocalComm, run_local};

    #[test]
    fn a_request_is_seen_by_every_clone() {
        let f = StopFlag::new();
        let g = f.clone();
        assert_eq!(g.requested(), None);
        f.request(15);
        assert_eq!(g.requested(), Some(15));
        assert_eq!(signal_name(15), "SIGTERM");
    }

    /// Ranks that saw no signal yet name the one the others saw (the kernel's SIGHUP to a
    /// killed launcher's ranks arrives moments apart); a rank that saw one keeps its own.
    #[test]
    fn every_rank_names_the_signal_the_others_saw() {
        let run = |seen: [Option<i32>; 3]| {
            run_local(3, std::time::Duration::from_secs(30), |comm: LocalComm| {
                let stop = StopFlag::new();
                if let Some(s) = seen[comm.rank()] {
                    stop.request(s);
                }
                agree(&comm, &stop)
            })
            .unwrap()
        };
        assert_eq!(run([None, None, None]), [None, None, None]);
        assert_eq!(run([None, Some(1), Some(1)]), [Some(1), Some(1), Some(1)]);
        assert_eq!(run([None, Some(15), None]), [Some(15); 3]);
        // Most seen wins for those that saw none; the lowest number on a tie.
        assert_eq!(run([None, Some(2), Some(15)]), [Some(2), Some(2), Some(15)]);
        assert_eq!(run([Some(99), None, None]), [Some(99), Some(64), Some(64)]);
    }
}
