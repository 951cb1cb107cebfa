//! Braid name <-> Hugging Face name tables and the one importer/exporter that uses them.
//!
//! Each model family builds ONE [`NameMap`] (from its config); import and export both
//! walk it, so the two directions cannot disagree. An entry also says how the tensor is
//! laid out on each side ([`Layout`]): the same, the same data under another shape (a
//! conv weight (D, C, P, P) that Braid keeps as the linear weight (D, C*P*P)), or one
//! chunk of a tensor HF packs (`nn.MultiheadAttention`'s `in_proj_weight`).
//!
//! Under tensor parallelism a parameter is this rank's [`Shard`] of the checkpoint's
//! tensor: [`load_params_sharded`] reads the full tensor (on the host) and keeps the
//! slice; [`block_shards`] says which parameters of a transformer block are split.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use braid_kernels::{Device, Tensor};
use braid_nn::error::Context;
use braid_nn::hf::{WeightFiles, save_safetensors};
use braid_nn::param::cut_shard;
use braid_nn::{
    Attention, ColumnParallelLinear, Error, Mlp, Module, Result, RowParallelLinear, Shard,
    TransformerBlock,
};

/// Parameter name -> the slice of the full tensor it holds; names not listed are full.
pub type Shards = HashMap<String, Shard>;

/// Adds the split parameters of `block` to `out`: column-parallel q/k/v and fc1 (or
/// gate/up) weights and biases hold rows (dim 0), row-parallel o_proj and fc2 (or
/// down) weights hold columns (dim 1); norms and row-parallel biases are full. Nothing
/// is added for a group of one.
pub fn block_shards(block: &TransformerBlock, out: &mut Shards) {
    attention_shards(&block.self_attn, out);
    mlp_shards(&block.mlp, out);
}

/// The split parameters of an attention layer (see [`block_shards`]).
pub fn attention_shards(attn: &Attention, out: &mut Shards) {
    for l in [&attn.q_proj, &attn.k_proj, &attn.v_proj] {
        column_shards(l, out);
    }
    row_shards(&attn.o_proj, out);
}

/// The split parameters of an MLP (see [`block_shards`]).
pub fn mlp_shards(mlp: &Mlp, out: &mut Shards) {
    column_shards(&mlp.up, out);
    if let Some(g) = &mlp.gate {
        column_shards(g, out);
    }
    row_shards(&mlp.down, out);
}

fn column_shards(l: &ColumnParallelLinear, out: &mut Shards) {
    let (rank, size) = (l.group.rank(), l.group.size());
    if size > 1 {
        let shard = Shard::Split { dim: 0, rank, size };
        l.linear.visit_params(&mut |p| {
            out.insert(p.name.clone(), shard);
        });
    }
}

fn row_shards(l: &RowParallelLinear, out: &mut Shards) {
    let (rank, size) = (l.group.rank(), l.group.size());
    if size > 1 {
        out.insert(
            l.linear.weight.name.clone(),
            Shard::Split { dim: 1, rank, size },
        );
    }
}

/// How a Braid parameter is stored under its HF name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Same shape.
    Same,
    /// Same row-major data under this HF shape.
    Reshape(Vec<usize>),
    /// Rows `[index * n, (index + 1) * n)` of an HF tensor that stacks `count` such
    /// Braid tensors along dimension 0.
    Chunk { index: usize, count: usize },
}

/// One line of a family's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapEntry {
    pub braid: String,
    /// Without the checkpoint's prefix (`vision_model.`, `model.encoder.`, ...).
    pub hf: String,
    pub layout: Layout,
}

/// A family's name table: every Braid parameter exactly once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NameMap {
    pub entries: Vec<MapEntry>,
}

impl NameMap {
    pub fn push(&mut self, braid: impl Into<String>, hf: impl Into<String>, layout: Layout) {
        self.entries.push(MapEntry {
            braid: braid.into(),
            hf: hf.into(),
            layout,
        });
    }

    /// `{braid}.weight`/`.bias` <-> `{hf}.weight`/`.bias` (a linear or LayerNorm).
    pub fn push_wb(&mut self, braid: &str, hf: &str, bias: bool) {
        self.push(
            format!("{braid}.weight"),
            format!("{hf}.weight"),
            Layout::Same,
        );
        if bias {
            self.push(format!("{braid}.bias"), format!("{hf}.bias"), Layout::Same);
        }
    }

    /// The HF name of the Braid parameter `braid` (without prefix).
    pub fn hf_name(&self, braid: &str) -> Option<&str> {
        self.entries
            .iter()
            .find(|e| e.braid == braid)
            .map(|e| e.hf.as_str())
    }

    fn by_braid(&self) -> HashMap<&str, &MapEntry> {
        self.entries.iter().map(|e| (e.braid.as_str(), e)).collect()
    }
}

/// The HF shape of a Braid tensor of shape `dims` under `layout`.
fn hf_shape(layout: &Layout, dims: &[usize]) -> Vec<usize> {
    match layout {
        Layout::Same => dims.to_vec(),
        Layout::Reshape(s) => s.clone(),
        Layout::Chunk { count, .. } => {
            let mut s = dims.to_vec();
            if let Some(d0) = s.first_mut() {
                *d0 *= count;
            }
            s
        }
    }
}

/// Loads every parameter of `model` from `files` (names `prefix + hf`), one tensor at
/// a time, onto `device`. Returns the checkpoint tensors nothing used (sorted).
///
/// A missing tensor or a shape that differs from the model's is an error naming the
/// file, the tensor and both shapes.
pub fn load_params(
    model: &mut dyn Module,
    map: &NameMap,
    files: &WeightFiles,
    prefix: &str,
    device: Device,
) -> Result<Vec<String>> {
    load_params_sharded(model, map, files, prefix, device, &Shards::new())
}

/// [`load_params`] for a tensor-parallel shard of a model: a parameter listed in
/// `shards` holds that slice of the checkpoint's (full) tensor, read on the host and
/// cut there, so only the slice reaches `device`.
pub fn load_params_sharded(
    model: &mut dyn Module,
    map: &NameMap,
    files: &WeightFiles,
    prefix: &str,
    device: Device,
    shards: &Shards,
) -> Result<Vec<String>> {
    let by_braid = map.by_braid();
    let mut used = BTreeSet::new();
    let mut res: Result<()> = Ok(());
    model.visit_params_mut(&mut |p| {
        if res.is_err() {
            return;
        }
        res = (|| {
            let entry = by_braid.get(p.name.as_str()).ok_or_else(|| {
                Error::config(
                    "NameMap",
                    format!("parameter {} has no Hugging Face name", p.name),
                )
            })?;
            let hf = format!("{prefix}{}", entry.hf);
            let dims = p.value.dims().to_vec();
            if let Some(&shard @ Shard::Split { dim, size, .. }) = shards.get(&p.name) {
                p.value = load_shard(files, &hf, &entry.layout, &p.name, &dims, shard, device)
                    .map_err(|e| match e {
                        Error::Kernel { source, .. } => Error::Kernel {
                            context: format!("loading {hf} (slice of dim {dim} for tp = {size})"),
                            source,
                        },
                        e => e,
                    })?;
                used.insert(hf);
                return Ok(());
            }
            let shape = hf_shape(&entry.layout, &dims);
            let value = match entry.layout {
                Layout::Same | Layout::Reshape(_) => {
                    files.load(&hf, &shape, device)?.reshape(dims.clone())
                }
                Layout::Chunk { index, .. } => {
                    // Slicing happens on the host: the packed tensor is small (3 D x D).
                    let all = files.load(&hf, &shape, Device::Cpu)?.to_vec_f32();
                    all.and_then(|all| {
                        let n: usize = dims.iter().product();
                        let part = all[index * n..(index + 1) * n].to_vec();
                        Tensor::from_vec(part, dims.clone(), device)
                    })
                }
            }
            .map_err(|e| Error::Kernel {
                context: format!("loading {hf}"),
                source: e,
            })?;
            p.value = value;
            used.insert(hf);
            Ok(())
        })();
    });
    res?;
    Ok(files
        .names()
        .filter(|n| !used.contains(*n))
        .map(str::to_string)
        .collect())
}

/// This rank's `shard` (local shape `dims`) of the checkpoint tensor `hf`: the full
/// tensor is read on the host, the slice cut there and copied to `device`.
fn load_shard(
    files: &WeightFiles,
    hf: &str,
    layout: &Layout,
    name: &str,
    dims: &[usize],
    shard: Shard,
    device: Device,
) -> Result<Tensor> {
    if shard == Shard::Full {
        return Err(Error::config("load_params", format!("{name}: not a split")));
    }
    if matches!(layout, Layout::Chunk { .. }) {
        // No packed tensor is split today (SigLIP's in_proj belongs to the replicated
        // pooling head); slicing a chunk of a packed tensor is not implemented.
        return Err(Error::config(
            "load_params",
            format!(
                "{name}: a chunk of the packed {hf} cannot be loaded as a tensor-parallel slice"
            ),
        ));
    }
    let full = shard.full_dims(name, dims)?;
    let shape = hf_shape(layout, &full);
    let data = files
        .load(hf, &shape, Device::Cpu)?
        .to_vec_f32()
        .ctx(hf, "copy to host")?;
    let (part, part_dims) = cut_shard(name, data, &full, shard)?;
    Tensor::from_vec(part, part_dims, device).ctx(hf, "copy slice to device")
}

/// Host tensors by name: (shape, row-major data).
pub type HostTensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// What [`hf_tensors`] collects from each parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Value,
    /// The gradient (frozen parameters are left out).
    Grad,
}

/// Every parameter's value (or grad) on the host under its HF name (`prefix + hf`) and
/// HF shape, packed tensors put back together: what export writes, and what parity
/// tests compare with a reference's grads.
pub fn hf_tensors(
    model: &dyn Module,
    map: &NameMap,
    prefix: &str,
    which: Which,
) -> Result<HostTensors> {
    let by_braid = map.by_braid();
    let mut whole = HostTensors::new();
    // Chunks are gathered by index first: hf name -> (HF shape, parts by index).
    type Parts = (Vec<usize>, Vec<Option<Vec<f32>>>);
    let mut chunks: BTreeMap<String, Parts> = BTreeMap::new();
    let mut res: Result<()> = Ok(());
    model.visit_params(&mut |p| {
        if res.is_err() {
            return;
        }
        res = (|| {
            let entry = by_braid.get(p.name.as_str()).ok_or_else(|| {
                Error::config(
                    "NameMap",
                    format!("parameter {} has no Hugging Face name", p.name),
                )
            })?;
            let t = match which {
                Which::Value => &p.value,
                Which::Grad => match &p.grad {
                    Some(g) => g,
                    None => return Ok(()),
                },
            };
            let hf = format!("{prefix}{}", entry.hf);
            let data = t.to_vec_f32().map_err(|e| Error::Kernel {
                context: format!("copying {} to the host", p.name),
                source: e,
            })?;
            let shape = hf_shape(&entry.layout, p.value.dims());
            match entry.layout {
                Layout::Same | Layout::Reshape(_) => {
                    whole.insert(hf, (shape, data));
                }
                Layout::Chunk { index, count } => {
                    let slot = chunks
                        .entry(hf)
                        .or_insert_with(|| (shape, vec![None; count]));
                    if let Some(s) = slot.1.get_mut(index) {
                        *s = Some(data);
                    }
                }
            }
            Ok(())
        })();
    });
    res?;
    for (hf, (shape, parts)) in chunks {
        let mut data = Vec::new();
        for (i, part) in parts.into_iter().enumerate() {
            let part = part.ok_or_else(|| {
                Error::config("NameMap", format!("{hf}: chunk {i} has no Braid parameter"))
            })?;
            data.extend(part);
        }
        whole.insert(hf, (shape, data));
    }
    Ok(whole)
}

/// Writes every parameter of `model` to `path` (safetensors, f32) under its HF name
/// (`prefix + hf`), packing chunked tensors back together.
pub fn save_params(model: &dyn Module, map: &NameMap, prefix: &str, path: &Path) -> Result<()> {
    let tensors = hf_tensors(model, map, prefix, Which::Value)?
        .into_iter()
        .map(|(name, (shape, data))| {
            Tensor::from_vec(data, shape, Device::Cpu)
                .map(|t| (name.clone(), t))
                .map_err(|e| Error::Kernel {
                    context: format!("exporting {name}"),
                    source: e,
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let list: Vec<(String, &Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(path, &list)
}

/// The first of `candidates` under which `probe` (an HF name without prefix) exists in
/// `files`: how a checkpoint nests the tower (`""`, `"vision_model."`, ...).
pub fn find_prefix(
    files: &WeightFiles,
    dir: &Path,
    probe: &str,
    candidates: &[&str],
) -> Result<String> {
    candidates
        .iter()
        .find(|p| files.contains(&format!("{p}{probe}")))
        .map(|p| p.to_string())
        .ok_or_else(|| {
            let tried: Vec<String> = candidates.iter().map(|p| format!("{p}{probe}")).collect();
            Error::weights(
                dir,
                probe,
                format!(
                    "missing tensor: none of {} is in the checkpoint",
                    tried.join(", ")
                ),
            )
        })
}
