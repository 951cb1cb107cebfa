//! Building an [`Mllm`]: random init, assembly from separately built or loaded parts
//! (module prefixes on the parameter names) and back, and per-module freezing.

use braid_encoders::{AudioProjector, MlpProjector, VisionEncoder, WhisperEncoder};
use braid_kernels::rng::Rng;
use braid_llm::Llm;
use braid_nn::{Error, Init, Module, Result};

use super::{
    AUDIO, AUDIO_PROJECTOR, AudioProjectorConfig, Freeze, LLM, Mllm, MllmConfig, VISION,
    VISION_PROJECTOR,
};

/// Which encoders and LLM [`Mllm::new_except`] leaves at zero for a checkpoint to fill.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    pub llm: bool,
    pub vision: bool,
    pub audio: bool,
}

/// The modules of an [`Mllm`] with their own parameter names (no module prefix).
#[derive(Debug)]
pub struct MllmParts {
    pub vision: Option<VisionEncoder>,
    pub vision_projector: Option<MlpProjector>,
    pub audio: Option<WhisperEncoder>,
    pub audio_projector: Option<AudioProjector>,
    pub llm: Llm,
}

/// A seed for one module, so that the parts' equal local names (`layers.0...` in the
/// audio encoder and in the LLM) do not draw equal weights.
pub(crate) fn module_init(init: &Init, module: &str) -> Init {
    let w = Rng::for_name(init.seed, module).index_vec(2, u32::MAX);
    Init {
        seed: (u64::from(w[0]) << 32) | u64::from(w[1]),
        ..*init
    }
}

fn add_prefix<M: Module + ?Sized>(m: &mut M, prefix: &str) {
    m.visit_params_mut(&mut |p| p.name.insert_str(0, prefix));
}

fn strip_prefix<M: Module + ?Sized>(m: &mut M, prefix: &str) {
    m.visit_params_mut(&mut |p| {
        if let Some(rest) = p.name.strip_prefix(prefix) {
            p.name = rest.to_string();
        }
    });
}

impl Mllm {
    /// A randomly initialized model. The LLM draws exactly what `Llm::new(config.llm,
    /// init)` draws; each other module draws from its own seed derived from `init.seed`
    /// and its name.
    pub fn new(config: MllmConfig, init: &Init) -> Result<Self> {
        Self::new_except(config, init, Loaded::default())
    }

    /// As [`Mllm::new`], but the modules flagged in `loaded` (about to be overwritten from
    /// a checkpoint) start at zero without drawing random numbers, as `Init::for_loading`
    /// does; the other modules draw exactly what `Mllm::new` draws.
    pub fn new_except(config: MllmConfig, init: &Init, loaded: Loaded) -> Result<Self> {
        config.validate()?;
        // Zero weights, with or without grads as `init` says.
        let zeroed = Init {
            trainable: init.trainable,
            ..Init::for_loading(init.device)
        };
        let pick = |skip: bool, name: &str| {
            if skip {
                zeroed
            } else {
                module_init(init, name)
            }
        };
        let vision = match &config.vision {
            Some(v) => Some(VisionEncoder::new(
                &pick(loaded.vision, "vision"),
                v.clone(),
            )?),
            None => None,
        };
        let vision_projector = match &config.vision_projector {
            Some(p) => Some(MlpProjector::new(
                &module_init(init, "vision_projector"),
                "vision_projector",
                p.projector(),
            )?),
            None => None,
        };
        let audio = match &config.audio {
            Some(a) => Some(WhisperEncoder::new(
                &pick(loaded.audio, "audio"),
                a.clone(),
            )?),
            None => None,
        };
        let audio_projector = match &config.audio_projector {
            Some(p) => Some(AudioProjector::new(
                &module_init(init, "audio_projector"),
                "audio_projector",
                p.in_dim,
                p.out_dim,
                p.stride,
                p.activation(),
            )?),
            None => None,
        };
        let llm = Llm::new(&config.llm, if loaded.llm { &zeroed } else { init })?;
        let mut parts = MllmParts {
            vision,
            vision_projector,
            audio,
            audio_projector,
            llm,
        };
        // The projectors were named after their module (for error messages); as
        // parts their parameters carry their own names (`linear_1.weight`).
        if let Some(p) = &mut parts.vision_projector {
            strip_prefix(p, VISION_PROJECTOR);
        }
        if let Some(p) = &mut parts.audio_projector {
            strip_prefix(p, AUDIO_PROJECTOR);
        }
        Self::from_parts(config, parts)
    }

    /// Assembles a model from parts built or loaded separately (e.g. each from its
    /// Hugging Face checkpoint), checking them against `config`; their parameters get
    /// the module prefixes.
    pub fn from_parts(config: MllmConfig, parts: MllmParts) -> Result<Self> {
        config.validate()?;
        let err = |msg: String| Err(Error::config("Mllm::from_parts", msg));
        if parts.llm.config() != &config.llm {
            return err("the LLM's config differs from config.llm".into());
        }
        if parts.vision.as_ref().map(|v| &v.config) != config.vision.as_ref() {
            return err("the vision encoder (or its absence) differs from config.vision".into());
        }
        if parts.vision_projector.as_ref().map(|p| p.config)
            != config.vision_projector.as_ref().map(|p| p.projector())
        {
            return err(
                "the vision projector (or its absence) differs from config.vision_projector".into(),
            );
        }
        if parts.audio.as_ref().map(|a| &a.config) != config.audio.as_ref() {
            return err("the audio encoder (or its absence) differs from config.audio".into());
        }
        let ap = |p: &AudioProjector| (p.in_dim, p.stride);
        let cp = |p: &AudioProjectorConfig| (p.in_dim, p.stride);
        if parts.audio_projector.as_ref().map(ap) != config.audio_projector.as_ref().map(cp) {
            return err(
                "the audio projector (or its absence) differs from config.audio_projector".into(),
            );
        }
        let MllmParts {
            mut vision,
            mut vision_projector,
            mut audio,
            mut audio_projector,
            mut llm,
        } = parts;
        if let Some(m) = &mut vision {
            add_prefix(m, VISION);
        }
        if let Some(m) = &mut vision_projector {
            add_prefix(m, VISION_PROJECTOR);
        }
        if let Some(m) = &mut audio {
            add_prefix(m, AUDIO);
        }
        if let Some(m) = &mut audio_projector {
            add_prefix(m, AUDIO_PROJECTOR);
        }
        add_prefix(&mut llm, LLM);
        Ok(Mllm {
            config,
            vision,
            vision_projector,
            audio,
            audio_projector,
            llm,
        })
    }

    /// The parts with their own parameter names again.
    pub fn into_parts(self) -> MllmParts {
        let Mllm {
            mut vision,
            mut vision_projector,
            mut audio,
            mut audio_projector,
            mut llm,
            ..
        } = self;
        if let Some(m) = &mut vision {
            strip_prefix(m, VISION);
        }
        if let Some(m) = &mut vision_projector {
            strip_prefix(m, VISION_PROJECTOR);
        }
        if let Some(m) = &mut audio {
            strip_prefix(m, AUDIO);
        }
        if let Some(m) = &mut audio_projector {
            strip_prefix(m, AUDIO_PROJECTOR);
        }
        strip_prefix(&mut llm, LLM);
        MllmParts {
            vision,
            vision_projector,
            audio,
            audio_projector,
            llm,
        }
    }

    /// Freezes the flagged modules (`Param::freeze` on each of their parameters). One
    /// way: modules not flagged keep their state (use `Module::unfreeze` on a part to
    /// train it again). Flagging a module the model does not have is an error.
    pub fn apply_freeze(&mut self, f: Freeze) -> Result<()> {
        fn one<M: Module>(m: Option<&mut M>, flag: bool, name: &str) -> Result<()> {
            match (flag, m) {
                (false, _) => Ok(()),
                (true, Some(m)) => {
                    m.freeze();
                    Ok(())
                }
                (true, None) => Err(Error::config(
                    "train.freeze",
                    format!("`{name}` is frozen but the model has no {name}"),
                )),
            }
        }
        one(self.vision.as_mut(), f.vision, "vision")?;
        one(
            self.vision_projector.as_mut(),
            f.vision_projector,
            "vision_projector",
        )?;
        one(self.audio.as_mut(), f.audio, "audio")?;
        one(
            self.audio_projector.as_mut(),
            f.audio_projector,
            "audio_projector",
        )?;
        one(Some(&mut self.llm), f.llm, "llm")
    }
}
