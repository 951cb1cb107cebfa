//! After the backward: gradients summed over the ranks that hold the same shard
//! (bucketed all-reduce over each module's cp x dp group, and the tied embedding's two
//! copies over the first and last LLM stage), the global grad norm counted once per
//! element, and ZeRO-1: which rank of a replica group updates which parameter, and the
//! broadcast of the updated values.
//!
//! The loss is normalized by the global target count, so the summed gradient is the
//! one-rank gradient whatever the replicas' token counts.

use std::collections::HashMap;

use braid_kernels::{Tensor, ops};
use braid_nn::{Module, Param, Shard};

use super::model::{ModuleGroups, RankModel};
use crate::error::{Result, TrainError};
use crate::mllm::LLM;

/// Which module part a parameter belongs to, by visiting order.
fn parts(model: &RankModel) -> Vec<(&ModuleGroups, Vec<&Param>)> {
    let mut out = Vec::new();
    if let Some(v) = &model.vision {
        let mut ps = Vec::new();
        v.encoder.visit_params(&mut |p| ps.push(p));
        if let Some(pr) = &v.projector {
            pr.visit_params(&mut |p| ps.push(p));
        }
        out.push((&v.groups, ps));
    }
    if let Some(a) = &model.audio {
        let mut ps = Vec::new();
        a.encoder.visit_params(&mut |p| ps.push(p));
        if let Some(pr) = &a.projector {
            pr.visit_params(&mut |p| ps.push(p));
        }
        out.push((&a.groups, ps));
    }
    if let Some(l) = &model.llm {
        let mut ps = Vec::new();
        l.visit_params(&mut |p| ps.push(p));
        out.push((&l.groups, ps));
    }
    out
}

/// The ZeRO-1 plan of a rank: for each trainable parameter, the rank of its replica
/// group that owns its optimizer state and update, and whether this rank's copy is the
/// one counted in the grad norm and written to checkpoints.
#[derive(Debug, Clone, Default)]
pub struct ShardPlan {
    /// name -> (owner's rank in the replica group, this rank is the owner)
    owner: HashMap<String, (usize, bool)>,
    /// Names whose copy on this rank is the primary one (norm, checkpoint).
    primary: HashMap<String, bool>,
}

impl ShardPlan {
    /// Owners assigned greedily in visiting order to the least-loaded group rank (ties
    /// to the lowest), so every rank of the group, and every TP rank (whose shards have
    /// equal sizes), computes the same plan. Without ZeRO-1 every rank updates every
    /// parameter and group rank 0 is the primary copy.
    pub fn new(model: &RankModel, zero1: bool) -> ShardPlan {
        let mut plan = ShardPlan::default();
        for (g, params) in parts(model) {
            let n = g.replicas.size();
            let me = g.replicas.rank();
            let mut load = vec![0usize; n];
            let last_stage_copy = g.tied.is_some() && g.coord.pp > 0;
            for p in params {
                let owner = if zero1 && p.is_trainable() {
                    let o = (0..n).min_by_key(|&r| (load[r], r)).unwrap_or(0);
                    load[o] += p.value.elem_count();
                    o
                } else {
                    0
                };
                let mine = !zero1 || owner == me;
                plan.owner.insert(p.name.clone(), (owner, mine));
                // One copy per element in the world: the owner (or group rank 0) of a
                // TP-split shard, or of tp rank 0 for a replicated one; never the last
                // stage's copy of a tied embedding.
                let tied_copy = last_stage_copy && p.name == format!("{LLM}embed_tokens.weight");
                let split = matches!(p.shard, Shard::Split { .. });
                let primary = owner == me && (split || g.coord.tp == 0) && !tied_copy;
                plan.primary.insert(p.name.clone(), primary);
            }
        }
        plan
    }

    /// Whether this rank holds the optimizer state of `name` and updates it.
    pub fn owns(&self, name: &str) -> bool {
        self.owner.get(name).is_some_and(|o| o.1)
    }

    /// Whether this rank's copy of `name` counts in the norm and is checkpointed.
    pub fn is_primary(&self, name: &str) -> bool {
        self.primary.get(name).copied().unwrap_or(false)
    }

    fn owner_of(&self, name: &str) -> Result<usize> {
        self.owner.get(name).map(|o| o.0).ok_or_else(|| {
            TrainError::Other(format!("parameter `{name}` is missing from the ZeRO plan"))
        })
    }
}

/// Sums every trainable parameter's grad over its replica group (all-reduce in buckets
/// of at most `bucket_elems`), then the tied embedding's copies over the first and last
/// stage.
pub fn all_reduce_grads(model: &mut RankModel, bucket_elems: usize) -> Result<()> {
    for (groups, names) in part_names(model) {
        if groups.replicas.size() > 1 {
            all_reduce_bucketed(model, &names, groups.replicas.as_ref(), bucket_elems)?;
        }
        if let Some(tied) = &groups.tied {
            let name = format!("{LLM}embed_tokens.weight");
            if names.contains(&name) {
                all_reduce_bucketed(model, &[name], tied.as_ref(), bucket_elems)?;
            }
        }
    }
    Ok(())
}

/// (groups, trainable parameter names) of each part.
fn part_names(model: &RankModel) -> Vec<(ModuleGroups, Vec<String>)> {
    parts(model)
        .into_iter()
        .map(|(g, ps)| {
            let names = ps
                .iter()
                .filter(|p| p.is_trainable())
                .map(|p| p.name.clone())
                .collect();
            (g.clone(), names)
        })
        .collect()
}

/// All-reduce of the grads of `names` (in that order) over `group`, packed into flat
/// buckets so that one message carries many small tensors. The buckets live where the
/// grads do: each grad is copied into its bucket's range and back on the device
/// (`ops::copy_range`), and the bucket is summed in place (on NCCL, without the host).
fn all_reduce_bucketed(
    model: &mut RankModel,
    names: &[String],
    group: &dyn braid_comm::Comm,
    bucket_elems: usize,
) -> Result<()> {
    // Every wanted grad's size, and the device and dtype the buckets take from them.
    let wanted: HashMap<&str, usize> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let mut sizes = vec![0usize; names.len()];
    let mut place: Option<(braid_kernels::Device, braid_kernels::DType)> = None;
    model.visit_params(&mut |p| {
        if let (Some(&i), Some(g)) = (wanted.get(p.name.as_str()), &p.grad) {
            sizes[i] = g.elem_count();
            place.get_or_insert((g.device(), g.dtype()));
        }
    });
    let Some((device, dtype)) = place else {
        return Ok(());
    };
    // Buckets: consecutive names whose sizes add up to at most bucket_elems (a larger
    // tensor is a bucket of its own).
    let mut start = 0;
    while start < names.len() {
        let mut end = start;
        let mut elems = 0;
        while end < names.len() {
            if end > start && elems + sizes[end] > bucket_elems {
                break;
            }
            elems += sizes[end];
            end += 1;
        }
        // Offsets of the bucket's grads in it, by name.
        let mut offset: HashMap<&str, usize> = HashMap::new();
        let mut off = 0;
        for (name, &n) in names[start..end].iter().zip(&sizes[start..end]) {
            offset.insert(name.as_str(), off);
            off += n;
        }
        let mut flat = Tensor::zeros([elems], dtype, device)?; // (E)
        let mut res: Result<()> = Ok(());
        model.visit_params(&mut |p| {
            if let (true, Some(&o), Some(g)) = (res.is_ok(), offset.get(p.name.as_str()), &p.grad) {
                res = ops::copy_range(g, 0, &mut flat, o, g.elem_count()).map_err(Into::into);
            }
        });
        res?;
        group.all_reduce_sum(&mut flat)?;
        let mut res: Result<()> = Ok(());
        model.visit_params_mut(&mut |p| {
            if let (true, Some(&o)) = (res.is_ok(), offset.get(p.name.as_str()))
                && let Some(g) = &mut p.grad
            {
                let n = g.elem_count();
                res = ops::copy_range(&flat, o, g, 0, n).map_err(Into::into);
            }
        });
        res?;
        start = end;
    }
    Ok(())
}

/// This rank's share of the squared grad norm: its primary copies only.
pub fn local_sq_norm(model: &RankModel, plan: &ShardPlan) -> Result<f64> {
    let mut grads = Vec::new();
    model.visit_params(&mut |p| {
        if let Some(g) = &p.grad
            && plan.is_primary(&p.name)
        {
            grads.push(g);
        }
    });
    let n = braid_kernels::ops::global_norm(grads)?;
    Ok(n * n)
}

/// After the owners' updates: every parameter's value broadcast from its owner to the
/// rest of its replica group (ZeRO-1's all-gather of the updated shards).
pub fn broadcast_updates(model: &mut RankModel, plan: &ShardPlan) -> Result<()> {
    for (g, names) in part_names(model) {
        if g.replicas.size() == 1 {
            continue;
        }
        let names: std::collections::HashSet<String> = names.into_iter().collect();
        // One pass in visiting order, the same on every rank of the group.
        let mut res = Ok(());
        model.visit_params_mut(&mut |p| {
            if res.is_err() || !names.contains(&p.name) {
                return;
            }
            res = plan.owner_of(&p.name).and_then(|owner| {
                g.replicas
                    .broadcast(&mut p.value, owner)
                    .map_err(TrainError::from)?;
                // The owner refreshed its compute copy in the fused step; the others
                // derive theirs from the value they received.
                p.refresh_compute().map_err(TrainError::from)
            });
        });
        res?;
    }
    Ok(())
}
