//! Shard writing: a staging file that holds media bytes while their samples wait in the packer's
//! window, and the Parquet writer that appends whole packs, rotates shards and hashes them.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{
    ArrayRef, BinaryArray, Float64Array, ListArray, RecordBatch, StringArray, StructArray,
    UInt8Array, UInt32Array, UInt64Array,
};
use arrow_buffer::OffsetBuffer;
use arrow_schema::{DataType, Fields, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use sha2::{Digest, Sha256};

use super::{ShardError, ShardInfo, audio_fields, image_fields, list_item, schema};
use crate::config::ShardConfig;
use crate::cost::{AudioMeta, CostModelConfig, ImageMeta};
use crate::prepare::{Prepared, StoredMedia};

/// Media bytes of samples admitted to the packer but not yet in a pack, kept on disk so the
/// packer's window (10,000 samples by default) costs token ids in memory, not images.
#[derive(Debug)]
pub struct Staging {
    path: PathBuf,
    file: File,
    end: u64,
    /// Sample index -> the sample without media bytes, and (offset, len) of each item's bytes.
    waiting: HashMap<usize, (Prepared, Vec<(u64, usize)>)>,
}

impl Staging {
    /// Creates (truncating) the staging file at `path`.
    pub fn create(path: &Path) -> Result<Staging, ShardError> {
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| ShardError::io(path, e))?;
        Ok(Staging {
            path: path.to_path_buf(),
            file,
            end: 0,
            waiting: HashMap::new(),
        })
    }

    /// Samples waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Parks sample `index`; its media bytes go to the file.
    pub fn put(&mut self, index: usize, mut s: Prepared) -> Result<(), ShardError> {
        let mut spans = Vec::with_capacity(s.images.len() + s.audio.len());
        self.file
            .seek(SeekFrom::Start(self.end))
            .map_err(|e| ShardError::io(&self.path, e))?;
        let mut w = BufWriter::new(&self.file);
        for m in s.images.iter_mut().chain(s.audio.iter_mut()) {
            let data = std::mem::take(&mut m.data);
            w.write_all(&data)
                .map_err(|e| ShardError::io(&self.path, e))?;
            spans.push((self.end, data.len()));
            self.end += data.len() as u64;
        }
        w.flush().map_err(|e| ShardError::io(&self.path, e))?;
        self.waiting.insert(index, (s, spans));
        Ok(())
    }

    /// Takes sample `index` back with its media bytes.
    pub fn take(&mut self, index: usize) -> Result<Prepared, ShardError> {
        let (mut s, spans) = self.waiting.remove(&index).ok_or_else(|| {
            ShardError::invalid(&self.path, format!("sample {index} is not staged"))
        })?;
        let items = s.images.iter_mut().chain(s.audio.iter_mut());
        for (m, &(offset, len)) in items.zip(&spans) {
            let mut buf = vec![0u8; len];
            self.file
                .seek(SeekFrom::Start(offset))
                .and_then(|_| self.file.read_exact(&mut buf))
                .map_err(|e| ShardError::io(&self.path, e))?;
            m.data = buf;
        }
        Ok(s)
    }

    /// Deletes the file.
    pub fn remove(self) -> Result<(), ShardError> {
        drop(self.file);
        std::fs::remove_file(&self.path).map_err(|e| ShardError::io(&self.path, e))
    }
}

/// A `Write` that hashes and counts what passes through.
struct HashingFile {
    inner: BufWriter<File>,
    hasher: Sha256,
    bytes: u64,
}

impl Write for HashingFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

struct OpenShard {
    writer: ArrowWriter<HashingFile>,
    /// Written under `<file>.tmp`, renamed when closed.
    tmp: PathBuf,
    file: String,
    rows: u64,
    packs: u64,
    row_groups: u64,
}

/// Appends packs to `shard-NNNNN.parquet` files in a folder.
pub struct ShardWriter {
    dir: PathBuf,
    cfg: ShardConfig,
    cost: CostModelConfig,
    schema: SchemaRef,
    props: WriterProperties,
    current: Option<OpenShard>,
    /// Rows of the row group being assembled, and their pack indices.
    buffer: Vec<(u64, Prepared)>,
    buffered_bytes: usize,
    buffered_packs: u64,
    shards: Vec<ShardInfo>,
}

impl std::fmt::Debug for ShardWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardWriter")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("buffered_rows", &self.buffer.len())
            .finish()
    }
}

impl ShardWriter {
    pub fn new(dir: &Path, cfg: &ShardConfig, cost: &CostModelConfig) -> Result<Self, ShardError> {
        let level = ZstdLevel::try_new(cfg.zstd_level).map_err(|e| ShardError::parquet(dir, e))?;
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(level))
            // Row groups are cut by `flush` at pack boundaries, never by the writer.
            .set_max_row_group_row_count(None)
            .set_max_row_group_bytes(None)
            .set_created_by(format!("braid {}", env!("CARGO_PKG_VERSION")))
            .build();
        Ok(ShardWriter {
            dir: dir.to_path_buf(),
            cfg: cfg.clone(),
            cost: cost.clone(),
            schema: schema(),
            props,
            current: None,
            buffer: Vec::new(),
            buffered_bytes: 0,
            buffered_packs: 0,
            shards: Vec::new(),
        })
    }

    /// Shards closed so far.
    pub fn shards(&self) -> &[ShardInfo] {
        &self.shards
    }

    /// Appends one pack (its samples in row order).
    pub fn write_pack(&mut self, pack: u64, samples: Vec<Prepared>) -> Result<(), ShardError> {
        for s in samples {
            self.buffered_bytes += s.heap_bytes();
            self.buffer.push((pack, s));
        }
        self.buffered_packs += 1;
        if self.buffered_bytes as u64 >= self.cfg.row_group_mib << 20 {
            self.flush_row_group()?;
        }
        Ok(())
    }

    /// Writes what is buffered and closes the last shard; returns every shard.
    pub fn finish(mut self) -> Result<Vec<ShardInfo>, ShardError> {
        self.flush_row_group()?;
        self.close_shard()?;
        Ok(self.shards)
    }

    fn flush_row_group(&mut self) -> Result<(), ShardError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let rows = std::mem::take(&mut self.buffer);
        let packs = std::mem::take(&mut self.buffered_packs);
        self.buffered_bytes = 0;
        let batch = self.record_batch(&rows)?;
        if self.current.is_none() {
            self.open_shard()?;
        }
        let dir = self.dir.clone();
        let Some(shard) = self.current.as_mut() else {
            return Err(ShardError::invalid(&dir, "no open shard"));
        };
        let path = dir.join(&shard.file);
        shard
            .writer
            .write(&batch)
            .and_then(|_| shard.writer.flush())
            .map_err(|e| ShardError::parquet(&path, e))?;
        shard.rows += rows.len() as u64;
        shard.packs += packs;
        shard.row_groups += 1;
        if shard.writer.bytes_written() as u64 >= self.cfg.max_shard_mib << 20 {
            self.close_shard()?;
        }
        Ok(())
    }

    fn open_shard(&mut self) -> Result<(), ShardError> {
        let file = format!("shard-{:05}.parquet", self.shards.len());
        let tmp = self.dir.join(format!("{file}.tmp"));
        let f = File::create(&tmp).map_err(|e| ShardError::io(&tmp, e))?;
        let sink = HashingFile {
            inner: BufWriter::with_capacity(1 << 20, f),
            hasher: Sha256::new(),
            bytes: 0,
        };
        let writer = ArrowWriter::try_new(sink, self.schema.clone(), Some(self.props.clone()))
            .map_err(|e| ShardError::parquet(&tmp, e))?;
        self.current = Some(OpenShard {
            writer,
            tmp,
            file,
            rows: 0,
            packs: 0,
            row_groups: 0,
        });
        Ok(())
    }

    fn close_shard(&mut self) -> Result<(), ShardError> {
        let Some(shard) = self.current.take() else {
            return Ok(());
        };
        let tmp = shard.tmp.clone();
        let mut sink = shard
            .writer
            .into_inner()
            .map_err(|e| ShardError::parquet(&tmp, e))?;
        sink.flush().map_err(|e| ShardError::io(&tmp, e))?;
        let file = sink
            .inner
            .into_inner()
            .map_err(|e| ShardError::io(&tmp, e.error()))?;
        file.sync_all().map_err(|e| ShardError::io(&tmp, e))?;
        let dst = self.dir.join(&shard.file);
        std::fs::rename(&tmp, &dst).map_err(|e| ShardError::io(&dst, e))?;
        self.shards.push(ShardInfo {
            file: shard.file,
            rows: shard.rows,
            packs: shard.packs,
            row_groups: shard.row_groups,
            bytes: sink.bytes,
            sha256: hex(&sink.hasher.finalize()),
        });
        Ok(())
    }

    fn record_batch(&self, rows: &[(u64, Prepared)]) -> Result<RecordBatch, ShardError> {
        let s = || rows.iter().map(|(_, s)| s);
        let pack = UInt64Array::from_iter_values(rows.iter().map(|(p, _)| *p));
        let id = StringArray::from_iter_values(s().map(|x| x.id.as_str()));
        let source = StringArray::from_iter_values(s().map(|x| x.source.as_str()));
        let ids = list(
            s().map(|x| x.tokens.ids.len()),
            Arc::new(UInt32Array::from_iter_values(
                s().flat_map(|x| x.tokens.ids.iter().copied()),
            )),
            DataType::UInt32,
        );
        let loss_mask = list(
            s().map(|x| x.tokens.loss_mask.len()),
            Arc::new(UInt8Array::from_iter_values(
                s().flat_map(|x| x.tokens.loss_mask.iter().copied()),
            )),
            DataType::UInt8,
        );
        let text_tokens = UInt32Array::from_iter_values(s().map(|x| x.meta.text_tokens));
        let llm_len = UInt32Array::from_iter_values(s().map(|x| x.meta.llm_len));
        let images = self.images(rows)?;
        let audio = self.audio(rows)?;
        let costs: Vec<_> = s().map(|x| self.cost.sample_cost(&x.meta)).collect();
        let mut cols: Vec<ArrayRef> = vec![
            Arc::new(pack),
            Arc::new(id),
            Arc::new(source),
            Arc::new(ids),
            Arc::new(loss_mask),
            Arc::new(text_tokens),
            Arc::new(llm_len),
            Arc::new(images),
            Arc::new(audio),
        ];
        let terms: [fn(&crate::cost::SampleCost) -> f64; 6] = [
            |c| c.llm.linear,
            |c| c.llm.attention,
            |c| c.vision.linear,
            |c| c.vision.attention,
            |c| c.audio.linear,
            |c| c.audio.attention,
        ];
        for f in terms {
            cols.push(Arc::new(Float64Array::from_iter_values(
                costs.iter().map(f),
            )));
        }
        RecordBatch::try_new(self.schema.clone(), cols)
            .map_err(|e| ShardError::invalid(&self.dir, format!("building a record batch: {e}")))
    }

    fn images(&self, rows: &[(u64, Prepared)]) -> Result<ListArray, ShardError> {
        let meta: [fn(&ImageMeta) -> u32; 3] = [|m| m.patches, |m| m.llm_tokens, |m| m.llm_offset];
        self.media_list(rows, image_items, &meta, image_fields(), "images")
    }

    fn audio(&self, rows: &[(u64, Prepared)]) -> Result<ListArray, ShardError> {
        let meta: [fn(&AudioMeta) -> u32; 4] = [
            |m| m.mel_frames,
            |m| m.encoder_frames,
            |m| m.llm_tokens,
            |m| m.llm_offset,
        ];
        self.media_list(rows, audio_items, &meta, audio_fields(), "audio")
    }

    /// A `list<struct{name, encoding, data, <meta u32 columns>}>` column: one list per row, one
    /// struct per item, the u32 columns read from each item's metadata `M` in `fields` order.
    fn media_list<M>(
        &self,
        rows: &[(u64, Prepared)],
        per_row: fn(&Prepared) -> (&[StoredMedia], &[M]),
        meta: &[fn(&M) -> u32],
        fields: Fields,
        column: &str,
    ) -> Result<ListArray, ShardError> {
        let items: Vec<(&StoredMedia, &M)> = rows
            .iter()
            .flat_map(|(_, s)| {
                let (media, metas) = per_row(s);
                media.iter().zip(metas)
            })
            .collect();
        let mut cols = media_columns(items.iter().map(|(m, _)| *m));
        for f in meta {
            cols.push(Arc::new(UInt32Array::from_iter_values(
                items.iter().map(|(_, m)| f(m)),
            )));
        }
        let values = StructArray::try_new(fields.clone(), cols, None)
            .map_err(|e| ShardError::invalid(&self.dir, format!("{column} column: {e}")))?;
        Ok(list(
            rows.iter().map(|(_, s)| per_row(s).0.len()),
            Arc::new(values),
            DataType::Struct(fields),
        ))
    }
}

fn image_items(s: &Prepared) -> (&[StoredMedia], &[ImageMeta]) {
    (&s.images, &s.meta.images)
}

fn audio_items(s: &Prepared) -> (&[StoredMedia], &[AudioMeta]) {
    (&s.audio, &s.meta.audio)
}

/// `name`, `encoding`, `data` columns of media items.
fn media_columns<'a>(items: impl Iterator<Item = &'a StoredMedia> + Clone) -> Vec<ArrayRef> {
    vec![
        Arc::new(StringArray::from_iter_values(
            items.clone().map(|m| m.name.as_str()),
        )),
        Arc::new(StringArray::from_iter_values(
            items.clone().map(|m| m.encoding.as_str()),
        )),
        Arc::new(BinaryArray::from_iter_values(
            items.map(|m| m.data.as_slice()),
        )),
    ]
}

/// A non-null list column of `lengths` over `values`.
fn list(lengths: impl Iterator<Item = usize>, values: ArrayRef, item: DataType) -> ListArray {
    ListArray::new(
        list_item(item),
        OffsetBuffer::from_lengths(lengths),
        values,
        None,
    )
}

/// Lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
