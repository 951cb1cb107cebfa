//! Test support: a group of ranks as threads with the bare minimum of collectives
//! (all-reduce, all-gather, barrier), so layers can be checked on several ranks
//! against one rank before `LocalComm` (the parallelism issue) exists. f32, host copies,
//! sums in rank order (deterministic). Not for training: no timeouts, no poisoning.

use std::sync::{Arc, Barrier, Mutex};

use braid_kernels::{Shape, Tensor};

use crate::{Comm, CommError, Result};

/// One rank of a [`ThreadRank::group`].
#[derive(Debug)]
pub struct ThreadRank {
    rank: usize,
    size: usize,
    slots: Arc<Mutex<Vec<Option<Vec<f32>>>>>,
    barrier: Arc<Barrier>,
}

impl ThreadRank {
    /// The `size` ranks of one group; move each into its own thread.
    pub fn group(size: usize) -> Vec<ThreadRank> {
        let slots = Arc::new(Mutex::new(vec![None; size]));
        let barrier = Arc::new(Barrier::new(size));
        (0..size)
            .map(|rank| ThreadRank {
                rank,
                size,
                slots: Arc::clone(&slots),
                barrier: Arc::clone(&barrier),
            })
            .collect()
    }

    fn err(&self, op: &'static str, msg: impl Into<String>) -> CommError {
        CommError::Invalid {
            op,
            rank: self.rank,
            size: self.size,
            msg: msg.into(),
        }
    }

    /// Every rank's `data`, in rank order.
    fn exchange(&self, op: &'static str, data: Vec<f32>) -> Result<Vec<Vec<f32>>> {
        let poisoned = |_| self.err(op, "another rank panicked while holding the exchange");
        self.slots.lock().map_err(poisoned)?[self.rank] = Some(data);
        self.barrier.wait();
        let all = self
            .slots
            .lock()
            .map_err(poisoned)?
            .iter()
            .enumerate()
            .map(|(r, s)| {
                s.clone()
                    .ok_or_else(|| self.err(op, format!("rank {r} sent nothing")))
            })
            .collect::<Result<Vec<_>>>();
        // Nobody overwrites a slot before every rank has read them all.
        self.barrier.wait();
        all
    }

    fn unsupported(&self, op: &'static str) -> CommError {
        self.err(op, "not supported by the test group (braid_comm::testing)")
    }
}

impl Comm for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        let all = self.exchange("all_reduce_sum", t.to_vec_f32()?)?;
        let mut sum = vec![0.0f32; t.elem_count()];
        for v in &all {
            sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
        }
        *t = Tensor::from_vec(sum, t.shape().clone(), t.device())?;
        Ok(())
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let all = self.exchange("all_gather", t.to_vec_f32()?)?;
        let mut dims = t.dims().to_vec();
        match dims.first_mut() {
            Some(d0) => *d0 *= self.size,
            None => return Err(self.err("all_gather", "cannot gather scalars along dim 0")),
        }
        Ok(Tensor::from_vec(all.concat(), dims, t.device())?)
    }
    fn reduce_scatter_sum(&self, _t: &Tensor) -> Result<Tensor> {
        Err(self.unsupported("reduce_scatter_sum"))
    }
    fn broadcast(&self, _t: &mut Tensor, _root: usize) -> Result<()> {
        Err(self.unsupported("broadcast"))
    }
    fn send(&self, _t: &Tensor, _dst: usize) -> Result<()> {
        Err(self.unsupported("send"))
    }
    fn recv(&self, _shape: &Shape, _src: usize) -> Result<Tensor> {
        Err(self.unsupported("recv"))
    }
    fn all_to_all_v(&self, _parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        Err(self.unsupported("all_to_all_v"))
    }
    fn barrier(&self) -> Result<()> {
        self.barrier.wait();
        Ok(())
    }
}

/// Runs `f` once per rank of a fresh group of `size`, each rank on its own thread, and
/// returns the results in rank order. A rank that panics re-raises its panic here.
pub fn run_on_ranks<T: Send>(size: usize, f: impl Fn(ThreadRank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ThreadRank::group(size)
            .into_iter()
            .map(|rank| s.spawn(move || f(rank)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}
