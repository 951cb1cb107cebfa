//! Forward (embeddings, encoder ranks -> LLM ranks) and its adjoint backward (grads, LLM ranks -> encoder ranks), one all_to_all_v each.
//!
//! Both are collective over a `Comm` spanning the world: every rank calls them with the
//! same [`Routes`], including ranks that send or receive nothing. Each rank derives from
//! the table alone what it sends and what it receives, so only embedding rows travel.
//! When the table moves no rows at all, every rank skips the exchange alike.
//!
//! Data movement uses device ops only (`zeros`, `gather_rows`, `scatter_rows`, and
//! `embedding_bwd` as a scatter-add), so the same code runs wherever the tensors live.

use braid_comm::Comm;
use braid_kernels::{DType, Device, Tensor, ops};

use crate::{BridgeError, Result, Routes};

const FORWARD: &str = "forward";
const BACKWARD: &str = "backward";

/// Attaches the op and rank to a kernel error.
trait KernelCtx<T> {
    fn ctx(self, op: &'static str, rank: usize) -> Result<T>;
}

impl<T> KernelCtx<T> for braid_kernels::Result<T> {
    fn ctx(self, op: &'static str, rank: usize) -> Result<T> {
        self.map_err(|source| BridgeError::Kernel { op, rank, source })
    }
}

fn input(op: &'static str, rank: usize, msg: String) -> BridgeError {
    BridgeError::Input { op, rank, msg }
}

/// A u32 index tensor (N) on `device`.
fn index(idx: Vec<u32>, device: Device, op: &'static str, rank: usize) -> Result<Tensor> {
    let n = idx.len();
    Tensor::from_vec_u32(idx, [n], device).ctx(op, rank)
}

/// `lo .. lo + n` as u32 (fits: `Routes::new` bounds every rank's row count by u32).
fn span(lo: usize, n: usize) -> impl Iterator<Item = u32> {
    (lo..lo + n).map(|p| p as u32)
}

impl Routes {
    /// This rank, after checking the comm spans the routes' world.
    fn comm_rank(&self, op: &'static str, comm: &dyn Comm) -> Result<usize> {
        let rank = comm.rank();
        if comm.size() != self.world() {
            return Err(input(
                op,
                rank,
                format!(
                    "the comm has {} ranks but the routes span a world of {}: the bridge \
                     needs the world comm",
                    comm.size(),
                    self.world()
                ),
            ));
        }
        Ok(rank)
    }

    /// `t` must be an f32 `(rows, C)` tensor on the routes' device.
    fn check_rows(
        &self,
        op: &'static str,
        rank: usize,
        what: &str,
        t: &Tensor,
        rows: usize,
    ) -> Result<()> {
        let c = self.width();
        if t.dims() != [rows, c] {
            return Err(input(
                op,
                rank,
                format!(
                    "{what} is {} but must be (rows, C) = [{rows}, {c}]",
                    t.shape()
                ),
            ));
        }
        if t.dtype() != self.dtype() {
            return Err(input(
                op,
                rank,
                format!(
                    "{what} is {} but the routes exchange {}",
                    t.dtype(),
                    self.dtype()
                ),
            ));
        }
        if t.device() != self.device() {
            return Err(input(
                op,
                rank,
                format!(
                    "{what} is on {} but the routes exchange on {}",
                    t.device(),
                    self.device()
                ),
            ));
        }
        Ok(())
    }

    /// An empty `(0, C)` part.
    pub(crate) fn empty(&self, op: &'static str, rank: usize) -> Result<Tensor> {
        Tensor::zeros([0, self.width()], self.dtype(), self.device()).ctx(op, rank)
    }

    /// One all_to_all_v, checking every received part is `(expected[s], C)`.
    fn exchange(
        &self,
        op: &'static str,
        comm: &dyn Comm,
        parts: Vec<Tensor>,
        expected: &[usize],
    ) -> Result<Vec<Tensor>> {
        let rank = comm.rank();
        let got = comm
            .all_to_all_v(parts)
            .map_err(|source| BridgeError::Comm { op, rank, source })?;
        if got.len() != self.world() {
            return Err(input(
                op,
                rank,
                format!(
                    "all_to_all_v returned {} parts for {} ranks",
                    got.len(),
                    self.world()
                ),
            ));
        }
        for (s, (t, &n)) in got.iter().zip(expected).enumerate() {
            if t.dims() != [n, self.width()] {
                return Err(input(
                    op,
                    rank,
                    format!(
                        "rank {s} sent {} but the routes say [{n}, {}]: do all ranks hold the \
                         same routes?",
                        t.shape(),
                        self.width()
                    ),
                ));
            }
        }
        Ok(got)
    }

    /// Forward: sends the embeddings this rank produced to the ranks that need them and
    /// returns the rows this rank asked for, `(M_r, C)` f32, in the order of
    /// [`Routes::received`] (by item, then by the order inside this rank's `Dest`).
    ///
    /// `produced` lists `(item, (rows, C) f32 tensor)` for exactly the items whose `src`
    /// is this rank ([`Routes::produced_by`]), in any order; a missing, extra or repeated
    /// item is an error naming it. Collective: every rank of `comm` (the world, rank `r`
    /// being world rank `r`) calls it.
    pub fn forward(&self, comm: &dyn Comm, produced: &[(usize, &Tensor)]) -> Result<Tensor> {
        let op = FORWARD;
        let rank = self.comm_rank(op, comm)?;
        let parts = self.forward_parts(op, rank, produced)?;
        if !self.moves_rows() {
            return self.empty(op, rank);
        }
        let (pos, m) = self.forward_positions(rank);
        let counts: Vec<usize> = pos.iter().map(Vec::len).collect();
        let got = self.exchange(op, comm, parts, &counts)?;
        self.forward_assemble(op, rank, got, pos, m)
    }

    /// Forward's parts on `rank`: `parts[d]` holds the rows rank `d` asked for of the
    /// items this rank produced (by item, then in `d`'s order); `(0, C)` where none.
    /// Checks `produced` as [`Routes::forward`] documents.
    pub(crate) fn forward_parts(
        &self,
        op: &'static str,
        rank: usize,
        produced: &[(usize, &Tensor)],
    ) -> Result<Vec<Tensor>> {
        let (c, world, items) = (self.width(), self.world(), self.items());
        // item -> its tensor, for the items this rank owns.
        let mut mine: Vec<Option<&Tensor>> = vec![None; items.len()];
        for &(i, t) in produced {
            let Some(item) = items.get(i) else {
                return Err(input(
                    op,
                    rank,
                    format!(
                        "item {i} does not exist (the step has {} items)",
                        items.len()
                    ),
                ));
            };
            if item.src != rank {
                return Err(input(
                    op,
                    rank,
                    format!("was given item {i}, whose src is rank {}", item.src),
                ));
            }
            if mine[i].replace(t).is_some() {
                return Err(input(op, rank, format!("was given item {i} twice")));
            }
            self.check_rows(op, rank, &format!("item {i}"), t, item.rows)?;
        }
        let missing: Vec<usize> = self
            .produced_by(rank)
            .into_iter()
            .filter(|&i| mine[i].is_none())
            .collect();
        if !missing.is_empty() {
            return Err(input(
                op,
                rank,
                format!("items {missing:?} are missing: this rank is their src"),
            ));
        }
        // (item, tensor) of every item this rank produces, ascending.
        let owned: Vec<(usize, &Tensor)> = mine
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.map(|t| (i, t)))
            .collect();

        // This rank's items one under the other: (S, C), item i at rows offset[i]...
        let mut offset = vec![0usize; items.len()];
        let mut s_rows = 0;
        for &(i, _) in &owned {
            offset[i] = s_rows;
            s_rows += items[i].rows;
        }
        // send[d]: the stacked rows rank d asked for, by item then in d's order.
        let mut send: Vec<Vec<u32>> = vec![Vec::new(); world];
        for &(i, _) in &owned {
            let base = offset[i];
            for dest in &items[i].dst {
                send[dest.rank].extend(dest.rows.iter().map(|&r| (base + r as usize) as u32));
            }
        }
        if send.iter().all(Vec::is_empty) {
            return (0..world).map(|_| self.empty(op, rank)).collect();
        }
        let stacked_buf;
        let stacked: &Tensor = match owned.as_slice() {
            [(_, t)] => t,
            _ => {
                let mut buf =
                    Tensor::zeros([s_rows, c], self.dtype(), self.device()).ctx(op, rank)?; // (S, C)
                for &(i, t) in owned.iter().filter(|(i, _)| items[*i].rows > 0) {
                    let rows = span(offset[i], items[i].rows).collect();
                    let idx = index(rows, self.device(), op, rank)?;
                    ops::scatter_rows(&mut buf, &idx, t).ctx(op, rank)?;
                }
                stacked_buf = buf;
                &stacked_buf
            }
        };
        let mut parts = Vec::with_capacity(world);
        for idx in send {
            parts.push(if idx.is_empty() {
                self.empty(op, rank)?
            } else {
                let idx = index(idx, self.device(), op, rank)?;
                ops::gather_rows(stacked, &idx).ctx(op, rank)? // (n_d, C)
            });
        }
        Ok(parts)
    }

    /// Where the forward rows from each rank go in `rank`'s output (`pos[s]`), and the
    /// output's row count `M_r`.
    pub(crate) fn forward_positions(&self, rank: usize) -> (Vec<Vec<u32>>, usize) {
        let mut pos: Vec<Vec<u32>> = vec![Vec::new(); self.world()];
        let mut m = 0;
        for (i, item) in self.items().iter().enumerate() {
            if let Some(dest) = self.dest_of(i, rank) {
                pos[item.src].extend(span(m, dest.rows.len()));
                m += dest.rows.len();
            }
        }
        (pos, m)
    }

    /// `rank`'s forward output `(M_r, C)` from what each rank sent it (`got[s]`, laid out
    /// as `pos[s]` says).
    pub(crate) fn forward_assemble(
        &self,
        op: &'static str,
        rank: usize,
        mut got: Vec<Tensor>,
        pos: Vec<Vec<u32>>,
        m: usize,
    ) -> Result<Tensor> {
        // One source: its part is already in output order (both go by item index).
        if let Some(s) = pos.iter().position(|p| p.len() == m).filter(|_| m > 0) {
            return Ok(got.swap_remove(s));
        }
        let mut out =
            Tensor::zeros([m, self.width()], self.dtype(), self.device()).ctx(op, rank)?; // (M_r, C)
        for (part, p) in got.iter().zip(pos) {
            if !p.is_empty() {
                let idx = index(p, self.device(), op, rank)?;
                ops::scatter_rows(&mut out, &idx, part).ctx(op, rank)?;
            }
        }
        Ok(out)
    }

    /// Backward, the transpose of forward: takes the grad of forward's output on this
    /// rank, `(M_r, C)` f32 in the same row order, and returns `(item, (rows, C) grad)`
    /// for every item whose `grad_to` contains this rank ([`Routes::grads_for`]),
    /// ascending by item.
    ///
    /// Only the copies marked `grad` contribute; a row is the sum of the grads of its
    /// `grad` copies, added in ascending order of their ranks starting from zero (a row
    /// no `grad` copy asked for is 0), so every `grad_to` rank gets bitwise the same
    /// tensor. Collective like forward; an empty `(0, C)` grad on ranks with `M_r = 0`.
    pub fn backward(&self, comm: &dyn Comm, grad: &Tensor) -> Result<Vec<(usize, Tensor)>> {
        let op = BACKWARD;
        let rank = self.comm_rank(op, comm)?;
        let got = if self.moves_grads() {
            let parts = self.backward_parts(op, rank, grad)?;
            let counts: Vec<usize> = self.backward_ids(rank).iter().map(Vec::len).collect();
            Some(self.exchange(op, comm, parts, &counts)?)
        } else {
            self.check_rows(op, rank, "grad", grad, self.rows_received(rank))?;
            None
        };
        self.backward_assemble(op, rank, got)
    }

    /// Backward's parts on `rank`: `parts[g]` holds the grads of this rank's `grad`
    /// copies of the items rank `g` wants back (by item, then in this rank's order).
    pub(crate) fn backward_parts(
        &self,
        op: &'static str,
        rank: usize,
        grad: &Tensor,
    ) -> Result<Vec<Tensor>> {
        self.check_rows(op, rank, "grad", grad, self.rows_received(rank))?;
        let mut send: Vec<Vec<u32>> = vec![Vec::new(); self.world()];
        let mut m = 0;
        for (i, item) in self.items().iter().enumerate() {
            let Some(dest) = self.dest_of(i, rank) else {
                continue;
            };
            if dest.grad {
                for &g in &item.grad_to {
                    send[g].extend(span(m, dest.rows.len()));
                }
            }
            m += dest.rows.len();
        }
        let mut parts = Vec::with_capacity(self.world());
        for idx in send {
            parts.push(if idx.is_empty() {
                self.empty(op, rank)?
            } else {
                let idx = index(idx, self.device(), op, rank)?;
                ops::gather_rows(grad, &idx).ctx(op, rank)? // (n_g, C)
            });
        }
        Ok(parts)
    }

    /// `rank`'s grad accumulator layout: its items ([`Routes::grads_for`]) one under the
    /// other, as (item, first row).
    fn grad_offsets(&self, rank: usize) -> (Vec<(usize, usize)>, usize) {
        let mut out = Vec::new();
        let mut g_rows = 0;
        for i in self.grads_for(rank) {
            out.push((i, g_rows));
            g_rows += self.items()[i].rows;
        }
        (out, g_rows)
    }

    /// `ids[d]`: the accumulator row of each grad row rank `d` sends `rank` (by item,
    /// then in `d`'s order, as `d` sends them).
    pub(crate) fn backward_ids(&self, rank: usize) -> Vec<Vec<u32>> {
        let mut ids: Vec<Vec<u32>> = vec![Vec::new(); self.world()];
        for (i, base) in self.grad_offsets(rank).0 {
            for dest in self.items()[i].dst.iter().filter(|d| d.grad) {
                ids[dest.rank].extend(dest.rows.iter().map(|&r| (base + r as usize) as u32));
            }
        }
        ids
    }

    /// `rank`'s backward result from what each rank sent it (`got[d]`; `None`: nothing
    /// moved, every grad is zero).
    pub(crate) fn backward_assemble(
        &self,
        op: &'static str,
        rank: usize,
        got: Option<Vec<Tensor>>,
    ) -> Result<Vec<(usize, Tensor)>> {
        let c = self.width();
        let (mine, g_rows) = self.grad_offsets(rank);
        // Summed in f32 whatever the rows' dtype (one rounding at the end under bf16).
        let mut acc = Tensor::zeros([g_rows, c], DType::F32, self.device()).ctx(op, rank)?; // (G, C)
        if let Some(got) = got {
            // Ascending source rank; within one source every accumulator row appears at
            // most once (one dest per rank, distinct rows), so each row is a plain f32
            // sum in rank order: deterministic and the same on every grad_to rank.
            for (part, id) in got.iter().zip(self.backward_ids(rank)) {
                if !id.is_empty() {
                    let id = index(id, self.device(), op, rank)?;
                    ops::embedding_bwd(part, &id, &mut acc).ctx(op, rank)?;
                }
            }
        }
        let acc = ops::into_dtype(acc, self.dtype()).ctx(op, rank)?;
        if let [(i, _)] = mine.as_slice() {
            return Ok(vec![(*i, acc)]);
        }
        let mut out = Vec::with_capacity(mine.len());
        for (i, base) in mine {
            let rows = self.items()[i].rows;
            let t = if rows == 0 {
                self.empty(op, rank)?
            } else {
                let idx = index(span(base, rows).collect(), self.device(), op, rank)?;
                ops::gather_rows(&acc, &idx).ctx(op, rank)? // (rows, C)
            };
            out.push((i, t));
        }
        Ok(out)
    }
}
