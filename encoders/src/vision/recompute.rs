//! What a [`VisionEncoder`] stage keeps between its forward and backward: every
//! activation, or under activation recomputation (`VisionEncoder::recompute`) only the
//! stage's input, the whole stage's forward run again by the backward. An encoder's
//! chunks all wait for the LLM in the phased schedule, so keeping one input per chunk
//! (not one per block) is what bounds its memory; the recomputed working set is one
//! chunk's stage.

use braid_kernels::Tensor;
use braid_nn::Result;
use braid_nn::error::Context;

use super::VisionEncoder;
use super::stage::{StageActs, VisionStageInput, VisionStageOutput};

/// What [`VisionEncoder::backward_stage`] (and [`VisionEncoder::backward`]) needs; one
/// per microbatch in flight.
#[derive(Debug)]
pub struct VisionCache(Saved);

/// The cache of a stage is the cache of the whole model.
pub type VisionStageCache = VisionCache;

#[derive(Debug)]
enum Saved {
    Acts(Box<StageActs>),
    /// The stage's input and image count.
    Input {
        input: OwnedInput,
        b: usize,
    },
}

#[derive(Debug)]
enum OwnedInput {
    /// (B, C, H, W)
    Pixels(Tensor),
    /// (N_local, D)
    Hidden(Tensor),
}

impl VisionEncoder {
    /// The forward of this stage over `b` images: pixels on the first stage, the
    /// previous stage's hidden states (N_local, D) otherwise; returns the hidden
    /// states for the next stage, or on the last stage the full output (see
    /// [`super::stage`] for CP).
    pub fn forward_stage(
        &self,
        input: VisionStageInput<'_>,
        b: usize,
    ) -> Result<(VisionStageOutput, VisionCache)> {
        if !self.recompute {
            let (out, acts) = self.forward_acts(input, b)?;
            return Ok((out, VisionCache(Saved::Acts(Box::new(acts)))));
        }
        let kept = match &input {
            VisionStageInput::Pixels(px) => OwnedInput::Pixels(
                px.try_clone()
                    .ctx("vision recompute", "keeping pixel_values")?,
            ),
            VisionStageInput::Hidden(h) => OwnedInput::Hidden(
                h.try_clone()
                    .ctx("vision recompute", "keeping the stage input")?,
            ),
        };
        // The activations are freed here; the backward computes them again.
        let (out, _acts) = self.forward_acts(input, b)?;
        Ok((out, VisionCache(Saved::Input { input: kept, b })))
    }

    /// The backward of this stage: `dout` is d last_hidden_state (B, S, D) on the
    /// last stage (with `dpooled` (B, D), optional), d hidden (N_local, D) before it.
    /// Returns d pixel_values (B, C, H, W) on the first stage, d hidden (N_local, D)
    /// for the previous stage otherwise; adds into the parameter grads (under CP,
    /// partial: see [`super::stage`]). A recomputing stage first runs its forward
    /// again (with its collectives, in the same order on every rank).
    pub fn backward_stage(
        &mut self,
        cache: VisionCache,
        dout: &Tensor,
        dpooled: Option<&Tensor>,
    ) -> Result<Tensor> {
        let acts = match cache.0 {
            Saved::Acts(acts) => *acts,
            Saved::Input { input, b } => match input {
                OwnedInput::Pixels(px) => self.forward_acts(VisionStageInput::Pixels(&px), b)?.1,
                OwnedInput::Hidden(h) => self.forward_acts(VisionStageInput::Hidden(h), b)?.1,
            },
        };
        self.backward_acts(acts, dout, dpooled)
    }
}
