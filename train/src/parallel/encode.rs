//! The encoders' part of a step on one rank: this replica's images (or clips) through
//! this rank's encoder stage. The first stage starts from pixels (mel frames), a middle
//! stage from the previous stage's hidden states, and the last stage's output goes
//! through the projector and, from TP/CP rank 0, to the bridge. Backward runs the same
//! way back: the bridge's grads enter the last stage, hidden-state grads go to the stage
//! before. Both schedules drive a stage through [`EncoderStage`], whose forward and
//! backward take and return the messages: the phased step (`encode_phased.rs`) runs all of
//! a replica's items as one chunk and moves the messages itself, the overlapped step one
//! chunk per LLM microbatch.
//!
//! Under CP every rank of a stage holds its share of each item's tokens; the last stage
//! gathers them (the encoder does it), so its output is whole on every CP rank.

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
    held: Held<B, C>,
}

impl<B, C> Encoded<B, C> {
    /// Whether its backward starts from the next stage's grad (a middle stage that
    /// trains) rather than the bridge's.
    pub fn wants_next_grad(&self) -> bool {
        matches!(self.held, Held::Middle(Some(_)))
    }
}

pub(crate) type VisionWork = Encoded<VisionBranch<VisionStageCache>, VisionStageCache>;
pub(crate) type AudioWork = Encoded<AudioBranch<AudioStageCache>, AudioStageCache>;

/// An item this rank encodes that its loader did not decode (its media filter and the
/// step's assignment disagree: a bug, never silent garbage).
fn not_decoded(rank: usize, what: &str, row: usize, index: usize) -> TrainError {
    TrainError::Other(format!(
        "rank {rank}: {what} {index} of row {row} is assigned to this rank but its loader did not decode it"
    ))
}

/// What a stage's forward hands on.
pub(crate) enum Handed {
    /// Hidden states for the next stage: (N_local, D).
    Next(Tensor),
    /// The items' projected rows for the bridge, `(plan item, (rows, C))`: on the last
    /// stage's TP/CP rank 0 (the sender); empty on the others.
    Embeds(Vec<(usize, Tensor)>),
}

/// The grad entering a stage's backward.
pub(crate) enum GradIn<'a> {
    /// The last stage: the bridge's grads, `(plan item, (rows, C))`.
    Bridge(&'a [(usize, Tensor)]),
    /// Another stage: the grad of its output hidden states (N_local, D).
    Next(Tensor),
}

/// An encoder stage, vision or audio: what the phased step and the overlapped executor
/// drive alike.
pub(crate) trait EncoderStage {
    type Work;
    const NAME: &'static str;
    /// The items it encodes.
    const KIND: ItemKind;
    fn groups(&self) -> &ModuleGroups;
    /// Whether the encoder's own weights train.
    fn encoder_trains(&self) -> bool;
    /// The shape of the stage's input (and output) hidden states for `items`.
    fn hidden(&self, rows: &[Row], plan: &StepPlan, items: &[usize]) -> Result<Shape>;
    fn stage_forward(
        &self,
        rank: usize,
        rows: &[Row],
        plan: &StepPlan,
        items: Vec<usize>,
        hidden: Option<Tensor>,
    ) -> Result<(Handed, Self::Work)>;
    fn stage_backward(
        &mut self,
        work: Self::Work,
        grad: GradIn<'_>,
        c: usize,
    ) -> Result<Option<Tensor>>;
    fn wants_next_grad(work: &Self::Work) -> bool;
}

impl EncoderStage for VisionPart {
    type Work = VisionWork;
    const NAME: &'static str = "vision";
    const KIND: ItemKind = ItemKind::Image;
    fn groups(&self) -> &ModuleGroups {
        &self.groups
    }
    fn encoder_trains(&self) -> bool {
        trainable(&self.encoder)
    }
    /// The stage's input (and output) hidden states for `items` images.
    fn hidden(&self, _rows: &[Row], _plan: &StepPlan, items: &[usize]) -> Result<Shape> {
        let n = self.encoder.hidden_tokens(items.len())?;
        Ok(Shape::new([n, self.encoder.config.hidden_size])) // (N_local, D)
    }
    /// `items` (plan indices, non-empty) through this rank's vision stage: from pixels on
    /// the first stage, from the previous stage's `hidden` states otherwise.
    fn stage_forward(
        &self,
        rank: usize,
        rows: &[Row],
        plan: &StepPlan,
        items: Vec<usize>,
        hidden: Option<Tensor>,
    ) -> Result<(Handed, VisionWork)> {
        let part = self;
        let g = &part.groups;
        let &first = items
            .first()
            .ok_or_else(|| TrainError::Other("a vision stage was given no images".into()))?;
        let b = items.len();
        let n_rows: Vec<usize> = items.iter().map(|&i| plan.items[i].rows).collect();
        let dev = device_of(&part.encoder);
        let (out, cache) = match hidden {
            None => {
                let im0 = &rows[plan.items[first].row].images[plan.items[first].index];
                let (h, w) = (im0.height, im0.width);
                let mut pixels = Vec::with_capacity(b * 3 * h * w); // (B, 3, H, W)
                for &i in &items {
                    let it = &plan.items[i];
                    let im = &rows[it.row].images[it.index];
                    if im.pixels.len() != 3 * h * w {
                        return Err(not_decoded(rank, "image", it.row, it.index));
                    }
                    pixels.extend_from_slice(&im.pixels);
                }
                let px = Tensor::from_vec(pixels, [b, 3, h, w], dev)?;
                part.encoder
                    .forward_stage(VisionStageInput::Pixels(&px), b)?
            }
            Some(h) => part
                .encoder
                .forward_stage(VisionStageInput::Hidden(h.into_device(dev)?), b)?,
        };
        let out = match out {
            VisionStageOutput::Hidden(h) => Out::Hidden(h),
            VisionStageOutput::Final(o) => Out::Final(o.last_hidden_state),
        };
        let trains = trainable(&part.encoder);
        hand_on(g, out, cache, trains, (items, n_rows), |last, cache| {
            let proj = last_stage_projector(part.projector.as_ref(), g)?;
            Ok(vision_project(&part.encoder, proj, last, cache)?) // (B * tpi, C)
        })
    }

    /// The backward of [`EncoderStage::stage_forward`]: the grad of the stage's input for the
    /// previous stage (`None` on the first stage, or where nothing trains).
    fn stage_backward(
        &mut self,
        work: VisionWork,
        grad: GradIn<'_>,
        c: usize,
    ) -> Result<Option<Tensor>> {
        let part = self;
        let g = part.groups.clone();
        let d = part.encoder.config.hidden_size;
        let dev = device_of(&part.encoder);
        let projector = &mut part.projector;
        let Some((cache, dout)) = grad_in(&g, dev, work, grad, c, |branch, dy| {
            let proj = projector.as_mut().ok_or_else(|| no_projector(&g))?;
            let back = vision_unproject(d, proj, branch, dy)?;
            replicated_over_cp(proj, &g)?;
            Ok(back)
        })?
        else {
            return Ok(None);
        };
        let dx = part.encoder.backward_stage(cache, &dout, None)?;
        Ok((g.coord.pp > 0).then_some(dx))
    }

    fn wants_next_grad(work: &VisionWork) -> bool {
        work.wants_next_grad()
    }
}

impl EncoderStage for AudioPart {
    type Work = AudioWork;
    const NAME: &'static str = "audio";
    const KIND: ItemKind = ItemKind::Clip;
    fn groups(&self) -> &ModuleGroups {
        &self.groups
    }
    fn encoder_trains(&self) -> bool {
        trainable(&self.encoder)
    }
    /// The stage's input (and output) hidden states for the clips `items`.
    fn hidden(&self, rows: &[Row], plan: &StepPlan, items: &[usize]) -> Result<Shape> {
        let n = self
            .encoder
            .hidden_tokens(&clip_frames(rows, plan, items))?;
        Ok(Shape::new([n, self.encoder.config.d_model])) // (T_local, D)
    }
    /// `items` (plan indices, non-empty) through this rank's audio stage: from mel frames
    /// on the first stage, from the previous stage's `hidden` states otherwise.
    fn stage_forward(
        &self,
        rank: usize,
        rows: &[Row],
        plan: &StepPlan,
        items: Vec<usize>,
        hidden: Option<Tensor>,
    ) -> Result<(Handed, AudioWork)> {
        let part = self;
        let g = &part.groups;
        if items.is_empty() {
            return Err(TrainError::Other(
                "an audio stage was given no clips".into(),
            ));
        }
        let clip = |i: usize| &rows[plan.items[i].row].audio[plan.items[i].index];
        let frames = clip_frames(rows, plan, &items);
        let n_rows: Vec<usize> = items.iter().map(|&i| plan.items[i].rows).collect();
        let dev = device_of(&part.encoder);
        let (out, cache) = match hidden {
            None => {
                for &i in &items {
                    let a = clip(i);
                    if a.mel.len() != a.n_mels * a.frames {
                        return Err(not_decoded(
                            rank,
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
                        Tensor::from_vec(a.mel.clone(), [a.n_mels, a.frames], dev)
                    })
                    .collect::<braid_kernels::Result<Vec<_>>>()?; // (n_mels, F) each
                part.encoder
                    .forward_stage(AudioStageInput::Clips(&clips), &frames)?
            }
            Some(h) => part
                .encoder
                .forward_stage(AudioStageInput::Hidden(h.into_device(dev)?), &frames)?,
        };
        let out = match out {
            AudioStageOutput::Hidden(h) => Out::Hidden(h),
            AudioStageOutput::Final(o) => Out::Final(o),
        };
        let trains = trainable(&part.encoder);
        hand_on(g, out, cache, trains, (items, n_rows), |o, cache| {
            let proj = last_stage_projector(part.projector.as_ref(), g)?;
            Ok(audio_project(
                &part.encoder,
                proj,
                &o.hidden,
                &o.cu_seqlens,
                cache,
            )?) // (G_a, C)
        })
    }

    /// The backward of [`EncoderStage::stage_forward`]: the grad of the stage's input for the
    /// previous stage (`None` on the first stage, or where nothing trains).
    fn stage_backward(
        &mut self,
        work: AudioWork,
        grad: GradIn<'_>,
        c: usize,
    ) -> Result<Option<Tensor>> {
        let part = self;
        let g = part.groups.clone();
        let dev = device_of(&part.encoder);
        let projector = &mut part.projector;
        let Some((cache, dout)) = grad_in(&g, dev, work, grad, c, |branch, dy| {
            let proj = projector.as_mut().ok_or_else(|| no_projector(&g))?;
            let back = audio_unproject(proj, branch, dy)?;
            replicated_over_cp(proj, &g)?;
            Ok(back)
        })?
        else {
            return Ok(None);
        };
        Ok(match part.encoder.backward_stage(cache, &dout)? {
            AudioStageGrad::Hidden(dh) => Some(dh),
            // The first stage: the clips' grads are not needed.
            AudioStageGrad::Clips(_) => None,
        })
    }

    fn wants_next_grad(work: &AudioWork) -> bool {
        work.wants_next_grad()
    }
}

/// Mel frames of each of `items` (clips).
fn clip_frames(rows: &[Row], plan: &StepPlan, items: &[usize]) -> Vec<usize> {
    items
        .iter()
        .map(|&i| rows[plan.items[i].row].audio[plan.items[i].index].frames)
        .collect()
}

/// A stage's output: hidden states for the next stage, or the encoder's final output.
enum Out<F> {
    Hidden(Tensor),
    Final(F),
}

/// After a stage's forward: a middle stage hands its hidden states on and keeps its
/// cache (when the encoder trains); the last stage projects the output (`project`) and,
/// on TP/CP rank 0, hands each item's rows to the bridge.
fn hand_on<F, B, C>(
    g: &ModuleGroups,
    out: Out<F>,
    cache: C,
    trains: bool,
    (items, rows): (Vec<usize>, Vec<usize>),
    project: impl FnOnce(F, C) -> Result<(Tensor, Option<B>)>,
) -> Result<(Handed, Encoded<B, C>)> {
    let (handed, held) = match out {
        Out::Hidden(h) => (Handed::Next(h), Held::Middle(trains.then_some(cache))),
        Out::Final(o) => {
            let (y, branch) = project(o, cache)?;
            let sender = g.coord.tp == 0 && g.coord.cp == 0;
            let mut embeds = Vec::new();
            hand_over(&y, &items, &rows, sender, &mut embeds)?;
            (Handed::Embeds(embeds), Held::Last(branch))
        }
    };
    Ok((handed, Encoded { items, rows, held }))
}

/// The grad entering a stage's backward, with its cache: from the bridge through the
/// projector (`unproject`) on the last stage, the next stage's otherwise. `None` when
/// nothing here runs backward.
fn grad_in<B, C>(
    g: &ModuleGroups,
    dev: Device,
    work: Encoded<B, C>,
    grad: GradIn<'_>,
    c: usize,
    unproject: impl FnOnce(B, &Tensor) -> Result<Option<(C, Tensor)>>,
) -> Result<Option<(C, Tensor)>> {
    match (work.held, grad) {
        (Held::Last(None) | Held::Middle(None), _) => Ok(None),
        (Held::Last(Some(branch)), GradIn::Bridge(grads)) => {
            let dy = stack_grads(grads, &work.items, &work.rows, c, dev)?;
            unproject(branch, &dy)
        }
        (Held::Middle(Some(cache)), GradIn::Next(dh)) => Ok(Some((cache, dh.into_device(dev)?))), // (N_local, D)
        _ => Err(TrainError::Other(format!(
            "{} stage {}: its backward got the wrong kind of grad (bridge vs next stage)",
            g.kind.key(),
            g.coord.pp
        ))),
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
