//! Context parallelism (CP) for attention over packed variable-length rows: the plan
//! that shards tokens over the CP group, and the key/value all-gather with its adjoint.
//!
//! **Sharding.** [`CpPlan::new`] cuts every sample of the full packed rows (T tokens,
//! `cu_seqlens`) into `2 * cp` chunks as equal as possible (a sample shorter than
//! `2 * cp` gives empty chunks) and gives rank `r` chunks `r` and `2cp - 1 - r` of every
//! sample (the zigzag of Llama 3 / Megatron: under a causal mask, early chunks see few
//! keys and late ones many, so pairing them balances the work). A rank holds its
//! tokens sample by sample, chunk `r` then chunk `2cp - 1 - r`: ascending global order.
//! Bidirectional encoders use the same split (any split balances them).
//!
//! **What travels with the batch.** [`CpPlan::seq_info`] gives rank `r` the
//! [`SeqInfo`] of its local tokens: `cu_seqlens` delimits its chunks (two per sample,
//! possibly empty), `positions` are the tokens' original positions within their
//! sample (what RoPE needs), and `cp: Some(Arc<CpLocal>)` carries the rest: the
//! query/key segments of attention and every rank's token list. Layers other than
//! attention are per token and ignore it. Things that look across tokens of a sample
//! (next-token targets) are computed on the full rows before splitting them with
//! [`CpPlan::tokens`] / [`CpPlan::local_rows`].
//!
//! **Attention** (`Attention` with `cp: Some(group)` and a `SeqInfo` with `cp`): each
//! rank projects its local q, k, v and applies RoPE at the original positions, then
//! [`gather_kv_fwd`] all-gathers K and V (ragged: ranks hold different counts) into
//! the full buffer in global token order, so every sample's keys are contiguous. A
//! local chunk's queries then attend to key rows `sample start .. chunk end` (causal,
//! bottom-right aligned) or the whole sample (bidirectional): one
//! `attention_fwd_ranges` call with [`CpLocal::segments`]. The backward gives dK/dV
//! for the full buffer on every rank; [`gather_kv_bwd`] (the adjoint: a ragged
//! reduce-scatter) returns to each rank the sum over ranks of its tokens' rows, summed
//! in rank order (deterministic). K and V are gathered again in the backward rather
//! than cached: the cache stays O(T / cp), as in ring attention.
//!
//! Parameter grads on a CP rank cover its tokens only: the trainer sums them over the
//! CP group (with the DP all-reduce), as for DP.

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::ops::attention::QkSegment;
use braid_kernels::{Tensor, ops};

use crate::error::{Context, Error, Result};
use crate::rope::SeqInfo;

/// The token layout of a CP plan, shared by the plan and every rank's [`CpLocal`].
#[derive(Debug, PartialEq, Eq)]
struct Layout {
    cp: usize,
    causal: bool,
    /// The full rows' `cu_seqlens` (T = last entry).
    cu_seqlens: Vec<usize>,
    /// Per rank: global token indices held, ascending.
    tokens: Vec<Vec<usize>>,
    /// Per rank: local `cu_seqlens`, one entry per chunk held (2 per sample).
    local_cu: Vec<Vec<usize>>,
    /// Per rank: its queries (local rows) against the full keys (global rows).
    segments: Vec<Vec<QkSegment>>,
}

/// How the full packed rows are sharded over a CP group of `cp` ranks; built from
/// the batch metadata every rank holds (so every rank builds the same plan).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpPlan {
    layout: Arc<Layout>,
}

/// What one CP rank's attention needs; rides on [`SeqInfo::cp`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpLocal {
    rank: usize,
    /// Largest position + 1 over the full rows: RoPE's dynamic NTK scaling must see
    /// the batch's length, not the local tokens'.
    seq_len: usize,
    layout: Arc<Layout>,
}

/// Chunk `c` of `2 * cp` of a sample `[a, b)`: `[a + c*L/(2cp), a + (c+1)*L/(2cp))`.
fn chunk(a: usize, b: usize, c: usize, n: usize) -> (usize, usize) {
    let len = b - a;
    (a + c * len / n, a + (c + 1) * len / n)
}

impl CpPlan {
    /// The plan for full rows delimited by `cu_seqlens` (`[0, ..., T]`, nondecreasing)
    /// over `cp >= 1` ranks, for causal or bidirectional attention.
    pub fn new(cu_seqlens: &[usize], cp: usize, causal: bool) -> Result<CpPlan> {
        let err = |msg: String| Err(Error::input("CpPlan", msg));
        if cp == 0 {
            return err("cp must be >= 1".into());
        }
        if cu_seqlens.len() < 2 || cu_seqlens[0] != 0 {
            return err(format!(
                "cu_seqlens must start with 0 and hold at least one sample, got {cu_seqlens:?}"
            ));
        }
        if let Some(i) = cu_seqlens.windows(2).position(|w| w[1] < w[0]) {
            return err(format!(
                "cu_seqlens must be nondecreasing, but cu_seqlens[{i}] = {} > cu_seqlens[{}] = {}",
                cu_seqlens[i],
                i + 1,
                cu_seqlens[i + 1]
            ));
        }
        let n = 2 * cp;
        let mut tokens = vec![Vec::new(); cp];
        let mut local_cu = vec![vec![0usize]; cp];
        let mut segments = vec![Vec::new(); cp];
        for w in cu_seqlens.windows(2) {
            let (a, b) = (w[0], w[1]);
            for r in 0..cp {
                let first = tokens[r].len();
                for c in [r, n - 1 - r] {
                    let (c0, c1) = chunk(a, b, c, n);
                    let q_start = tokens[r].len();
                    tokens[r].extend(c0..c1);
                    local_cu[r].push(tokens[r].len());
                    if causal && c1 > c0 {
                        // Queries c0..c1 see keys a..=their own: keys a..c1, the
                        // diagonal bottom-right aligned.
                        segments[r].push(QkSegment {
                            q_start,
                            q_len: c1 - c0,
                            k_start: a,
                            k_len: c1 - a,
                        });
                    }
                }
                // Bidirectional: both chunks (adjacent locally) see the whole sample,
                // one segment.
                let held = tokens[r].len() - first;
                if !causal && held > 0 {
                    segments[r].push(QkSegment {
                        q_start: first,
                        q_len: held,
                        k_start: a,
                        k_len: b - a,
                    });
                }
            }
        }
        // Empty chunks give no segment: the segments still cover the local rows in order.
        Ok(CpPlan {
            layout: Arc::new(Layout {
                cp,
                causal,
                cu_seqlens: cu_seqlens.to_vec(),
                tokens,
                local_cu,
                segments,
            }),
        })
    }

    /// Ranks in the CP group.
    pub fn cp(&self) -> usize {
        self.layout.cp
    }

    pub fn causal(&self) -> bool {
        self.layout.causal
    }

    /// The full rows' `cu_seqlens`.
    pub fn cu_seqlens(&self) -> &[usize] {
        &self.layout.cu_seqlens
    }

    /// Tokens T of the full rows.
    pub fn total_tokens(&self) -> usize {
        self.layout.cu_seqlens.last().copied().unwrap_or(0)
    }

    /// Global token indices rank `rank` holds, in local order (ascending).
    pub fn tokens(&self, rank: usize) -> Result<&[usize]> {
        tokens_of(&self.layout, rank)
    }

    /// How many tokens rank `rank` holds.
    pub fn num_tokens(&self, rank: usize) -> Result<usize> {
        Ok(self.tokens(rank)?.len())
    }

    /// (rank, local index) of global token `token`.
    pub fn owner(&self, token: usize) -> Result<(usize, usize)> {
        let l = &self.layout;
        let t = self.total_tokens();
        if token >= t {
            return Err(Error::input(
                "CpPlan",
                format!("token {token} is out of range: the rows hold T = {t}"),
            ));
        }
        // A token's sample and chunk say its rank; its local index is where it lands
        // in that rank's ascending list.
        let s = l.cu_seqlens.partition_point(|&c| c <= token) - 1;
        let (a, b) = (l.cu_seqlens[s], l.cu_seqlens[s + 1]);
        let n = 2 * l.cp;
        let c = (0..n)
            .find(|&c| chunk(a, b, c, n).1 > token)
            .unwrap_or(n - 1);
        let rank = c.min(n - 1 - c);
        let local = l.tokens[rank].partition_point(|&g| g < token);
        Ok((rank, local))
    }

    /// The local [`SeqInfo`] of rank `rank` from the full rows' `full` (whose
    /// `cu_seqlens` must be the plan's): positions picked from `full.positions`, one
    /// `cu_seqlens` entry per chunk held, and `cp` set.
    pub fn seq_info(&self, rank: usize, full: &SeqInfo) -> Result<SeqInfo> {
        let l = &self.layout;
        if full.cu_seqlens != l.cu_seqlens {
            return Err(Error::input(
                "CpPlan",
                format!(
                    "the full SeqInfo's cu_seqlens {:?} differ from the plan's {:?}",
                    full.cu_seqlens, l.cu_seqlens
                ),
            ));
        }
        full.validate(self.total_tokens())?;
        let tokens = self.tokens(rank)?;
        let seq_len = full.positions.iter().max().map_or(0, |&p| p as usize + 1);
        Ok(SeqInfo {
            cu_seqlens: l.local_cu[rank].clone(),
            positions: tokens.iter().map(|&g| full.positions[g]).collect(),
            cp: Some(Arc::new(CpLocal {
                rank,
                seq_len,
                layout: Arc::clone(&self.layout),
            })),
        })
    }

    /// Rank `rank`'s rows of a full (T, ...) tensor -> (T_local, ...).
    pub fn local_rows(&self, rank: usize, full: &Tensor) -> Result<Tensor> {
        let t = self.total_tokens();
        let dims = full.dims().to_vec();
        if dims.first() != Some(&t) {
            return Err(Error::input(
                "CpPlan",
                format!(
                    "local_rows: expected (T = {t}, ...) rows, got {}",
                    full.shape()
                ),
            ));
        }
        let row: usize = dims[1..].iter().product();
        let idx = index(self.tokens(rank)?, full.device())?;
        let x = full
            .try_clone()
            .and_then(|x| x.reshape([t, row]))
            .ctx("CpPlan", "local_rows")?;
        let mut out_dims = dims;
        out_dims[0] = idx.dims()[0];
        ops::gather_rows(&x, &idx)
            .and_then(|y| y.reshape(out_dims))
            .ctx("CpPlan", "local_rows")
    }

    /// The full (T, ...) tensor from every rank's local rows `parts[r]` (rank order).
    pub fn assemble(&self, parts: &[Tensor]) -> Result<Tensor> {
        scatter_parts(&self.layout, parts).ctx("CpPlan", "assemble")
    }
}

fn tokens_of(l: &Layout, rank: usize) -> Result<&[usize]> {
    l.tokens.get(rank).map(Vec::as_slice).ok_or_else(|| {
        Error::input(
            "CpPlan",
            format!("rank {rank} is outside the CP group of {}", l.cp),
        )
    })
}

/// `tokens` as a u32 index tensor.
fn index(tokens: &[usize], device: braid_kernels::Device) -> Result<Tensor> {
    let idx = tokens
        .iter()
        .map(|&g| u32::try_from(g))
        .collect::<std::result::Result<Vec<u32>, _>>()
        .map_err(|_| Error::input("CpPlan", "token index does not fit in u32"))?;
    let m = idx.len();
    Tensor::from_vec_u32(idx, [m], device).ctx("CpPlan", "token index")
}

/// (T, ...) in global order from each rank's (T_r, ...) rows.
fn scatter_parts(l: &Layout, parts: &[Tensor]) -> Result<Tensor> {
    if parts.len() != l.cp {
        return Err(Error::input(
            "CpPlan",
            format!(
                "expected {} parts (one per CP rank), got {}",
                l.cp,
                parts.len()
            ),
        ));
    }
    let t = l.cu_seqlens.last().copied().unwrap_or(0);
    let first = &parts[0];
    let mut dims = first.dims().to_vec();
    let row: usize = dims.get(1..).map_or(1, |d| d.iter().product());
    let mut full =
        Tensor::zeros([t, row], first.dtype(), first.device()).ctx("CpPlan", "full rows")?;
    for (r, part) in parts.iter().enumerate() {
        let n = l.tokens[r].len();
        if part.dims().first() != Some(&n) || part.elem_count() != n * row {
            return Err(Error::input(
                "CpPlan",
                format!(
                    "CP rank {r}'s part is {}, but the token split gives it {n} of the {t} tokens, {row} values each",
                    part.shape()
                ),
            ));
        }
        let src = part
            .try_clone()
            .and_then(|p| p.reshape([n, row]))
            .ctx("CpPlan", "part")?;
        ops::scatter_rows(&mut full, &index(&l.tokens[r], first.device())?, &src)
            .ctx("CpPlan", "placing a rank's rows")?;
    }
    if let Some(d0) = dims.first_mut() {
        *d0 = t;
    }
    full.reshape(dims).ctx("CpPlan", "full rows")
}

impl CpLocal {
    /// This rank's index in the CP group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the CP group.
    pub fn cp(&self) -> usize {
        self.layout.cp
    }

    pub fn causal(&self) -> bool {
        self.layout.causal
    }

    /// Tokens T of the full rows (rows of the gathered K/V).
    pub fn total_tokens(&self) -> usize {
        self.layout.cu_seqlens.last().copied().unwrap_or(0)
    }

    /// Largest position + 1 over the full rows.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Global token indices rank `rank` of the group holds.
    pub fn tokens(&self, rank: usize) -> Result<&[usize]> {
        tokens_of(&self.layout, rank)
    }

    /// This rank's queries (local rows) against the gathered keys (global rows).
    pub fn segments(&self) -> &[QkSegment] {
        &self.layout.segments[self.rank]
    }

    /// Checks that `group` is the CP group this plan was made for, from this rank.
    pub fn check_group(&self, what: &str, group: &dyn Comm) -> Result<()> {
        if group.size() != self.cp() || group.rank() != self.rank {
            return Err(Error::input(
                what,
                format!(
                    "the CP plan is for rank {} of {} but the CP group is rank {} of {}",
                    self.rank,
                    self.cp(),
                    group.rank(),
                    group.size()
                ),
            ));
        }
        Ok(())
    }
}

// ---- gather_kv: local K/V rows -> the full rows, and its adjoint --------------------

/// Forward: x (T_local, D) on every rank of `group` -> (T, D) in global token order
/// (a ragged all-gather: one all-to-all-v sending `x` to every rank).
pub fn gather_kv_fwd(group: &dyn Comm, cp: &CpLocal, x: &Tensor) -> Result<Tensor> {
    const WHAT: &str = "cp gather_kv";
    cp.check_group(WHAT, group)?;
    let parts = (0..group.size())
        .map(|_| x.try_clone())
        .collect::<braid_kernels::Result<Vec<_>>>()
        .ctx(WHAT, "forward")?;
    let got = group.all_to_all_v(parts).ctx(WHAT, "forward all-to-all")?;
    scatter_parts(&cp.layout, &got).ctx(WHAT, "forward")
}

/// Backward: dx_full (T, D), this rank's grad for every token's row -> (T_local, D),
/// the sum over ranks of the rows of this rank's tokens (a ragged reduce-scatter),
/// added in rank order.
pub fn gather_kv_bwd(group: &dyn Comm, cp: &CpLocal, dx_full: &Tensor) -> Result<Tensor> {
    const WHAT: &str = "cp gather_kv";
    cp.check_group(WHAT, group)?;
    let l = &cp.layout;
    let parts = (0..l.cp)
        .map(|r| {
            ops::gather_rows(dx_full, &index(&l.tokens[r], dx_full.device())?).ctx(WHAT, "backward")
        })
        .collect::<Result<Vec<_>>>()?;
    let mut got = group
        .all_to_all_v(parts)
        .ctx(WHAT, "backward all-to-all")?
        .into_iter();
    let mut sum = got
        .next()
        .ok_or_else(|| Error::input(WHAT, "the all-to-all returned no parts"))?;
    for part in got {
        ops::add_assign(&mut sum, &part).ctx(WHAT, "backward sum over ranks")?;
    }
    Ok(sum)
}
