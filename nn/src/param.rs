//! Parameters, the `Module` trait that lists them by name, and deterministic,
//! tensor-parallel-aware initialization.

use braid_kernels::rng::Rng;
use braid_kernels::{DType, Device, Tensor, ops};

use crate::error::{Context, Error, Result};

/// A named weight and its gradient buffer.
///
/// `grad == None` means frozen: backward passes `None` to the ops, so no weight grad
/// is computed at all (not computed and dropped). Input grads are unaffected.
///
/// Under mixed precision `value` stays the f32 master (what the optimizer updates and
/// checkpoints hold) and `compute` is its bf16 copy, which the layers read
/// ([`Param::compute`]); the grad stays f32 and gathers the bf16 products unrounded.
#[derive(Debug)]
pub struct Param {
    /// Full dotted name, Hugging Face style: `blocks.3.self_attn.q_proj.weight`.
    pub name: String,
    /// This rank's value (a shard of the full tensor under tensor parallelism).
    pub value: Tensor,
    /// Accumulated gradient, same shape as `value`; `None` when frozen.
    pub grad: Option<Tensor>,
    /// Which part of the full tensor `value` is (tensor parallelism splits some
    /// parameters; checkpoints store shards under the full name and reassemble them).
    pub shard: Shard,
    /// The compute copy (bf16) under mixed precision; `None` computes on `value`.
    compute: Option<Tensor>,
    /// While set, a linear layer's backward keeps its weight gradient's inputs in
    /// `deferred` instead of computing it (zero-bubble pipelining, [`crate::wgrad`]).
    pub(crate) defer_wgrad: bool,
    /// `(dy, x)` of each weight gradient deferred, in backward order.
    /// Shared where several weights read one input (q, k and v; gate and up).
    pub(crate) deferred: Vec<(std::sync::Arc<Tensor>, std::sync::Arc<Tensor>)>,
}

impl Param {
    /// A trainable parameter with a zero gradient buffer.
    pub fn new(name: impl Into<String>, value: Tensor) -> Result<Self> {
        let name = name.into();
        let grad = Tensor::zeros(value.shape().clone(), value.dtype(), value.device())
            .ctx(&name, "allocating grad")?;
        Ok(Param {
            name,
            value,
            grad: Some(grad),
            shard: Shard::Full,
            compute: None,
            defer_wgrad: false,
            deferred: Vec::new(),
        })
    }

    /// A frozen parameter: no gradient buffer is allocated.
    pub fn frozen(name: impl Into<String>, value: Tensor) -> Self {
        Param {
            name: name.into(),
            value,
            grad: None,
            shard: Shard::Full,
            compute: None,
            defer_wgrad: false,
            deferred: Vec::new(),
        }
    }

    /// The tensor the layers compute with: the bf16 copy under mixed precision,
    /// otherwise `value` itself.
    pub fn compute(&self) -> &Tensor {
        self.compute.as_ref().unwrap_or(&self.value)
    }

    /// The dtype the layers compute this weight in.
    pub fn compute_dtype(&self) -> DType {
        self.compute().dtype()
    }

    /// Makes the layers compute in `dtype`: bf16 keeps a rounded copy of `value`
    /// (refreshed by [`Param::refresh_compute`] and the optimizer), the master's own
    /// dtype drops the copy.
    pub fn set_compute_dtype(&mut self, dtype: DType) -> Result<()> {
        self.compute = if dtype == self.value.dtype() {
            None
        } else {
            Some(ops::cast(&self.value, dtype).ctx(&self.name, "making the compute copy")?)
        };
        Ok(())
    }

    /// Re-derives the compute copy from `value` after `value` changed outside the
    /// optimizer (a checkpoint or Hugging Face load, a broadcast).
    pub fn refresh_compute(&mut self) -> Result<()> {
        match &self.compute {
            Some(c) => {
                let dtype = c.dtype();
                self.set_compute_dtype(dtype)
            }
            None => Ok(()),
        }
    }

    /// The compute tensor and the grad, borrowed together for a backward.
    pub fn compute_and_grad(&mut self) -> (&Tensor, Option<&mut Tensor>) {
        (
            self.compute.as_ref().unwrap_or(&self.value),
            self.grad.as_mut(),
        )
    }

    /// The master value, its grad and the compute copy to refresh, borrowed together
    /// for the optimizer's fused step.
    pub fn parts_mut(&mut self) -> (&mut Tensor, Option<&Tensor>, Option<&mut Tensor>) {
        (&mut self.value, self.grad.as_ref(), self.compute.as_mut())
    }

    pub fn is_trainable(&self) -> bool {
        self.grad.is_some()
    }

    /// Drops the gradient buffer: backward stops computing this weight's grad.
    pub fn freeze(&mut self) {
        self.grad = None;
    }

    /// Gives a frozen parameter a zero gradient buffer again (no-op when trainable).
    pub fn unfreeze(&mut self) -> Result<()> {
        if self.grad.is_none() {
            let v = &self.value;
            self.grad = Some(
                Tensor::zeros(v.shape().clone(), v.dtype(), v.device())
                    .ctx(&self.name, "allocating grad")?,
            );
        }
        Ok(())
    }

    /// Sets the gradient to zero (no-op when frozen).
    pub fn zero_grad(&mut self) -> Result<()> {
        match &mut self.grad {
            Some(g) => g.zero_().ctx(&self.name, "zeroing grad"),
            None => Ok(()),
        }
    }
}

/// A layer or model that owns parameters.
///
/// Visiting order is fixed (construction order), so it can index optimizer state and
/// checkpoints; names are unique within a model.
pub trait Module {
    /// Calls `f` on every parameter.
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param));
    /// Calls `f` on every parameter, mutably.
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param));

    /// Sets every gradient to zero (between optimizer steps).
    fn zero_grads(&mut self) -> Result<()> {
        let mut res = Ok(());
        self.visit_params_mut(&mut |p| {
            if res.is_ok() {
                res = p.zero_grad();
            }
        });
        res
    }

    /// Freezes every parameter (an encoder that is not trained).
    fn freeze(&mut self) {
        self.visit_params_mut(&mut |p| p.freeze());
    }

    /// Makes every parameter trainable again, with zero grads.
    fn unfreeze(&mut self) -> Result<()> {
        let mut res = Ok(());
        self.visit_params_mut(&mut |p| {
            if res.is_ok() {
                res = p.unfreeze();
            }
        });
        res
    }

    /// `(name, local shape)` of every parameter, in visiting order.
    fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let mut out = Vec::new();
        self.visit_params(&mut |p| out.push((p.name.clone(), p.value.dims().to_vec())));
        out
    }

    /// Makes every parameter compute in `dtype` (see [`Param::set_compute_dtype`]).
    fn set_compute_dtype(&mut self, dtype: DType) -> Result<()> {
        let mut res = Ok(());
        self.visit_params_mut(&mut |p| {
            if res.is_ok() {
                res = p.set_compute_dtype(dtype);
            }
        });
        res
    }

    /// Re-derives every compute copy from its master value (after a load).
    fn refresh_compute(&mut self) -> Result<()> {
        let mut res = Ok(());
        self.visit_params_mut(&mut |p| {
            if res.is_ok() {
                res = p.refresh_compute();
            }
        });
        res
    }

    /// The dtype the layers compute in (that of the first parameter; f32 for none).
    fn compute_dtype(&self) -> DType {
        let mut dtype = None;
        self.visit_params(&mut |p| {
            dtype.get_or_insert(p.compute_dtype());
        });
        dtype.unwrap_or(DType::F32)
    }

    /// Number of parameter elements held by this rank.
    fn num_params(&self) -> usize {
        let mut n = 0;
        self.visit_params(&mut |p| n += p.value.elem_count());
        n
    }
}

/// Which part of a full parameter this rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shard {
    /// The whole tensor (replicated across the TP group).
    Full,
    /// Slice `rank` of `size` equal slices along dimension `dim`.
    Split {
        dim: usize,
        rank: usize,
        size: usize,
    },
}

impl Shard {
    /// The full tensor's shape, from the shape `local` of this slice of it (`name` for
    /// the error: a slice of a dimension `local` does not have).
    pub fn full_dims(self, name: &str, local: &[usize]) -> Result<Vec<usize>> {
        let mut full = local.to_vec();
        if let Shard::Split { dim, size, .. } = self {
            match full.get_mut(dim) {
                Some(d) => *d *= size,
                None => {
                    return Err(Error::config(
                        "Shard",
                        format!("{name}: shape {local:?} has no dimension {dim} to split"),
                    ));
                }
            }
        }
        Ok(full)
    }
}

/// How a parameter is initialized before it is sharded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InitKind {
    /// Normal(0, std).
    Normal(f32),
    /// Every element `value` (norm weights 1, biases 0).
    Constant(f32),
}

/// Where and how layers create their parameters.
///
/// Each parameter is drawn from `Rng::for_name(seed, full_name)` as the FULL
/// (unsharded) tensor, then this rank's shard is cut from it: the TP ranks together
/// hold exactly the single-rank weights, and no weight depends on construction order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Init {
    pub seed: u64,
    pub device: Device,
    /// Standard deviation of linear and embedding weights (GPT-2 / Llama: 0.02).
    pub std: f32,
    /// Whether the parameters get gradient buffers ([`Init::frozen`]: weights only, for
    /// a model that is read, evaluated or exported but not trained).
    pub trainable: bool,
}

impl Init {
    /// Seed and device; `std` = 0.02.
    pub fn new(seed: u64, device: Device) -> Self {
        Init {
            seed,
            device,
            std: 0.02,
            trainable: true,
        }
    }

    /// For a model whose weights are about to be loaded from a checkpoint: every
    /// weight starts at zero (no random draws, which for a 7B model would cost more
    /// than the load itself), and each is then overwritten one tensor at a time.
    pub fn for_loading(device: Device) -> Self {
        Init {
            seed: 0,
            device,
            std: 0.0,
            trainable: true,
        }
    }

    /// The same init without gradient buffers: every parameter is created frozen, so a
    /// model only read (evaluated, exported) never allocates its grads.
    pub fn frozen(self) -> Self {
        Init {
            trainable: false,
            ..self
        }
    }

    /// The same init with another weight std (e.g. a scaled output projection).
    pub fn with_std(self, std: f32) -> Self {
        Init { std, ..self }
    }

    /// Creates the trainable parameter `name` of full shape `full`, keeping `shard`.
    pub fn param(&self, name: &str, full: &[usize], kind: InitKind, shard: Shard) -> Result<Param> {
        // Checked and reserved fallibly: a size no machine holds is an error naming the
        // parameter, not a wrapped shape or an allocation abort.
        let too_big = |why: String| {
            Error::config(
                "parameter",
                format!(
                    "`{name}` of shape {full:?}: {why}; is a model size in the config too large?"
                ),
            )
        };
        let n = full
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| too_big("the element count overflows".into()))?;
        let mut data: Vec<f32> = Vec::new();
        data.try_reserve_exact(n).map_err(|e| {
            too_big(format!(
                "{:.1} GiB cannot be allocated ({e})",
                n as f64 * 4.0 / (1u64 << 30) as f64
            ))
        })?;
        let data = match kind {
            InitKind::Normal(std) if std != 0.0 => {
                Rng::for_name(self.seed, name).extend_normal(&mut data, n, std);
                data
            }
            // std 0 is all zeros: skip the generator (see `for_loading`). `vec!` takes
            // zeroed pages from the allocator instead of writing them (the room is known
            // to exist now).
            InitKind::Normal(_) => {
                drop(data);
                vec![0.0; n]
            }
            InitKind::Constant(v) => {
                drop(data);
                vec![v; n]
            }
        };
        let (data, dims) = cut_shard(name, data, full, shard)?;
        let value = Tensor::from_vec(data, dims, self.device).ctx(name, "creating parameter")?;
        let mut p = if self.trainable {
            Param::new(name, value)?
        } else {
            Param::frozen(name, value)
        };
        p.shard = shard;
        Ok(p)
    }
}

/// Cuts `shard` out of `data`, a row-major tensor of shape `full`, on the host.
pub fn cut_shard(
    name: &str,
    data: Vec<f32>,
    full: &[usize],
    shard: Shard,
) -> Result<(Vec<f32>, Vec<usize>)> {
    let (dim, rank, size) = match shard {
        Shard::Full => return Ok((data, full.to_vec())),
        Shard::Split { dim, rank, size } => (dim, rank, size),
    };
    let Some(&d) = full.get(dim) else {
        return Err(Error::config(
            "Shard",
            format!("{name}: shape {full:?} has no dimension {dim} to split"),
        ));
    };
    if size == 0 || rank >= size || d % size != 0 {
        return Err(Error::config(
            "Shard",
            format!(
                "{name}: cannot take slice {rank} of {size} of dimension {dim} = {d} of {full:?}"
            ),
        ));
    }
    // View the tensor as (outer, d, inner) and keep rows [rank * d/size, (rank+1) * d/size)
    // of the middle axis.
    let outer: usize = full[..dim].iter().product();
    let inner: usize = full[dim + 1..].iter().product();
    let part = d / size;
    let mut out = Vec::with_capacity(outer * part * inner);
    for o in 0..outer {
        let start = (o * d + rank * part) * inner;
        out.extend_from_slice(&data[start..start + part * inner]);
    }
    let mut dims = full.to_vec();
    dims[dim] = part;
    Ok((out, dims))
}
