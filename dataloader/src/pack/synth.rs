//! Synthetic length mixes for packing tests and benchmarks (no data, only [`SampleMeta`]s).
//!
//! `Llava` imitates LLaVA-665k's instruction mix with a CLIP-336 tower (576 placeholder tokens, 577
//! encoder tokens per image): mostly short single-image turns, some multi-turn conversations of 1-2k,
//! some text-only (ShareGPT-like) conversations, a few long 3-4k samples with several images and a
//! handful over 4096. `Audio` imitates an ASR / audio-QA mix through a Whisper-style encoder (100 mel
//! frames/s, 50 encoder frames/s, 25 LLM tokens/s after pooling). `Multimodal` draws 65% from the
//! first and 35% from the second. Seeded and platform-independent (SplitMix64, integer arithmetic
//! where it matters), so the Rust and Python benchmarks can share lengths.

use crate::cost::{AudioMeta, ImageMeta, SampleMeta};

/// Which length mix to draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    Llava,
    Audio,
    Multimodal,
}

/// SplitMix64: tiny, fast, good enough for synthetic lengths, identical everywhere.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [lo, hi] (hi >= lo).
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        let span = (hi.saturating_sub(lo) as u64) + 1;
        lo + (self.next_u64() % span) as u32
    }

    /// Log-uniform integer in [lo, hi] (lo >= 1): many short, a long tail.
    pub fn log_range(&mut self, lo: u32, hi: u32) -> u32 {
        let (l, h) = ((lo.max(1) as f64).ln(), (hi.max(lo).max(1) as f64).ln());
        ((l + (h - l) * self.f64()).exp().round() as u32).clamp(lo, hi.max(lo))
    }
}

/// `n` samples of `mix`, deterministic in `seed`.
pub fn generate(mix: Mix, n: usize, seed: u64) -> Vec<SampleMeta> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| match mix {
            Mix::Llava => llava_sample(&mut rng),
            Mix::Audio => audio_sample(&mut rng),
            Mix::Multimodal => {
                if rng.f64() < 0.65 {
                    llava_sample(&mut rng)
                } else {
                    audio_sample(&mut rng)
                }
            }
        })
        .collect()
}

const CLIP336_TOKENS: u32 = 576;
const CLIP336_PATCHES: u32 = 577;

/// A sample of `text` text tokens with `k` images spread through it (the first after a short prompt).
fn with_images(rng: &mut SplitMix64, text: u32, k: u32) -> SampleMeta {
    let mut images = Vec::new();
    let mut pos = 0u32;
    let mut text_left = text;
    for j in 0..k {
        // The first image comes after the system prompt and "USER:"; later ones after a paragraph.
        let gap = if j == 0 {
            rng.range(10, 40)
        } else {
            rng.range(50, 400)
        }
        .min(text_left);
        pos += gap;
        text_left -= gap;
        images.push(ImageMeta {
            patches: CLIP336_PATCHES,
            llm_tokens: CLIP336_TOKENS,
            llm_offset: pos,
        });
        pos += CLIP336_TOKENS;
    }
    SampleMeta::new(text, images, Vec::new())
}

fn llava_sample(rng: &mut SplitMix64) -> SampleMeta {
    let u = rng.f64();
    if u < 0.62 {
        // Short single-image turn (VQA, short answers, single-turn reasoning).
        let text = rng.range(50, 300);
        with_images(rng, text, 1)
    } else if u < 0.84 {
        // Multi-turn conversation about one image: 1-2k in all.
        let text = rng.range(1000, 2000) - CLIP336_TOKENS;
        with_images(rng, text, 1)
    } else if u < 0.96 {
        // Text-only conversation (ShareGPT-like): heavy short side, long tail.
        SampleMeta::text(rng.log_range(20, 3000))
    } else if u < 0.995 {
        // Long: 3-4k with 1-3 images.
        let k = rng.range(1, 3);
        let text = rng.range(3000, 4000) - k * CLIP336_TOKENS;
        with_images(rng, text, k)
    } else {
        // Over 4096: one image up front, a very long conversation.
        let text = rng.range(4100, 6000) - CLIP336_TOKENS;
        with_images(rng, text, 1)
    }
}

/// A clip of `secs` seconds (tenths) at Whisper/Qwen2-Audio rates.
fn clip(tenths: u32, llm_offset: u32) -> AudioMeta {
    let mel_frames = tenths * 10;
    let encoder_frames = mel_frames.div_ceil(2);
    AudioMeta {
        mel_frames,
        encoder_frames,
        llm_tokens: encoder_frames.div_ceil(2),
        llm_offset,
    }
}

fn with_clips(rng: &mut SplitMix64, text: u32, clips_tenths: &[u32]) -> SampleMeta {
    let mut audio = Vec::new();
    let mut pos = 0u32;
    let mut text_left = text;
    for (j, &t) in clips_tenths.iter().enumerate() {
        let gap = if j == 0 {
            rng.range(8, 30)
        } else {
            rng.range(20, 200)
        }
        .min(text_left);
        pos += gap;
        text_left -= gap;
        let c = clip(t, pos);
        pos += c.llm_tokens;
        audio.push(c);
    }
    SampleMeta::new(text, Vec::new(), audio)
}

fn audio_sample(rng: &mut SplitMix64) -> SampleMeta {
    let u = rng.f64();
    if u < 0.5 {
        // ASR: 1-30 s, transcript ~3 tokens/s plus a prompt.
        let tenths = rng.range(10, 300);
        let text = rng.range(10, 30) + tenths * 3 / 10;
        with_clips(rng, text, &[tenths])
    } else if u < 0.75 {
        // Audio QA: 5-30 s, a question and an answer.
        let tenths = rng.range(50, 300);
        let text = rng.range(30, 300);
        with_clips(rng, text, &[tenths])
    } else if u < 0.9 {
        // Text-only turns mixed into the audio set.
        SampleMeta::text(rng.log_range(20, 2000))
    } else {
        // Multi-clip conversation: 2-4 clips of 2-10 s.
        let k = rng.range(2, 4) as usize;
        let tenths: Vec<u32> = (0..k).map(|_| rng.range(20, 100)).collect();
        let text = rng.range(100, 800);
        with_clips(rng, text, &tenths)
    }
}
