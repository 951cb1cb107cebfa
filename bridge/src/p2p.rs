//! The bridge as point-to-point messages, for schedules that move one microbatch's items at a time (the overlapped step).
//!
//! [`Routes::forward`] and [`Routes::backward`] are world-wide collectives over a whole
//! step. The overlapped schedule instead moves each microbatch's items as soon as they
//! are encoded, between only the ranks that hold them: [`Routes::subset`] keeps one
//! microbatch's items, and the functions here split its forward (and backward) into what
//! this rank sends to each peer and how it assembles what its peers sent. The caller
//! moves the messages (so it can group them with its other sends and receives); both
//! sides derive every message's size from the routes alone.
//!
//! Messages go in ascending peer order and carry the same rows, in the same order, as the
//! collective forms, so the results are bitwise the collective's.

use braid_kernels::Tensor;

use crate::{BridgeError, Result, Routes};

const FORWARD: &str = "p2p forward";
const BACKWARD: &str = "p2p backward";

impl Routes {
    /// The routes of `items` only (ascending indices into this table), renumbered
    /// `0..items.len()` in that order: item `j` of the subset is item `items[j]` here.
    pub fn subset(&self, items: &[usize]) -> Result<Routes> {
        if let Some(w) = items.windows(2).find(|w| w[0] >= w[1]) {
            return Err(BridgeError::Table(format!(
                "subset items must ascend, got {} before {}",
                w[0], w[1]
            )));
        }
        let kept = items
            .iter()
            .map(|&i| {
                self.items().get(i).cloned().ok_or_else(|| {
                    BridgeError::Table(format!(
                        "subset item {i} does not exist (the step has {} items)",
                        self.items().len()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Routes::new(kept, self.width(), self.world())?
            .with_device(self.device())
            .with_dtype(self.dtype()))
    }

    /// The forward messages `rank` sends: `(peer, (n, C) rows)` for every peer that asked
    /// for rows of the items `rank` produced, ascending by peer (a peer may be `rank`
    /// itself). `produced` as in [`Routes::forward`].
    pub fn forward_sends(
        &self,
        rank: usize,
        produced: &[(usize, &Tensor)],
    ) -> Result<Vec<(usize, Tensor)>> {
        let parts = self.forward_parts(FORWARD, rank, produced)?;
        Ok(parts
            .into_iter()
            .enumerate()
            .filter(|(_, t)| t.dims()[0] > 0)
            .collect())
    }

    /// The peers [`Routes::forward_sends`] sends to, ascending, from the table alone.
    pub fn forward_targets(&self, rank: usize) -> Vec<usize> {
        let mut to = vec![false; self.world()];
        for item in self.items().iter().filter(|it| it.src == rank) {
            for d in item.dst.iter().filter(|d| !d.rows.is_empty()) {
                to[d.rank] = true;
            }
        }
        (0..self.world()).filter(|&p| to[p]).collect()
    }

    /// The forward messages `rank` receives: `(peer, rows)`, ascending by peer.
    pub fn forward_sources(&self, rank: usize) -> Vec<(usize, usize)> {
        nonempty(self.forward_positions(rank).0.iter().map(Vec::len))
    }

    /// `rank`'s forward output `(M_r, C)` (as [`Routes::forward`] returns it) from the
    /// messages of [`Routes::forward_sources`], given as `(peer, tensor)` in any order.
    pub fn forward_gather(&self, rank: usize, got: Vec<(usize, Tensor)>) -> Result<Tensor> {
        let (pos, m) = self.forward_positions(rank);
        let expected: Vec<usize> = pos.iter().map(Vec::len).collect();
        let parts = self.place(FORWARD, rank, got, &expected)?;
        if m == 0 {
            return self.empty(FORWARD, rank);
        }
        self.forward_assemble(FORWARD, rank, parts, pos, m)
    }

    /// The backward messages `rank` sends: `(peer, (n, C) grads)` of its `grad` copies
    /// for every encoder rank that wants them back, ascending by peer. `grad` is the
    /// grad of `rank`'s forward output, as in [`Routes::backward`].
    pub fn backward_sends(&self, rank: usize, grad: &Tensor) -> Result<Vec<(usize, Tensor)>> {
        let parts = self.backward_parts(BACKWARD, rank, grad)?;
        Ok(parts
            .into_iter()
            .enumerate()
            .filter(|(_, t)| t.dims()[0] > 0)
            .collect())
    }

    /// The peers [`Routes::backward_sends`] sends to, ascending, from the table alone.
    pub fn backward_targets(&self, rank: usize) -> Vec<usize> {
        let mut to = vec![false; self.world()];
        for (i, item) in self.items().iter().enumerate() {
            if let Some(d) = self.dest_of(i, rank)
                && d.grad
                && !d.rows.is_empty()
            {
                item.grad_to.iter().for_each(|&g| to[g] = true);
            }
        }
        (0..self.world()).filter(|&p| to[p]).collect()
    }

    /// The backward messages `rank` receives: `(peer, rows)`, ascending by peer.
    pub fn backward_sources(&self, rank: usize) -> Vec<(usize, usize)> {
        nonempty(self.backward_ids(rank).iter().map(Vec::len))
    }

    /// `rank`'s backward result (as [`Routes::backward`] returns it) from the messages of
    /// [`Routes::backward_sources`], in any order.
    pub fn backward_gather(
        &self,
        rank: usize,
        got: Vec<(usize, Tensor)>,
    ) -> Result<Vec<(usize, Tensor)>> {
        let expected: Vec<usize> = self.backward_ids(rank).iter().map(Vec::len).collect();
        let parts = self.place(BACKWARD, rank, got, &expected)?;
        self.backward_assemble(BACKWARD, rank, Some(parts))
    }

    /// `got` as a world-long list (empty parts for silent peers), each checked against
    /// the `(expected[peer], C)` the routes say, none missing or repeated.
    fn place(
        &self,
        op: &'static str,
        rank: usize,
        got: Vec<(usize, Tensor)>,
        expected: &[usize],
    ) -> Result<Vec<Tensor>> {
        let bad = |msg: String| BridgeError::Input { op, rank, msg };
        let mut parts: Vec<Option<Tensor>> = (0..self.world()).map(|_| None).collect();
        for (peer, t) in got {
            let Some(slot) = parts.get_mut(peer) else {
                return Err(bad(format!(
                    "a message from rank {peer}, outside the world of {}",
                    self.world()
                )));
            };
            if t.dims() != [expected[peer], self.width()] {
                return Err(bad(format!(
                    "rank {peer} sent {} but the routes say [{}, {}]",
                    t.shape(),
                    expected[peer],
                    self.width()
                )));
            }
            if slot.replace(t).is_some() {
                return Err(bad(format!("two messages from rank {peer}")));
            }
        }
        parts
            .into_iter()
            .enumerate()
            .map(|(peer, t)| match t {
                Some(t) => Ok(t),
                None if expected[peer] == 0 => self.empty(op, rank),
                None => Err(bad(format!(
                    "no message from rank {peer}, which the routes say sends {} rows",
                    expected[peer]
                ))),
            })
            .collect()
    }
}

/// `(index, n)` of the non-zero counts.
fn nonempty(counts: impl Iterator<Item = usize>) -> Vec<(usize, usize)> {
    counts.enumerate().filter(|&(_, n)| n > 0).collect()
}
