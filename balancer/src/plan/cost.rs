//! Time and memory of one module's pipeline stage under a layout: FLOPs of a load
//! (linear terms per token, attention per attended pair) at the achieved matmul rate for
//! the GEMM sizes the layout leaves each GPU, TP all-reduces and CP K/V exchanges per
//! block, PP sends, the DP gradient sync, and weights, gradients, AdamW state (ZeRO-1) and
//! activations (with or without recomputation) per GPU.

use crate::cluster::Cluster;
use crate::dims::ModuleDims;
use crate::plan::layout::Layout;

/// Seconds of one task: `compute` occupies the device (shared between ranks on a CPU),
/// `comm` is waiting on links.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    pub compute: f64,
    pub comm: f64,
}

impl Cost {
    pub fn total(&self) -> f64 {
        self.compute + self.comm
    }
    pub fn plus(self, o: Cost) -> Cost {
        Cost {
            compute: self.compute + o.compute,
            comm: self.comm + o.comm,
        }
    }
}

/// The seconds of one forward pass by kind: matmuls and the memory-bound work between
/// them, attention, fixed per-block costs (forward and backward), collectives.
#[derive(Clone, Copy, Debug, Default)]
struct Pass {
    matmul: f64,
    /// The part of `matmul` recomputation does not rerun: the LLM's head and loss, an
    /// encoder's projector (they sit after the recomputed blocks or stage).
    head: f64,
    /// The part of `matmul` that is the blocks' (and stem's) linear layers: their weight
    /// gradients cost as much again in the backward (what zero-bubble pipelining moves
    /// to a W pass).
    weight_grad: f64,
    attention: f64,
    fixed: f64,
    fixed_backward: f64,
    comm: f64,
}

impl Pass {
    fn forward(&self) -> Cost {
        Cost {
            compute: self.matmul + self.attention + self.fixed,
            comm: self.comm,
        }
    }
}

/// Bytes per GPU of one stage.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Memory {
    pub weights: f64,
    pub grads: f64,
    pub optimizer: f64,
    pub activations: f64,
}

impl Memory {
    pub fn total(&self) -> f64 {
        self.weights + self.grads + self.optimizer + self.activations
    }
}

/// One module under one layout on one cluster.
#[derive(Clone, Copy, Debug)]
pub struct StageCost<'a> {
    pub dims: &'a ModuleDims,
    pub layout: Layout,
    pub cluster: &'a Cluster,
    pub recompute: bool,
    pub zero1: bool,
    /// A frozen module has no backward, gradients, optimizer state or sync.
    pub frozen: bool,
    /// Recomputation keeps only each microbatch's stage input (encoders: their chunks
    /// wait for the whole LLM, so per-block inputs would pile up) instead of every
    /// block's input (the LLM).
    pub checkpoint_stages: bool,
    /// The gradient sync runs in buckets beside the compute (NCCL on its own stream): the
    /// reduce behind the last backward, the parameter all-gather behind the next
    /// step's first forward. False: after the backward, as CPU ranks run it.
    pub overlap_sync: bool,
    /// TP splits the norms and residuals by sequence (Megatron's sequence parallelism):
    /// their elementwise work and activations are divided by TP too. False: every TP rank
    /// repeats them and holds them whole (`braid train`'s TP; see
    /// [`Cluster::replicated_elementwise`] and [`crate::dims::ModuleDims::act_bytes_per_token`]).
    pub sequence_parallel: bool,
    /// Blocks of the first stage when it holds fewer than the others, the rest split
    /// evenly (Megatron's first-stage layer count: room for the encoders an LLM-centric
    /// layout puts there); `None`: `layers / pp` on every stage.
    pub first_stage_layers: Option<usize>,
    /// Model chunks per stage (the LLM's virtual pipeline stages, interleaved 1F1B):
    /// chunk `k` of a stage holds `1 / chunks` of its blocks; the first stage's chunk 0
    /// the stem (embedding), the last stage's last chunk the head. 1: one chunk.
    pub chunks: usize,
    /// The first GPU of the module's grid (disjoint placement puts the LLM after the
    /// encoders): where a collective's group meets node boundaries.
    pub first_gpu: usize,
    /// The backward runs split for zero-bubble pipelining (`plan.llm_zero_bubble`): a
    /// microbatch waiting for its W pass holds each linear layer's input and output
    /// gradient, as much as its whole activations, so recomputation saves no memory.
    pub split_backward: bool,
}

impl StageCost<'_> {
    /// Blocks of stage `stage`.
    fn layers(&self, stage: usize) -> f64 {
        let (l, pp) = (self.dims.layers, self.layout.pp.max(1));
        match self.first_stage_layers {
            Some(f) if pp > 1 && f < l => {
                if stage == 0 {
                    f as f64
                } else {
                    (l - f) as f64 / (pp - 1) as f64
                }
            }
            _ => (l / pp) as f64,
        }
    }

    /// The first GPU of stage `stage` (the grid order is TP, CP, DP, PP).
    fn stage_start(&self, stage: usize) -> usize {
        let l = self.layout;
        self.first_gpu + stage * l.tp * l.cp * l.dp
    }

    fn last(&self, stage: usize) -> bool {
        stage + 1 == self.layout.pp
    }

    /// Forward of `tokens` tokens whose sequences' squared lengths sum to `sq`, on one
    /// GPU of stage `stage`.
    pub fn forward(&self, stage: usize, tokens: f64, sq: f64) -> Cost {
        self.pass(stage, tokens, sq).forward()
    }

    /// Forward of model chunk `chunk` of stage `stage` (see [`StageCost::chunks`]).
    pub fn forward_chunk(&self, stage: usize, chunk: usize, tokens: f64, sq: f64) -> Cost {
        self.pass_of(stage, Some(chunk), tokens, sq).forward()
    }

    /// Backward of model chunk `chunk` of stage `stage`.
    pub fn backward_chunk(&self, stage: usize, chunk: usize, tokens: f64, sq: f64) -> Cost {
        self.backward_of(&self.pass_of(stage, Some(chunk), tokens, sq))
    }

    /// Whether this module may run with its backward split for zero-bubble pipelining:
    /// the LLM (the only module with a vocabulary), trained, over two stages or more of
    /// one model chunk each. Its bound must hold for that schedule too.
    pub fn may_split_backward(&self) -> bool {
        self.dims.vocab > 0 && !self.frozen && self.layout.pp >= 2 && self.chunks <= 1
    }

    /// Zero-bubble pipelining's split of [`StageCost::backward_chunk`] into `(B, W)`: W
    /// the linear layers' weight-gradient GEMMs (their forward's FLOPs again, at its
    /// rate), B the rest, with the backward's collectives.
    pub fn split_backward_chunk(
        &self,
        stage: usize,
        chunk: usize,
        tokens: f64,
        sq: f64,
    ) -> (Cost, Cost) {
        let p = self.pass_of(stage, Some(chunk), tokens, sq);
        let whole = self.backward_of(&p);
        let w = if self.frozen {
            0.0
        } else {
            p.weight_grad.min(whole.compute)
        };
        (
            Cost {
                compute: whole.compute - w,
                comm: whole.comm,
            },
            Cost {
                compute: w,
                comm: 0.0,
            },
        )
    }

    /// The forward's parts, which the backward scales differently.
    fn pass(&self, stage: usize, tokens: f64, sq: f64) -> Pass {
        self.pass_of(stage, None, tokens, sq)
    }

    /// A pass of the whole stage (`chunk = None`) or of one of its chunks.
    fn pass_of(&self, stage: usize, chunk: Option<usize>, tokens: f64, sq: f64) -> Pass {
        if tokens <= 0.0 {
            return Pass::default();
        }
        let (d, l, c) = (self.dims, self.layout, self.cluster);
        let split = (l.tp * l.cp) as f64;
        let rows = tokens / l.cp as f64; // GEMM rows on one GPU
        let v = self.chunks.max(1);
        let (stem_here, head_here) = match chunk {
            None => (true, true),
            Some(k) => (k == 0, k + 1 == v),
        };
        let layers = match chunk {
            None => self.layers(stage),
            Some(_) => self.layers(stage) / v as f64,
        };
        // The representative GEMM: the MLP's up projection on this GPU's share.
        let gemm = 2.0 * rows * d.hidden as f64 * (d.ffn / l.tp).max(1) as f64;
        let rate = c.matmul_rate(gemm);
        let mut linear = tokens * layers * d.layer_flops_per_token() / split;
        // An encoder's stem and projector, charged like the blocks (over TP x CP): at
        // the scale of the reference models they are 1-7 % of an encoder's work, in a
        // tiny CPU model as much as its blocks.
        if stage == 0 && stem_here {
            linear += tokens * d.stem_flops_per_token / split;
        }
        let mut head = 0.0;
        if self.last(stage) && head_here {
            let mut flops = tokens * d.projector_flops_per_token / split;
            let mut logits = 0.0;
            if d.vocab > 0 {
                flops += 2.0 * tokens * (d.vocab * d.hidden) as f64 / split;
                // The loss's softmax over this GPU's vocabulary shard of its logits.
                logits = tokens / split * d.vocab as f64;
            }
            head = flops / rate + logits * c.elementwise_ns * 1e-9;
        }
        let attention = layers * d.attention_flops_per_pair() * sq / split;
        // Activations touched, per GPU; without sequence parallelism the hidden-size share
        // of them is on every TP rank.
        let tp_share = if self.sequence_parallel {
            1.0 / l.tp as f64
        } else {
            let r = c.replicated_elementwise;
            r + (1.0 - r) / l.tp as f64
        };
        let values = layers * tokens / l.cp as f64 * d.hidden as f64 * tp_share;
        let elementwise = values * c.elementwise_ns * 1e-9;
        let matmul = linear / rate + elementwise + head;
        let attention = attention / (rate * c.attention_efficiency);
        // Sequence-parallel TP: a reduce-scatter and an all-gather around attention and
        // around the MLP (the volume of two all-reduces) per block.
        let act = rows * d.hidden as f64 * c.compute_bytes;
        let tp = 2.0 * layers * c.intra.all_reduce(act, l.tp);
        // CP: each rank gathers the K and V of its TP head shard from the other CP ranks.
        let kv = 2.0 * tokens * (d.kv_heads * d.head_dim) as f64 * c.compute_bytes / l.tp as f64;
        let cp = layers
            * c.group_link(self.stage_start(stage), l.tp * l.cp, l.tp)
                .gather(kv, l.cp);
        Pass {
            matmul,
            head,
            weight_grad: linear / rate,
            attention,
            fixed: layers * c.layer_overhead_us * 1e-6,
            fixed_backward: layers * c.backward_overhead_us() * 1e-6,
            comm: tp + cp,
        }
    }

    /// Backward: twice the forward's linear FLOPs (input and weight grads), attention's
    /// backward at `cluster.attention_backward` times its forward (flash: 2.5), the
    /// backward's own fixed cost, plus with recomputation a forward of everything but the
    /// head (or projector); the adjoint collectives of the forward's.
    pub fn backward(&self, stage: usize, tokens: f64, sq: f64) -> Cost {
        self.backward_of(&self.pass(stage, tokens, sq))
    }

    fn backward_of(&self, p: &Pass) -> Cost {
        if self.frozen {
            return Cost::default();
        }
        let again = if self.recompute { 1.0 } else { 0.0 };
        Cost {
            compute: 2.0 * p.matmul
                + self.cluster.attention_backward * p.attention
                + p.fixed_backward
                + again * (p.forward().compute - p.head),
            comm: (1.0 + again) * p.comm,
        }
    }

    /// Seconds of [`StageCost::forward`] and of [`StageCost::backward`] of `tokens`
    /// tokens on stage `stage`, each as `(a, b)`: `a + b * sq` for sequences whose squared
    /// lengths sum to `sq` (a pass is linear in it at a given size).
    pub fn linear_in_sq(&self, stage: usize, tokens: f64) -> [(f64, f64); 2] {
        // Probed at one full sequence's squared length, where the difference is exact to
        // rounding.
        let probe = (tokens * tokens).max(1.0);
        let (bare, full) = (
            self.pass(stage, tokens, 0.0),
            self.pass(stage, tokens, probe),
        );
        let (f0, f1) = (bare.forward().total(), full.forward().total());
        let (b0, b1) = (
            self.backward_of(&bare).total(),
            self.backward_of(&full).total(),
        );
        [(f0, (f1 - f0) / probe), (b0, (b1 - b0) / probe)]
    }

    /// Boundaries a microbatch crosses one way: `pp - 1` between stages, `chunks pp - 1`
    /// round an interleaved ring (each a [`StageCost::send`]).
    pub fn boundaries(&self) -> f64 {
        (self.layout.pp * self.chunks.max(1)).saturating_sub(1) as f64
    }

    /// Sending one microbatch's boundary activations to the next stage (each TP rank its
    /// sequence shard).
    pub fn send(&self, tokens: f64) -> f64 {
        let l = self.layout;
        if l.pp <= 1 {
            return 0.0;
        }
        let bytes =
            tokens / (l.cp * l.tp) as f64 * self.dims.hidden as f64 * self.cluster.compute_bytes;
        self.cluster.link(l.block() * l.dp + 1).send(bytes)
    }

    /// Parameters of stage `stage` on one GPU.
    pub fn params(&self, stage: usize) -> f64 {
        let d = self.dims;
        let mut p = self.layers(stage) * d.layer_params() as f64;
        if stage == 0 {
            p += (d.vocab * d.hidden) as f64 + d.extra_params as f64;
        }
        if self.last(stage) && !d.tied {
            p += (d.vocab * d.hidden) as f64;
        }
        p / self.layout.tp as f64
    }

    /// The gradient sync after the last backward: f32 grads reduce-scattered to their
    /// ZeRO-1 owners and bf16 params all-gathered back (or one all-reduce without ZeRO-1)
    /// over the stage's CP × DP ranks.
    pub fn dp_sync(&self, stage: usize) -> f64 {
        let (reduce, gather) = self.sync_parts(stage);
        reduce + gather
    }

    /// `(before the optimizer step, after it)` seconds of the gradient sync.
    fn sync_parts(&self, stage: usize) -> (f64, f64) {
        let l = self.layout;
        let n = l.cp * l.dp;
        if self.frozen || n <= 1 {
            return (0.0, 0.0);
        }
        let p = self.params(stage);
        // A stage's CP x DP group: PP is the grid's outermost dimension.
        let link = self
            .cluster
            .group_link(self.stage_start(stage), l.tp * l.cp * l.dp, l.tp);
        if self.zero1 {
            let params = self.cluster.compute_bytes * p;
            (link.gather(4.0 * p, n), link.gather(params, n))
        } else {
            (link.all_reduce(4.0 * p, n), 0.0)
        }
    }

    /// The part of the gradient sync the step waits for, given the seconds of this
    /// stage's last backward (the reduce's window: its grads become final block by block)
    /// and of its first forward (the all-gather's, the next step's). Without overlap: all
    /// of it. With it: what the window does not cover, and at least one block's share
    /// (the last bucket starts when the pass ends).
    pub fn exposed_sync(&self, stage: usize, last_backward: f64, first_forward: f64) -> f64 {
        if !self.overlap_sync {
            return self.dp_sync(stage);
        }
        let (reduce, gather) = self.sync_parts(stage);
        let layers = self.layers(stage).max(1.0);
        let hidden = |t: f64, window: f64| (t - window * (1.0 - 1.0 / layers)).max(t / layers);
        hidden(reduce, last_backward) + hidden(gather, first_forward)
    }

    /// Memory per GPU of stage `stage` holding activations of `inflight` tokens (every
    /// microbatch in flight) whose largest microbatch has `largest` tokens.
    pub fn memory(&self, stage: usize, inflight: f64, largest: f64) -> Memory {
        let (d, l) = (self.dims, self.layout);
        let p = self.params(stage);
        let (grads, optimizer) = if self.frozen {
            (0.0, 0.0)
        } else {
            let owners = if self.zero1 {
                (l.dp * l.cp) as f64
            } else {
                1.0
            };
            (4.0 * p, 12.0 * p / owners)
        };
        let per_cp = |t: f64| t / l.cp as f64;
        let sp = self.sequence_parallel;
        let mut activations = if self.frozen {
            // Inference only: one block's working set.
            per_cp(largest) * d.act_bytes_per_token(l.tp, false, sp)
        } else {
            // Split, a microbatch between its B and its W holds every linear's input and
            // output gradient: the whole activations' size, recomputed or not.
            let saves = self.recompute && !self.split_backward;
            let kept = if saves && self.checkpoint_stages {
                1.0
            } else {
                self.layers(stage)
            };
            let mut a = per_cp(inflight) * kept * d.act_bytes_per_token(l.tp, saves, sp);
            if saves {
                // The recomputed working set: one block, or the whole stage of one chunk.
                let span = if self.checkpoint_stages {
                    self.layers(stage)
                } else {
                    1.0
                };
                a += per_cp(largest) * span * d.act_bytes_per_token(l.tp, false, sp);
            }
            a
        };
        // The activation counts are of bf16 values; ranks that compute in f32 (Braid's
        // CPU ranks, `compute_bytes` 4) hold twice as many bytes.
        activations *= self.cluster.compute_bytes / 2.0;
        if self.last(stage) && d.vocab > 0 {
            // f32 logits of the vocab shard and their grad.
            activations += per_cp(largest) * (d.vocab / l.tp) as f64 * 8.0;
        }
        Memory {
            weights: self.cluster.compute_bytes * p,
            grads,
            optimizer,
            activations,
        }
    }
}

#[cfg(test)]
#[path = "cost_tests.rs"]
mod tests;
