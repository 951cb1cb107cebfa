//! One rank's share of the model and the groups it talks over.
//!
//! A rank holds, for each module whose grid contains it, that module's shard: an encoder
//! and its projector (TP-split blocks), or one pipeline stage of the LLM (TP-split blocks,
//! vocab-split embedding/head). Parameters keep the single-rank model's names
//! (`vision.layers.0...`, `llm.layers.3...`) and record which slice they are
//! (`Param::shard`), so checkpoints and gradient checks line up with one rank.
//!
//! Every layout starts from exactly the weights of the one-rank run ([`ShardSource`]):
//! cut from a full single-rank [`Mllm`] built the usual way (threads), or made shard by
//! shard with the same per-name draws and Hugging Face files (one process per rank, which
//! never holds the full model).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use braid_comm::Comm;
use braid_comm::grid::{Axis, Coord, Grid};
use braid_encoders::{AudioProjector, MlpProjector, VisionEncoder, WhisperEncoder};
use braid_kernels::{Device, Tensor};
use braid_llm::LlmStage;
use braid_nn::param::cut_shard;
use braid_nn::{Init, Module, Param};

use super::layout::{Layouts, ModuleKind};
use crate::config::{ParallelConfig, RunConfig};
use crate::error::{Result, TrainError};
use crate::mllm::{AUDIO, AUDIO_PROJECTOR, LLM, Mllm, MllmConfig, VISION, VISION_PROJECTOR};

/// A module's groups as seen from one of its ranks.
#[derive(Debug, Clone)]
pub struct ModuleGroups {
    pub kind: ModuleKind,
    pub grid: Grid,
    pub coord: Coord,
    /// Same cp/dp/pp, every tp: splits the blocks.
    pub tp: Arc<dyn Comm>,
    /// Same tp/dp/pp, every cp: splits the sequence.
    pub cp: Arc<dyn Comm>,
    /// Same tp/pp, every cp and dp: ranks holding the same parameter shard (gradient
    /// all-reduce, ZeRO-1 sharding).
    pub replicas: Arc<dyn Comm>,
    /// LLM with tied embeddings over several stages: {first stage, last stage} with
    /// this rank's tp/cp/dp, on both ends (their embedding copies' grads are summed).
    pub tied: Option<Arc<dyn Comm>>,
}

impl ModuleGroups {
    /// The groups of `kind` for world rank `rank`, or `None` when the module is not on it.
    pub fn new(
        world: &dyn Comm,
        layouts: &Layouts,
        kind: ModuleKind,
        rank: usize,
        tied_embeddings: bool,
    ) -> Result<Option<ModuleGroups>> {
        let Some(grid) = layouts.grid(kind).copied() else {
            return Ok(None);
        };
        let Some(coord) = grid.coord(rank) else {
            return Ok(None);
        };
        let group = |axes: &[Axis]| -> Result<Arc<dyn Comm>> {
            let members = grid.group(rank, axes).unwrap_or_default();
            Ok(world.subgroup(&members)?)
        };
        let pp = grid.dims.pp;
        let tied = if tied_embeddings && pp > 1 && (coord.pp == 0 || coord.pp == pp - 1) {
            let first = grid.rank(Coord { pp: 0, ..coord });
            let last = grid.rank(Coord {
                pp: pp - 1,
                ..coord
            });
            Some(world.subgroup(&[first, last])?)
        } else {
            None
        };
        Ok(Some(ModuleGroups {
            kind,
            grid,
            coord,
            tp: group(&[Axis::Tp])?,
            cp: group(&[Axis::Cp])?,
            replicas: group(&[Axis::Cp, Axis::Dp])?,
            tied,
        }))
    }

    /// The sender of this rank's replica: tp 0, cp 0, last stage.
    pub fn is_last_stage(&self) -> bool {
        self.coord.pp + 1 == self.grid.dims.pp
    }
}

/// A stage of an encoder, and its projector on the last stage.
#[derive(Debug)]
pub struct VisionPart {
    pub encoder: VisionEncoder,
    pub projector: Option<MlpProjector>,
    pub groups: ModuleGroups,
}

#[derive(Debug)]
pub struct AudioPart {
    pub encoder: WhisperEncoder,
    pub projector: Option<AudioProjector>,
    pub groups: ModuleGroups,
}

/// One pipeline stage of the LLM: its model chunks (one, or `parallel.llm.virtual_stages`
/// slices of the layers `pp` chunks apart, in chunk order).
#[derive(Debug)]
pub struct LlmPart {
    pub chunks: Vec<LlmStage>,
    pub groups: ModuleGroups,
    /// Zero-bubble pipelining: each backward leaves the weight gradients to a W pass.
    pub split_backward: bool,
}

impl LlmPart {
    pub fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        for c in &self.chunks {
            c.visit_params(f);
        }
    }

    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        for c in &mut self.chunks {
            c.visit_params_mut(f);
        }
    }
}

/// What one rank holds.
#[derive(Debug, Default)]
pub struct RankModel {
    pub vision: Option<VisionPart>,
    pub audio: Option<AudioPart>,
    pub llm: Option<LlmPart>,
}

/// The layers of stage `s` of `pp` over `layers` (validated: `pp` divides `layers`;
/// with virtual stages, `s` is a chunk of `pp * virtual_stages`).
pub fn stage_layers(layers: usize, pp: usize, s: usize) -> Range<usize> {
    let per = layers / pp.max(1);
    s * per..(s + 1) * per
}

/// The layers of LLM stage `s` of `pp` whose first stage holds `first` (validated: the
/// rest split evenly over the others), or [`stage_layers`]'s even split without one.
pub fn llm_stage_layers(layers: usize, pp: usize, s: usize, first: Option<usize>) -> Range<usize> {
    match first {
        Some(f) if pp > 1 => {
            let per = layers.saturating_sub(f) / (pp - 1);
            match s {
                0 => 0..f,
                _ => f + (s - 1) * per..f + s * per,
            }
        }
        _ => stage_layers(layers, pp, s),
    }
}

/// The device a module's parameters live on (the CPU for a module without any).
pub fn device_of<M: Module + ?Sized>(m: &M) -> Device {
    let mut device = None;
    m.visit_params(&mut |p| {
        device.get_or_insert(p.value.device());
    });
    device.unwrap_or(Device::Cpu)
}

fn prefix<M: Module + ?Sized>(m: &mut M, p: &str) {
    m.visit_params_mut(&mut |q| q.name.insert_str(0, p));
}

/// Where a rank's shard gets its starting weights.
#[derive(Clone, Copy, Debug)]
pub enum ShardSource<'a> {
    /// Cut from a full single-rank model built the usual way (threads: the process holds
    /// the full model anyway, for evaluation and export).
    Cut(&'a Mllm),
    /// Made shard by shard, without the full model ([`super::load`]): every random weight
    /// is drawn by name as the full model draws it and cut, a module started from Hugging
    /// Face reads only its slices of the files, and `train.freeze` is applied by module.
    Direct {
        config: &'a MllmConfig,
        cfg: &'a RunConfig,
    },
}

impl ShardSource<'_> {
    pub fn config(&self) -> &MllmConfig {
        match self {
            ShardSource::Cut(full) => &full.config,
            ShardSource::Direct { config, .. } => config,
        }
    }
}

/// The init each module's shard is created with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ModuleInits {
    pub vision: Init,
    pub vision_projector: Init,
    pub audio: Init,
    pub audio_projector: Init,
    pub llm: Init,
}

impl ModuleInits {
    /// Every weight zero, about to be overwritten.
    pub fn zeros(device: Device) -> Self {
        let z = Init::for_loading(device);
        ModuleInits {
            vision: z,
            vision_projector: z,
            audio: z,
            audio_projector: z,
            llm: z,
        }
    }
}

impl RankModel {
    /// The share of world rank `rank`, from `source`.
    pub fn build(
        source: ShardSource<'_>,
        world: &dyn Comm,
        layouts: &Layouts,
        rank: usize,
    ) -> Result<Self> {
        match source {
            ShardSource::Cut(full) => {
                // The shards live where the full model does (the configured device).
                let inits = ModuleInits::zeros(device_of(full));
                let mut model = Self::shells(&full.config, &inits, world, layouts, rank)?;
                model.add_prefixes();
                model.copy_from(full)?;
                Ok(model)
            }
            ShardSource::Direct { config, cfg } => {
                super::load::build_direct(config, cfg, world, layouts, rank)
            }
        }
    }

    /// The shards of `rank`'s modules, each created with its module's init.
    pub(crate) fn shells(
        cfg: &MllmConfig,
        inits: &ModuleInits,
        world: &dyn Comm,
        layouts: &Layouts,
        rank: usize,
    ) -> Result<Self> {
        let mut model = RankModel::default();
        if let (Some(vc), Some(pc)) = (&cfg.vision, &cfg.vision_projector)
            && let Some(groups) =
                ModuleGroups::new(world, layouts, ModuleKind::Vision, rank, false)?
        {
            let layers = stage_layers(vc.num_layers, groups.grid.dims.pp, groups.coord.pp);
            let mut encoder =
                VisionEncoder::stage(&inits.vision, vc.clone(), layers, Arc::clone(&groups.tp))?;
            if groups.grid.dims.cp > 1 {
                encoder = encoder.with_cp(Arc::clone(&groups.cp));
            }
            // The projector sits on the encoder's last stage.
            let projector = if groups.is_last_stage() {
                let p =
                    MlpProjector::new(&inits.vision_projector, "vision_projector", pc.projector())?;
                debug_assert!(p.param_shapes()[0].0.starts_with(VISION_PROJECTOR));
                Some(p)
            } else {
                None
            };
            model.vision = Some(VisionPart {
                encoder,
                projector,
                groups,
            });
        }
        if let (Some(ac), Some(pc)) = (&cfg.audio, &cfg.audio_projector)
            && let Some(groups) = ModuleGroups::new(world, layouts, ModuleKind::Audio, rank, false)?
        {
            let layers = stage_layers(ac.encoder_layers, groups.grid.dims.pp, groups.coord.pp);
            let mut encoder =
                WhisperEncoder::stage(&inits.audio, ac.clone(), layers, Arc::clone(&groups.tp))?;
            if groups.grid.dims.cp > 1 {
                encoder = encoder.with_cp(Arc::clone(&groups.cp));
            }
            let projector = if groups.is_last_stage() {
                let p = AudioProjector::new(
                    &inits.audio_projector,
                    "audio_projector",
                    pc.in_dim,
                    pc.out_dim,
                    pc.stride,
                    pc.activation(),
                )?;
                debug_assert!(p.param_shapes()[0].0.starts_with(AUDIO_PROJECTOR));
                Some(p)
            } else {
                None
            };
            model.audio = Some(AudioPart {
                encoder,
                projector,
                groups,
            });
        }
        let tied = cfg.llm.tie_embeddings;
        if let Some(groups) = ModuleGroups::new(world, layouts, ModuleKind::Llm, rank, tied)? {
            // Chunk k of stage s is slice k pp + s of the pp * chunks equal slices.
            let (pp, v) = (groups.grid.dims.pp, layouts.llm_chunks.max(1));
            let mut chunks = Vec::with_capacity(v);
            for k in 0..v {
                // A shorter first stage comes without virtual stages (validated).
                let first = layouts.llm_first_stage_layers;
                let layers =
                    llm_stage_layers(cfg.llm.layers, pp * v, k * pp + groups.coord.pp, first);
                let mut c = LlmStage::new(&cfg.llm, layers, &inits.llm, Arc::clone(&groups.tp))?;
                if groups.grid.dims.cp > 1 {
                    for b in &mut c.blocks {
                        b.self_attn.cp = Some(Arc::clone(&groups.cp));
                    }
                }
                chunks.push(c);
            }
            model.llm = Some(LlmPart {
                chunks,
                groups,
                split_backward: layouts.llm_zero_bubble,
            });
        }
        Ok(model)
    }

    /// Gives every parameter its module's prefix (`vision.`, `llm.`; the projectors
    /// are named after their module at construction): the full model's names.
    pub(crate) fn add_prefixes(&mut self) {
        if let Some(v) = &mut self.vision {
            prefix(&mut v.encoder, VISION);
        }
        if let Some(a) = &mut self.audio {
            prefix(&mut a.encoder, AUDIO);
        }
        if let Some(l) = &mut self.llm {
            for c in &mut l.chunks {
                prefix(c, LLM);
            }
        }
    }

    /// Activation recomputation per module (`parallel.<module>.recompute`).
    pub fn set_recompute(&mut self, p: &ParallelConfig) {
        if let Some(v) = &mut self.vision {
            v.encoder.recompute = p.vision.recompute;
        }
        if let Some(a) = &mut self.audio {
            a.encoder.recompute = p.audio.recompute;
        }
        if let Some(l) = &mut self.llm {
            for c in &mut l.chunks {
                c.recompute = p.llm.recompute;
            }
        }
    }

    /// Overwrites every parameter with its slice of the same-named parameter of `full`
    /// and takes over its frozen state.
    fn copy_from(&mut self, full: &Mllm) -> Result<()> {
        let mut by_name: HashMap<&str, &Param> = HashMap::new();
        full.visit_params(&mut |p| {
            by_name.insert(p.name.as_str(), p);
        });
        let mut res = Ok(());
        self.visit_params_mut(&mut |p| {
            if res.is_err() {
                return;
            }
            res = copy_slice(p, &by_name);
        });
        res
    }
}

/// `p` = its slice of `by_name[p.name]`, frozen when that is.
fn copy_slice(p: &mut Param, by_name: &HashMap<&str, &Param>) -> Result<()> {
    let src = by_name.get(p.name.as_str()).ok_or_else(|| {
        TrainError::Other(format!(
            "parameter `{}` of a rank's shard has no counterpart in the full model",
            p.name
        ))
    })?;
    let data = src.value.to_vec_f32()?;
    let (data, dims) = cut_shard(&p.name, data, src.value.dims(), p.shard)?;
    if dims != p.value.dims() {
        return Err(TrainError::Other(format!(
            "parameter `{}`: the slice of {:?} is {dims:?} but the shard holds {:?}",
            p.name,
            src.value.dims(),
            p.value.dims()
        )));
    }
    p.value = Tensor::from_vec(data, dims, p.value.device())?;
    if !src.is_trainable() {
        p.freeze();
    }
    Ok(())
}

impl Module for RankModel {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        if let Some(v) = &self.vision {
            v.encoder.visit_params(f);
            if let Some(p) = &v.projector {
                p.visit_params(f);
            }
        }
        if let Some(a) = &self.audio {
            a.encoder.visit_params(f);
            if let Some(p) = &a.projector {
                p.visit_params(f);
            }
        }
        if let Some(l) = &self.llm {
            l.visit_params(f);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some(v) = &mut self.vision {
            v.encoder.visit_params_mut(f);
            if let Some(p) = &mut v.projector {
                p.visit_params_mut(f);
            }
        }
        if let Some(a) = &mut self.audio {
            a.encoder.visit_params_mut(f);
            if let Some(p) = &mut a.projector {
                p.visit_params_mut(f);
            }
        }
        if let Some(l) = &mut self.llm {
            l.visit_params_mut(f);
        }
    }
}
