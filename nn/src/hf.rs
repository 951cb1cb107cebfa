//! Hugging Face checkpoint directories: memory-mapped safetensors weights (one file or
//! a sharded `model.safetensors.index.json`), `config.json`, and atomic writing.
//!
//! Reading never parses a whole checkpoint into memory: opening maps the files and
//! reads only their headers; [`WeightFiles::load`] converts one tensor (f32, f16, bf16
//! or f64 on disk) to an f32 [`Tensor`] on the requested device. Peak memory while
//! loading a model is therefore its f32 parameters plus one tensor, not twice the
//! checkpoint.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use braid_kernels::{Device, Tensor};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, View};

use crate::error::{Context, Error, Result};
use crate::param::Shard;

/// Where one tensor's bytes are: shard, dtype, shape, absolute byte range.
#[derive(Debug, Clone)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// The weights of a checkpoint: memory-mapped safetensors files and an index of the
/// tensors they hold.
#[derive(Debug)]
pub struct WeightFiles {
    shards: Vec<(PathBuf, Mmap)>,
    index: BTreeMap<String, Entry>,
}

impl WeightFiles {
    /// Opens the weights of a Hugging Face model directory: `model.safetensors`, or the
    /// shards listed in `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if single.is_file() {
            Self::open_files(&[single])
        } else if index.is_file() {
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: HashMap<String, String>,
            }
            let idx: Index = read_json(&index)?;
            let mut files: Vec<String> = idx.weight_map.into_values().collect();
            files.sort();
            files.dedup();
            if files.is_empty() {
                return Err(Error::weights(&index, "", "`weight_map` lists no files"));
            }
            // Shards live in the model's folder: no absolute paths or `..` out of it.
            if let Some(f) = files.iter().find(|f| {
                let p = Path::new(f.as_str());
                f.is_empty()
                    || !p.components().all(|c| {
                        matches!(
                            c,
                            std::path::Component::Normal(_) | std::path::Component::CurDir
                        )
                    })
                    || !p
                        .components()
                        .any(|c| matches!(c, std::path::Component::Normal(_)))
            }) {
                return Err(Error::weights(
                    &index,
                    "",
                    format!(
                        "`weight_map` names {f:?}, which is not a file inside the model's folder"
                    ),
                ));
            }
            let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
            Self::open_files(&paths)
        } else {
            Err(Error::weights(
                dir,
                "",
                "no model.safetensors or model.safetensors.index.json in this directory",
            ))
        }
    }

    /// Opens one or more safetensors files as one set of tensors (names must be unique).
    pub fn open_files(paths: &[PathBuf]) -> Result<Self> {
        let mut shards = Vec::with_capacity(paths.len());
        let mut index = BTreeMap::new();
        for (i, path) in paths.iter().enumerate() {
            // A FIFO would block the open and a device map endless bytes: weights are
            // regular files.
            let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "open", e))?;
            if !meta.is_file() {
                return Err(Error::weights(path, "", "not a regular file"));
            }
            let file = File::open(path).map_err(|e| Error::io(path, "open", e))?;
            // SAFETY: the map is read-only and lives as long as `self`. Another process
            // truncating or rewriting the file while it is mapped would be undefined
            // behaviour; checkpoints are written to a temporary name and renamed into
            // place (see `save_safetensors`), so a file being read is never rewritten.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, "mmap", e))?;
            let (header_len, meta) = SafeTensors::read_metadata(&mmap)
                .map_err(|e| Error::weights(path, "", format!("bad safetensors header: {e}")))?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let (s, e) = info.data_offsets;
                if base + e > mmap.len() || s > e {
                    return Err(Error::weights(
                        path,
                        &name,
                        "byte range past the end of the file",
                    ));
                }
                let entry = Entry {
                    shard: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: base + s,
                    end: base + e,
                };
                if index.insert(name.clone(), entry).is_some() {
                    return Err(Error::weights(
                        path,
                        &name,
                        "tensor appears in more than one shard",
                    ));
                }
            }
            shards.push((path.clone(), mmap));
        }
        Ok(WeightFiles { shards, index })
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Shape of a tensor as stored.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.index.get(name).map(|e| e.shape.as_slice())
    }

    /// Drops a read tensor's file pages from this process's resident set (they stay in
    /// the page cache): loading a model then holds its parameters, not also every byte
    /// of the files it read. Best effort: a failed advice only leaves the pages mapped.
    fn release(&self, entry: &Entry) {
        self.release_bytes(entry.shard, entry.start, entry.end);
    }

    fn release_bytes(&self, shard: usize, start: usize, end: usize) {
        #[cfg(unix)]
        if let Some((_, mmap)) = self.shards.get(shard)
            && start < end
        {
            // SAFETY: the map is a read-only shared file mapping (`Mmap::map`: PROT_READ,
            // MAP_SHARED) that nothing writes through, and checkpoints are never rewritten
            // in place (`save_safetensors` renames a new file over an old one). Dropping
            // its pages therefore never changes a byte anyone can read: a later access,
            // also to a neighbouring tensor's bytes on a page the advice rounds over,
            // faults the same contents back in from the file.
            let _ = unsafe {
                mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
        #[cfg(not(unix))]
        let _ = (shard, start, end);
    }

    /// Drops tensor `name`'s file pages from this process's resident set (after reading it
    /// in parts with [`WeightFiles::read_f32_into`]).
    pub fn release_tensor(&self, name: &str) {
        if let Some(entry) = self.index.get(name) {
            self.release(entry);
        }
    }

    fn entry(&self, name: &str) -> Result<(&Entry, &Path, &[u8])> {
        let entry = self.index.get(name).ok_or_else(|| {
            let where_ = self
                .shards
                .first()
                .map_or(Path::new(""), |(p, _)| p.as_path());
            Error::weights(where_, name, "no such tensor in the checkpoint")
        })?;
        let (path, mmap) = &self.shards[entry.shard];
        Ok((entry, path, &mmap[entry.start..entry.end]))
    }

    /// Loads a float tensor as f32 on `device`, checking it has `expected` shape.
    pub fn load(&self, name: &str, expected: &[usize], device: Device) -> Result<Tensor> {
        let (entry, path, bytes) = self.entry(name)?;
        if entry.shape != expected {
            return Err(Error::weights(
                path,
                name,
                format!(
                    "shape {:?} in the file, the model expects {:?}",
                    entry.shape, expected
                ),
            ));
        }
        let data = float_data(entry, path, name, bytes)?;
        self.release(entry);
        Tensor::from_vec(data, expected.to_vec(), device).ctx(name, "copy to device")
    }

    /// Loads `shard` of the float tensor `name` as f32 on `device`, checking the stored
    /// tensor has the full shape `full`. Only the slice's bytes are read from the
    /// memory-mapped file (a tensor-parallel rank touches 1/size of the tensor), so a
    /// process loading its shard never holds the full tensor.
    pub fn load_shard(
        &self,
        name: &str,
        full: &[usize],
        shard: Shard,
        device: Device,
    ) -> Result<Tensor> {
        let (dim, rank, size) = match shard {
            Shard::Full => return self.load(name, full, device),
            Shard::Split { dim, rank, size } => (dim, rank, size),
        };
        let (entry, path, bytes) = self.entry(name)?;
        if entry.shape != full {
            return Err(Error::weights(
                path,
                name,
                format!(
                    "shape {:?} in the file, the model expects {:?} (before slicing)",
                    entry.shape, full
                ),
            ));
        }
        let Some(&d) = full.get(dim) else {
            return Err(Error::weights(
                path,
                name,
                format!("{full:?} has no dimension {dim} to slice"),
            ));
        };
        if size == 0 || rank >= size || d % size != 0 {
            return Err(Error::weights(
                path,
                name,
                format!("cannot take slice {rank} of {size} of dimension {dim} of {full:?}"),
            ));
        }
        let width = match entry.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F64 => 8,
            other => {
                return Err(Error::weights(
                    path,
                    name,
                    format!("dtype {other:?} is not a float type Braid reads"),
                ));
            }
        };
        // View the tensor as (outer, d, inner): the slice is `part` rows of the middle axis
        // in each of the `outer` blocks.
        let outer: usize = full[..dim].iter().product();
        let inner: usize = full[dim + 1..].iter().product();
        let part = d / size;
        let (block, run) = (d * inner * width, part * inner * width);
        let mut data = Vec::with_capacity(outer * part * inner);
        for o in 0..outer {
            let start = o * block + rank * run;
            let chunk = bytes.get(start..start + run).ok_or_else(|| {
                Error::weights(path, name, "the stored bytes are shorter than the shape")
            })?;
            data.extend(float_data(entry, path, name, chunk)?);
        }
        self.release(entry);
        let mut dims = full.to_vec();
        dims[dim] = part;
        Tensor::from_vec(data, dims, device).ctx(name, "copy to device")
    }

    /// Appends elements `elems` (row-major) of the float tensor `name`, as f32, to `out`:
    /// slices are joined straight from the file into one buffer. The pages stay mapped
    /// ([`WeightFiles::release_tensor`] drops them once the tensor is read).
    pub fn read_f32_into(
        &self,
        name: &str,
        elems: std::ops::Range<usize>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let (entry, path, bytes) = self.entry(name)?;
        let n: usize = entry.shape.iter().product();
        let width = bytes.len() / n.max(1);
        if elems.start > elems.end || elems.end > n {
            return Err(Error::weights(
                path,
                name,
                format!("elements {elems:?} of a tensor of {n}"),
            ));
        }
        let (a, b) = (elems.start * width, elems.end * width);
        let data = float_data(entry, path, name, &bytes[a..b])?;
        out.extend_from_slice(&data);
        Ok(())
    }

    /// Loads a float tensor as f32 on `device`, whatever its shape (returned with it).
    pub fn load_any(&self, name: &str, device: Device) -> Result<Tensor> {
        let shape = self
            .index
            .get(name)
            .map(|e| e.shape.clone())
            .unwrap_or_default();
        self.load(name, &shape, device)
    }

    /// Loads an integer tensor (i64, i32, u32: token ids) as u32 on `device`.
    pub fn load_ids(&self, name: &str, device: Device) -> Result<Tensor> {
        let (entry, path, bytes) = self.entry(name)?;
        let ids: Option<Vec<i64>> = match entry.dtype {
            Dtype::I64 => Some(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            ),
            Dtype::I32 => Some(
                bytes
                    .chunks_exact(4)
                    .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
            ),
            Dtype::U32 => Some(
                bytes
                    .chunks_exact(4)
                    .map(|c| i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
            ),
            _ => None,
        };
        let ids = ids.ok_or_else(|| {
            Error::weights(
                path,
                name,
                format!(
                    "dtype {:?} is not an integer id type (i64, i32, u32)",
                    entry.dtype
                ),
            )
        })?;
        let ids: Vec<u32> = ids
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                u32::try_from(v).map_err(|_| {
                    Error::weights(path, name, format!("element {i} = {v} is not a valid id"))
                })
            })
            .collect::<Result<_>>()?;
        self.release(entry);
        Tensor::from_vec_u32(ids, entry.shape.clone(), device).ctx(name, "copy to device")
    }
}

/// `bytes` (all or part of tensor `name`) as f32, or an error naming a dtype Braid does
/// not read as floats, or the first value that is not finite: a NaN or an infinity in a
/// weight or an optimizer moment (a damaged file, a run saved after it diverged, an f64
/// beyond f32's range) would only surface steps later as a loss of NaN.
fn float_data(entry: &Entry, path: &Path, name: &str, bytes: &[u8]) -> Result<Vec<f32>> {
    let data = to_f32(entry.dtype, bytes).ok_or_else(|| {
        Error::weights(
            path,
            name,
            format!("dtype {:?} is not a float type Braid reads", entry.dtype),
        )
    })?;
    if let Some(i) = data.iter().position(|v| !v.is_finite()) {
        return Err(Error::weights(
            path,
            name,
            format!(
                "holds {} (at element {i} of this read): the file is damaged, or was saved after training diverged",
                data[i]
            ),
        ));
    }
    Ok(data)
}

/// Decodes little-endian float bytes to f32.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        _ => return None,
    })
}

/// Reads and parses a JSON file (a `config.json`), naming the file on error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let bytes =
        crate::files::read_limited(path, 256 << 20).map_err(|e| Error::io(path, "read", e))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| Error::weights(path, "", format!("invalid JSON: not UTF-8 ({e})")))?;
    serde_json::from_str(&text).map_err(|e| Error::weights(path, "", format!("invalid JSON: {e}")))
}

/// Writes `path` atomically: `write` fills a temporary file in the same directory, which
/// is synced, then renamed over `path`, so a crash leaves either the old file or the new
/// one, and a failure removes the temporary file. A symlink is written through (its
/// target replaced, the link kept); an existing path that is not a regular file (a
/// device, a folder) is refused rather than replaced.
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let target = atomic_target(path)?;
    let file_name = target
        .file_name()
        .ok_or_else(|| Error::weights(path, "", "not a file path"))?
        .to_string_lossy();
    // Unique per call: threads of one process may write the same file at once.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = target.with_file_name(format!(".{file_name}.{}-{n}.tmp", std::process::id()));
    // The mode a new file gets here (0666 less the umask), put back after `write`: some
    // writers leave 0600 (safetensors persists a temporary file of its own), which the
    // other accounts of a team sharing a run folder could not read.
    let mode = File::create(&tmp)
        .and_then(|f| f.metadata())
        .map(|m| m.permissions())
        // Named by the file asked for: a missing or read-only folder is the usual cause,
        // and the temporary name means nothing to the user.
        .map_err(|e| Error::io(path, "create", e));
    let result = mode
        .and_then(|mode| {
            write(&tmp)?;
            let f = File::open(&tmp).map_err(|e| Error::io(&tmp, "sync", e))?;
            // Only where it changed, and a refusal (a file system without modes: some NFS
            // and FUSE mounts) keeps the file as written rather than failing the write.
            if f.metadata().is_ok_and(|m| m.permissions() != mode) {
                let _ = f.set_permissions(mode);
            }
            f.sync_all().map_err(|e| Error::io(&tmp, "sync", e))
        })
        .and_then(|()| {
            std::fs::rename(&tmp, &target).map_err(|e| Error::io(path, "rename into place", e))
        });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Where [`write_atomic`] writes for `path`: `path` itself, or the file a symlink at
/// `path` points to (followed to its end); an error where something other than a regular
/// file is there.
fn atomic_target(path: &Path) -> Result<std::path::PathBuf> {
    let mut at = path.to_path_buf();
    // A link chain ends within a few hops; a loop is the OS's ELOOP below.
    for _ in 0..40 {
        match std::fs::symlink_metadata(&at) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(at),
            Err(e) => return Err(Error::io(&at, "inspect", e)),
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&at).map_err(|e| Error::io(&at, "read link", e))?;
                at = match at.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            Ok(m) if m.is_file() => return Ok(at),
            Ok(_) => {
                return Err(Error::weights(
                    path,
                    "",
                    "exists and is not a regular file (a device, a folder): refusing to replace it",
                ));
            }
        }
    }
    Err(Error::weights(
        path,
        "",
        "too many levels of symbolic links",
    ))
}

/// Writes a JSON value to `path` atomically (pretty-printed).
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    write_atomic(path, |tmp| {
        let text = serde_json::to_string_pretty(value)
            .map_err(|e| Error::weights(path, "", format!("cannot serialize JSON: {e}")))?;
        std::fs::write(tmp, text).map_err(|e| Error::io(tmp, "write", e))
    })
}

/// Writes named f32 tensors to a safetensors file, atomically. Tensors are copied to
/// the host one at a time.
pub fn save_safetensors(path: &Path, tensors: &[(String, &Tensor)]) -> Result<()> {
    let failed = RefCell::new(None);
    let views: Vec<(&str, LazyF32<'_>)> = tensors
        .iter()
        .map(|(name, tensor)| {
            let view = LazyF32 {
                name,
                tensor,
                failed: &failed,
            };
            (name.as_str(), view)
        })
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_atomic(path, |tmp| {
        let written = safetensors::serialize_to_file(views, Some(metadata), tmp)
            .map_err(|e| Error::weights(tmp, "", format!("cannot write safetensors: {e}")));
        // A tensor that could not be copied to the host was written as zeros: the file
        // is dropped, never renamed into place.
        let failed = failed.borrow_mut().take();
        match failed.map_or(written, Err) {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = std::fs::remove_file(tmp);
                Err(e)
            }
        }
    })
}

/// One tensor as little-endian f32 bytes, converted only when the writer reaches it:
/// saving holds one tensor's host copy at a time, not the whole file's (a rank's
/// checkpoint or a model's export would otherwise double its host memory).
struct LazyF32<'a> {
    name: &'a str,
    tensor: &'a Tensor,
    /// The first tensor that could not be copied to the host (the writer's `data()`
    /// cannot fail, so the error is kept here and returned after the write).
    failed: &'a RefCell<Option<Error>>,
}

impl View for LazyF32<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        self.tensor.dims()
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self.tensor.to_vec_f32().ctx(self.name, "copy to host") {
            Ok(v) => Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Err(e) => {
                self.failed.borrow_mut().get_or_insert(e);
                Cow::Owned(vec![0; self.data_len()])
            }
        }
    }

    fn data_len(&self) -> usize {
        self.tensor.elem_count() * 4
    }
}
