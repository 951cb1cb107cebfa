//! A candidate plan: per module `(tp, cp, pp, dp)`, how the module grids share GPUs, the
//! microbatch count and recomputation. The grid order is the trainer's (TP fastest, then
//! CP, DP, PP), so a TP group is `tp` consecutive GPUs.

use serde::{Deserialize, Serialize};

use crate::cluster::Cluster;
use crate::dims::{ModelDims, Module};

/// One module's grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    pub tp: usize,
    pub cp: usize,
    pub pp: usize,
    pub dp: usize,
}

impl Layout {
    pub const ONE: Layout = Layout {
        tp: 1,
        cp: 1,
        pp: 1,
        dp: 1,
    };

    pub fn gpus(&self) -> usize {
        // Saturating: a hostile plan file's sizes must not overflow before a check.
        [self.cp, self.pp, self.dp]
            .iter()
            .fold(self.tp, |n, &k| n.saturating_mul(k))
    }

    /// GPUs of one pipeline stage of one replica (a TP × CP block).
    pub fn block(&self) -> usize {
        self.tp * self.cp
    }

    /// Under the LLM-centric placement (this the LLM's layout), the replicas of an
    /// encoder at TP `tp` (a divisor of this TP) inside the first stage: one on every
    /// `tp` of each replica's `tp * cp` first-stage GPUs, as the trainer runs them.
    pub fn centric_encoder_dp(&self, tp: usize) -> usize {
        self.tp / tp.max(1) * self.cp * self.dp
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tp{} cp{} pp{} dp{}", self.tp, self.cp, self.pp, self.dp)
    }
}

/// How module grids share the GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Each module on its own GPUs (encoders first, then the LLM).
    Disjoint,
    /// Every module over all GPUs, taking turns.
    Colocated,
    /// The baseline most frameworks use (Megatron's, and `parallel.placement = "centric"`):
    /// each encoder runs inside the LLM's first pipeline stage at a TP dividing the
    /// LLM's, a replica on every `tp` of the stage's GPUs
    /// ([`Layout::centric_encoder_dp`]; no CP, no stages of its own).
    LlmCentric,
}

impl Placement {
    /// Its name in plan files (serde's).
    pub fn name(self) -> &'static str {
        match self {
            Placement::Disjoint => "disjoint",
            Placement::Colocated => "colocated",
            Placement::LlmCentric => "llm_centric",
        }
    }
}

/// How a step is scheduled across modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// Encoders forward every microbatch, the bridge, the LLM's 1F1B, the bridge back,
    /// the encoders' backward (`braid train`'s default, `parallel.schedule = "phased"`).
    Phased,
    /// 1F1B over the module graph: an encoder's microbatch feeds the LLM's first stage as
    /// soon as it is done (disjoint or colocated placement, a colocated GPU running its
    /// modules' passes in one global order; `parallel.schedule = "overlapped"`).
    Overlapped,
}

impl Schedule {
    /// Its name in configs and plan files (serde's).
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Phased => "phased",
            Schedule::Overlapped => "overlapped",
        }
    }
}

/// A full candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub placement: Placement,
    pub schedule: Schedule,
    /// LLM microbatches per replica per step.
    pub microbatches: usize,
    /// Full activation recomputation (per block) in the LLM, and in the encoders (each
    /// stage from its input): the vision encoder, and the audio one unless
    /// `recompute_audio` says otherwise.
    pub recompute: bool,
    pub recompute_encoders: bool,
    /// The audio encoder's own choice where it differs from the vision one's (a small
    /// encoder may keep its activations where the ViT cannot); absent: as
    /// `recompute_encoders`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_audio: Option<bool>,
    /// The LLM's first pipeline stage holds this many blocks, the others the rest evenly
    /// (the LLM-centric baseline's option, as Megatron's first-stage layer count);
    /// absent: an even split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub llm_first_stage_layers: Option<usize>,
    /// Model chunks per LLM pipeline stage, run in the interleaved 1F1B
    /// ([`crate::pipeline`]; `parallel.llm.virtual_stages`); 1 (absent): plain 1F1B.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub llm_virtual_stages: usize,
    /// Each encoder with two pipeline stages or more has them on its PP slices of GPUs
    /// in reverse order (`parallel.<encoder>.reverse_stages`): colocated, its first stage
    /// beside the LLM's last stages, idle while 1F1B fills and drains.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reverse_encoder_stages: bool,
    /// The LLM's backward split for zero-bubble pipelining ([`crate::zero_bubble`];
    /// `parallel.llm.zero_bubble`): two stages or more, one model chunk a stage.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub llm_zero_bubble: bool,
    /// AdamW state sharded over each module's data-parallel ranks.
    pub zero1: bool,
    pub llm: Layout,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vision: Option<Layout>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<Layout>,
}

fn one() -> usize {
    1
}

fn is_one(v: &usize) -> bool {
    *v == 1
}

impl Plan {
    /// Whether module `m` recomputes its activations in the backward.
    pub fn recomputes(&self, m: Module) -> bool {
        match m {
            Module::Llm => self.recompute,
            Module::Vision => self.recompute_encoders,
            Module::Audio => self.recompute_audio.unwrap_or(self.recompute_encoders),
        }
    }

    /// The audio encoder's recomputation where it differs from the vision one's.
    pub fn own_audio_recompute(&self) -> Option<bool> {
        self.recompute_audio
            .filter(|&a| a != self.recompute_encoders)
    }

    pub fn layout(&self, m: Module) -> Option<Layout> {
        match m {
            Module::Llm => Some(self.llm),
            Module::Vision => self.vision,
            Module::Audio => self.audio,
        }
    }

    /// Whether any module splits its layers by TP (where sequence parallelism, or its
    /// absence, changes what a GPU holds).
    pub fn has_tp(&self) -> bool {
        [Some(self.llm), self.vision, self.audio]
            .into_iter()
            .flatten()
            .any(|l| l.tp > 1)
    }

    /// GPUs the plan occupies.
    pub fn gpus(&self) -> usize {
        let enc = [self.vision, self.audio].into_iter().flatten();
        match self.placement {
            Placement::Disjoint => enc.fold(self.llm.gpus(), |n, l| n.saturating_add(l.gpus())),
            Placement::Colocated => enc.map(|l| l.gpus()).fold(self.llm.gpus(), usize::max),
            Placement::LlmCentric => self.llm.gpus(),
        }
    }

    /// The first GPU of each module's grid (disjoint: vision, audio, then the LLM).
    pub fn offset(&self, m: Module) -> usize {
        if self.placement != Placement::Disjoint {
            return 0;
        }
        let before: &[Option<Layout>] = match m {
            Module::Vision => &[],
            Module::Audio => &[self.vision],
            Module::Llm => &[self.vision, self.audio],
        };
        before.iter().flatten().map(Layout::gpus).sum()
    }

    /// Structural checks against the model and the cluster (memory is the cost
    /// model's): divisibility, TP inside a node, the world, rows per replica.
    pub fn check(
        &self,
        model: &ModelDims,
        cluster: &Cluster,
        gpus: usize,
        batch_rows: usize,
    ) -> Result<(), String> {
        for m in model.modules() {
            let Some(l) = self.layout(m) else {
                return Err(format!("{} has no layout", m.name()));
            };
            let dims = model.module(m).ok_or("no dims")?;
            dims.fits(l.tp, l.pp)
                .map_err(|e| format!("{}: {e}", m.name()))?;
            if l.tp > cluster.gpus_per_node || !cluster.gpus_per_node.is_multiple_of(l.tp) {
                return Err(format!(
                    "{}: tp {} must divide the {} GPUs of a node",
                    m.name(),
                    l.tp,
                    cluster.gpus_per_node
                ));
            }
            if l.gpus() == 0 {
                return Err(format!("{}: a zero-sized grid", m.name()));
            }
        }
        for m in model.modules() {
            if self.layout(m).is_some() && model.module(m).is_none() {
                return Err(format!("{} has a layout but no module", m.name()));
            }
        }
        if self.gpus() != gpus {
            return Err(format!("uses {} GPUs, not {gpus}", self.gpus()));
        }
        if self.placement == Placement::Colocated
            && model
                .modules()
                .iter()
                .any(|&m| self.layout(m).is_some_and(|l| l.gpus() != gpus))
        {
            return Err("colocated grids must each span every GPU".into());
        }
        if self.schedule == Schedule::Overlapped && self.placement == Placement::LlmCentric {
            return Err(
                "the overlapped schedule needs disjoint or colocated placement (the LLM-centric one runs phased)"
                    .into(),
            );
        }
        let v = self.llm_virtual_stages;
        if v == 0 {
            return Err("llm_virtual_stages must be >= 1".into());
        }
        if v > 1 {
            if !crate::pipeline::chunks_split_evenly(model.llm.layers, self.llm.pp, v) {
                return Err(format!(
                    "llm_virtual_stages = {v} with llm pp {}: needs pp >= 2 and pp * virtual stages dividing the LLM's {} layers",
                    self.llm.pp, model.llm.layers
                ));
            }
            if self.llm_first_stage_layers.is_some() {
                return Err(
                    "llm_virtual_stages > 1 splits the stages evenly: no llm_first_stage_layers"
                        .into(),
                );
            }
        }
        if self.llm_zero_bubble
            && (self.llm.pp < 2 || v > 1 || self.placement == Placement::LlmCentric)
        {
            return Err(format!(
                "llm_zero_bubble splits the backward of an LLM pipeline of two stages or more, one model chunk a stage, beside its encoders (llm pp {}, {v} chunks a stage, {} placement)",
                self.llm.pp,
                self.placement.name()
            ));
        }
        if self.reverse_encoder_stages && self.placement == Placement::LlmCentric {
            return Err(
                "reverse_encoder_stages with the LLM-centric placement, whose encoders have one stage inside the LLM's first"
                    .into(),
            );
        }
        let rows = batch_rows / self.llm.dp;
        if rows == 0 || self.microbatches == 0 || self.microbatches > rows {
            return Err(format!(
                "{batch_rows} rows over llm dp {} leave {rows} per replica for {} microbatches",
                self.llm.dp, self.microbatches
            ));
        }
        Ok(())
    }
}
