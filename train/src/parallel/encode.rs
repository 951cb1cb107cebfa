//! The encoders' part of a step on one rank: this replica's images (or clips) through
//! this rank's encoder stage. The first stage starts from pixels (mel frames), a middle
//! stage from the previous stage's hidden states, and the last stage's output goes
//! through the projector and, from TP/CP rank 0, to the bridge. Backward runs the same
//! way back: the bridge's grads enter the last stage, hidden-state grads go to the stage
//! before. All of a replica's items run as one microbatch.
//!
//! Under CP every rank of a stage holds its share of each item's tokens; the last stage
//! gathers them (the encoder does it), so its output is whole on every CP rank.

use braid_comm::Comm;
use braid_dataloader::loader::Row;
use braid_encoders::{
    AudioStageCache, AudioStageGrad, AudioStageInput, AudioStageOutput, VisionStageCache,
    VisionStageInput, VisionStageOutput,
};
use braid_kernels::{DType, Device, Shape, Tensor, ops};
use braid_nn::Module;

use super::model::{AudioPart, ModuleGroups, VisionPart, device_of};
use super::plan::{ItemKind, StepPlan};
use crate::error::{Result, TrainError};
use crate::mllm::{
    AudioBranch, VisionBranch, audio_project, audio_unproject, trainable, vision_project,
    vision_unproject,
};

/// What a stage keeps for its backward.
pub(crate) enum Held<B, C> {
    /// The last stage: the branch state (projector and the stage's cache), when anything
    /// in the branch trains.
    Last(Option<B>),
    /// Another stage: its cache, when the encoder trains.
    Middle(Option<C>),
}

/// One rank's encoder work of a step.
pub(crate) struct Encoded<B, C> {
    /// Items (indices into the plan) in the order they were encoded.
    pub items: Vec<usize>,
    /// Embedding rows per item, same order.
    pub rows: Vec<usize>,
    /// Mel frames per clip (empty for images).
    frames: Vec<usize>,
    held: Held<B, C>,
}

pub(crate) type VisionWork = Encoded<VisionBranch<VisionStageCache>, VisionStageCache>;
pub(crate) type AudioWork = Encoded<AudioBranch<AudioStageCache>, AudioStageCache>;

/// The items of `kind` this replica encodes, in plan order.
fn my_items(plan: &StepPlan, kind: ItemKind, dp: usize) -> Vec<usize> {
    (0..plan.items.len())
        .filter(|&i| plan.items[i].kind == kind && plan.items[i].enc_dp == dp)
        .collect()
}

/// An item this rank encodes that its loader did not decode (its media filter and the
/// step's assignment disagree: a bug, never silent garbage).
fn not_decoded(world: &dyn Comm, what: &str, row: usize, index: usize) -> TrainError {
    TrainError::Other(format!(
        "rank {}: {what} {index} of row {row} is assigned to this rank but its loader did not decode it",
        world.rank()
    ))
}

fn neighbor(g: &ModuleGroups, world: &dyn Comm, delta: isize) -> Result<usize> {
    g.grid.pp_neighbor(world.rank(), delta).ok_or_else(|| {
        TrainError::Other(format!("{} stage has no neighbour {delta}", g.kind.key()))
    })
}

/// This replica's images through this rank's vision stage.
pub(crate) fn encode_images(
    part: &VisionPart,
    world: &dyn Comm,
    rows: &[Row],
    plan: &StepPlan,
    produced: &mut Vec<(usize, Tensor)>,
) -> Result<Option<VisionWork>> {
    let g = &part.groups;
    let items = my_items(plan, ItemKind::Image, g.coord.dp);
    let Some(&first) = items.first() else {
        return Ok(None);
    };
    let b = items.len();
    let n_rows: Vec<usize> = items.iter().map(|&i| plan.items[i].rows).collect();
    let d = part.encoder.config.hidden_size;
    let (out, cache) = if g.coord.pp == 0 {
        let im0 = &rows[plan.items[first].row].images[plan.items[first].index];
        let (h, w) = (im0.height, im0.width);
        let mut pixels = Vec::with_capacity(b * 3 * h * w); // (B, 3, H, W)
        for &i in &items {
            let it = &plan.items[i];
            let im = &rows[it.row].images[it.index];
            if im.pixels.len() != 3 * h * w {
                return Err(not_decoded(world, "image", it.row, it.index));
            }
            pixels.extend_from_slice(&im.pixels);
        }
        let px = Tensor::from_vec(pixels, [b, 3, h, w], device_of(&part.encoder))?;
        part.encoder
            .forward_stage(VisionStageInput::Pixels(&px), b)?
    } else {
        let n = part.encoder.hidden_tokens(b)?;
        let h = world
            .recv(&Shape::new([n, d]), neighbor(g, world, -1)?)?
            .into_device(device_of(&part.encoder))?; // (N_local, D)
        part.encoder.forward_stage(VisionStageInput::Hidden(h), b)?
    };
    let out = match out {
        VisionStageOutput::Hidden(h) => Out::Hidden(h),
        VisionStageOutput::Final(o) => Out::Final(o.last_hidden_state),
    };
    let work = Encoded {
        items,
        rows: n_rows,
        frames: Vec::new(),
        held: Held::Last(None),
    };
    let trains = trainable(&part.encoder);
    hand_on(
        g,
        world,
        out,
        cache,
        trains,
        work,
        produced,
        |last, cache| {
            let proj = last_stage_projector(part.projector.as_ref(), g)?;
            Ok(vision_project(&part.encoder, proj, last, cache)?) // (B * tpi, C)
        },
    )
    .map(Some)
}

/// The backward of [`encode_images`], given the bridge's grads.
pub(crate) fn backward_images(
    part: &mut VisionPart,
    world: &dyn Comm,
    work: VisionWork,
    grads: &[(usize, Tensor)],
    c: usize,
) -> Result<()> {
    let g = part.groups.clone();
    let d = part.encoder.config.hidden_size;
    let n = part.encoder.hidden_tokens(work.items.len())?; // N_local
    let dev = device_of(&part.encoder);
    let projector = &mut part.projector;
    let Some((cache, dout)) = grad_in(&g, world, dev, work, grads, c, n, d, |branch, dy| {
        let proj = projector.as_mut().ok_or_else(|| no_projector(&g))?;
        let back = vision_unproject(d, proj, branch, dy)?;
        replicated_over_cp(proj, &g)?;
        Ok(back)
    })?
    else {
        return Ok(());
    };
    let dx = part.encoder.backward_stage(cache, &dout, None)?;
    if g.coord.pp > 0 {
        world.send(&dx, neighbor(&g, world, -1)?)?;
    }
    Ok(())
}

/// This replica's clips through this rank's audio stage.
pub(crate) fn encode_clips(
    part: &AudioPart,
    world: &dyn Comm,
    rows: &[Row],
    plan: &StepPlan,
    produced: &mut Vec<(usize, Tensor)>,
) -> Result<Option<AudioWork>> {
    let g = &part.groups;
    let items = my_items(plan, ItemKind::Clip, g.coord.dp);
    if items.is_empty() {
        return Ok(None);
    }
    let clip = |i: usize| &rows[plan.items[i].row].audio[plan.items[i].index];
    let frames: Vec<usize> = items.iter().map(|&i| clip(i).frames).collect();
    let n_rows: Vec<usize> = items.iter().map(|&i| plan.items[i].rows).collect();
    let d = part.encoder.config.d_model;
    let (out, cache) = if g.coord.pp == 0 {
        for &i in &items {
            let a = clip(i);
            if a.mel.len() != a.n_mels * a.frames {
                return Err(not_decoded(
                    world,
                    "clip",
                    plan.items[i].row,
                    plan.items[i].index,
                ));
            }
        }
        let clips = items
            .iter()
            .map(|&i| {
                let a = clip(i);
                Tensor::from_vec(
                    a.mel.clone(),
                    [a.n_mels, a.frames],
                    device_of(&part.encoder),
                )
            })
            .collect::<braid_kernels::Result<Vec<_>>>()?; // (n_mels, F) each
        part.encoder
            .forward_stage(AudioStageInput::Clips(&clips), &frames)?
    } else {
        let n = part.encoder.hidden_tokens(&frames)?;
        let h = world
            .recv(&Shape::new([n, d]), neighbor(g, world, -1)?)?
            .into_device(device_of(&part.encoder))?; // (T_local, D)
        part.encoder
            .forward_stage(AudioStageInput::Hidden(h), &frames)?
    };
    let out = match out {
        AudioStageOutput::Hidden(h) => Out::Hidden(h),
        AudioStageOutput::Final(o) => Out::Final(o),
    };
    let work = Encoded {
        items,
        rows: n_rows,
        frames,
        held: Held::Last(None),
    };
    let trains = trainable(&part.encoder);
    hand_on(g, world, out, cache, trains, work, produced, |o, cache| {
        let proj = last_stage_projector(part.projector.as_ref(), g)?;
        Ok(audio_project(
            &part.encoder,
            proj,
            &o.hidden,
            &o.cu_seqlens,
            cache,
        )?) // (G_a, C)
    })
    .map(Some)
}

/// The backward of [`encode_clips`], given the bridge's grads.
pub(crate) fn backward_clips(
    part: &mut AudioPart,
    world: &dyn Comm,
    work: AudioWork,
    grads: &[(usize, Tensor)],
    c: usize,
) -> Result<()> {
    let g = part.groups.clone();
    let d = part.encoder.config.d_model;
    let n = part.encoder.hidden_tokens(&work.frames)?; // T_local
    let dev = device_of(&part.encoder);
    let projector = &mut part.projector;
    let Some((cache, dout)) = grad_in(&g, world, dev, work, grads, c, n, d, |branch, dy| {
        let proj = projector.as_mut().ok_or_else(|| no_projector(&g))?;
        let back = audio_unproject(proj, branch, dy)?;
        replicated_over_cp(proj, &g)?;
        Ok(back)
    })?
    else {
        return Ok(());
    };
    match part.encoder.backward_stage(cache, &dout)? {
        AudioStageGrad::Hidden(dh) => world.send(&dh, neighbor(&g, world, -1)?)?,
        // The first stage: the clips' grads are not needed.
        AudioStageGrad::Clips(_) => {}
    }
    Ok(())
}

/// A stage's output: hidden states for the next stage, or the encoder's final output.
enum Out<F> {
    Hidden(Tensor),
    Final(F),
}

/// After a stage's forward: a middle stage sends its hidden states on and keeps its
/// cache (when the encoder trains); the last stage projects the output (`project`) and,
/// on TP/CP rank 0, hands each item's rows to the bridge.
#[allow(clippy::too_many_arguments)]
fn hand_on<F, B, C>(
    g: &ModuleGroups,
    world: &dyn Comm,
    out: Out<F>,
    cache: C,
    trains: bool,
    mut work: Encoded<B, C>,
    produced: &mut Vec<(usize, Tensor)>,
    project: impl FnOnce(F, C) -> Result<(Tensor, Option<B>)>,
) -> Result<Encoded<B, C>> {
    work.held = match out {
        Out::Hidden(h) => {
            world.send(&h, neighbor(g, world, 1)?)?;
            Held::Middle(trains.then_some(cache))
        }
        Out::Final(o) => {
            let (y, branch) = project(o, cache)?;
            let sender = g.coord.tp == 0 && g.coord.cp == 0;
            hand_over(&y, &work.items, &work.rows, sender, produced)?;
            Held::Last(branch)
        }
    };
    Ok(work)
}

/// The grad entering a stage's backward, with its cache: from the bridge through the
/// projector (`unproject`) on the last stage, from the next stage otherwise (`n` rows of
/// width `d`). `None` when nothing here runs backward.
#[allow(clippy::too_many_arguments)]
fn grad_in<B, C>(
    g: &ModuleGroups,
    world: &dyn Comm,
    dev: Device,
    work: Encoded<B, C>,
    grads: &[(usize, Tensor)],
    c: usize,
    n: usize,
    d: usize,
    unproject: impl FnOnce(B, &Tensor) -> Result<Option<(C, Tensor)>>,
) -> Result<Option<(C, Tensor)>> {
    match work.held {
        Held::Last(None) | Held::Middle(None) => Ok(None),
        Held::Last(Some(branch)) => {
            let dy = stack_grads(grads, &work.items, &work.rows, c, dev)?;
            unproject(branch, &dy)
        }
        Held::Middle(Some(cache)) => {
            let dh = world
                .recv(&Shape::new([n, d]), neighbor(g, world, 1)?)?
                .into_device(dev)?; // (N_local, D)
            Ok(Some((cache, dh)))
        }
    }
}

fn no_projector(g: &ModuleGroups) -> TrainError {
    TrainError::Other(format!(
        "the {} encoder's last stage has no projector",
        g.kind.key()
    ))
}

fn last_stage_projector<'a, P>(p: Option<&'a P>, g: &ModuleGroups) -> Result<&'a P> {
    p.ok_or_else(|| no_projector(g))
}

/// Every CP rank of the last stage runs the projector on the whole output, so each holds
/// the projector's full grad; only CP rank 0 keeps it, so that the gradient sum over
/// the CP x DP group counts it once (the encoder's own grads are per-token shares).
fn replicated_over_cp<M: Module + ?Sized>(proj: &mut M, g: &ModuleGroups) -> Result<()> {
    if g.coord.cp != 0 {
        proj.zero_grads()?;
    }
    Ok(())
}

/// Rows `start .. start + n` of `x` (N, C).
fn row_slice(x: &Tensor, start: usize, n: usize) -> Result<Tensor> {
    let idx: Vec<u32> = (start as u32..(start + n) as u32).collect();
    let idx = Tensor::from_vec_u32(idx, [n], x.device())?;
    Ok(ops::gather_rows(x, &idx)?)
}

/// Splits `y` (sum of n_rows, C) into one tensor per item for the bridge (sender only).
fn hand_over(
    y: &Tensor,
    items: &[usize],
    n_rows: &[usize],
    sender: bool,
    produced: &mut Vec<(usize, Tensor)>,
) -> Result<()> {
    let total: usize = n_rows.iter().sum();
    if y.dims()[0] != total {
        return Err(TrainError::Other(format!(
            "the encoder gave {} rows for {} placeholder tokens of {} items",
            y.dims()[0],
            total,
            items.len()
        )));
    }
    if !sender {
        return Ok(());
    }
    let mut off = 0;
    for (&i, &n) in items.iter().zip(n_rows) {
        produced.push((i, row_slice(y, off, n)?));
        off += n;
    }
    Ok(())
}

/// The grads of `items` from the bridge, stacked in that order: (sum of rows, C).
fn stack_grads(
    grads: &[(usize, Tensor)],
    items: &[usize],
    n_rows: &[usize],
    c: usize,
    dev: Device,
) -> Result<Tensor> {
    let total: usize = n_rows.iter().sum();
    // The bridge returns grads in the dtype it carried the embeddings in.
    let dtype = grads.first().map_or(DType::F32, |g| g.1.dtype());
    let mut dy = Tensor::zeros(vec![total, c], dtype, dev)?; // (N, C)
    let mut off = 0;
    for (&i, &n) in items.iter().zip(n_rows) {
        let g = grads.iter().find(|(j, _)| *j == i).ok_or_else(|| {
            TrainError::Other(format!("the bridge returned no grad for item {i}"))
        })?;
        let idx: Vec<u32> = (off as u32..(off + n) as u32).collect();
        let idx = Tensor::from_vec_u32(idx, [n], dev)?;
        ops::scatter_rows(&mut dy, &idx, &g.1)?;
        off += n;
    }
    Ok(dy)
}
