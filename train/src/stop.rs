//! A request to stop a run between steps (Ctrl-C, or the SIGTERM that SLURM sends before
//! preemption and torchrun forwards): a front end sets it from its signal handler, the
//! trainer checks it after every step, writes a checkpoint of that step and returns
//! [`crate::TrainError::Interrupted`].

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_seen_by_every_clone() {
        let f = StopFlag::new();
        let g = f.clone();
        assert_eq!(g.requested(), None);
        f.request(15);
        assert_eq!(g.requested(), Some(15));
        assert_eq!(signal_name(15), "SIGTERM");
    }
}
