//! Next-token cross-entropy: targets from packed token rows, the mean loss over valid
//! targets, and the vocab-parallel variant (Megatron's `vocab_parallel_cross_entropy`)
//! for logits split along the vocabulary across a TP group.

use braid_comm::Comm;
use braid_kernels::{DType, Tensor, ops};
use braid_nn::error::Context;
use braid_nn::{Error, Result, SeqInfo};

/// Target id of a position that has no loss (last token of a sample, prompt tokens,
/// padding).
pub const IGNORE_INDEX: u32 = u32::MAX;

/// Next-token targets (T) of packed rows: `targets[t] = ids[t + 1]` when `t + 1` is in
/// the same sample and is a loss token (`loss_mask[t + 1]`, all when `None`), else
/// [`IGNORE_INDEX`]. The mask marks the tokens to be predicted (e.g. assistant turns).
pub fn next_token_targets(
    ids: &[u32],
    seq: &SeqInfo,
    loss_mask: Option<&[bool]>,
) -> Result<Vec<u32>> {
    seq.validate(ids.len())?;
    if let Some(m) = loss_mask
        && m.len() != ids.len()
    {
        return Err(Error::input(
            "next_token_targets",
            format!(
                "loss_mask has {} entries for T = {} tokens",
                m.len(),
                ids.len()
            ),
        ));
    }
    let mut targets = vec![IGNORE_INDEX; ids.len()]; // (T)
    for w in seq.cu_seqlens.windows(2) {
        for t in w[0]..w[1].saturating_sub(1) {
            if loss_mask.is_none_or(|m| m[t + 1]) {
                targets[t] = ids[t + 1];
            }
        }
    }
    Ok(targets)
}

/// The loss of one microbatch and the grad of its logits.
#[derive(Debug)]
pub struct LossOutput {
    /// `loss_sum / normalizer`
    pub loss: f32,
    /// Sum of the per-token losses (f64).
    pub loss_sum: f64,
    /// Number of targets that are not [`IGNORE_INDEX`].
    pub n_valid: usize,
    /// d loss / d logits (T, V), already divided by the normalizer.
    pub dlogits: Tensor,
}

/// Mean cross-entropy of logits (T, V) against host `targets` (T), ignoring
/// [`IGNORE_INDEX`]. `normalizer` is the number of valid targets the mean is over: the
/// global count across microbatches and data-parallel ranks for an exact mean of a
/// whole step, `None` for this microbatch's own count. With no valid target the loss
/// and grad are 0.
pub fn cross_entropy_loss(
    logits: &Tensor,
    targets: &[u32],
    normalizer: Option<usize>,
) -> Result<LossOutput> {
    let n_valid = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    let denom = normalizer.unwrap_or(n_valid);
    if denom < n_valid {
        return Err(Error::input(
            "cross_entropy_loss",
            format!("normalizer {denom} is smaller than this batch's {n_valid} valid targets"),
        ));
    }
    let scale = if denom == 0 { 0.0 } else { 1.0 / denom as f64 };
    let tt = Tensor::from_vec_u32(targets.to_vec(), [targets.len()], logits.device())
        .ctx("cross_entropy_loss", "targets to device")?;
    let (losses, dlogits) = ops::cross_entropy_fwd_bwd(logits, &tt, IGNORE_INDEX, scale as f32)
        .ctx("cross_entropy_loss", "forward/backward")?;
    // The scalar loss comes to the host for logging: T floats, not T x V.
    let loss_sum: f64 = losses
        .to_vec_f32()
        .ctx("cross_entropy_loss", "losses to host")?
        .iter()
        .map(|&l| f64::from(l))
        .sum();
    Ok(LossOutput {
        loss: (loss_sum * scale) as f32,
        loss_sum,
        n_valid,
        dlogits,
    })
}

/// [`cross_entropy_loss`] for logits split along the vocabulary across `group`: this
/// rank's columns `vocab_start .. vocab_start + V/tp` (T, V/tp), as an
/// [`crate::LlmStage`] under tensor parallelism returns them. Every rank gets the same
/// loss and its own dlogits shard; a group of one is [`cross_entropy_loss`] itself.
///
/// The targets' range is checked here, on the host slice they are made in; the loss
/// itself runs on the device ([`vocab_parallel_cross_entropy`]'s kernels) and only the
/// (T) losses come back, for the logged scalar.
pub fn vocab_parallel_loss(
    group: &dyn Comm,
    logits: &Tensor,
    vocab_start: usize,
    targets: &[u32],
    normalizer: Option<usize>,
) -> Result<LossOutput> {
    const OP: &str = "vocab_parallel_loss";
    if group.size() == 1 {
        return cross_entropy_loss(logits, targets, normalizer);
    }
    let n_valid = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    let denom = normalizer.unwrap_or(n_valid);
    if denom < n_valid {
        return Err(Error::input(
            OP,
            format!("normalizer {denom} is smaller than this batch's {n_valid} valid targets"),
        ));
    }
    let v = logits.dims().get(1).copied().unwrap_or(0) * group.size();
    check_targets(OP, targets, IGNORE_INDEX, v)?;
    let scale = if denom == 0 { 0.0 } else { 1.0 / denom as f64 };
    let tt = Tensor::from_vec_u32(targets.to_vec(), [targets.len()], logits.device())
        .ctx(OP, "targets to device")?;
    let (losses, dlogits) =
        shard_cross_entropy(group, logits, vocab_start, &tt, IGNORE_INDEX, scale as f32)?;
    let loss_sum: f64 = losses
        .to_vec_f32()
        .ctx(OP, "losses to host")?
        .iter()
        .map(|&l| f64::from(l))
        .sum();
    Ok(LossOutput {
        loss: (loss_sum * scale) as f32,
        loss_sum,
        n_valid,
        dlogits,
    })
}

/// A target `>= v` that is not `ignore_index` is an error naming its row.
fn check_targets(op: &'static str, targets: &[u32], ignore_index: u32, v: usize) -> Result<()> {
    match targets
        .iter()
        .enumerate()
        .find(|&(_, &x)| x != ignore_index && x as usize >= v)
    {
        Some((row, bad)) => Err(Error::input(
            op,
            format!("targets[{row}] = {bad} is out of range for a vocabulary of {v}"),
        )),
        None => Ok(()),
    }
}

/// Cross-entropy of logits split along the vocabulary: this rank holds columns
/// `vocab_start .. vocab_start + V/tp` of logits (T, V/tp). Returns (losses (T),
/// dlogits shard (T, V/tp)) equal to [`ops::cross_entropy_fwd_bwd`] on the full logits
/// (ignore rows: loss 0, grad 0; grads times `grad_scale`).
///
/// Megatron's math with one collective: each shard's row max `m`, `sum exp(x - m)` and
/// the target logit (held by exactly one rank, 0 elsewhere) are all-gathered, then every
/// rank combines them (`M = max m`, `S = sum s e^(m - M)`) and writes
/// `loss = ln S + M - x_target` and `dlogits = grad_scale * (softmax - onehot)` for its
/// shard — two device kernels ([`ops::vocab_loss_partials`], [`ops::vocab_loss_finish`])
/// and a (tp, 3, T) all-gather; no logit leaves the device. A group of one is the fused
/// kernel itself.
///
/// `targets` is a device tensor here, so its range check copies it (T u32) to the host;
/// [`vocab_parallel_loss`], the training path, checks the host slice instead.
pub fn vocab_parallel_cross_entropy(
    group: &dyn Comm,
    logits: &Tensor,
    vocab_start: usize,
    targets: &Tensor,
    ignore_index: u32,
    grad_scale: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "vocab_parallel_cross_entropy";
    let vl = logits.dims().get(1).copied().unwrap_or(0);
    if group.size() > 1 && targets.dtype() == DType::U32 {
        let tg = targets.to_vec_u32().ctx(OP, "targets to host")?; // (T)
        check_targets(OP, &tg, ignore_index, vl * group.size())?;
    }
    shard_cross_entropy(
        group,
        logits,
        vocab_start,
        targets,
        ignore_index,
        grad_scale,
    )
}

/// [`vocab_parallel_cross_entropy`] without the targets' range check.
fn shard_cross_entropy(
    group: &dyn Comm,
    logits: &Tensor,
    vocab_start: usize,
    targets: &Tensor,
    ignore_index: u32,
    grad_scale: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "vocab_parallel_cross_entropy";
    let (rank, size) = (group.rank(), group.size());
    let (t, vl) = match *logits.dims() {
        [t, vl] if vl > 0 => (t, vl),
        _ => {
            return Err(Error::input(
                OP,
                format!("logits shard must be (T, V/tp > 0), got {}", logits.shape()),
            ));
        }
    };
    if vocab_start != rank * vl {
        return Err(Error::input(
            OP,
            format!(
                "rank {rank} of {size} with a shard of {vl} columns must start at {}, got vocab_start = {vocab_start}",
                rank * vl
            ),
        ));
    }
    if targets.dims() != [t] || targets.dtype() != DType::U32 {
        return Err(Error::input(
            OP,
            format!(
                "targets must be (T = {t}) u32, got {} {}",
                targets.shape(),
                targets.dtype()
            ),
        ));
    }
    if size == 1 {
        return ops::cross_entropy_fwd_bwd(logits, targets, ignore_index, grad_scale)
            .ctx(OP, "fused kernel");
    }
    let partials = ops::vocab_loss_partials(logits, targets, vocab_start, ignore_index)
        .ctx(OP, "shard partials")?; // (3, T)
    let gathered = group
        .all_gather(&partials)
        .ctx(OP, "all-gather partials")?
        .reshape([size, 3, t])
        .ctx(OP, "partials by rank")?; // (tp, 3, T)
    ops::vocab_loss_finish(
        logits,
        targets,
        &gathered,
        vocab_start,
        ignore_index,
        grad_scale,
    )
    .ctx(OP, "loss and grad")
}
