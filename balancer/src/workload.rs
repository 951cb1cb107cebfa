//! What a plan is for: the dataset's packed rows (their samples' LLM lengths, each
//! image's and clip's encoder length) and the global batch. Rows come from real shards
//! (`braid plan --data`) or from a synthetic [`Mix`] with published length distributions.

use serde::{Deserialize, Serialize};

use crate::assign::BatchShape;
use crate::synthetic::Lcg;

/// One packed row as the planner sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowShape {
    /// LLM tokens of each packed sample (their sum is the row's length).
    pub samples: Vec<u32>,
    /// Vision-encoder tokens of each image.
    pub images: Vec<u32>,
    /// Mel frames of each clip (the audio encoder's stem halves them).
    pub clips: Vec<u32>,
}

impl RowShape {
    pub fn tokens(&self) -> usize {
        self.samples.iter().map(|&s| s as usize).sum()
    }
}

/// The [`BatchShape`] an assigner sees for `rows`.
pub fn shape_of(rows: &[RowShape]) -> BatchShape {
    BatchShape {
        row_tokens: rows.iter().map(RowShape::tokens).collect(),
        row_sq: rows
            .iter()
            .map(|r| r.samples.iter().map(|&s| u64::from(s).pow(2)).sum())
            .collect(),
        row_images: rows.iter().map(|r| r.images.len()).collect(),
        image_tokens: rows
            .iter()
            .flat_map(|r| r.images.iter().map(|&t| t as usize))
            .collect(),
        row_clips: rows.iter().map(|r| r.clips.len()).collect(),
        clip_frames: rows
            .iter()
            .flat_map(|r| r.clips.iter().map(|&f| f as usize))
            .collect(),
    }
}

/// A synthetic sample distribution. Text lengths are log-normal; a sample has images
/// with probability `image_prob` (1..=`images_max` of them, uniform) and clips with
/// probability `audio_prob` (1..=`clips_max`, each `clip_s` seconds uniform in range).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mix {
    /// Median text tokens of a sample, and the log-normal's sigma.
    pub text_median: f64,
    pub text_sigma: f64,
    pub image_prob: f64,
    #[serde(default = "one")]
    pub images_max: usize,
    #[serde(default)]
    pub audio_prob: f64,
    #[serde(default = "one")]
    pub clips_max: usize,
    /// Seconds of one clip: [min, max].
    #[serde(default = "default_clip_s")]
    pub clip_s: [f64; 2],
}

impl Mix {
    /// Refuses values that have no meaning (a probability outside [0, 1], a NaN length)
    /// or that would make the synthetic batch unbounded: each message names the key.
    pub fn validate(&self) -> Result<(), String> {
        let bad =
            |key: &str, v: String, want: &str| Err(format!("plan.mix.{key} = {v}: must be {want}"));
        if !(self.text_median.is_finite() && (1.0..=1e7).contains(&self.text_median)) {
            return bad(
                "text_median",
                self.text_median.to_string(),
                "tokens in [1, 1e7]",
            );
        }
        if !(self.text_sigma.is_finite() && (0.0..=5.0).contains(&self.text_sigma)) {
            return bad("text_sigma", self.text_sigma.to_string(), "in [0, 5]");
        }
        for (key, p) in [
            ("image_prob", self.image_prob),
            ("audio_prob", self.audio_prob),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return bad(key, p.to_string(), "a probability in [0, 1]");
            }
        }
        for (key, n) in [
            ("images_max", self.images_max),
            ("clips_max", self.clips_max),
        ] {
            if !(1..=4096).contains(&n) {
                return bad(key, n.to_string(), "from 1 to 4096");
            }
        }
        let [lo, hi] = self.clip_s;
        if !(lo.is_finite() && hi.is_finite() && 0.0 < lo && lo <= hi && hi <= 3600.0) {
            return bad(
                "clip_s",
                format!("[{lo}, {hi}]"),
                "[min, max] seconds with 0 < min <= max <= 3600",
            );
        }
        Ok(())
    }
}

fn one() -> usize {
    1
}
fn default_clip_s() -> [f64; 2] {
    [1.0, 30.0]
}

/// How the model turns media into tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MediaTokens {
    /// Vision-encoder tokens per image, and the LLM tokens they become.
    pub image_encoder: usize,
    pub image_llm: usize,
    /// LLM tokens per mel frame (100 frames a second; Whisper's stem halves them, the
    /// projector's stride divides further).
    pub llm_per_frame: f64,
}

/// `n` samples of `mix` packed first-fit-decreasing into rows of `seq_len` tokens, rows
/// shuffled. Samples longer than a row drop media until they fit, then truncate text.
pub fn generate(
    mix: &Mix,
    media: MediaTokens,
    n: usize,
    seq_len: usize,
    seed: u64,
) -> Vec<RowShape> {
    let mut rng = Lcg(seed);
    // (llm tokens, images, clips)
    let mut samples: Vec<(usize, Vec<u32>, Vec<u32>)> = (0..n)
        .map(|_| {
            let mut images = Vec::new();
            if rng.next_f64() < mix.image_prob {
                let k = 1 + (rng.next_f64() * mix.images_max as f64) as usize;
                images = vec![media.image_encoder as u32; k.min(mix.images_max)];
            }
            let text = (rng.lognormal(mix.text_median.ln(), mix.text_sigma) as usize).max(8);
            let mut clips = Vec::new();
            if rng.next_f64() < mix.audio_prob {
                let k = 1 + (rng.next_f64() * mix.clips_max as f64) as usize;
                for _ in 0..k.min(mix.clips_max) {
                    let s = mix.clip_s[0] + rng.next_f64() * (mix.clip_s[1] - mix.clip_s[0]);
                    clips.push((s * 100.0) as u32);
                }
            }
            let media_tokens = |im: &[u32], cl: &[u32]| {
                im.len() * media.image_llm
                    + cl.iter()
                        .map(|&f| (f as f64 * media.llm_per_frame).ceil() as usize)
                        .sum::<usize>()
            };
            while media_tokens(&images, &clips) + 8 > seq_len
                && !(images.is_empty() && clips.is_empty())
            {
                if clips.len() >= images.len() {
                    clips.pop();
                } else {
                    images.pop();
                }
            }
            let m = media_tokens(&images, &clips);
            ((m + text).min(seq_len), images, clips)
        })
        .collect();
    samples.sort_by_key(|s| std::cmp::Reverse(s.0));
    let mut rows: Vec<(usize, RowShape)> = Vec::new();
    for (t, images, clips) in samples {
        let i = match rows.iter().position(|r| r.0 + t <= seq_len) {
            Some(i) => i,
            None => {
                rows.push((0, RowShape::default()));
                rows.len() - 1
            }
        };
        let r = &mut rows[i];
        r.0 += t;
        r.1.samples.push(t as u32);
        r.1.images.extend(images);
        r.1.clips.extend(clips);
    }
    let mut rows: Vec<RowShape> = rows.into_iter().map(|r| r.1).collect();
    // Fisher-Yates: a batch is a random draw of rows, not the packer's size order.
    for i in (1..rows.len()).rev() {
        let j = (rng.next_f64() * (i + 1) as f64) as usize;
        rows.swap(i, j.min(i));
    }
    rows
}

/// The rows a plan draws its batches from.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    pub rows: Vec<RowShape>,
    /// Rows per global batch.
    pub batch_rows: usize,
    pub seq_len: usize,
}

impl Workload {
    /// Batch `k`: `batch_rows` consecutive rows of the pool (wrapping).
    pub fn batch(&self, k: usize) -> Vec<RowShape> {
        let n = self.rows.len().max(1);
        (0..self.batch_rows)
            .filter_map(|i| self.rows.get((k * self.batch_rows + i) % n).cloned())
            .collect()
    }

    /// Mean tokens, images and clips per row: the summary `braid plan` prints.
    pub fn summary(&self) -> (f64, f64, f64) {
        let n = self.rows.len().max(1) as f64;
        let sum =
            |f: &dyn Fn(&RowShape) -> usize| self.rows.iter().map(f).sum::<usize>() as f64 / n;
        (
            sum(&RowShape::tokens),
            sum(&|r| r.images.len()),
            sum(&|r| r.clips.len()),
        )
    }
}
