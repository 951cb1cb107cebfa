//! Shard reading: the pack index of a dataset folder (from the small columns of every shard)
//! and random access to one pack's rows (row-group and page pruning by row selection).

use std::path::{Path, PathBuf};

use arrow_array::{
    Array, BinaryArray, Float64Array, ListArray, RecordBatch, StringArray, StructArray, UInt8Array,
    UInt32Array, UInt64Array,
};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelector,
};
use parquet::file::metadata::PageIndexPolicy;

use super::{COST_COLUMNS, ShardError, ShardInfo};
use crate::cost::{AudioMeta, ImageMeta, ModuleCost, SampleCost, SampleMeta};
use crate::prepare::{MediaEncoding, StoredMedia};

/// Where one pack lives, and what it costs (every rank knows this for every pack).
#[derive(Clone, Debug, PartialEq)]
pub struct PackEntry {
    pub shard: usize,
    /// Row group inside the shard, and the first row inside that row group.
    pub row_group: usize,
    pub row: usize,
    /// Samples (rows).
    pub samples: usize,
    /// LLM tokens (sum of the samples' `llm_len`).
    pub tokens: u64,
    /// Summed per-module cost of its samples.
    pub cost: SampleCost,
}

/// One sample as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredSample {
    pub pack: u64,
    pub id: String,
    pub source: String,
    /// (L)
    pub ids: Vec<u32>,
    /// (L)
    pub loss_mask: Vec<u8>,
    pub meta: SampleMeta,
    pub images: Vec<StoredMedia>,
    pub audio: Vec<StoredMedia>,
    pub cost: SampleCost,
}

struct Shard {
    path: PathBuf,
    meta: ArrowReaderMetadata,
}

/// An opened dataset folder: shard metadata and the pack index, no sample data.
pub struct Dataset {
    dir: PathBuf,
    shards: Vec<Shard>,
    packs: Vec<PackEntry>,
    /// The tokenizer's vocabulary (`dataset.json`'s): every stored id is below it.
    vocab: Option<usize>,
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataset")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("packs", &self.packs.len())
            .finish()
    }
}

impl Dataset {
    /// Opens the shards `infos` lists in `dir` and builds the pack index. Checks that pack
    /// numbers run 0, 1, 2, ... across the shards and that row counts match `infos`.
    pub fn open(dir: &Path, infos: &[ShardInfo]) -> Result<Dataset, ShardError> {
        let mut shards = Vec::with_capacity(infos.len());
        let mut packs: Vec<PackEntry> = Vec::new();
        for (si, info) in infos.iter().enumerate() {
            let path = dir.join(&info.file);
            let file = super::open_shard(&path).map_err(|e| ShardError::io(&path, e))?;
            let opts = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
            let meta = ArrowReaderMetadata::load(&file, opts)
                .map_err(|e| ShardError::parquet(&path, e))?;
            let schema = meta.parquet_schema();
            let mut cols = vec!["pack", "llm_len"];
            cols.extend(COST_COLUMNS);
            let indices = cols
                .iter()
                .map(|c| root_index(&meta, c).ok_or_else(|| missing(&path, c)))
                .collect::<Result<Vec<_>, _>>()?;
            let mask = ProjectionMask::roots(schema, indices);
            let mut rows = 0u64;
            for rg in 0..meta.metadata().num_row_groups() {
                let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(
                    file.try_clone().map_err(|e| ShardError::io(&path, e))?,
                    meta.clone(),
                )
                .with_projection(mask.clone())
                .with_row_groups(vec![rg])
                .with_batch_size(8192)
                .build()
                .map_err(|e| ShardError::parquet(&path, e))?;
                let mut row_in_group = 0usize;
                for batch in reader {
                    let batch = batch.map_err(|e| ShardError::parquet(&path, e))?;
                    index_batch(&path, &batch, si, rg, &mut row_in_group, &mut packs)?;
                }
                rows += row_in_group as u64;
            }
            if rows != info.rows {
                return Err(ShardError::invalid(
                    &path,
                    format!("{rows} rows, dataset.json says {}", info.rows),
                ));
            }
            shards.push(Shard { path, meta });
        }
        Ok(Dataset {
            dir: dir.to_path_buf(),
            shards,
            packs,
            vocab: None,
        })
    }

    /// Checks every pack read against the tokenizer's vocabulary of `vocab` ids: an id past
    /// it (a damaged shard read with `data.verify` off, or an edited `dataset.json`) is
    /// an error naming the shard and the sample, not an out-of-range id deep in a step.
    pub fn check_ids_below(&mut self, vocab: usize) {
        self.vocab = Some(vocab);
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The pack index, by pack number.
    pub fn packs(&self) -> &[PackEntry] {
        &self.packs
    }

    /// Reads the samples of pack `index`.
    pub fn read_pack(&self, index: usize) -> Result<Vec<StoredSample>, ShardError> {
        let entry = self
            .packs
            .get(index)
            .ok_or_else(|| ShardError::invalid(&self.dir, format!("no pack {index}")))?;
        let shard = &self.shards[entry.shard];
        let path = &shard.path;
        let file = super::open_shard(path).map_err(|e| ShardError::io(path, e))?;
        let selection = RowSelection::from(vec![
            RowSelector::skip(entry.row),
            RowSelector::select(entry.samples),
        ]);
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, shard.meta.clone())
            .with_row_groups(vec![entry.row_group])
            .with_row_selection(selection)
            .with_batch_size(entry.samples.max(1))
            .build()
            .map_err(|e| ShardError::parquet(path, e))?;
        let mut out = Vec::with_capacity(entry.samples);
        for batch in reader {
            let batch = batch.map_err(|e| ShardError::parquet(path, e))?;
            decode_rows(path, &batch, &mut out)?;
        }
        if let Some(v) = self.vocab {
            for s in &out {
                if let Some(&id) = s.ids.iter().find(|&&id| id as usize >= v) {
                    return Err(ShardError::invalid(
                        path,
                        format!(
                            "pack {index}, sample {:?}: token id {id} is past the tokenizer's vocabulary of {v} (dataset.json's tokenizer.vocab_size): the shard is damaged or dataset.json was edited",
                            s.id
                        ),
                    ));
                }
            }
        }
        if out.len() != entry.samples || out.iter().any(|s| s.pack != index as u64) {
            return Err(ShardError::invalid(
                path,
                format!(
                    "pack {index}: expected {} rows at row group {} row {}",
                    entry.samples, entry.row_group, entry.row
                ),
            ));
        }
        Ok(out)
    }
}

fn root_index(meta: &ArrowReaderMetadata, name: &str) -> Option<usize> {
    meta.schema().fields().iter().position(|f| f.name() == name)
}

fn missing(path: &Path, col: &str) -> ShardError {
    ShardError::invalid(path, format!("not a braid shard: no column `{col}`"))
}

fn column<'a, T: 'static>(
    path: &Path,
    b: &'a RecordBatch,
    name: &str,
) -> Result<&'a T, ShardError> {
    b.column_by_name(name)
        .ok_or_else(|| missing(path, name))?
        .as_any()
        .downcast_ref::<T>()
        .ok_or_else(|| ShardError::invalid(path, format!("column `{name}` has the wrong type")))
}

fn costs<'a>(path: &Path, b: &'a RecordBatch) -> Result<Vec<&'a Float64Array>, ShardError> {
    COST_COLUMNS
        .iter()
        .map(|c| column::<Float64Array>(path, b, c))
        .collect()
}

fn cost_at(c: &[&Float64Array], i: usize) -> SampleCost {
    let m = |a: usize| ModuleCost {
        linear: c[a].value(i),
        attention: c[a + 1].value(i),
    };
    SampleCost {
        llm: m(0),
        vision: m(2),
        audio: m(4),
    }
}

/// Appends the packs of one batch of (pack, llm_len, costs) rows to the index.
fn index_batch(
    path: &Path,
    b: &RecordBatch,
    shard: usize,
    row_group: usize,
    row_in_group: &mut usize,
    packs: &mut Vec<PackEntry>,
) -> Result<(), ShardError> {
    let pack = column::<UInt64Array>(path, b, "pack")?;
    let len = column::<UInt32Array>(path, b, "llm_len")?;
    let c = costs(path, b)?;
    for i in 0..b.num_rows() {
        let p = pack.value(i);
        let cost = cost_at(&c, i);
        let n = packs.len();
        if n > 0 && p as usize == n - 1 {
            let last = &mut packs[n - 1];
            if last.shard != shard || last.row_group != row_group {
                return Err(ShardError::invalid(
                    path,
                    format!("pack {p} straddles row groups"),
                ));
            }
            last.samples += 1;
            last.tokens += u64::from(len.value(i));
            last.cost += cost;
        } else if p as usize == n {
            packs.push(PackEntry {
                shard,
                row_group,
                row: *row_in_group,
                samples: 1,
                tokens: u64::from(len.value(i)),
                cost,
            });
        } else {
            return Err(ShardError::invalid(
                path,
                format!("pack numbers out of order: {p} after {n}"),
            ));
        }
        *row_in_group += 1;
    }
    Ok(())
}

/// Decodes full rows.
fn decode_rows(
    path: &Path,
    b: &RecordBatch,
    out: &mut Vec<StoredSample>,
) -> Result<(), ShardError> {
    let pack = column::<UInt64Array>(path, b, "pack")?;
    let id = column::<StringArray>(path, b, "id")?;
    let source = column::<StringArray>(path, b, "source")?;
    let ids = column::<ListArray>(path, b, "ids")?;
    let mask = column::<ListArray>(path, b, "loss_mask")?;
    let text = column::<UInt32Array>(path, b, "text_tokens")?;
    let len = column::<UInt32Array>(path, b, "llm_len")?;
    let images = column::<ListArray>(path, b, "images")?;
    let audio = column::<ListArray>(path, b, "audio")?;
    let c = costs(path, b)?;
    for i in 0..b.num_rows() {
        let ids_i = ids.value(i);
        let ids_i = downcast::<UInt32Array>(path, &ids_i, "ids")?;
        let mask_i = mask.value(i);
        let mask_i = downcast::<UInt8Array>(path, &mask_i, "loss_mask")?;
        let (imgs, img_meta) = media(path, &images.value(i), |s, j| {
            Ok(ImageMeta {
                patches: u32_field(path, s, "patches")?.value(j),
                llm_tokens: u32_field(path, s, "llm_tokens")?.value(j),
                llm_offset: u32_field(path, s, "llm_offset")?.value(j),
            })
        })?;
        let (clips, clip_meta) = media(path, &audio.value(i), |s, j| {
            Ok(AudioMeta {
                mel_frames: u32_field(path, s, "mel_frames")?.value(j),
                encoder_frames: u32_field(path, s, "encoder_frames")?.value(j),
                llm_tokens: u32_field(path, s, "llm_tokens")?.value(j),
                llm_offset: u32_field(path, s, "llm_offset")?.value(j),
            })
        })?;
        let meta = SampleMeta::new(text.value(i), img_meta, clip_meta);
        let sample = StoredSample {
            pack: pack.value(i),
            id: id.value(i).to_string(),
            source: source.value(i).to_string(),
            ids: ids_i.values().to_vec(),
            loss_mask: mask_i.values().to_vec(),
            meta,
            images: imgs,
            audio: clips,
            cost: cost_at(&c, i),
        };
        let n = sample.ids.len();
        if sample.meta.llm_len != len.value(i)
            || n != len.value(i) as usize
            || sample.loss_mask.len() != n
        {
            return Err(ShardError::invalid(
                path,
                format!(
                    "sample {:?} (row {i}): lengths disagree: `ids` holds {n}, `loss_mask` {}, the `llm_len` column says {}, its text and media spans add up to {}",
                    sample.id,
                    sample.loss_mask.len(),
                    len.value(i),
                    sample.meta.llm_len
                ),
            ));
        }
        sample
            .meta
            .validate()
            .map_err(|e| ShardError::invalid(path, format!("sample {:?}: {e}", sample.id)))?;
        out.push(sample);
    }
    Ok(())
}

fn downcast<'a, T: 'static>(
    path: &Path,
    a: &'a dyn Array,
    what: &str,
) -> Result<&'a T, ShardError> {
    a.as_any()
        .downcast_ref::<T>()
        .ok_or_else(|| ShardError::invalid(path, format!("`{what}` has the wrong type")))
}

fn u32_field<'a>(
    path: &Path,
    s: &'a StructArray,
    name: &str,
) -> Result<&'a UInt32Array, ShardError> {
    let col = s.column_by_name(name).ok_or_else(|| missing(path, name))?;
    downcast::<UInt32Array>(path, col.as_ref(), name)
}

type MediaRows<M> = (Vec<StoredMedia>, Vec<M>);

/// The items of one row's `images` or `audio` list.
fn media<M>(
    path: &Path,
    list: &dyn Array,
    meta: impl Fn(&StructArray, usize) -> Result<M, ShardError>,
) -> Result<MediaRows<M>, ShardError> {
    let s = downcast::<StructArray>(path, list, "media")?;
    let name = s
        .column_by_name("name")
        .ok_or_else(|| missing(path, "name"))?;
    let name = downcast::<StringArray>(path, name.as_ref(), "name")?;
    let enc = s
        .column_by_name("encoding")
        .ok_or_else(|| missing(path, "encoding"))?;
    let enc = downcast::<StringArray>(path, enc.as_ref(), "encoding")?;
    let data = s
        .column_by_name("data")
        .ok_or_else(|| missing(path, "data"))?;
    let data = downcast::<BinaryArray>(path, data.as_ref(), "data")?;
    let mut items = Vec::with_capacity(s.len());
    let mut metas = Vec::with_capacity(s.len());
    for j in 0..s.len() {
        let encoding = MediaEncoding::parse(enc.value(j)).ok_or_else(|| {
            ShardError::invalid(path, format!("unknown media encoding {:?}", enc.value(j)))
        })?;
        items.push(StoredMedia {
            name: name.value(j).to_string(),
            encoding,
            data: data.value(j).to_vec(),
        });
        metas.push(meta(s, j)?);
    }
    Ok((items, metas))
}
