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

/// The free tokens of up to `n` rows, for first fit in O(log n) a sample: a max segment
/// tree, descended to the leftmost row with room (a linear scan made planning quadratic
/// in the rows sampled: 77 s for 16,384).
struct FreeSpace {
    /// Leaves from `leaves`: `tree[leaves + i]` is row i's free tokens; inner nodes hold
    /// their children's max.
    tree: Vec<usize>,
    leaves: usize,
}

impl FreeSpace {
    fn new(n: usize, seq_len: usize) -> Self {
        let leaves = n.max(1).next_power_of_two();
        let mut tree = vec![0; 2 * leaves];
        tree[leaves..leaves + n.max(1)].fill(seq_len);
        for i in (1..leaves).rev() {
            tree[i] = tree[2 * i].max(tree[2 * i + 1]);
        }
        FreeSpace { tree, leaves }
    }

    /// The first row with at least `t` free tokens (`t` at most the row length).
    fn first_with(&self, t: usize) -> usize {
        let mut i = 1;
        while i < self.leaves {
            i = if self.tree[2 * i] >= t {
                2 * i
            } else {
                2 * i + 1
            };
        }
        i - self.leaves
    }

    /// Row `row` takes `t` of its free tokens.
    fn take(&mut self, row: usize, t: usize) {
        let mut i = self.leaves + row;
        self.tree[i] -= t;
        while i > 1 {
            i /= 2;
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }
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
    // First fit: each sample goes to the first row with room, a new row when none has.
    let mut free = FreeSpace::new(samples.len(), seq_len);
    let mut rows: Vec<RowShape> = Vec::new();
    for (t, images, clips) in samples {
        // Every sample fits an empty row (t <= seq_len), and the rows not opened yet are
        // empty and after the open ones: the first with room is an open one, or the next.
        let i = free.first_with(t);
        if i == rows.len() {
            rows.push(RowShape::default());
        }
        free.take(i, t);
        let r = &mut rows[i];
        r.samples.push(t as u32);
        r.images.extend(images);
        r.clips.extend(clips);
    }
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

    /// Its first `n` batches (at least one): what the planner averages a candidate over.
    pub fn batches(&self, n: usize) -> Vec<Vec<RowShape>> {
        (0..n.max(1)).map(|k| self.batch(k)).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The tree finds what a linear first-fit scan finds, sample by sample, over random
    /// sizes (sorted and not) and row lengths.
    #[test]
    fn free_space_is_first_fit() {
        let mut rng = Lcg(7);
        for case in 0..200 {
            let seq_len = 1 + (rng.next_f64() * 600.0) as usize;
            let n = (rng.next_f64() * 300.0) as usize;
            let mut sizes: Vec<usize> = (0..n)
                .map(|_| 1 + (rng.next_f64() * seq_len as f64) as usize % seq_len)
                .collect();
            if case % 2 == 0 {
                sizes.sort_unstable_by(|a, b| b.cmp(a));
            }
            let mut free = FreeSpace::new(n, seq_len);
            let mut linear: Vec<usize> = Vec::new(); // used tokens per open row
            let mut opened = 0;
            for &t in &sizes {
                let want = linear
                    .iter()
                    .position(|&u| u + t <= seq_len)
                    .unwrap_or(linear.len());
                if want == linear.len() {
                    linear.push(0);
                }
                linear[want] += t;
                let got = free.first_with(t);
                assert_eq!(got, want, "case {case}: size {t} of {seq_len}");
                opened = opened.max(got + 1);
                free.take(got, t);
            }
            assert_eq!(opened, linear.len());
        }
    }
}
