//! The phased step's encoder drivers: all of a replica's images (or clips) through this
//! rank's encoder stage as one chunk, the stage-to-stage messages sent and received
//! here, the embeddings handed to the bridge's list, and the backward the same way back.

use braid_comm::Comm;
use braid_dataloader::loader::Row;
use braid_kernels::Tensor;

use super::encode::{EncoderStage, GradIn, Handed};
use super::model::ModuleGroups;
use super::plan::{ItemKind, StepPlan};
use crate::error::{Result, TrainError};
use crate::trace::Tracer;

/// The items of `kind` this replica encodes, in plan order.
fn my_items(plan: &StepPlan, kind: ItemKind, dp: usize) -> Vec<usize> {
    (0..plan.items.len())
        .filter(|&i| plan.items[i].kind == kind && plan.items[i].enc_dp == dp)
        .collect()
}

fn neighbor(g: &ModuleGroups, world: &dyn Comm, delta: isize) -> Result<usize> {
    g.grid.pp_neighbor(world.rank(), delta).ok_or_else(|| {
        TrainError::Other(format!("{} stage has no neighbour {delta}", g.kind.key()))
    })
}

/// The phased step's messages of a stage's forward: the hidden states on to the next
/// stage, or the embeddings to the bridge's list.
fn hand(
    handed: Handed,
    g: &ModuleGroups,
    world: &dyn Comm,
    produced: &mut Vec<(usize, Tensor)>,
) -> Result<()> {
    match handed {
        Handed::Next(h) => world.send(&h, neighbor(g, world, 1)?)?,
        Handed::Embeds(e) => produced.extend(e),
    }
    Ok(())
}

/// The phased step: this replica's images (or clips) through this rank's stage as one
/// chunk, the hidden states received from the stage before and sent to the next, the
/// embeddings added to the bridge's list. `None` when the replica has none. The stage's
/// compute is a span of the module's lane and the waits for its neighbours are spans of
/// the comm lane, so a stage waiting on a slow one before it is not the straggler.
pub(crate) fn encode<P: EncoderStage>(
    part: &P,
    world: &dyn Comm,
    rows: &[Row],
    plan: &StepPlan,
    produced: &mut Vec<(usize, Tensor)>,
    trace: &mut Tracer,
) -> Result<Option<P::Work>> {
    let g = part.groups();
    let items = my_items(plan, P::KIND, g.coord.dp);
    if items.is_empty() {
        return Ok(None);
    }
    let hidden = if g.coord.pp > 0 {
        let shape = part.hidden(rows, plan, &items)?;
        let t0 = trace.start();
        let h = world.recv(&shape, neighbor(g, world, -1)?)?;
        trace.end(t0, format!("{} recv act", P::NAME), "comm")?;
        Some(h)
    } else {
        None
    };
    let t0 = trace.start();
    let (handed, work) = part.stage_forward(world.rank(), rows, plan, items, hidden)?;
    trace.end(t0, format!("{} fwd s{}", P::NAME, g.coord.pp), P::NAME)?;
    // Only a middle stage sends here; the last stage's embeddings go to the bridge.
    let sends = matches!(handed, Handed::Next(_));
    let t0 = trace.start();
    hand(handed, g, world, produced)?;
    if sends {
        trace.end(t0, format!("{} send act", P::NAME), "comm")?;
    }
    Ok(Some(work))
}

/// The backward of [`encode`], given the bridge's grads (`rows`/`plan` size the next
/// stage's grad, which a middle stage receives). The arguments mirror [`encode`]'s plus
/// what the backward adds (the saved work, the bridge's grads and width).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<P: EncoderStage>(
    part: &mut P,
    world: &dyn Comm,
    rows: &[Row],
    plan: &StepPlan,
    work: P::Work,
    grads: &[(usize, Tensor)],
    c: usize,
    trace: &mut Tracer,
) -> Result<()> {
    let g = part.groups().clone();
    let grad = if P::wants_next_grad(&work) {
        let items = my_items(plan, P::KIND, g.coord.dp);
        let shape = part.hidden(rows, plan, &items)?;
        let t0 = trace.start();
        let dy = world.recv(&shape, neighbor(&g, world, 1)?)?;
        trace.end(t0, format!("{} recv grad", P::NAME), "comm")?;
        GradIn::Next(dy)
    } else {
        GradIn::Bridge(grads)
    };
    let t0 = trace.start();
    let dx = part.stage_backward(work, grad, c)?;
    trace.end(t0, format!("{} bwd s{}", P::NAME, g.coord.pp), P::NAME)?;
    if let Some(dx) = dx {
        let t0 = trace.start();
        world.send(&dx, neighbor(&g, world, -1)?)?;
        trace.end(t0, format!("{} send grad", P::NAME), "comm")?;
    }
    Ok(())
}
