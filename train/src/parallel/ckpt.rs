//! Checkpoints that any layout can load: every rank writes the parameters (and AdamW
//! moments) whose primary copy it holds to `model-rank-NNNNN.safetensors` (and
//! `optim-rank-NNNNN.safetensors`), full-name tensors, a TP slice stored as
//! `<name>#split<dim>.<rank>of<size>`. Loading gathers every file's tensors, joins the
//! slices into full tensors and cuts the loader's own slices, so a checkpoint saved
//! under one layout (or on one rank, `model.safetensors`) loads under any other.
//!
//! Atomicity is the single-rank protocol: rank 0 creates `.tmp-step-N`, every rank
//! writes its files (each synced), and after a barrier rank 0 writes `state.json`, the
//! config and data files, and renames the folder into place. Loading goes through
//! [`SliceReader`]: the full model (`checkpoint::load_weights` / `load_optim`) and a
//! rank's shard (`super::load::load_rank_checkpoint`) alike read one tensor at a time.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use braid_comm::Comm;
use braid_kernels::{Device, Tensor};
use braid_nn::hf::{WeightFiles, save_safetensors};
use braid_nn::param::cut_shard;
use braid_nn::{Module, Shard};

use super::engine::Engine;
use crate::checkpoint::{self, MODEL_FILE, OPTIM_FILE, TrainState};
use crate::error::{Result, TrainError};

fn rank_file(kind: &str, rank: usize) -> String {
    format!("{kind}-rank-{rank:05}.safetensors")
}

/// The stored name of a tensor that is `shard` of `name`.
fn stored_name(name: &str, shard: Shard) -> String {
    match shard {
        Shard::Full => name.to_string(),
        Shard::Split { dim, rank, size } => format!("{name}#split{dim}.{rank}of{size}"),
    }
}

/// (name, shard) of a stored name.
fn parse_stored(stored: &str) -> Result<(String, Shard)> {
    let Some((name, tag)) = stored.split_once("#split") else {
        return Ok((stored.to_string(), Shard::Full));
    };
    let bad = || TrainError::Other(format!("checkpoint tensor `{stored}`: bad shard tag"));
    let (dim, rest) = tag.split_once('.').ok_or_else(bad)?;
    let (rank, size) = rest.split_once("of").ok_or_else(bad)?;
    let n = |s: &str| s.parse::<usize>().map_err(|_| bad());
    Ok((
        name.to_string(),
        Shard::Split {
            dim: n(dim)?,
            rank: n(rank)?,
            size: n(size)?,
        },
    ))
}

/// The tensors of one kind ("model" or "optim") of checkpoint `dir`, whatever layout
/// wrote them, read one tensor (or one slice) at a time from the memory-mapped files:
/// loading a model holds its parameters plus at most one full tensor.
#[derive(Debug)]
pub struct SliceReader {
    dir: PathBuf,
    /// "model" or "optim".
    kind: String,
    /// How many rank files were read (0: one `<kind>.safetensors`).
    ranks: usize,
    files: WeightFiles,
    /// Full name -> its stored pieces: (which slice, stored name).
    pieces: BTreeMap<String, Vec<(Shard, String)>>,
}

impl SliceReader {
    pub fn open(dir: &Path, kind: &str) -> Result<Self> {
        let single = dir.join(if kind == "model" {
            MODEL_FILE
        } else {
            OPTIM_FILE
        });
        let (paths, ranks) = if single.exists() {
            (vec![single], 0)
        } else {
            let paths = rank_files(dir, kind)?;
            let n = paths.len();
            // Every rank writes both of its files: fewer of this kind than of the other
            // are files lost at the end (a gap below the last is caught in `rank_files`).
            let other = if kind == "model" { "optim" } else { "model" };
            let theirs = rank_files(dir, other).map_or(0, |p| p.len());
            if n < theirs {
                return Err(ckpt_err(
                    dir,
                    format!(
                        "{other} files of {theirs} ranks but {kind} files of {n}: {} (and any after it) is missing, the checkpoint is incomplete",
                        rank_file(kind, n)
                    ),
                ));
            }
            (paths, n)
        };
        if paths.is_empty() {
            return Err(ckpt_err(
                dir,
                format!("no {kind} tensors (neither {kind}.safetensors nor {kind}-rank-*)"),
            ));
        }
        let files = WeightFiles::open_files(&paths)?;
        let mut pieces: BTreeMap<String, Vec<(Shard, String)>> = BTreeMap::new();
        for stored in files.names() {
            let (name, shard) = parse_stored(stored)?;
            pieces
                .entry(name)
                .or_default()
                .push((shard, stored.to_string()));
        }
        Ok(SliceReader {
            dir: dir.to_path_buf(),
            kind: kind.to_string(),
            ranks,
            files,
            pieces,
        })
    }

    /// How many full tensors the checkpoint holds.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Slice `want` (local shape `dims`) of the full tensor `name` on `device`: read as is
    /// when stored as that slice, cut from the stored bytes when stored whole, otherwise
    /// joined from the stored slices on the host and cut.
    pub fn tensor(
        &self,
        name: &str,
        want: Shard,
        dims: &[usize],
        device: Device,
    ) -> Result<Tensor> {
        let pieces = self
            .pieces
            .get(name)
            .ok_or_else(|| ckpt_err(&self.dir, self.no_tensor(name)))?;
        if let Some((_, stored)) = pieces.iter().find(|(s, _)| *s == want) {
            return Ok(self.files.load(stored, dims, device)?);
        }
        let full = want.full_dims(name, dims)?;
        if let [(Shard::Full, stored)] = pieces.as_slice() {
            return Ok(self.files.load_shard(stored, &full, want, device)?);
        }
        let (data, stored_dims) = self.join(name, pieces)?;
        if stored_dims != full {
            return Err(ckpt_err(
                &self.dir,
                format!("`{name}` is {stored_dims:?} but the model's is {full:?}"),
            ));
        }
        let (data, local) = cut_shard(name, data, &full, want)?;
        Ok(Tensor::from_vec(data, local, device)?)
    }
}

impl SliceReader {
    fn no_tensor(&self, name: &str) -> String {
        match self.ranks {
            0 => format!("no tensor `{name}`"),
            n => format!(
                "no tensor `{name}` in its {n} {kind}-rank files (ranks 0-{last}): the \
                 checkpoint is of another model, or the file of a rank after {last} is missing",
                kind = self.kind,
                last = n - 1
            ),
        }
    }

    /// The full tensor `name` from its stored slices, read straight from the files into
    /// one buffer (no per-slice copies): (data, dims).
    fn join(&self, name: &str, pieces: &[(Shard, String)]) -> Result<(Vec<f32>, Vec<usize>)> {
        let shapes: Vec<(Shard, &[usize])> = pieces
            .iter()
            .map(|(shard, stored)| (*shard, self.files.shape(stored).unwrap_or(&[])))
            .collect();
        let join = slice_layout(name, &shapes).map_err(|reason| ckpt_err(&self.dir, reason))?;
        let mut data = Vec::with_capacity(join.dims.iter().product());
        for o in 0..join.outer {
            for &k in &join.order {
                let range = o * join.inner..(o + 1) * join.inner;
                self.files.read_f32_into(&pieces[k].1, range, &mut data)?;
            }
        }
        for (_, stored) in pieces {
            self.files.release_tensor(stored);
        }
        Ok((data, join.dims))
    }
}

/// The `<kind>-rank-NNNNN.safetensors` files of checkpoint `dir`, in rank order; an
/// error names the first rank whose file is missing below the highest one (every rank
/// writes both of its files, even empty, so a gap is a damaged checkpoint). Other names
/// that merely start like one (an editor's backup, a copy's `.partial`) are not read.
fn rank_files(dir: &Path, kind: &str) -> Result<Vec<PathBuf>> {
    let prefix = format!("{kind}-rank-");
    let mut by_rank: BTreeMap<usize, PathBuf> = BTreeMap::new();
    for entry in std::fs::read_dir(dir)
        .map_err(crate::error::io_err(dir, "list"))?
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let rank = name
            .strip_prefix(&prefix)
            .and_then(|r| r.strip_suffix(".safetensors"))
            .filter(|r| r.len() >= 5 && r.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|r| r.parse::<usize>().ok());
        if let Some(rank) = rank {
            by_rank.insert(rank, entry.path());
        }
    }
    if let Some(missing) = (0..by_rank.len()).find(|r| !by_rank.contains_key(r)) {
        let last = by_rank.keys().next_back().copied().unwrap_or(0);
        return Err(ckpt_err(
            dir,
            format!(
                "{} is missing (the checkpoint holds {kind} files of {} ranks up to rank \
                 {last}): the checkpoint is incomplete",
                rank_file(kind, missing),
                by_rank.len()
            ),
        ));
    }
    Ok(by_rank.into_values().collect())
}

/// How slices make their full tensor: each slice is `outer` runs of `inner` elements,
/// and the full tensor is, for each run, the slices' runs in `order` (of rank).
struct SliceLayout {
    order: Vec<usize>,
    outer: usize,
    inner: usize,
    dims: Vec<usize>,
}

/// The layout of the slices `(shard, shape)` of `name`; an error names a tensor stored
/// both whole and in slices, a missing slice, or slices of different shapes.
fn slice_layout(
    name: &str,
    slices: &[(Shard, &[usize])],
) -> std::result::Result<SliceLayout, String> {
    let mut by_rank: Vec<(usize, usize, usize, usize)> = Vec::new(); // (rank, dim, size, k)
    for (k, (shard, _)) in slices.iter().enumerate() {
        match *shard {
            Shard::Split { dim, rank, size } => by_rank.push((rank, dim, size, k)),
            Shard::Full => return Err(format!("`{name}` is stored both whole and in slices")),
        }
    }
    by_rank.sort_unstable();
    let Some(&(_, dim, size, first)) = by_rank.first() else {
        return Err(format!("`{name}` has no stored slices"));
    };
    let ranks: Vec<usize> = by_rank.iter().map(|s| s.0).collect();
    if by_rank.iter().any(|s| (s.1, s.2) != (dim, size)) || ranks != (0..size).collect::<Vec<_>>() {
        return Err(format!(
            "`{name}` has slices {ranks:?} of {size}: the checkpoint is incomplete"
        ));
    }
    let part = slices[first].1;
    if part.len() <= dim || slices.iter().any(|s| s.1 != part) {
        return Err(format!("`{name}`: slices of different shapes"));
    }
    let mut dims = part.to_vec();
    dims[dim] *= size;
    Ok(SliceLayout {
        order: by_rank.iter().map(|s| s.3).collect(),
        outer: part[..dim].iter().product(),
        inner: part[dim..].iter().product(), // slice rows * trailing
        dims,
    })
}

fn ckpt_err(dir: &Path, reason: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: dir.to_path_buf(),
        reason: reason.into(),
    }
}

/// The full tensor from its slices (or its one full copy): (data, dims).
pub fn join_slices(
    name: &str,
    slices: &mut [(Shard, Vec<f32>, Vec<usize>)],
) -> std::result::Result<(Vec<f32>, Vec<usize>), String> {
    if let [(Shard::Full, data, dims)] = slices {
        return Ok((std::mem::take(data), dims.clone()));
    }
    let shapes: Vec<(Shard, &[usize])> = slices.iter().map(|s| (s.0, &s.2[..])).collect();
    let join = slice_layout(name, &shapes)?;
    let mut data = Vec::with_capacity(join.dims.iter().product());
    for o in 0..join.outer {
        for &k in &join.order {
            data.extend_from_slice(&slices[k].1[o * join.inner..(o + 1) * join.inner]);
        }
    }
    Ok((data, join.dims))
}

/// Writes this rank's primary parameters and their moments into the checkpoint folder
/// `tmp`.
pub fn write_rank_files(engine: &Engine, tmp: &Path) -> Result<()> {
    let plan = &engine.plan;
    let mut weights: Vec<(String, &Tensor)> = Vec::new();
    let mut shards: HashMap<String, Shard> = HashMap::new();
    engine.model.visit_params(&mut |p| {
        shards.insert(p.name.clone(), p.shard);
        if plan.is_primary(&p.name) {
            weights.push((stored_name(&p.name, p.shard), &p.value));
        }
    });
    save_safetensors(&tmp.join(rank_file("model", engine.rank)), &weights)?;
    let mut moments: Vec<(String, &Tensor)> = Vec::new();
    for m in &engine.optim.moments {
        if plan.is_primary(&m.name) {
            let shard = shards.get(&m.name).copied().unwrap_or(Shard::Full);
            moments.push((
                stored_name(&format!("{}.exp_avg", m.name), shard),
                &m.exp_avg,
            ));
            moments.push((
                stored_name(&format!("{}.exp_avg_sq", m.name), shard),
                &m.exp_avg_sq,
            ));
        }
    }
    save_safetensors(&tmp.join(rank_file("optim", engine.rank)), &moments)?;
    Ok(())
}

/// One checkpoint of every rank's files, collectively: returns the folder on every rank.
#[allow(clippy::too_many_arguments)]
pub fn save(
    engine: &Engine,
    world: &dyn Comm,
    root: &Path,
    state: &TrainState,
    files: &[(&str, &[u8])],
    keep: usize,
    abort_midway: bool,
) -> Result<PathBuf> {
    let tmp = root.join(format!(".tmp-step-{:08}", state.step));
    if world.rank() == 0 {
        checkpoint::begin(root, state.step)?;
    }
    world.barrier()?;
    write_rank_files(engine, &tmp)?;
    world.barrier()?;
    let dst = if world.rank() == 0 {
        if abort_midway {
            // Fault injection: die with the shards written but nothing committed.
            std::process::abort();
        }
        checkpoint::finish(root, &tmp, state, files, keep)?
    } else {
        root.join(format!("step-{:08}", state.step))
    };
    world.barrier()?;
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_join_back_to_the_full_tensor() {
        let full: Vec<f32> = (0..24).map(|x| x as f32).collect();
        for (dim, size) in [(0, 2), (1, 3), (1, 2), (0, 4)] {
            let dims = vec![4, 6];
            let mut slices: Vec<_> = (0..size)
                .rev()
                .map(|rank| {
                    let shard = Shard::Split { dim, rank, size };
                    let (d, ld) = cut_shard("w", full.clone(), &dims, shard).unwrap();
                    (shard, d, ld)
                })
                .collect();
            assert_eq!(join_slices("w", &mut slices).unwrap(), (full.clone(), dims));
        }
        let mut missing = vec![(
            Shard::Split {
                dim: 0,
                rank: 1,
                size: 2,
            },
            vec![0.0; 12],
            vec![2, 6],
        )];
        assert!(
            join_slices("w", &mut missing)
                .unwrap_err()
                .contains("incomplete")
        );
    }

    /// A tensor stored in slices reads back whole and as any other slicing; a missing
    /// slice is an error naming the tensor.
    #[test]
    fn slice_reader_joins_and_recuts_stored_slices() {
        let dir = tempfile::tempdir().unwrap();
        let full: Vec<f32> = (0..48).map(|x| x as f32 * 0.25).collect();
        let dims = vec![4, 12];
        for (dim, size) in [(0, 2), (1, 4), (1, 3)] {
            let _ = std::fs::remove_dir_all(dir.path().join("c"));
            std::fs::create_dir_all(dir.path().join("c")).unwrap();
            for rank in 0..size {
                let shard = Shard::Split { dim, rank, size };
                let (d, ld) = cut_shard("w", full.clone(), &dims, shard).unwrap();
                let t = Tensor::from_vec(d, ld, Device::Cpu).unwrap();
                let path = dir.path().join("c").join(rank_file("model", rank));
                save_safetensors(&path, &[(stored_name("w", shard), &t)]).unwrap();
            }
            let r = SliceReader::open(&dir.path().join("c"), "model").unwrap();
            let whole = r.tensor("w", Shard::Full, &dims, Device::Cpu).unwrap();
            assert_eq!(whole.to_vec_f32().unwrap(), full, "dim {dim} of {size}");
            for (d2, s2) in [(0, 4), (1, 2), (1, 6)] {
                let want = Shard::Split {
                    dim: d2,
                    rank: 1,
                    size: s2,
                };
                let (data, local) = cut_shard("w", full.clone(), &dims, want).unwrap();
                let got = r.tensor("w", want, &local, Device::Cpu).unwrap();
                assert_eq!(got.to_vec_f32().unwrap(), data, "{dim}/{size} -> {d2}/{s2}");
            }
            if size > 2 {
                // A stray file named like a rank's is not read.
                std::fs::write(
                    dir.path()
                        .join("c")
                        .join("model-rank-00001.safetensors.partial"),
                    b"junk",
                )
                .unwrap();
                assert!(SliceReader::open(&dir.path().join("c"), "model").is_ok());
                // The last rank's file gone: the tensor's slices are incomplete.
                let last = rank_file("model", size - 1);
                std::fs::remove_file(dir.path().join("c").join(&last)).unwrap();
                let r = SliceReader::open(&dir.path().join("c"), "model").unwrap();
                let e = r
                    .tensor("w", Shard::Full, &dims, Device::Cpu)
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("`w`") && e.contains("incomplete"), "{e}");
                let e = r
                    .tensor("v", Shard::Full, &dims, Device::Cpu)
                    .unwrap_err()
                    .to_string();
                assert!(e.contains("no tensor `v`") && e.contains("ranks 0-"), "{e}");
                // A rank below the highest gone: named when the checkpoint opens.
                std::fs::remove_file(dir.path().join("c").join(rank_file("model", 0))).unwrap();
                let e = SliceReader::open(&dir.path().join("c"), "model")
                    .unwrap_err()
                    .to_string();
                assert!(
                    e.contains("model-rank-00000.safetensors is missing")
                        && e.contains("incomplete"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn stored_names_round_trip() {
        let s = Shard::Split {
            dim: 1,
            rank: 2,
            size: 4,
        };
        let n = stored_name("llm.layers.0.mlp.down_proj.weight", s);
        assert_eq!(
            parse_stored(&n).unwrap(),
            ("llm.layers.0.mlp.down_proj.weight".to_string(), s)
        );
        assert_eq!(
            parse_stored("a.b").unwrap(),
            ("a.b".to_string(), Shard::Full)
        );
    }
}
