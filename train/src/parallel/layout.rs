//! The world split into one grid per module, checked against the model before any work:
//! every message names the key to change and says how.
//!
//! Disjoint placement lays the grids side by side in data-flow order (vision, audio,
//! LLM), so their sizes must add up to the world; colocated placement puts every grid
//! over the whole world (each module its own layout on the same ranks); centric
//! placement puts each encoder's grid over the LLM's first pipeline stage (the LLM's
//! ranks `0..tp * cp * dp`, PP being the slowest axis). A world of one rank is
//! colocated whatever the placement says.

use braid_comm::grid::Grid;

use crate::config::{ConfigError, ModuleLayout, ParallelConfig, Placement, invalid};
use crate::mllm::MllmConfig;

/// The three modules a rank can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModuleKind {
    Vision,
    Audio,
    Llm,
}

impl ModuleKind {
    pub fn key(&self) -> &'static str {
        match self {
            ModuleKind::Vision => "vision",
            ModuleKind::Audio => "audio",
            ModuleKind::Llm => "llm",
        }
    }
}

/// Every module's grid in the world.
#[derive(Clone, Debug, PartialEq)]
pub struct Layouts {
    pub world: usize,
    pub placement: Placement,
    pub vision: Option<Grid>,
    pub audio: Option<Grid>,
    pub llm: Grid,
    /// Model chunks per LLM pipeline stage (`parallel.llm.virtual_stages`; 1: 1F1B).
    pub llm_chunks: usize,
    /// Layers of the LLM's first stage where it is shorter than the others
    /// (`parallel.llm.first_stage_layers`).
    pub llm_first_stage_layers: Option<usize>,
    /// The LLM's backward split for zero-bubble pipelining (`parallel.llm.zero_bubble`).
    pub llm_zero_bubble: bool,
}

/// `what` = `n` split `tp` ways, or an error naming `key` that says what to change.
fn divisible(key: &str, what: &str, n: usize, by: usize, axis: &str) -> Result<(), ConfigError> {
    if !n.is_multiple_of(by) {
        return Err(invalid(
            key,
            format!("{axis} = {by} does not divide {what} = {n}: pick a {axis} that divides {n}"),
        ));
    }
    Ok(())
}

/// A shorter first LLM stage: `f` layers there, the rest split evenly over the other
/// stages, each keeping at least one, without virtual stages.
fn check_first_stage(f: usize, layers: usize, l: &ModuleLayout) -> Result<(), ConfigError> {
    let key = "parallel.llm.first_stage_layers";
    if l.pp < 2 {
        return Err(invalid(
            key,
            format!(
                "{f}, but the LLM has one pipeline stage (parallel.llm.pp = {}): remove the key or set pp >= 2",
                l.pp
            ),
        ));
    }
    if l.virtual_stages > 1 {
        return Err(invalid(
            key,
            "a shorter first stage and virtual stages do not go together: remove one of the keys",
        ));
    }
    let rest = layers.saturating_sub(f);
    if f == 0 || rest < l.pp - 1 || !rest.is_multiple_of(l.pp - 1) {
        return Err(invalid(
            key,
            format!(
                "{f} of model.llm.layers = {layers} leaves {rest} for the other {} stages: pick a count from 1 that leaves them an equal share of at least one layer each",
                l.pp - 1
            ),
        ));
    }
    Ok(())
}

/// Under "centric" placement an encoder lives on the LLM's first pipeline stage: its TP
/// divides the LLM's, it has no CP or PP of its own, and its replicas tile the stage's
/// `tp * cp * dp` ranks (`llm.tp / tp` ranks of a CP rank of an LLM replica each, so a
/// replica's items stay inside the LLM replica whose rows hold them).
fn centric_encoder(key: &str, e: &ModuleLayout, llm: &ModuleLayout) -> Result<(), ConfigError> {
    if !llm.tp.is_multiple_of(e.tp) {
        return Err(invalid(
            format!("parallel.{key}.tp"),
            format!(
                "{}, but under \"centric\" placement an encoder's TP divides the LLM's ({}): pick one that divides {}",
                e.tp, llm.tp, llm.tp
            ),
        ));
    }
    for (axis, v) in [("cp", e.cp), ("pp", e.pp)] {
        if v != 1 {
            return Err(invalid(
                format!("parallel.{key}.{axis}"),
                format!(
                    "{v}, but under \"centric\" placement an encoder runs whole inside the LLM's first stage: set {axis} = 1"
                ),
            ));
        }
    }
    let dp = llm.centric_encoder_dp(e.tp);
    if e.dp != dp {
        return Err(invalid(
            format!("parallel.{key}.dp"),
            format!(
                "{}, but under \"centric\" placement the {key} encoder has one replica per {} (its tp) of the LLM's {} first-stage ranks (tp * cp * dp = {} * {} * {}): set dp = {dp}",
                e.dp,
                e.tp,
                llm.tp * llm.cp * llm.dp,
                llm.tp,
                llm.cp,
                llm.dp
            ),
        ));
    }
    Ok(())
}

impl Layouts {
    /// The grids of `p` for `model`, or the first problem found.
    pub fn new(p: &ParallelConfig, model: &MllmConfig) -> Result<Layouts, ConfigError> {
        let llm = &model.llm;
        let l = &p.llm;
        divisible("parallel.llm.tp", "model.llm.heads", llm.heads, l.tp, "tp")?;
        divisible(
            "parallel.llm.tp",
            "model.llm.kv_heads",
            llm.kv_heads,
            l.tp,
            "tp",
        )?;
        divisible("parallel.llm.tp", "model.llm.vocab", llm.vocab, l.tp, "tp")?;
        divisible(
            "parallel.llm.tp",
            "model.llm.intermediate",
            llm.intermediate,
            l.tp,
            "tp",
        )?;
        if l.pp > llm.layers {
            return Err(invalid(
                "parallel.llm.pp",
                format!(
                    "{} pipeline stages for {} layers: at most one stage per layer",
                    l.pp, llm.layers
                ),
            ));
        }
        match l.first_stage_layers {
            Some(f) => check_first_stage(f, llm.layers, l)?,
            None => divisible(
                "parallel.llm.pp",
                "model.llm.layers",
                llm.layers,
                l.pp,
                "pp",
            )?,
        }
        let chunks = l.pp * l.virtual_stages;
        if l.virtual_stages > 1
            && !braid_balancer::pipeline::chunks_split_evenly(llm.layers, l.pp, l.virtual_stages)
        {
            return Err(invalid(
                "parallel.llm.virtual_stages",
                format!(
                    "pp * virtual_stages = {} * {} = {chunks} chunks must divide model.llm.layers = {} evenly: pick virtual_stages dividing {}",
                    l.pp,
                    l.virtual_stages,
                    llm.layers,
                    llm.layers / l.pp
                ),
            ));
        }

        let encoders = [
            (
                ModuleKind::Vision,
                &p.vision,
                model
                    .vision
                    .as_ref()
                    .map(|v| (v.num_heads, v.intermediate_size, v.num_layers)),
            ),
            (
                ModuleKind::Audio,
                &p.audio,
                model.audio.as_ref().map(|a| {
                    (
                        a.encoder_attention_heads,
                        a.encoder_ffn_dim,
                        a.encoder_layers,
                    )
                }),
            ),
        ];
        for (kind, layout, sizes) in encoders {
            let key = kind.key();
            let Some((heads, ff, layers)) = sizes else {
                if *layout != ModuleLayout::default() {
                    return Err(invalid(
                        format!("parallel.{key}"),
                        format!("is set but the model has no [model.{key}]: remove the section"),
                    ));
                }
                continue;
            };
            divisible(
                &format!("parallel.{key}.tp"),
                &format!("the {key} encoder's attention heads"),
                heads,
                layout.tp,
                "tp",
            )?;
            divisible(
                &format!("parallel.{key}.tp"),
                &format!("the {key} encoder's MLP width"),
                ff,
                layout.tp,
                "tp",
            )?;
            if layout.pp > layers {
                return Err(invalid(
                    format!("parallel.{key}.pp"),
                    format!(
                        "{} pipeline stages for the {key} encoder's {layers} layers: at most one stage per layer",
                        layout.pp
                    ),
                ));
            }
            divisible(
                &format!("parallel.{key}.pp"),
                &format!("the {key} encoder's layers"),
                layers,
                layout.pp,
                "pp",
            )?;
        }

        let has_vision = model.vision.is_some();
        let has_audio = model.audio.is_some();
        let world = p.world_size;
        let sizes = [
            (has_vision, "vision", p.vision.ranks()),
            (has_audio, "audio", p.audio.ranks()),
            (true, "llm", p.llm.ranks()),
        ];
        // One rank holds every module, whatever the placement says.
        let placement = if world == 1 {
            Placement::Colocated
        } else {
            p.placement
        };
        let mut offset = 0usize;
        let mut grid = |present: bool, l: &ModuleLayout| -> Result<Option<Grid>, ConfigError> {
            if !present {
                return Ok(None);
            }
            let at = match placement {
                Placement::Disjoint => offset,
                Placement::Colocated | Placement::Centric => 0,
            };
            offset = offset.saturating_add(l.ranks());
            Grid::new(l.grid_dims(), at)
                .map(|g| Some(g.with_stages_reversed(l.reverse_stages)))
                .map_err(|e| invalid("parallel", e.to_string()))
        };
        let vision = grid(has_vision, &p.vision)?;
        let audio = grid(has_audio, &p.audio)?;
        let llm = grid(true, &p.llm)?.ok_or_else(|| invalid("parallel.llm", "missing"))?;

        let listed = sizes
            .iter()
            .filter(|s| s.0)
            .map(|s| format!("{} ({})", s.2, s.1))
            .collect::<Vec<_>>();
        match placement {
            Placement::Disjoint => {
                let need = sizes
                    .iter()
                    .filter(|s| s.0)
                    .fold(0usize, |n, s| n.saturating_add(s.2));
                if need != world {
                    return Err(invalid(
                        "parallel.world_size",
                        format!(
                            "{world}, but disjoint grids need {} = {need} ranks (tp * cp * pp * dp per module): change world_size (under a launcher, the processes it starts: --nproc-per-node, WORLD_SIZE, SLURM's tasks) or a module's dp",
                            listed.join(" + ")
                        ),
                    ));
                }
            }
            Placement::Centric => {
                if l.ranks() != world {
                    return Err(invalid(
                        "parallel.llm",
                        format!(
                            "tp * cp * pp * dp = {}, but under \"centric\" placement the LLM spans the whole world of {world} ranks",
                            l.ranks()
                        ),
                    ));
                }
                for (present, key, e) in [
                    (has_vision, "vision", &p.vision),
                    (has_audio, "audio", &p.audio),
                ] {
                    if present {
                        centric_encoder(key, e, l)?;
                    }
                }
            }
            Placement::Colocated => {
                for (present, key, n) in sizes {
                    if present && n != world {
                        return Err(invalid(
                            format!("parallel.{key}"),
                            format!(
                                "tp * cp * pp * dp = {n}, but colocated grids each span the whole world of {world} ranks"
                            ),
                        ));
                    }
                }
            }
        }
        Ok(Layouts {
            world,
            placement,
            vision,
            audio,
            llm,
            llm_chunks: l.virtual_stages,
            llm_first_stage_layers: l.first_stage_layers,
            llm_zero_bubble: l.zero_bubble,
        })
    }

    pub fn grid(&self, kind: ModuleKind) -> Option<&Grid> {
        match kind {
            ModuleKind::Vision => self.vision.as_ref(),
            ModuleKind::Audio => self.audio.as_ref(),
            ModuleKind::Llm => Some(&self.llm),
        }
    }

    /// One line per module: its layout and ranks.
    pub fn describe(&self) -> Vec<String> {
        [ModuleKind::Vision, ModuleKind::Audio, ModuleKind::Llm]
            .iter()
            .filter_map(|&k| {
                self.grid(k).map(|g| {
                    let reversed = if g.stages_reversed {
                        "  (stages reversed: stage 0 on the last slice)"
                    } else if k == ModuleKind::Llm && self.llm_zero_bubble {
                        "  (zero-bubble: weight gradients in passes of their own)"
                    } else {
                        ""
                    };
                    format!(
                        "{:<6} {}  ranks {}..{}{reversed}",
                        k.key(),
                        g.dims,
                        g.ranks().start,
                        g.ranks().end - 1
                    )
                })
            })
            .collect()
    }
}
