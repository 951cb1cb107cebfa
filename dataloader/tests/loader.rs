//! The loader: exact resume from any position, data-parallel split, epoch order, and
//! batch contents against the stored samples.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use braid_dataloader::dataset::DatasetInfo;
use braid_dataloader::loader::{Batch, Loader, LoaderConfig, dp_rows, epoch_order};
use braid_dataloader::media::image::decode_image;
use braid_dataloader::media::mel::log_mel;
use braid_dataloader::read::Format;
use common::*;

fn packed(n: usize) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = jsonl_good(&tmp.path().join("data"), n);
    let out = tmp.path().join("out");
    let mut cfg = test_config();
    cfg.pack.max_seq_len = 256;
    pack(&manifest, Format::Jsonl, &out, &cfg);
    (tmp, out)
}

fn cfg(batch_rows: usize) -> LoaderConfig {
    LoaderConfig {
        seed: 7,
        batch_rows,
        workers: 2,
        prefetch: 2,
        shuffle: true,
    }
}

/// Everything a training step consumes, flattened for comparison.
fn key(b: &Batch) -> (u64, u64, Vec<usize>, Vec<Vec<u32>>, Vec<u32>) {
    let ids = b.rows.iter().map(|r| r.ids.clone()).collect();
    let px: Vec<u32> = b
        .rows
        .iter()
        .flat_map(|r| {
            r.images
                .iter()
                .flat_map(|i| i.pixels.iter().map(|x| x.to_bits()))
        })
        .chain(b.rows.iter().flat_map(|r| {
            r.audio
                .iter()
                .flat_map(|a| a.mel.iter().map(|x| x.to_bits()))
        }))
        .collect();
    (
        b.epoch,
        b.batch,
        b.global.iter().map(|g| g.pack).collect(),
        ids,
        px,
    )
}

#[test]
fn resume_anywhere_gives_the_same_batches() {
    let (_tmp, out) = packed(40);
    let c = cfg(3);
    let mut full = Loader::open(&out, &c, 0, 1, None).unwrap();
    let per_epoch = full.batches_per_epoch() as usize;
    assert!(per_epoch >= 3, "{per_epoch} batches per epoch");
    let total = 2 * per_epoch + 2; // crosses two epoch boundaries
    let mut states = vec![full.state()];
    let mut reference = Vec::new();
    for _ in 0..total {
        reference.push(key(&full.next_batch().unwrap()));
        states.push(full.state());
    }
    drop(full);
    for stop in [0, 1, per_epoch - 1, per_epoch, per_epoch + 1, total - 1] {
        let mut l = Loader::open(&out, &c, 0, 1, Some(states[stop])).unwrap();
        // The saved state survives a JSON round trip (it goes into checkpoints).
        let json = serde_json::to_string(&states[stop]).unwrap();
        assert_eq!(
            serde_json::from_str::<braid_dataloader::loader::LoaderState>(&json).unwrap(),
            states[stop]
        );
        for (i, want) in reference.iter().enumerate().skip(stop) {
            assert_eq!(
                &key(&l.next_batch().unwrap()),
                want,
                "resumed at {stop}, batch {i}"
            );
        }
    }
    // A state for another order is refused with a reason.
    let mut other = c.clone();
    other.seed = 8;
    let err = Loader::open(&out, &other, 0, 1, Some(states[1]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("seed"), "{err}");
}

#[test]
fn data_parallel_ranks_split_each_global_batch() {
    let (_tmp, out) = packed(40);
    let (info, ds) = DatasetInfo::open(&out).unwrap();
    let (info, ds) = (Arc::new(info), Arc::new(ds));
    let c = cfg(5);
    let single: Vec<_> = {
        let mut l = Loader::new(info.clone(), ds.clone(), &c, 0, 1, None).unwrap();
        (0..4).map(|_| l.next_batch().unwrap()).collect()
    };
    for dp in [2, 3] {
        let mut ranks: Vec<_> = (0..dp)
            .map(|r| Loader::new(info.clone(), ds.clone(), &c, r, dp, None).unwrap())
            .collect();
        for want in &single {
            let parts: Vec<Batch> = ranks.iter_mut().map(|l| l.next_batch().unwrap()).collect();
            let mut rows = Vec::new();
            for (r, p) in parts.iter().enumerate() {
                assert_eq!(p.global, want.global);
                assert_eq!(p.rows_range, dp_rows(5, dp, r));
                rows.extend(p.rows.iter().cloned());
            }
            assert_eq!(rows, want.rows, "dp {dp}");
        }
    }
    // Uneven split: sizes differ by at most one and cover every row once.
    for (rows, dp) in [(5, 2), (7, 3), (8, 8), (9, 4)] {
        let sizes: Vec<_> = (0..dp).map(|r| dp_rows(rows, dp, r).len()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), rows);
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
    }
    assert!(Loader::new(info, ds, &cfg(2), 0, 3, None).is_err());
}

#[test]
fn epochs_visit_every_pack_once_in_a_new_order() {
    let a = epoch_order(100, 1, 0, true);
    let b = epoch_order(100, 1, 1, true);
    assert_eq!(a.iter().copied().collect::<BTreeSet<_>>().len(), 100);
    assert_eq!(b.iter().copied().collect::<BTreeSet<_>>().len(), 100);
    assert_ne!(a, b);
    assert_eq!(a, epoch_order(100, 1, 0, true));
    assert_ne!(a, epoch_order(100, 2, 0, true));
    assert_eq!(epoch_order(5, 1, 3, false), [0, 1, 2, 3, 4]);
}

#[test]
fn rows_match_the_stored_samples_and_the_media_decoders() {
    let (tmp, out) = packed(24);
    let (info, ds) = DatasetInfo::open(&out).unwrap();
    let mut l = Loader::open(&out, &cfg(2), 0, 1, None).unwrap();
    let image_cfg = info.settings.image.image_config();
    let mut seen_image = false;
    let mut seen_audio = false;
    for _ in 0..l.batches_per_epoch() {
        let b = l.next_batch().unwrap();
        for row in &b.rows {
            let stored = ds.read_pack(row.pack).unwrap();
            assert_eq!(
                row.sample_ids,
                stored.iter().map(|s| s.id.clone()).collect::<Vec<_>>()
            );
            assert_eq!(*row.sample_offsets.last().unwrap() as usize, row.len());
            for (s, w) in stored.iter().zip(row.sample_offsets.windows(2)) {
                let (a, z) = (w[0] as usize, w[1] as usize);
                assert_eq!(&row.ids[a..z], &s.ids[..]);
                assert_eq!(row.positions[a], 0);
                assert_eq!(row.positions[z - 1] as usize, z - a - 1);
            }
            for im in &row.images {
                assert_eq!(im.pixels.len(), 3 * 32 * 32);
                // every placeholder position holds the image token, and nothing else does
                assert!(
                    row.ids[im.start..im.start + im.len]
                        .iter()
                        .all(|&t| t == row.ids[im.start])
                );
            }
            for a in &row.audio {
                assert_eq!(a.mel.len(), a.n_mels * a.frames);
            }
            seen_image |= !row.images.is_empty();
            seen_audio |= !row.audio.is_empty();
        }
    }
    assert!(seen_image && seen_audio);

    // Pixels equal a direct decode of the source file (pack stores the resized RGB8).
    let src = std::fs::read(tmp.path().join("data/media/0.png")).unwrap();
    let direct = decode_image(&src, "0.png", &image_cfg).unwrap();
    let mut l = Loader::open(
        &out,
        &LoaderConfig {
            shuffle: false,
            batch_rows: 1,
            ..cfg(1)
        },
        0,
        1,
        None,
    )
    .unwrap();
    let mut found = false;
    for _ in 0..l.batches_per_epoch() {
        let b = l.next_batch().unwrap();
        let r = &b.rows[0];
        if let Some(k) = r.sample_ids.iter().position(|id| id == "good0000") {
            let start = r.sample_offsets[k] as usize;
            let im = r.images.iter().find(|i| i.start >= start).unwrap();
            assert_eq!(im.pixels, direct.data);
            found = true;
        }
    }
    assert!(found);
    // The log-mel from stored 16-bit PCM is within quantization noise of the f32 path.
    let clip = std::fs::read(tmp.path().join("data/media/1.wav")).unwrap();
    let pcm =
        braid_dataloader::media::audio::decode_audio(&clip, "1.wav", &info.settings.audio.decode)
            .unwrap();
    let (m32, _) = log_mel(&pcm, 80).unwrap();
    let q = braid_dataloader::prepare::from_pcm_s16(&braid_dataloader::prepare::to_pcm_s16(&pcm));
    let (m16, _) = log_mel(&q, 80).unwrap();
    // Differences sit in the bins near Whisper's floor (80 dB under the peak), where 16-bit
    // quantization noise lives: max 0.011 in the scaled log-mel units (~0.4 dB), mean far less.
    let diff: Vec<f32> = m32.iter().zip(&m16).map(|(a, b)| (a - b).abs()).collect();
    let worst = diff.iter().copied().fold(0f32, f32::max);
    let mean = diff.iter().sum::<f32>() / diff.len() as f32;
    eprintln!("mel(f32) vs mel(s16): max {worst:.2e}, mean {mean:.2e}");
    assert!(worst < 2e-2 && mean < 1e-3, "max {worst}, mean {mean}");
}

#[test]
fn original_media_mode_gives_the_same_pixels_and_near_mels() {
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = jsonl_good(&tmp.path().join("data"), 12);
    let mut data = test_config();
    data.pack.max_seq_len = 256;
    let pre = tmp.path().join("pre");
    pack(&manifest, Format::Jsonl, &pre, &data);
    data.shards.media = braid_dataloader::config::MediaStorage::Original;
    let orig = tmp.path().join("orig");
    pack(&manifest, Format::Jsonl, &orig, &data);
    let c = LoaderConfig {
        shuffle: false,
        batch_rows: 1,
        ..cfg(1)
    };
    let mut a = Loader::open(&pre, &c, 0, 1, None).unwrap();
    let mut b = Loader::open(&orig, &c, 0, 1, None).unwrap();
    assert_eq!(a.batches_per_epoch(), b.batches_per_epoch());
    for _ in 0..a.batches_per_epoch() {
        let (x, y) = (a.next_batch().unwrap(), b.next_batch().unwrap());
        for (r, s) in x.rows.iter().zip(&y.rows) {
            assert_eq!(r.ids, s.ids);
            for (i, j) in r.images.iter().zip(&s.images) {
                assert_eq!(i.pixels, j.pixels);
            }
            for (i, j) in r.audio.iter().zip(&s.audio) {
                assert_eq!(i.frames, j.frames);
                let worst = i
                    .mel
                    .iter()
                    .zip(&j.mel)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 2e-2, "{worst}");
            }
        }
    }
}

/// A media filter decodes exactly the items it wants; every other item keeps its shape
/// (patches, frames, placeholder span) with empty pixels / mel, and the token layout is
/// the unfiltered loader's. The filter sees the shapes, not the media.
#[test]
fn a_media_filter_decodes_only_the_items_it_wants() {
    use braid_dataloader::loader::{MediaFilter, Row, WantedMedia};
    let (_tmp, out) = packed(24);
    // Every other image and every third clip, by their place in the batch.
    let filter: MediaFilter = Arc::new(|rows: &[Row]| {
        let mut w = WantedMedia::default();
        let (mut image, mut clip) = (0, 0);
        for (r, row) in rows.iter().enumerate() {
            for (i, im) in row.images.iter().enumerate() {
                assert!(
                    im.pixels.is_empty() && im.patches > 0,
                    "the filter sees shapes"
                );
                if image % 2 == 0 {
                    w.images.insert((r, i));
                }
                image += 1;
            }
            for (i, a) in row.audio.iter().enumerate() {
                assert!(a.mel.is_empty() && a.frames > 0, "the filter sees shapes");
                if clip % 3 == 0 {
                    w.clips.insert((r, i));
                }
                clip += 1;
            }
        }
        Ok(w)
    });
    let mut all = Loader::open(&out, &cfg(4), 0, 1, None).unwrap();
    let mut some = Loader::open_filtered(&out, &cfg(4), 0, 1, None, Some(filter)).unwrap();
    let (mut decoded, mut skipped) = (0, 0);
    for _ in 0..all.batches_per_epoch() {
        let (a, s) = (all.next_batch().unwrap(), some.next_batch().unwrap());
        let (mut image, mut clip) = (0, 0);
        for (ra, rs) in a.rows.iter().zip(&s.rows) {
            assert_eq!(
                (&ra.ids, &ra.positions, &ra.loss_mask, &ra.sample_offsets),
                (&rs.ids, &rs.positions, &rs.loss_mask, &rs.sample_offsets)
            );
            assert_eq!(ra.images.len(), rs.images.len());
            for (ia, is) in ra.images.iter().zip(&rs.images) {
                assert_eq!(
                    (ia.patches, ia.start, ia.len, ia.height),
                    (is.patches, is.start, is.len, is.height)
                );
                if image % 2 == 0 {
                    assert_eq!(ia.pixels, is.pixels);
                    decoded += 1;
                } else {
                    assert!(is.pixels.is_empty());
                    skipped += 1;
                }
                image += 1;
            }
            for (ca, cs) in ra.audio.iter().zip(&rs.audio) {
                assert_eq!((ca.frames, ca.start, ca.len), (cs.frames, cs.start, cs.len));
                if clip % 3 == 0 {
                    assert_eq!(ca.mel, cs.mel);
                    decoded += 1;
                } else {
                    assert!(cs.mel.is_empty());
                    skipped += 1;
                }
                clip += 1;
            }
        }
    }
    assert!(
        decoded > 0 && skipped > 0,
        "{decoded} decoded, {skipped} skipped"
    );
    // A filter's error fails the batch, naming it.
    let failing: MediaFilter = Arc::new(|_: &[Row]| Err("no assignment".to_string()));
    let mut l = Loader::open_filtered(&out, &cfg(4), 0, 1, None, Some(failing)).unwrap();
    let e = l.next_batch().unwrap_err().to_string();
    assert!(e.contains("no assignment"), "{e}");
}
