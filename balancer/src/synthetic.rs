//! Synthetic global batches with published length distributions, for tests and
//! benchmarks of the assignment (and later the planner): LLaVA-1.5-like image-text
//! (one 336 px image = 576 patch tokens in ~85 % of samples, text lengths heavy-tailed
//! around ~120 tokens) plus optional speech clips of 1-30 s, packed first-fit-decreasing
//! into rows of `max_seq_len`. Deterministic for a seed (a 64-bit LCG: no dependency).

use crate::assign::BatchShape;

/// A small deterministic generator (Knuth's MMIX LCG).
pub(crate) struct Lcg(pub(crate) u64);

impl Lcg {
    pub(crate) fn next_f64(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    /// exp(N(mu, sigma)) by Box-Muller.
    pub(crate) fn lognormal(&mut self, mu: f64, sigma: f64) -> f64 {
        let (u1, u2) = (self.next_f64().max(1e-12), self.next_f64());
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        (mu + sigma * z).exp()
    }
}

/// One sample: LLM tokens, whether it has an image, its clips' mel frames.
#[derive(Clone, Debug)]
struct Sample {
    tokens: usize,
    image: bool,
    clips: Vec<usize>,
}

/// `n` LLaVA-like samples (`speech` of them also with one clip) packed into rows of
/// `max_seq_len` tokens.
pub fn llava_like(n: usize, speech: f64, max_seq_len: usize, seed: u64) -> BatchShape {
    let mut rng = Lcg(seed);
    let mut samples: Vec<Sample> = (0..n)
        .map(|_| {
            let image = rng.next_f64() < 0.85;
            let text = (rng.lognormal(4.8, 0.9) as usize).clamp(8, 2048);
            let clips = if rng.next_f64() < speech {
                // 1-30 s at 100 mel frames per second; the projector gives frames / 8 tokens.
                vec![(100.0 + rng.next_f64() * 2900.0) as usize]
            } else {
                Vec::new()
            };
            let tokens =
                text + if image { 576 } else { 0 } + clips.iter().map(|f| f / 8).sum::<usize>();
            Sample {
                tokens: tokens.min(max_seq_len),
                image,
                clips,
            }
        })
        .collect();
    // First-fit decreasing into rows.
    samples.sort_by_key(|s| std::cmp::Reverse(s.tokens));
    let mut rows: Vec<(usize, Vec<Sample>)> = Vec::new();
    for s in samples {
        match rows.iter_mut().find(|r| r.0 + s.tokens <= max_seq_len) {
            Some(r) => {
                r.0 += s.tokens;
                r.1.push(s);
            }
            None => rows.push((s.tokens, vec![s])),
        }
    }
    let mut b = BatchShape {
        row_tokens: Vec::new(),
        row_sq: Vec::new(),
        row_images: Vec::new(),
        image_tokens: Vec::new(),
        row_clips: Vec::new(),
        clip_frames: Vec::new(),
    };
    for (t, ss) in rows {
        b.row_tokens.push(t);
        b.row_sq
            .push(ss.iter().map(|s| (s.tokens as u64).pow(2)).sum());
        b.row_images.push(ss.iter().filter(|s| s.image).count());
        b.image_tokens
            .extend(ss.iter().filter(|s| s.image).map(|_| 576));
        b.row_clips.push(ss.iter().map(|s| s.clips.len()).sum());
        b.clip_frames
            .extend(ss.iter().flat_map(|s| s.clips.iter().copied()));
    }
    b
}
