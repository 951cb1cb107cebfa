//! From the loader's packed rows to the model's batches, and the datasets a run needs:
//! made on first use (demo data generated, raw input packed) when the config says how.

use std::path::Path;

use braid_dataloader::config::DataConfig;
use braid_dataloader::dataset::DatasetInfo;
use braid_dataloader::demo::{DemoConfig, write_demo};
use braid_dataloader::job::{PackJob, run_pack};
use braid_dataloader::loader::Row;
use braid_kernels::{Device, Tensor};
use braid_llm::next_token_targets;
use braid_nn::SeqInfo;
use braid_nn::error::Context;

use crate::error::{Result, TrainError};
use crate::mllm::MllmBatch;

/// Concatenates packed rows into one model batch (the samples of every row back to back),
/// with next-token targets from the loss masks.
pub fn rows_to_batch(rows: &[&Row], device: Device) -> Result<MllmBatch> {
    let text = rows_to_text(rows)?;
    let mut pixels = Vec::new(); // (B_img, 3, H, W)
    let mut image_hw: Option<(usize, usize)> = None;
    let mut image_positions = Vec::new();
    let mut clips = Vec::new();
    let mut clip_positions = Vec::new();
    let mut off = 0;
    for r in rows {
        for im in &r.images {
            match image_hw {
                None => image_hw = Some((im.height, im.width)),
                Some(hw) if hw != (im.height, im.width) => {
                    return Err(TrainError::Data(format!(
                        "pack {}: image of {}x{} among images of {}x{} (the vision encoder takes one size)",
                        r.pack, im.height, im.width, hw.0, hw.1
                    )));
                }
                Some(_) => {}
            }
            pixels.extend_from_slice(&im.pixels);
            image_positions.push(
                (off + im.start..off + im.start + im.len)
                    .map(|p| p as u32)
                    .collect(),
            );
        }
        for a in &r.audio {
            let mel = Tensor::from_vec(a.mel.clone(), [a.n_mels, a.frames], device)
                .ctx("batch", "mel features")?; // (n_mels, F)
            clips.push(mel);
            clip_positions.push(
                (off + a.start..off + a.start + a.len)
                    .map(|p| p as u32)
                    .collect(),
            );
        }
        off += r.len();
    }
    let images = match image_hw {
        None => None,
        Some((h, w)) => {
            let b = image_positions.len();
            Some(Tensor::from_vec(pixels, [b, 3, h, w], device).ctx("batch", "pixel values")?)
        }
    };
    let t = text.ids.len();
    let ids = Tensor::from_vec_u32(text.ids, [t], device).ctx("batch", "token ids")?;
    Ok(MllmBatch {
        ids,
        seq: text.seq,
        targets: text.targets,
        images,
        image_positions,
        clips,
        clip_positions,
    })
}

/// The text of packed rows concatenated into one packed sequence (no media copied).
#[derive(Debug)]
pub struct PackedText {
    /// (T) token ids.
    pub ids: Vec<u32>,
    pub seq: SeqInfo,
    /// (T) next-token targets, [`braid_llm::IGNORE_INDEX`] where there is no loss.
    pub targets: Vec<u32>,
}

/// The token ids, sample layout and next-token targets (from the loss masks) of `rows`
/// back to back: the text half of [`rows_to_batch`].
pub fn rows_to_text(rows: &[&Row]) -> Result<PackedText> {
    let t: usize = rows.iter().map(|r| r.len()).sum();
    let mut ids = Vec::with_capacity(t); // (T)
    let mut positions = Vec::with_capacity(t); // (T)
    let mut mask = Vec::with_capacity(t); // (T)
    let mut cu_seqlens = vec![0usize];
    for r in rows {
        let off = ids.len();
        ids.extend_from_slice(&r.ids);
        positions.extend_from_slice(&r.positions);
        mask.extend(r.loss_mask.iter().map(|&m| m != 0));
        cu_seqlens.extend(r.sample_offsets.iter().skip(1).map(|&o| off + o as usize));
    }
    let seq = SeqInfo {
        cu_seqlens,
        positions,
        cp: None,
    };
    let targets = next_token_targets(&ids, &seq, Some(&mask))?;
    Ok(PackedText { ids, seq, targets })
}

/// Takes the exclusive lock of packing `path` (created if missing), waiting while another
/// process or thread holds it.
fn lock_dataset(path: &Path) -> Result<std::fs::File> {
    braid_dataloader::job_output::lock_output(path, true)
        .map_err(|e| TrainError::Data(e.to_string()))
}

/// Checks every shard of the dataset at `dir` against `info`'s SHA-256 (`data.verify`):
/// a damaged or swapped shard is an error naming it; `log` gets what was checked and how
/// long it took.
pub fn verify_shards(
    info: &braid_dataloader::dataset::DatasetInfo,
    dir: &Path,
    log: &mut dyn FnMut(&str),
) -> Result<()> {
    let t0 = std::time::Instant::now();
    let bytes = info.verify_checksums(dir).map_err(|e| {
        crate::config::invalid(
            "data.path",
            format!("{e} (set data.verify = false to train on it anyway)"),
        )
    })?;
    log(&format!(
        "data: {} shards ({:.1} MB) match dataset.json's SHA-256 ({:.1} s; data.verify = false skips this)",
        info.shards.len(),
        bytes as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Splits `n` rows into `parts` contiguous groups whose sizes differ by at most one.
pub fn split_even(n: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts)
        .map(|i| (i * n / parts)..((i + 1) * n / parts))
        .collect()
}

/// What happened while making sure a dataset exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prepared {
    Existing,
    Packed,
    GeneratedAndPacked,
}

/// Whether `path` holds anything named `dataset.json`: such a folder is read, never
/// packed over (a FIFO or device there is refused by name when read).
fn has_dataset_json(path: &Path) -> bool {
    std::fs::symlink_metadata(path.join("dataset.json")).is_ok()
}

/// Opens the dataset at `path`, or makes it: with `build` (a data config), packs `input`
/// (default: the config's `[input] path`); when that input does not exist and `demo` is
/// given, generates the demo data there first. `log` receives one line per action.
pub fn ensure_dataset(
    path: &Path,
    build: Option<&Path>,
    input: Option<&Path>,
    demo: Option<&Path>,
    log: &mut dyn FnMut(&str),
) -> Result<(DatasetInfo, Prepared)> {
    if has_dataset_json(path) {
        let info = DatasetInfo::read(path).map_err(|e| TrainError::Data(e.to_string()))?;
        if let Some(build) = build
            && let Ok(wanted) = DataConfig::from_file(build)
        {
            let (a, b) = (&info.settings, &wanted);
            let differs = [
                ("tokenizer", a.tokenizer != b.tokenizer),
                ("template", a.template != b.template),
                ("image", a.image != b.image),
                ("audio", a.audio != b.audio),
                ("pack", a.pack != b.pack),
            ]
            .into_iter()
            .filter_map(|(k, d)| d.then_some(k))
            .collect::<Vec<_>>();
            if !differs.is_empty() {
                log(&format!(
                    "warning: {} was packed with other [{}] settings than {} says; training on the existing dataset (delete it to repack)",
                    path.display(),
                    differs.join("], ["),
                    build.display()
                ));
            }
        }
        return Ok((info, Prepared::Existing));
    }
    let Some(build) = build else {
        return Err(TrainError::Data(format!(
            "{}: no packed dataset there (no dataset.json); run `braid pack` first or set data.build to a data config to pack it on first use",
            path.display()
        )));
    };
    let config = DataConfig::from_file(build).map_err(|e| TrainError::Data(e.to_string()))?;
    let input = input
        .map(Path::to_path_buf)
        .or_else(|| config.input.path.clone())
        .ok_or_else(|| TrainError::Data(format!("{}: [input] path is not set", build.display())))?;
    let mut prepared = Prepared::Packed;
    if !input.exists() {
        let Some(demo_dir) = demo else {
            return Err(TrainError::Data(format!(
                "{}: the input of {} does not exist",
                input.display(),
                build.display()
            )));
        };
        log(&format!(
            "generating the demo data into {}",
            demo_dir.display()
        ));
        let s = write_demo(demo_dir, &DemoConfig::default())
            .map_err(|e| TrainError::Data(e.to_string()))?;
        log(&format!(
            "  {} train + {} held-out samples ({} image-only, {} audio-only, {} both)",
            s.train, s.heldout, s.image_only, s.audio_only, s.both
        ));
        if !input.exists() {
            return Err(TrainError::Data(format!(
                "{}: still missing after generating the demo data in {}",
                input.display(),
                demo_dir.display()
            )));
        }
        prepared = Prepared::GeneratedAndPacked;
    }
    let format = config
        .input
        .format
        .unwrap_or(braid_dataloader::read::Format::Jsonl);
    // Packed in place under a lock held in the folder (released by the OS if this
    // process dies): runs, or every rank of a launched job, may start on the same
    // unpacked dataset at once; one packs, the others wait and read what it wrote (a
    // dataset is there once its `dataset.json` is, which the pack writes last).
    let _lock = lock_dataset(path)?;
    if has_dataset_json(path) {
        let info = DatasetInfo::read(path).map_err(|e| TrainError::Data(e.to_string()))?;
        return Ok((info, Prepared::Existing));
    }
    log(&format!(
        "packing {} into {}",
        input.display(),
        path.display()
    ));
    let job = PackJob {
        input,
        format,
        output: path.to_path_buf(),
        config,
        overwrite: false,
    };
    let info = run_pack(&job, &mut |_| {}).map_err(|e| TrainError::Data(e.to_string()))?;
    log(&format!(
        "  {} samples in {} packs (fill {:.1} %), {} rejected",
        info.packed_samples,
        info.packs,
        100.0 * info.fill,
        info.rejected
    ));
    Ok((info, prepared))
}
