//! Turning stored packs into batch rows: token layout (positions, sample offsets, placeholder
//! positions) and media (normalized pixels, log-mel features), one worker per item.

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

/// A media item to decode, with where its output goes.
enum Job<'a> {
    Image(&'a StoredMedia),
    Audio(&'a StoredMedia),
}

enum Decoded {
    Image(Vec<f32>),
    Audio(Vec<f32>, usize),
}

/// Reads and decodes the packs `packs` (in order) with the current rayon pool.
pub(crate) fn decode_rows(
    ds: &Dataset,
    cfg: &DataConfig,
    packs: &[usize],
) -> Result<Vec<Row>, String> {
    let stored: Vec<Vec<StoredSample>> = packs
        .par_iter()
        .map(|&p| ds.read_pack(p).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let jobs: Vec<Job> = stored
        .iter()
        .flatten()
        .flat_map(|s| {
            s.images
                .iter()
                .map(Job::Image)
                .chain(s.audio.iter().map(Job::Audio))
        })
        .collect();
    let image_cfg = cfg.image.image_config();
    let n_mels = cfg.audio.decode.n_mels;
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
                    Job::Image(m) => {
                        let px = match m.encoding {
                            MediaEncoding::Rgb8 => normalize_rgb8(&m.data, &m.name, &image_cfg),
                            _ => decode_image(&m.data, &m.name, &image_cfg),
                        }
                        .map_err(|e| e.to_string())?;
                        Ok(Decoded::Image(px.data))
                    }
                    Job::Audio(m) => {
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
    let mut decoded = decoded.into_iter();
    let size = image_cfg.size;
    let mut rows = Vec::with_capacity(packs.len());
    for (&pack, samples) in packs.iter().zip(stored) {
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
            for m in &s.meta.images {
                let Some(Decoded::Image(pixels)) = decoded.next() else {
                    return Err(format!("sample {:?}: image/decode order mismatch", s.id));
                };
                row.images.push(ImageItem {
                    pixels,
                    height: size,
                    width: size,
                    patches: m.patches as usize,
                    start: base + m.llm_offset as usize,
                    len: m.llm_tokens as usize,
                });
            }
            for m in &s.meta.audio {
                let Some(Decoded::Audio(mel, frames)) = decoded.next() else {
                    return Err(format!("sample {:?}: audio/decode order mismatch", s.id));
                };
                if frames != m.mel_frames as usize {
                    return Err(format!(
                        "sample {:?}: clip has {frames} mel frames, the shard says {}",
                        s.id, m.mel_frames
                    ));
                }
                row.audio.push(AudioItem {
                    mel,
                    n_mels,
                    frames,
                    start: base + m.llm_offset as usize,
                    len: m.llm_tokens as usize,
                });
            }
            row.positions.extend(0..s.ids.len() as u32);
            row.ids.extend_from_slice(&s.ids);
            row.loss_mask.extend_from_slice(&s.loss_mask);
            row.sample_offsets.push(row.ids.len() as u32);
            row.sample_ids.push(s.id);
            row.costs.push(s.cost);
        }
        rows.push(row);
    }
    Ok(rows)
}
