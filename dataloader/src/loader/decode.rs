//! Turning stored packs into batch rows: token layout (positions, sample offsets, placeholder
//! positions) and media (normalized pixels, log-mel features), one worker per item.

use std::sync::Arc;

use rayon::prelude::*;

use crate::config::DataConfig;
use crate::cost::SampleCost;
use crate::media::audio::AudioDecoder;
use crate::media::image::{decode_image, normalize_rgb8};
use crate::media::mel::MelExtractor;
use crate::prepare::{MediaEncoding, StoredMedia, from_pcm_s16};
use crate::shard::{Dataset, StoredSample};

/// One image of a row.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageItem {
    /// (3, H, W) normalized pixels.
    pub pixels: Vec<f32>,
    pub height: usize,
    pub width: usize,
    /// Vision-encoder sequence length.
    pub patches: usize,
    /// Its placeholder positions in the row: `start .. start + len`.
    pub start: usize,
    pub len: usize,
}

/// One audio clip of a row.
#[derive(Clone, Debug, PartialEq)]
pub struct AudioItem {
    /// (n_mels, frames) log-mel features.
    pub mel: Vec<f32>,
    pub n_mels: usize,
    pub frames: usize,
    /// Its placeholder positions in the row: `start .. start + len`.
    pub start: usize,
    pub len: usize,
}

/// One packed row: several samples back to back (unpadded; `len() <= max_seq_len`).
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub pack: usize,
    /// (T) token ids.
    pub ids: Vec<u32>,
    /// (T) position of each token inside its own sample (restarts at 0).
    pub positions: Vec<u32>,
    /// (T) 1 where the token is a training target.
    pub loss_mask: Vec<u8>,
    /// (S + 1) cumulative sample lengths: sample s is `ids[offsets[s]..offsets[s + 1]]`.
    pub sample_offsets: Vec<u32>,
    /// (S) the samples' ids.
    pub sample_ids: Vec<String>,
    /// (S) per-sample cost.
    pub costs: Vec<SampleCost>,
    /// In position order.
    pub images: Vec<ImageItem>,
    pub audio: Vec<AudioItem>,
}

impl Row {
    /// T
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn loss_tokens(&self) -> usize {
        self.loss_mask.iter().map(|&m| usize::from(m)).sum()
    }
}

/// Which media of a batch's rows this rank decodes: `(row, index)` of each image and
/// each clip, indices into `rows[row].images` / `rows[row].audio`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WantedMedia {
    pub images: std::collections::HashSet<(usize, usize)>,
    pub clips: std::collections::HashSet<(usize, usize)>,
}

/// Decides, from a batch's rows before any media is decoded (token layout and every
/// item's shape filled in, `pixels` and `mel` empty), which media this rank decodes: a
/// rank of a multi-rank run decodes only the images and clips its encoder stage takes.
pub type MediaFilter = Arc<dyn Fn(&[Row]) -> Result<WantedMedia, String> + Send + Sync>;

/// A media item to decode, with where its output goes: (row, index, stored bytes).
enum Job<'a> {
    Image(usize, usize, &'a StoredMedia),
    Audio(usize, usize, &'a StoredMedia),
}

enum Decoded {
    Image(Vec<f32>),
    Audio(Vec<f32>, usize),
}

/// Reads the packs `packs` (in order) and decodes their media with the current rayon
/// pool: every item, or those `filter` wants (the others keep their shape, with empty
/// `pixels` / `mel`).
pub(crate) fn decode_rows(
    ds: &Dataset,
    cfg: &DataConfig,
    packs: &[usize],
    filter: Option<&MediaFilter>,
) -> Result<Vec<Row>, String> {
    let stored: Vec<Vec<StoredSample>> = packs
        .par_iter()
        .map(|&p| ds.read_pack(p).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let image_cfg = cfg.image.image_config();
    let n_mels = cfg.audio.decode.n_mels;
    let size = image_cfg.size;
    // The token layout and every item's shape first: what the filter decides from.
    let mut rows = Vec::with_capacity(packs.len());
    for (&pack, samples) in packs.iter().zip(&stored) {
        let mut row = Row {
            pack,
            ids: Vec::new(),
            positions: Vec::new(),
            loss_mask: Vec::new(),
            sample_offsets: vec![0],
            sample_ids: Vec::with_capacity(samples.len()),
            costs: Vec::with_capacity(samples.len()),
            images: Vec::new(),
            audio: Vec::new(),
        };
        for s in samples {
            let base = row.ids.len();
            if s.meta.images.len() != s.images.len() || s.meta.audio.len() != s.audio.len() {
                return Err(format!(
                    "sample {:?}: {} images and {} clips stored for {} and {} described",
                    s.id,
                    s.images.len(),
                    s.audio.len(),
                    s.meta.images.len(),
                    s.meta.audio.len()
                ));
            }
            for m in &s.meta.images {
                row.images.push(ImageItem {
                    pixels: Vec::new(),
                    height: size,
                    width: size,
                    patches: m.patches as usize,
                    start: base + m.llm_offset as usize,
                    len: m.llm_tokens as usize,
                });
            }
            for m in &s.meta.audio {
                row.audio.push(AudioItem {
                    mel: Vec::new(),
                    n_mels,
                    frames: m.mel_frames as usize,
                    start: base + m.llm_offset as usize,
                    len: m.llm_tokens as usize,
                });
            }
            row.positions.extend(0..s.ids.len() as u32);
            row.ids.extend_from_slice(&s.ids);
            row.loss_mask.extend_from_slice(&s.loss_mask);
            row.sample_offsets.push(row.ids.len() as u32);
            row.sample_ids.push(s.id.clone());
            row.costs.push(s.cost);
        }
        rows.push(row);
    }
    let wanted = filter.map(|f| f(&rows)).transpose()?;
    let mut jobs: Vec<Job> = Vec::new();
    for (r, samples) in stored.iter().enumerate() {
        let (mut image, mut clip) = (0, 0);
        for s in samples {
            for m in &s.images {
                if wanted
                    .as_ref()
                    .is_none_or(|w| w.images.contains(&(r, image)))
                {
                    jobs.push(Job::Image(r, image, m));
                }
                image += 1;
            }
            for m in &s.audio {
                if wanted.as_ref().is_none_or(|w| w.clips.contains(&(r, clip))) {
                    jobs.push(Job::Audio(r, clip, m));
                }
                clip += 1;
            }
        }
    }
    let decoded: Vec<Decoded> = jobs
        .par_iter()
        .map_init(
            || {
                (
                    MelExtractor::new(n_mels),
                    AudioDecoder::new(cfg.audio.decode.clone()),
                )
            },
            |(mel, dec), job| -> Result<Decoded, String> {
                match job {
                    Job::Image(_, _, m) => {
                        let px = match m.encoding {
                            MediaEncoding::Rgb8 => normalize_rgb8(&m.data, &m.name, &image_cfg),
                            _ => decode_image(&m.data, &m.name, &image_cfg),
                        }
                        .map_err(|e| e.to_string())?;
                        Ok(Decoded::Image(px.data))
                    }
                    Job::Audio(_, _, m) => {
                        let pcm = match m.encoding {
                            MediaEncoding::PcmS16le => from_pcm_s16(&m.data),
                            _ => dec
                                .as_mut()
                                .map_err(|e| e.to_string())?
                                .decode(&m.data, &m.name)
                                .map_err(|e| e.to_string())?,
                        };
                        let mel = mel.as_mut().map_err(|e| e.to_string())?;
                        let (x, frames) =
                            mel.compute(&pcm).map_err(|e| format!("{}: {e}", m.name))?;
                        Ok(Decoded::Audio(x, frames))
                    }
                }
            },
        )
        .collect::<Result<_, _>>()?;
    for (job, out) in jobs.iter().zip(decoded) {
        match (job, out) {
            (Job::Image(r, i, _), Decoded::Image(pixels)) => rows[*r].images[*i].pixels = pixels,
            (Job::Audio(r, i, m), Decoded::Audio(mel, frames)) => {
                let item = &mut rows[*r].audio[*i];
                if frames != item.frames {
                    return Err(format!(
                        "{}: clip has {frames} mel frames, the shard says {}",
                        m.name, item.frames
                    ));
                }
                item.mel = mel;
            }
            _ => return Err("media decode order mismatch".into()),
        }
    }
    Ok(rows)
}
