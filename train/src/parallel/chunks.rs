//! The overlapped step's computes: an encoder stage's or an LLM stage's forward and backward of one chunk, taking their inputs from the rank's received messages and filing their outputs as messages to send ([`super::overlapped`] moves them).

use braid_bridge::Routes;
use braid_dataloader::loader::Row;
use braid_kernels::ops::copy_range;
use braid_kernels::{Shape, Tensor};

use super::encode::{EncoderStage, GradIn, Handed};
use super::graph::{Graph, Msg, Node, Role, Xfer};
use super::llm_stage::{LlmIn, LlmStageRun, microbatch_placeholders};
use super::overlapped::Mail;
use super::plan::{ItemKind, StepPlan};
use crate::error::{Result, TrainError};
use crate::trace::Tracer;

/// What a module's computes need from the executor: the shape of each hidden-state
/// message (of the chunk at position `j` of the role), and the forward and backward of
/// a pass (`p`, [`Role::pass`]: the chunk's position on an encoder).
pub(super) trait Chunks {
    fn hidden_shape(&self, j: usize) -> Result<Shape>;
    fn forward(&mut self, p: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()>;
    fn backward(&mut self, p: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()>;
    /// Pass `p`'s weight gradients, left by its backward (zero-bubble pipelining: the
    /// LLM's stages only).
    fn weight(&mut self, p: usize, _trace: &mut Tracer) -> Result<()> {
        Err(TrainError::Other(format!(
            "pass {p}: a weight-gradient pass on a module whose backward is not split"
        )))
    }
    /// After the step's last pass: an error if work was left undone (a backward's
    /// weight gradients without their W pass).
    fn finish(&self) -> Result<()> {
        Ok(())
    }
    /// The loss sum this rank contributes (the LLM's last stage).
    fn loss(&self) -> f64 {
        0.0
    }
}

/// The plan items of chunk `k` (microbatch `k` over every replica), ascending: item `j`
/// of the chunk's routes is `[j]`.
pub(super) fn items_of_chunk(plan: &StepPlan, k: usize) -> Vec<usize> {
    (0..plan.items.len())
        .filter(|&i| plan.items[i].mb == k)
        .collect()
}

/// The plan items of `kind` in chunk `k`, ascending: item `j` of that encoder's routes
/// of the chunk ([`Graph::bridge`]) is `[j]`.
pub(super) fn items_of_kind(plan: &StepPlan, k: usize, kind: ItemKind) -> Vec<usize> {
    (0..plan.items.len())
        .filter(|&i| plan.items[i].mb == k && plan.items[i].kind == kind)
        .collect()
}

fn bridge_of(graph: &Graph, k: usize, e: usize) -> Result<&Routes> {
    graph
        .bridge(k, e)
        .ok_or_else(|| TrainError::Other(format!("chunk {k} has no bridge routes for encoder {e}")))
}

/// The messages of `xs` that belong to `node`.
fn of_node(xs: &[Xfer], node: Node) -> Vec<Xfer> {
    xs.iter().filter(|x| x.node == node).copied().collect()
}

/// The one message of `xs` (a pipeline neighbour's).
fn single(xs: &[Xfer], what: &str) -> Result<Xfer> {
    match xs {
        [x] => Ok(*x),
        _ => Err(TrainError::Other(format!(
            "the schedule gives {} messages for {what}, not one",
            xs.len()
        ))),
    }
}

/// An encoder rank's chunks.
pub(super) struct EncoderChunks<'a, P: EncoderStage> {
    pub part: &'a mut P,
    /// Its index in the graph's encoders.
    pub e: usize,
    pub rows: &'a [Row],
    pub plan: &'a StepPlan,
    pub rank: usize,
    /// The bridge's row width (the LLM hidden size).
    pub c: usize,
    pub role: &'a Role,
    pub graph: &'a Graph,
    /// Per chunk (position in the role): its items, and what its forward kept.
    pub items: Vec<Vec<usize>>,
    pub works: Vec<Option<P::Work>>,
}

impl<P: EncoderStage> Chunks for EncoderChunks<'_, P> {
    fn hidden_shape(&self, j: usize) -> Result<Shape> {
        self.part.hidden(self.rows, self.plan, &self.items[j])
    }

    fn forward(&mut self, j: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()> {
        let k = self.role.chunks[j];
        let pp = self.part.groups().coord.pp;
        let hidden = match self.role.fwd_in[j].as_slice() {
            [] => None,
            xs => Some(mail.take(single(xs, "a stage's input")?)?),
        };
        let t0 = trace.start();
        let (handed, work) = self.part.stage_forward(
            self.rank,
            self.rows,
            self.plan,
            self.items[j].clone(),
            hidden,
        )?;
        trace.end(t0, format!("{} fwd s{pp} mb{k}", P::NAME), P::NAME)?;
        self.works[j] = Some(work);
        match handed {
            Handed::Next(h) => mail.put(single(&self.role.fwd_out[j], "a stage's output")?, h),
            Handed::Embeds(embeds) => {
                let of_chunk = items_of_kind(self.plan, k, P::KIND);
                let produced = embeds
                    .iter()
                    .map(|(i, t)| {
                        let j = of_chunk.binary_search(i).map_err(|_| {
                            TrainError::Other(format!("item {i} is not of microbatch {k}"))
                        })?;
                        Ok((j, t))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let sends =
                    bridge_of(self.graph, k, self.e)?.forward_sends(self.rank, &produced)?;
                let node = Node::Encoder(self.e);
                mail.put_all(&self.role.fwd_out[j], node, Msg::Embed(k), sends)
            }
        }
    }

    fn backward(&mut self, j: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()> {
        let k = self.role.chunks[j];
        let pp = self.part.groups().coord.pp;
        let work = self.works[j]
            .take()
            .ok_or_else(|| TrainError::Other(format!("{} chunk {k} has no cache", P::NAME)))?;
        let t0 = trace.start();
        let dx = if P::wants_next_grad(&work) {
            let dh = mail.take(single(&self.role.bwd_in[j], "a stage's output grad")?)?;
            self.part.stage_backward(work, GradIn::Next(dh), self.c)?
        } else {
            let got = mail.take_all(&self.role.bwd_in[j])?;
            let of_chunk = items_of_kind(self.plan, k, P::KIND);
            let grads: Vec<(usize, Tensor)> = bridge_of(self.graph, k, self.e)?
                .backward_gather(self.rank, got)?
                .into_iter()
                .map(|(j, t)| (of_chunk[j], t))
                .collect();
            self.part
                .stage_backward(work, GradIn::Bridge(&grads), self.c)?
        };
        trace.end(t0, format!("{} bwd s{pp} mb{k}", P::NAME), P::NAME)?;
        match (dx, self.role.bwd_out[j].as_slice()) {
            (Some(dx), xs) => mail.put(single(xs, "a stage's input grad")?, dx),
            (None, []) => Ok(()),
            (None, _) => Err(TrainError::Other(format!(
                "{} stage {pp} chunk {k}: no input grad for the previous stage",
                P::NAME
            ))),
        }
    }
}

/// An LLM rank's chunks (its replica's microbatches).
pub(super) struct LlmChunks<'a> {
    pub run: LlmStageRun<'a>,
    pub plan: &'a StepPlan,
    pub rank: usize,
    pub role: &'a Role,
    pub graph: &'a Graph,
    /// What each of the graph's encoders encodes.
    pub kinds: Vec<ItemKind>,
    /// Per chunk (first stage): the modality rows its forward took from each encoder,
    /// in order, as (encoder, rows): how its backward splits their grads.
    pub took: Vec<Vec<(usize, usize)>>,
}

impl Chunks for LlmChunks<'_> {
    fn hidden_shape(&self, j: usize) -> Result<Shape> {
        self.run.hidden_shape(j)
    }

    fn weight(&mut self, p: usize, trace: &mut Tracer) -> Result<()> {
        let (_, j) = self.role.unpass(p);
        self.run.weight(j, trace)
    }

    fn finish(&self) -> Result<()> {
        self.run.check_weights_done()
    }

    fn forward(&mut self, p: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()> {
        let (m, j) = self.role.unpass(p);
        let k = self.role.chunks[j];
        let input = if self.run.stage().0 > 0 || m > 0 {
            LlmIn::Hidden(mail.take(single(&self.role.fwd_in[p], "a stage's input")?)?)
        } else {
            // Each encoder's rows of this microbatch, with their placeholder positions.
            let mut parts: Vec<(Tensor, Vec<u32>)> = Vec::new();
            let mut took = Vec::new();
            for (e, &kind) in self.kinds.iter().enumerate() {
                let xs = of_node(&self.role.fwd_in[p], Node::Encoder(e));
                if xs.is_empty() {
                    continue;
                }
                let bridge = bridge_of(self.graph, k, e)?;
                let rows = bridge.forward_gather(self.rank, mail.take_all(&xs)?)?; // (M_ke, C)
                let pos = microbatch_placeholders(
                    self.plan,
                    self.run.mbs[j],
                    self.run.cp(),
                    bridge,
                    &items_of_kind(self.plan, k, kind),
                    self.rank,
                    rows.dims()[0],
                )?;
                took.push((e, rows.dims()[0]));
                parts.push((rows, pos));
            }
            self.took[j] = took;
            LlmIn::Tokens(concat_rows(parts)?)
        };
        if let Some(out) = self.run.forward(m, j, input, trace)? {
            mail.put(single(&self.role.fwd_out[p], "a stage's output")?, out)?;
        }
        Ok(())
    }

    fn backward(&mut self, p: usize, mail: &mut Mail, trace: &mut Tracer) -> Result<()> {
        let (m, j) = self.role.unpass(p);
        let k = self.role.chunks[j];
        let stage = self.run.stage().0;
        let dout = if self.run.ends_model(m) {
            None
        } else {
            Some(mail.take(single(&self.role.bwd_in[p], "a stage's output grad")?)?)
        };
        let dx = self.run.backward(m, j, dout, trace)?;
        let no_grad = || {
            TrainError::Other(format!(
                "llm stage {stage} chunk {m} microbatch {k}: no input grad"
            ))
        };
        if stage > 0 || m > 0 {
            return mail.put(
                single(&self.role.bwd_out[p], "a stage's input grad")?,
                dx.ok_or_else(no_grad)?,
            );
        }
        let took = std::mem::take(&mut self.took[j]);
        if took.is_empty() {
            return Ok(());
        }
        // The modality rows' grads, in the order they came: each encoder's back over
        // its bridge.
        let dmod = dx.ok_or_else(no_grad)?; // (M_k, C)
        let whole = took.len() == 1;
        let mut at = 0;
        for (e, n) in took {
            let d = if whole {
                None
            } else {
                Some(rows_of(&dmod, at, n)?)
            };
            let d = d.as_ref().unwrap_or(&dmod);
            at += n;
            let sends = bridge_of(self.graph, k, e)?.backward_sends(self.rank, d)?;
            let node = Node::Encoder(e);
            let xs = of_node(&self.role.bwd_out[p], node);
            mail.put_all(&xs, node, Msg::EmbedGrad(k), sends)?;
        }
        Ok(())
    }

    fn loss(&self) -> f64 {
        self.run.loss
    }
}

/// `parts`' rows one after another `(sum M, C)` with their positions; `None` without any.
fn concat_rows(mut parts: Vec<(Tensor, Vec<u32>)>) -> Result<Option<(Tensor, Vec<u32>)>> {
    if parts.len() <= 1 {
        return Ok(parts.pop());
    }
    let c = parts[0].0.dims()[1];
    let m: usize = parts.iter().map(|p| p.0.dims()[0]).sum();
    let (dtype, device) = (parts[0].0.dtype(), parts[0].0.device());
    let mut rows = Tensor::zeros([m, c], dtype, device)?; // (M, C)
    let mut pos = Vec::with_capacity(m);
    let mut at = 0;
    for (t, p) in parts {
        let n = t.elem_count();
        copy_range(&t, 0, &mut rows, at, n)?;
        at += n;
        pos.extend(p);
    }
    Ok(Some((rows, pos)))
}

/// Rows `at..at + n` of `x` (M, C), as a tensor of their own.
fn rows_of(x: &Tensor, at: usize, n: usize) -> Result<Tensor> {
    let c = x.dims()[1];
    let mut out = Tensor::zeros([n, c], x.dtype(), x.device())?; // (n, C)
    copy_range(x, at * c, &mut out, 0, n * c)?;
    Ok(out)
}
