//! One rank's training step under any layout, top to bottom:
//!
//! 1. every rank plans the step from the global batch it holds (assignment, microbatches,
//!    CP token split, bridge routes);
//! 2. encoder ranks encode their images and clips (encoder + projector);
//! 3. the bridge moves the embeddings to the LLM's first-stage ranks (one all-to-all-v);
//! 4. LLM ranks run their microbatches through the 1F1B pipeline; the last stage takes
//!    the loss normalized by the global target count; the first stage collects the
//!    modality-embedding grads;
//! 5. the bridge returns those grads to the encoder ranks (its transpose), which run
//!    their backward;
//! 6. grads are summed over each shard's replicas; the global norm; AdamW (ZeRO-1).

use std::sync::Arc;

use braid_balancer::Schedule;
use braid_comm::Comm;
use braid_dataloader::loader::{MediaFilter, Row, WantedMedia};
use braid_kernels::{Device, Tensor};
use braid_nn::Module;

use super::centric::CentricEncoders;
use super::encode_phased::{backward, encode};
use super::layout::Layouts;
use super::llm_stage::{Modality, run_pipeline};
use super::model::{RankModel, ShardSource};
use super::overlapped::run_overlapped;
use super::plan::{ItemKind, StepPlan, TokenSplit, batch_shape, media_items};
use super::sync::{ShardPlan, all_reduce_grads, broadcast_updates, local_sq_norm};
use crate::config::{AssignPolicy, Placement, RunConfig};
use crate::error::{Result, TrainError};
use crate::mllm::{Freeze, MllmConfig};
use crate::optim::AdamW;
use crate::trace::Tracer;
use braid_balancer::{
    Assigner, Balanced, Centric, Imbalance, PerMicrobatch, Replicas, RoundRobin, TokenCost,
};

/// What one forward/backward over the global batch measured (the same on every rank).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pass {
    /// Sum of the per-target losses over the whole global batch.
    pub loss_sum: f64,
    pub targets: usize,
    pub tokens: usize,
    pub images: usize,
    pub clips: usize,
    /// How even the step's assignment was under the balancer's cost model.
    pub imbalance: Imbalance,
}

/// One rank's model, optimizer and groups.
#[derive(Debug)]
pub struct Engine {
    pub rank: usize,
    pub world: Arc<dyn Comm>,
    pub layouts: Layouts,
    pub mconfig: MllmConfig,
    pub model: RankModel,
    pub plan: ShardPlan,
    pub optim: AdamW,
    pub assigner: Box<dyn Assigner>,
    assign_policy: AssignPolicy,
    /// The cost model the step's imbalance is measured with.
    pub costs: Balanced,
    pub microbatches: usize,
    pub freeze: Freeze,
    bucket_elems: usize,
    zero1: bool,
    /// Present when this run takes the overlapped schedule (`parallel.schedule`, on
    /// several ranks, disjoint or colocated; otherwise the phased one): the world's
    /// channel for its point-to-point messages (a module group of every rank, colocated,
    /// must not take them for its collectives'), made once, by every rank.
    p2p: Option<Arc<dyn Comm>>,
    /// Where this rank's shards live and the dtype they compute in: what the bridge
    /// carries (fixed at construction, not looked up every step).
    device: Device,
    compute_dtype: braid_kernels::DType,
    /// This rank's timeline (`log.trace`; records nothing when off).
    pub trace: Tracer,
}

impl Engine {
    /// This rank's share of the model from `source` (weights, frozen state) for `cfg`'s
    /// layouts.
    pub fn new(
        source: ShardSource<'_>,
        world: Arc<dyn Comm>,
        layouts: Layouts,
        cfg: &RunConfig,
    ) -> Result<Self> {
        let rank = world.rank();
        let mconfig = source.config().clone();
        let mut model = RankModel::build(source, world.as_ref(), &layouts, rank)?;
        model.set_recompute(&cfg.parallel);
        let compute_dtype = cfg.precision().compute_dtype();
        model.set_compute_dtype(compute_dtype)?;
        let device = super::model::device_of(&model);
        let zero1 = cfg.parallel.zero1;
        let overlapped = runs_overlapped(cfg.parallel.schedule, &layouts);
        let p2p = if overlapped {
            Some(world.channel("overlapped p2p")?)
        } else {
            None
        };
        let placement = layouts.placement;
        let plan = ShardPlan::new(&model, zero1);
        let optim = AdamW::new_owned(cfg.optim.clone(), &model, &|p| plan.owns(&p.name), zero1)?;
        Ok(Engine {
            rank,
            world,
            layouts,
            costs: balanced(&mconfig),
            assigner: assigner(cfg.parallel.assign, &mconfig, overlapped, placement),
            assign_policy: cfg.parallel.assign,
            mconfig,
            model,
            plan,
            optim,
            microbatches: cfg.train.microbatches,
            freeze: Freeze::from_names(&cfg.train.freeze)?,
            bucket_elems: ((cfg.parallel.bucket_mb * 1024.0 * 1024.0) / 4.0).max(1.0) as usize,
            zero1,
            p2p,
            device,
            compute_dtype,
            trace: Tracer::new(rank, device, cfg.log.trace, cfg.log.trace_steps),
        })
    }

    /// What this rank's loader decodes of each batch: the images and clips the step's
    /// assignment gives to this rank's encoder replicas, on their first stage (the only
    /// ranks that read pixels or mel frames); nothing on a rank without one. The filter
    /// runs the step's own assignment on the batch's shapes, so it agrees with
    /// [`Engine::forward_backward`] by construction.
    pub fn media_filter(&self) -> MediaFilter {
        let assigner = assigner(
            self.assign_policy,
            &self.mconfig,
            self.p2p.is_some(),
            self.layouts.placement,
        );
        let replicas = self.replicas();
        let first_stage_dp =
            |g: &super::model::ModuleGroups| (g.coord.pp == 0).then_some(g.coord.dp);
        let vision = self
            .model
            .vision
            .as_ref()
            .and_then(|v| first_stage_dp(&v.groups));
        let audio = self
            .model
            .audio
            .as_ref()
            .and_then(|a| first_stage_dp(&a.groups));
        Arc::new(move |rows: &[Row]| {
            let mut wanted = WantedMedia::default();
            if vision.is_none() && audio.is_none() {
                return Ok(wanted);
            }
            let shape = batch_shape(rows);
            let a = assigner.assign(&shape, &replicas);
            a.validate(&shape, &replicas).map_err(|e| e.to_string())?;
            // The items as the step's plan numbers them (`a` is validated above).
            for (kind, r, i, dp) in media_items(rows, &a) {
                match kind {
                    ItemKind::Image if vision == Some(dp) => wanted.images.insert((r, i)),
                    ItemKind::Clip if audio == Some(dp) => wanted.clips.insert((r, i)),
                    _ => false,
                };
            }
            Ok(wanted)
        })
    }

    fn replicas(&self) -> Replicas {
        let dp = |g: Option<&braid_comm::grid::Grid>| g.map_or(1, |g| g.dims.dp);
        Replicas {
            llm_dp: self.layouts.llm.dims.dp,
            microbatches: self.microbatches,
            vision_dp: dp(self.layouts.vision.as_ref()),
            audio_dp: dp(self.layouts.audio.as_ref()),
        }
    }

    /// Forward and backward of the global batch `rows` (every rank passes the same):
    /// afterwards every trainable parameter's grad is the one-rank gradient of the
    /// batch's mean loss (summed over replicas).
    pub fn forward_backward(&mut self, rows: &[Row]) -> Result<Pass> {
        let shape = batch_shape(rows);
        let replicas = self.replicas();
        let a = self.assigner.assign(&shape, &replicas);
        a.validate(&shape, &replicas)?;
        let imbalance = self.costs.imbalance(&shape, &replicas, &a);
        let cp = self.layouts.llm.dims.cp;
        let plan = StepPlan::new(rows, &a, replicas.llm_dp, &|cu| TokenSplit::causal(cu, cp))?;
        let c = self.mconfig.llm.hidden;
        // The bridge carries rows in the compute dtype, on this rank's device.
        let routes = plan
            .routes(&self.layouts, c, self.freeze)?
            .with_device(self.device)
            .with_dtype(self.compute_dtype);
        self.model.zero_grads()?;
        let norm = plan.targets.max(1);
        let loss_local = if let Some(p2p) = &self.p2p {
            run_overlapped(
                &mut self.model,
                p2p.as_ref(),
                &self.layouts,
                rows,
                &plan,
                &routes,
                self.freeze,
                norm,
                &mut self.trace,
            )?
        } else {
            self.phased(rows, &plan, &routes, norm)?
        };
        let trace = &mut self.trace;
        let t0 = trace.start();
        all_reduce_grads(&mut self.model, self.bucket_elems)?;
        trace.end(t0, "grad all-reduce", "comm")?;

        let mut loss = Tensor::from_vec(vec![loss_local as f32], [1], Device::Cpu)?;
        self.world.all_reduce_sum(&mut loss)?;
        let loss_sum = f64::from(loss.to_vec_f32()?[0]);
        Ok(Pass {
            loss_sum,
            targets: plan.targets,
            tokens: plan.tokens,
            images: shape.num_images(),
            clips: shape.num_clips(),
            imbalance,
        })
    }

    /// The phased step: every encoder forward, one bridge exchange, the LLM's 1F1B, the
    /// bridge back, every encoder backward. Returns the loss sum this rank contributes.
    fn phased(
        &mut self,
        rows: &[Row],
        plan: &StepPlan,
        routes: &braid_bridge::Routes,
        norm: usize,
    ) -> Result<f64> {
        let c = self.mconfig.llm.hidden;
        if self.layouts.placement == Placement::Centric {
            // The encoders inside the LLM's first stage, microbatch by microbatch.
            let RankModel { vision, audio, llm } = &mut self.model;
            let world = self.world.as_ref();
            let Some(l) = llm.as_mut() else {
                return Err(TrainError::Other(format!(
                    "rank {}: \"centric\" placement puts the LLM on every rank",
                    self.rank
                )));
            };
            let mut enc = CentricEncoders::new(
                vision.as_mut(),
                audio.as_mut(),
                world,
                rows,
                plan,
                routes,
                c,
            );
            let modality = Modality::Centric(&mut enc);
            return run_pipeline(
                l,
                world,
                rows,
                plan,
                routes,
                modality,
                norm,
                &mut self.trace,
            );
        }
        // Encoders, then the bridge to the LLM's first stage.
        let mut produced: Vec<(usize, Tensor)> = Vec::new();
        let world = self.world.as_ref();
        let trace = &mut self.trace;
        let vision = match &self.model.vision {
            Some(v) => encode(v, world, rows, plan, &mut produced, trace)?,
            None => None,
        };
        let audio = match &self.model.audio {
            Some(a) => encode(a, world, rows, plan, &mut produced, trace)?,
            None => None,
        };
        let sent: Vec<(usize, &Tensor)> = produced.iter().map(|(i, t)| (*i, t)).collect();
        let t0 = trace.start();
        let received = routes.forward(self.world.as_ref(), &sent)?; // (M_r, C)
        trace.end(t0, "bridge fwd", "bridge")?;
        drop(sent);
        drop(produced);

        // The LLM pipeline; the modality grads come back in `received`'s row order.
        let dev = self.device;
        let received = received.into_device(dev)?; // (M_r, C)
        let mut dreceived = Tensor::zeros(received.shape().clone(), received.dtype(), dev)?; // (M_r, C)
        let loss_local = match &mut self.model.llm {
            Some(l) => run_pipeline(
                l,
                self.world.as_ref(),
                rows,
                plan,
                routes,
                Modality::Received(&received, &mut dreceived),
                norm,
                trace,
            )?,
            None => 0.0,
        };
        drop(received);

        // The bridge back and the encoders' backward.
        let t0 = trace.start();
        let grads = routes.backward(self.world.as_ref(), &dreceived)?;
        trace.end(t0, "bridge bwd", "bridge")?;
        // Vision then audio on every rank: a fixed order, so stage-to-stage messages of
        // the two encoders never wait on each other in a cycle.
        if let (Some(work), Some(v)) = (vision, &mut self.model.vision) {
            backward(v, self.world.as_ref(), rows, plan, work, &grads, c, trace)?;
        }
        if let (Some(work), Some(a)) = (audio, &mut self.model.audio) {
            backward(a, self.world.as_ref(), rows, plan, work, &grads, c, trace)?;
        }
        Ok(loss_local)
    }

    /// The global L2 norm of the gradient (every element counted once in the world).
    pub fn grad_norm(&mut self) -> Result<f64> {
        let t0 = self.trace.start();
        let sq = local_sq_norm(&self.model, &self.plan)?;
        let mut t = Tensor::from_vec(vec![sq as f32], [1], Device::Cpu)?;
        self.world.all_reduce_sum(&mut t)?;
        self.trace.end(t0, "grad norm", "comm")?;
        Ok(f64::from(t.to_vec_f32()?[0]).sqrt())
    }

    /// Scales every grad of this rank by `s` (clipping; every rank scales alike).
    pub fn scale_grads(&mut self, s: f32) -> Result<()> {
        Ok(crate::optim::scale_grads(&mut self.model, s)?)
    }

    /// AdamW on this rank's share, then the updated values to the rest of each replica
    /// group.
    pub fn update(&mut self, lr: f32) -> Result<()> {
        let t0 = self.trace.start();
        self.optim.update(&mut self.model, lr)?;
        self.trace.end(t0, "adamw", "optim")?;
        if self.zero1 {
            let t0 = self.trace.start();
            broadcast_updates(&mut self.model, &self.plan)?;
            self.trace.end(t0, "zero-1 broadcast", "comm")?;
        }
        Ok(())
    }
}

/// Whether a run of `schedule` on `layouts` takes the overlapped step: on several ranks,
/// disjoint or colocated (one rank, and centric placement, run phased).
pub(crate) fn runs_overlapped(schedule: Schedule, layouts: &Layouts) -> bool {
    schedule == Schedule::Overlapped && layouts.placement != Placement::Centric && layouts.world > 1
}

/// The assigner of `parallel.assign`: under the overlapped schedule the balanced one
/// evens out each microbatch's media over the encoder replicas (each is a chunk there).
/// Under "centric" placement the rows go as the policy says and every image and clip to
/// an encoder replica of its row's LLM replica (they run inside its first stage).
fn assigner(
    policy: AssignPolicy,
    m: &MllmConfig,
    overlapped: bool,
    placement: Placement,
) -> Box<dyn Assigner> {
    let b = balanced(m);
    match (policy, placement) {
        (AssignPolicy::Balanced, Placement::Centric) => Box::new(Centric(b, b)),
        (AssignPolicy::RoundRobin, Placement::Centric) => Box::new(Centric(RoundRobin, b)),
        (AssignPolicy::Balanced, _) if overlapped => Box::new(PerMicrobatch(b)),
        (AssignPolicy::Balanced, _) => Box::new(b),
        (AssignPolicy::RoundRobin, _) => Box::new(RoundRobin),
    }
}

/// The cost model of the data-aware assignment for `m`: forward FLOPs per token and per
/// attended pair of each module (SwiGLU LLM with its head; GELU encoders).
pub fn balanced(m: &MllmConfig) -> Balanced {
    let l = &m.llm;
    let none = TokenCost {
        per_token: 0.0,
        per_pair: 0.0,
    };
    Balanced {
        llm: TokenCost::transformer(
            l.layers,
            l.hidden,
            l.intermediate,
            3,
            l.hidden * l.vocab,
            true,
        ),
        vision: m.vision.as_ref().map_or(none, |v| {
            TokenCost::transformer(
                v.num_layers,
                v.hidden_size,
                v.intermediate_size,
                2,
                0,
                false,
            )
        }),
        audio: m.audio.as_ref().map_or(none, |a| {
            TokenCost::transformer(a.encoder_layers, a.d_model, a.encoder_ffn_dim, 2, 0, false)
        }),
    }
}
