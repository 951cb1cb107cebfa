//! What a [`WhisperEncoder`] stage keeps between its forward and backward: every
//! activation, or under activation recomputation (`WhisperEncoder::recompute`) only
//! the stage's input, the whole stage's forward run again by the backward (one input
//! per chunk in flight, not one per block; see `crate::vision::VisionCache`).

use braid_kernels::Tensor;
use braid_nn::Result;
use braid_nn::error::Context;

use super::WhisperEncoder;
use super::stage::{AudioStageGrad, AudioStageInput, AudioStageOutput, StageActs};

/// What [`WhisperEncoder::backward`] / [`WhisperEncoder::backward_stage`] need; one
/// per microbatch in flight.
#[derive(Debug)]
pub struct AudioCache(Saved);

/// The cache of a stage (the same type as the whole encoder's).
pub type AudioStageCache = AudioCache;

#[derive(Debug)]
enum Saved {
    Acts(Box<StageActs>),
    /// The stage's input and the clips' mel frame counts.
    Input {
        input: OwnedInput,
        frames: Vec<usize>,
    },
}

#[derive(Debug)]
enum OwnedInput {
    /// each (n_mels, F_j)
    Clips(Vec<Tensor>),
    /// (T_local, D)
    Hidden(Tensor),
}

impl WhisperEncoder {
    /// One stage's forward for clips of `frames` mel frames each (known to every
    /// stage): clips on the first stage, this rank's hidden rows (T_local, D)
    /// elsewhere; returns hidden rows (T_local, D) for the next stage, or on the last
    /// stage the full output. The whole encoder without CP computes exactly
    /// [`Self::forward`].
    pub fn forward_stage(
        &self,
        input: AudioStageInput<'_>,
        frames: &[usize],
    ) -> Result<(AudioStageOutput, AudioCache)> {
        if !self.recompute {
            let (out, acts) = self.forward_acts(input, frames)?;
            return Ok((out, AudioCache(Saved::Acts(Box::new(acts)))));
        }
        let kept = match &input {
            AudioStageInput::Clips(clips) => OwnedInput::Clips(
                clips
                    .iter()
                    .map(Tensor::try_clone)
                    .collect::<std::result::Result<_, _>>()
                    .ctx("audio recompute", "keeping the clips")?,
            ),
            AudioStageInput::Hidden(h) => OwnedInput::Hidden(
                h.try_clone()
                    .ctx("audio recompute", "keeping the stage input")?,
            ),
        };
        // The activations are freed here; the backward computes them again.
        let (out, _acts) = self.forward_acts(input, frames)?;
        let frames = frames.to_vec();
        Ok((
            out,
            AudioCache(Saved::Input {
                input: kept,
                frames,
            }),
        ))
    }

    /// Backward of [`Self::forward_stage`] given the grad of its output: d output
    /// hidden (T, D) on the last stage (the full rows, identical on every CP rank), d
    /// hidden (T_local, D) elsewhere. Adds into the parameter grads (under CP, this
    /// rank's share: see the module doc) and returns the grad of the stage's input. A
    /// recomputing stage first runs its forward again (with its collectives, in the
    /// same order on every rank).
    pub fn backward_stage(&mut self, cache: AudioCache, dout: &Tensor) -> Result<AudioStageGrad> {
        let acts = match cache.0 {
            Saved::Acts(acts) => *acts,
            Saved::Input { input, frames } => match input {
                OwnedInput::Clips(c) => self.forward_acts(AudioStageInput::Clips(&c), &frames)?.1,
                OwnedInput::Hidden(h) => self.forward_acts(AudioStageInput::Hidden(h), &frames)?.1,
            },
        };
        self.backward_acts(acts, dout)
    }
}
