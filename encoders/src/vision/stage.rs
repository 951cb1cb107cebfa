//! Pipeline stages and context parallelism (CP) of the [`VisionEncoder`].
//!
//! **Stages.** [`VisionEncoder::stage`] holds layers `layers`; the first stage
//! ([`VisionEncoder::is_first`]) takes pixels and owns the embeddings, the last
//! ([`VisionEncoder::is_last`]) owns the post-norm and pooling head and returns the
//! [`VisionOutput`]. Between stages travel the hidden states of this rank's tokens,
//! (N_local, D) with N_local = [`VisionEncoder::hidden_tokens`]: rank r of the CP group
//! of one stage sends to rank r of the CP group of the next (both must have the same
//! CP size). The whole model is the one stage that is both, and
//! [`VisionEncoder::forward_stage`] on it from pixels is [`VisionEncoder::forward`].
//!
//! **CP** ([`VisionEncoder::with_cp`], a group of cp > 1 ranks). The B images are B
//! samples of S tokens packed back to back (`cu_seqlens` = [0, S, ..., B*S]); they are
//! split with `CpPlan::new(cu_seqlens, cp, false)` (bidirectional): each rank holds
//! two chunks of every image, its tokens in ascending global order. Every CP rank is
//! given the same full pixels; the first stage patchifies them whole (a copy, no
//! math) and embeds only its own tokens. The blocks run on the local tokens
//! (attention all-gathers K/V). The last stage all-gathers the hidden states back to
//! the full (B*S, D) and runs the post-norm and head on them replicated, so every CP
//! rank returns the same full [`VisionOutput`], bit for bit.
//!
//! The backward is the adjoint. The last stage takes the full output grads (the same
//! on every CP rank), runs the post-norm/head backward replicated and keeps its own
//! tokens' rows: the adjoint of an all-gather whose consumer is replicated is the
//! slice, not a sum. The blocks and the embedding then run on the local tokens.
//!
//! **Grad rule under CP: every parameter grad and d pixels are partial, and their
//! SUM over the CP ranks is the true one.** Parameters that see only local tokens
//! (patch/class/position embeddings, pre-norm, blocks) naturally hold their tokens'
//! share. The post-norm and the pooling head run replicated; to keep the rule uniform
//! only CP rank 0 adds their grads, the other ranks leave them untouched. So the
//! trainer all-reduces every vision parameter grad over CP (x DP) with no special
//! case. d pixels (first stage): each rank returns the grad through its own tokens'
//! patches (zero elsewhere); the sum over CP ranks is the true d pixels.

use braid_kernels::{Shape, Tensor, ops};
use braid_nn::error::Context;
use braid_nn::norm::LayerNormCache;
use braid_nn::{BlockCache, CpPlan, Error, LinearCache, Module, Result, SeqInfo};

use super::{VisionEncoder, VisionOutput};
use crate::config::VisionFamily;
use crate::siglip_head::HeadCache;
use crate::util::{ids, zeros};

/// What a stage's forward starts from.
#[derive(Debug)]
pub enum VisionStageInput<'a> {
    /// First stage: pixel_values (B, C, H, W), the same full batch on every CP rank.
    Pixels(&'a Tensor),
    /// Later stages: the previous stage's output on this CP rank, (N_local, D).
    Hidden(Tensor),
}

/// What a stage's forward returns.
#[derive(Debug)]
pub enum VisionStageOutput {
    /// A stage before the last: this rank's tokens' hidden states (N_local, D), for
    /// the next stage.
    Hidden(Tensor),
    /// The last stage: the full output, the same on every CP rank.
    Final(VisionOutput),
}

/// The tokens of a batch of B images on this rank.
#[derive(Debug)]
struct Layout {
    /// images, patches per image, tokens per image
    b: usize,
    n: usize,
    s: usize,
    /// The CP split and this rank's index in it; None without CP.
    cp: Option<(CpPlan, usize)>,
    /// This rank's tokens (all B*S of them without CP).
    seq: SeqInfo,
}

impl Layout {
    /// Global token index (in the packed B*S rows) of local row `k`.
    fn global(&self, k: usize) -> Result<usize> {
        match &self.cp {
            None => Ok(k),
            Some((plan, rank)) => {
                plan.tokens(*rank)?.get(k).copied().ok_or_else(|| {
                    Error::input("vision cp", format!("local row {k} is out of range"))
                })
            }
        }
    }
}

/// What the embedding's backward needs (first stage).
#[derive(Debug)]
struct EmbedCache {
    image_shape: Shape,
    patch: LinearCache,
    /// (N_p) u32: which of the B*N patches this rank embeds; None = all, in order.
    patch_src: Option<Tensor>,
    /// (N_p) u32: their local rows; None = the local rows are exactly those patches.
    patch_rows: Option<Tensor>,
    /// CLIP: (M) u32 local rows of the class tokens held here and (M) u32 zeros (the
    /// broadcast of the one class embedding); None when none is held.
    cls: Option<(Tensor, Tensor)>,
    /// (N_local) u32: each token's position within its image
    pos_ids: Tensor,
    pre: Option<LayerNormCache>,
}

/// What the post-norm/head backward needs (last stage).
#[derive(Debug)]
enum FinalCache {
    /// pooled = post_layernorm(class tokens at `first_rows` (B) u32).
    Clip {
        first_rows: Tensor,
        post: LayerNormCache,
    },
    Siglip {
        post: LayerNormCache,
        /// Boxed: far larger than the other variant.
        head: Option<Box<HeadCache>>,
    },
}

/// Every activation a stage's backward needs (see [`super::VisionCache`]).
#[derive(Debug)]
pub(super) struct StageActs {
    layout: Layout,
    embed: Option<EmbedCache>,
    blocks: Vec<BlockCache>,
    fin: Option<FinalCache>,
}

/// Takes the grads of `m`'s parameters out (so that a backward adds nothing to them).
fn take_grads<M: Module>(m: &mut M) -> Vec<Option<Tensor>> {
    let mut out = Vec::new();
    m.visit_params_mut(&mut |p| out.push(p.grad.take()));
    out
}

/// Puts back what [`take_grads`] took.
fn put_grads<M: Module>(m: &mut M, grads: Vec<Option<Tensor>>) {
    let mut it = grads.into_iter();
    m.visit_params_mut(&mut |p| {
        if let Some(g) = it.next() {
            p.grad = g;
        }
    });
}

impl VisionEncoder {
    /// The token layout of `b` images on this rank.
    fn layout(&self, b: usize) -> Result<Layout> {
        if b == 0 {
            return Err(Error::input("vision", "a batch of B = 0 images"));
        }
        let (n, s) = (self.config.num_patches(), self.seq_len());
        let full = SeqInfo::packed(&vec![s; b]);
        let Some(group) = &self.cp else {
            return Ok(Layout {
                b,
                n,
                s,
                cp: None,
                seq: full,
            });
        };
        let (cp, rank) = (group.size(), group.rank());
        let plan = CpPlan::new(&full.cu_seqlens, cp, false).ctx("vision cp", "plan")?;
        let seq = plan.seq_info(rank, &full).ctx("vision cp", "plan")?;
        if seq.num_tokens() == 0 {
            return Err(Error::config(
                "vision cp",
                format!(
                    "CP rank {rank} of {cp} holds no token of {b} images of S = {s} tokens (each image is cut into 2 * cp = {} chunks): use a smaller CP group",
                    2 * cp
                ),
            ));
        }
        Ok(Layout {
            b,
            n,
            s,
            cp: Some((plan, rank)),
            seq,
        })
    }

    /// N_local: the rows of the hidden states (N_local, D) this rank's stages pass
    /// between them for `b` images (B*S without CP).
    pub fn hidden_tokens(&self, b: usize) -> Result<usize> {
        Ok(self.layout(b)?.seq.num_tokens())
    }

    /// [`Self::forward_stage`] keeping every activation.
    pub(super) fn forward_acts(
        &self,
        input: VisionStageInput<'_>,
        b: usize,
    ) -> Result<(VisionStageOutput, StageActs)> {
        let layout = self.layout(b)?;
        let d = self.config.hidden_size;
        let t_local = layout.seq.num_tokens();
        let (mut x, embed) = match input {
            VisionStageInput::Pixels(px) if self.is_first() => {
                let (pb, _) = self.check_images(px)?;
                if pb != b {
                    return Err(Error::input(
                        "vision stage",
                        format!("pixel_values {} hold {pb} images, b = {b}", px.shape()),
                    ));
                }
                let (x, c) = self.embed_fwd(px, &layout)?;
                (x, Some(c))
            }
            VisionStageInput::Hidden(h) if !self.is_first() => {
                if h.dims() != [t_local, d] {
                    return Err(Error::input(
                        "vision stage",
                        format!(
                            "the hidden states {} from the previous stage must be (N_local, D) = [{t_local}, {d}] for {b} images",
                            h.shape()
                        ),
                    ));
                }
                (h, None)
            }
            _ => {
                return Err(Error::input(
                    "vision stage",
                    format!(
                        "the stage of layers {:?} takes {}",
                        self.layers,
                        if self.is_first() {
                            "pixel_values (it holds the embeddings)"
                        } else {
                            "the previous stage's hidden states, not pixels"
                        }
                    ),
                ));
            }
        };
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for blk in &self.blocks {
            let (y, c) = blk.forward_owned(x, &layout.seq)?;
            blocks.push(c);
            x = y;
        }
        let (out, fin) = if self.is_last() {
            let (out, fin) = self.final_fwd(x, &layout)?;
            (VisionStageOutput::Final(out), Some(fin))
        } else {
            (VisionStageOutput::Hidden(x), None)
        };
        let cache = StageActs {
            layout,
            embed,
            blocks,
            fin,
        };
        Ok((out, cache))
    }

    /// [`Self::backward_stage`] from every activation.
    pub(super) fn backward_acts(
        &mut self,
        cache: StageActs,
        dout: &Tensor,
        dpooled: Option<&Tensor>,
    ) -> Result<Tensor> {
        let StageActs {
            layout,
            embed,
            blocks,
            fin,
        } = cache;
        if blocks.len() != self.blocks.len()
            || fin.is_some() != self.is_last()
            || embed.is_some() != self.is_first()
        {
            return Err(Error::input(
                "vision backward",
                "cache does not match this model",
            ));
        }
        let mut dx = match fin {
            Some(fin) => self.final_bwd(fin, &layout, dout, dpooled)?,
            None => {
                let (t, d) = (layout.seq.num_tokens(), self.config.hidden_size);
                if dout.dims() != [t, d] {
                    return Err(Error::input(
                        "vision backward",
                        format!(
                            "d hidden {} must be (N_local, D) = [{t}, {d}]",
                            dout.shape()
                        ),
                    ));
                }
                dout.try_clone().ctx("vision backward", "d hidden")?
            }
        };
        for (blk, c) in self.blocks.iter_mut().zip(blocks).rev() {
            dx = blk.backward(c, &dx)?;
        }
        match embed {
            Some(e) => self.embed_bwd(e, &layout, dx),
            None => Ok(dx),
        }
    }

    /// pixels (B, C, H, W) -> this rank's tokens (N_local, D): patches or class token,
    /// plus position, then CLIP's pre-norm.
    fn embed_fwd(&self, px: &Tensor, lay: &Layout) -> Result<(Tensor, EmbedCache)> {
        let missing = || Error::input("vision", "this stage holds no embeddings");
        let patch_embedding = self.patch_embedding.as_ref().ok_or_else(missing)?;
        let position = self.position_embedding.as_ref().ok_or_else(missing)?;
        let (b, n, s) = (lay.b, lay.n, lay.s);
        let d = self.config.hidden_size;
        let dev = px.device();
        let clip = self.class_embedding.is_some();
        let off = usize::from(clip);
        let t = lay.seq.num_tokens();

        // Where each local token comes from: image i's token j is its class token
        // (CLIP, j = 0) or patch i*N + j - off.
        let (mut src, mut rows, mut cls_rows) = (Vec::new(), Vec::new(), Vec::new());
        for k in 0..t {
            let g = lay.global(k)?;
            let (i, j) = (g / s, g % s);
            if clip && j == 0 {
                cls_rows.push(k as u32);
            } else {
                src.push((i * n + j - off) as u32);
                rows.push(k as u32);
            }
        }
        let all = src.len() == b * n && src.iter().enumerate().all(|(k, &p)| p as usize == k);
        let patch_src = if all { None } else { Some(ids(src, dev)?) };

        // Every rank patchifies the whole batch (a copy) and embeds its own patches.
        let patches = ops::patchify_fwd(px, self.config.patch_size)
            .and_then(|x| {
                let cpp = x.dims()[2];
                x.reshape([b * n, cpp])
            })
            .ctx("vision", "patchify")?; // (B*N, C*P*P)
        let patches = match &patch_src {
            Some(idx) => ops::gather_rows(&patches, idx).ctx("vision", "local patches")?, // (N_p, C*P*P)
            None => patches,
        };
        let patches = ops::into_dtype(patches, patch_embedding.weight.compute_dtype())
            .ctx("vision", "patches to the compute dtype")?;
        let (pe, patch) = patch_embedding.forward_owned(patches)?; // (N_p, D)

        let (mut x, patch_rows) = if clip {
            let mut x = zeros(&[t, d], pe.dtype(), dev)?; // (N_local, D)
            let rows = ids(rows, dev)?;
            ops::scatter_rows(&mut x, &rows, &pe).ctx("vision", "place patches")?;
            (x, Some(rows))
        } else {
            (pe, None) // SigLIP: every token is a patch, in order
        };
        let cls = match &self.class_embedding {
            Some(cls) if !cls_rows.is_empty() => {
                let m = cls_rows.len();
                let (rows, zeros_m) = (ids(cls_rows, dev)?, ids(vec![0; m], dev)?);
                let c = ops::gather_rows(cls.compute(), &zeros_m).ctx("vision", "class token")?; // (M, D)
                ops::scatter_rows(&mut x, &rows, &c).ctx("vision", "place class")?;
                Some((rows, zeros_m))
            }
            _ => None,
        };
        let pos_ids = ids(lay.seq.positions.clone(), dev)?;
        let pos_emb = ops::gather_rows(position.compute(), &pos_ids).ctx("vision", "positions")?; // (N_local, D)
        ops::add_assign(&mut x, &pos_emb).ctx("vision", "add positions")?;

        let (x, pre) = match &self.pre_layrnorm {
            Some(ln) => {
                let (y, c) = ln.forward_owned(x)?;
                (y, Some(c))
            }
            None => (x, None),
        };
        let cache = EmbedCache {
            image_shape: px.shape().clone(),
            patch,
            patch_src,
            patch_rows,
            cls,
            pos_ids,
            pre,
        };
        Ok((x, cache))
    }

    /// d tokens (N_local, D) -> d pixels (B, C, H, W) through this rank's tokens.
    fn embed_bwd(&mut self, cache: EmbedCache, lay: &Layout, dx: Tensor) -> Result<Tensor> {
        let EmbedCache {
            image_shape,
            patch,
            patch_src,
            patch_rows,
            cls,
            pos_ids,
            pre,
        } = cache;
        let mut dx = dx;
        if let (Some(ln), Some(c)) = (self.pre_layrnorm.as_mut(), pre) {
            dx = ln.backward(c, &dx)?;
        }
        if let Some(g) = self
            .position_embedding
            .as_mut()
            .and_then(|p| p.grad.as_mut())
        {
            ops::embedding_bwd(&dx, &pos_ids, g).ctx("vision backward", "positions")?;
        }
        if let (Some(g), Some((rows, zeros_m))) = (
            self.class_embedding.as_mut().and_then(|p| p.grad.as_mut()),
            &cls,
        ) {
            let dcls = ops::gather_rows(&dx, rows).ctx("vision backward", "class")?; // (M, D)
            ops::embedding_bwd(&dcls, zeros_m, g).ctx("vision backward", "class")?;
        }
        let dpe = match &patch_rows {
            Some(rows) => ops::gather_rows(&dx, rows).ctx("vision backward", "patches")?, // (N_p, D)
            None => dx,
        };
        let patch_embedding = self
            .patch_embedding
            .as_mut()
            .ok_or_else(|| Error::input("vision backward", "this stage holds no embeddings"))?;
        let dsel = patch_embedding.backward(patch, &dpe)?; // (N_p, C*P*P)
        let cpp = dsel.dims()[1];
        let dpatches = match &patch_src {
            Some(idx) => {
                // The patches of other ranks' tokens get no grad here.
                let mut full = zeros(&[lay.b * lay.n, cpp], dsel.dtype(), dsel.device())?; // (B*N, C*P*P)
                ops::scatter_rows(&mut full, idx, &dsel).ctx("vision backward", "patches")?;
                full
            }
            None => dsel,
        };
        let dpatches = dpatches
            .reshape([lay.b, lay.n, cpp])
            .ctx("vision backward", "patchify")?;
        ops::patchify_bwd(&dpatches, &image_shape, self.config.patch_size)
            .ctx("vision backward", "patchify")
    }

    /// The last stage's tail: this rank's tokens (N_local, D) -> the full output
    /// (all-gathered over CP first).
    fn final_fwd(&self, x: Tensor, lay: &Layout) -> Result<(VisionOutput, FinalCache)> {
        let post_layernorm = self
            .post_layernorm
            .as_ref()
            .ok_or_else(|| Error::input("vision", "this stage holds no post_layernorm"))?;
        let (b, s, d) = (lay.b, lay.s, self.config.hidden_size);
        let x = match (&lay.cp, &self.cp) {
            (Some((plan, _)), Some(group)) => {
                // Ragged all-gather: this rank's rows to every rank, placed in global
                // order by the plan. Its adjoint (the backward's slice) is below.
                let parts = (0..group.size())
                    .map(|_| x.try_clone())
                    .collect::<braid_kernels::Result<Vec<_>>>()
                    .ctx("vision cp", "gather hidden states")?;
                let got = group
                    .all_to_all_v(parts)
                    .ctx("vision cp", "gather hidden states")?;
                plan.assemble(&got)
                    .ctx("vision cp", "gather hidden states")? // (B*S, D)
            }
            _ => x,
        };
        let dev = x.device();
        let first_rows = ids((0..b).map(|i| (i * s) as u32).collect(), dev)?; // (B)
        let (last, pooled, fin) = if self.config.family == VisionFamily::Clip {
            let cls = ops::gather_rows(&x, &first_rows).ctx("vision", "pool class token")?; // (B, D)
            let (pooled, post) = post_layernorm.forward_owned(cls)?;
            (x, Some(pooled), FinalCache::Clip { first_rows, post })
        } else {
            let (y, post) = post_layernorm.forward_owned(x)?;
            match &self.head {
                Some(h) => {
                    let seq = SeqInfo::packed(&vec![s; b]);
                    let (pooled, hc) = h.forward(&y, &seq, &first_rows)?;
                    let fin = FinalCache::Siglip {
                        post,
                        head: Some(Box::new(hc)),
                    };
                    (y, Some(pooled), fin)
                }
                None => (y, None, FinalCache::Siglip { post, head: None }),
            }
        };
        let last = last.reshape([b, s, d]).ctx("vision", "output")?;
        Ok((
            VisionOutput {
                last_hidden_state: last,
                pooler_output: pooled,
            },
            fin,
        ))
    }

    /// d last_hidden_state (B, S, D), d pooled (B, D) -> d of this rank's tokens
    /// (N_local, D). Under CP only rank 0 adds the (replicated) post-norm and head
    /// grads, so that their sum over the CP group is the true grad.
    fn final_bwd(
        &mut self,
        fin: FinalCache,
        lay: &Layout,
        d_last: &Tensor,
        d_pooled: Option<&Tensor>,
    ) -> Result<Tensor> {
        let skip = lay.cp.as_ref().is_some_and(|(_, rank)| *rank != 0);
        let saved = if skip {
            (
                self.post_layernorm.as_mut().map(take_grads),
                self.head.as_mut().map(take_grads),
            )
        } else {
            (None, None)
        };
        let dx = self.final_bwd_replicated(fin, lay, d_last, d_pooled);
        if let (Some(ln), Some(g)) = (self.post_layernorm.as_mut(), saved.0) {
            put_grads(ln, g);
        }
        if let (Some(h), Some(g)) = (self.head.as_mut(), saved.1) {
            put_grads(h, g);
        }
        let dx = dx?; // (B*S, D)
        match &lay.cp {
            // The adjoint of the forward's all-gather: the downstream is replicated,
            // so this rank's rows of its own (identical) full grad, not a sum.
            Some((plan, rank)) => plan
                .local_rows(*rank, &dx)
                .ctx("vision cp backward", "local rows"),
            None => Ok(dx),
        }
    }

    /// The post-norm/head backward on the full rows -> d hidden (B*S, D).
    fn final_bwd_replicated(
        &mut self,
        fin: FinalCache,
        lay: &Layout,
        d_last: &Tensor,
        d_pooled: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, s, d) = (lay.b, lay.s, self.config.hidden_size);
        if d_last.dims() != [b, s, d] {
            return Err(Error::input(
                "vision backward",
                format!(
                    "d_last {} must be (B, S, D) = [{b}, {s}, {d}]",
                    d_last.shape()
                ),
            ));
        }
        if let Some(dp) = d_pooled
            && dp.dims() != [b, d]
        {
            return Err(Error::input(
                "vision backward",
                format!("d_pooled {} must be (B, D) = [{b}, {d}]", dp.shape()),
            ));
        }
        let mut dx = d_last
            .try_clone()
            .and_then(|x| x.reshape([b * s, d]))
            .ctx("vision backward", "d_last")?; // (B*S, D)
        let post_layernorm = self
            .post_layernorm
            .as_mut()
            .ok_or_else(|| Error::input("vision backward", "this stage holds no post_layernorm"))?;
        match fin {
            FinalCache::Clip { first_rows, post } => {
                if let Some(dp) = d_pooled {
                    let dcls = post_layernorm.backward(post, dp)?; // (B, D)
                    // Add into the class-token rows (one per image, distinct): gather,
                    // add, scatter back, in dx's own dtype.
                    let rows = ops::gather_rows(&dx, &first_rows)
                        .and_then(|cur| ops::add(&cur, &dcls))
                        .ctx("vision backward", "pool")?;
                    ops::scatter_rows(&mut dx, &first_rows, &rows)
                        .ctx("vision backward", "pool")?;
                }
            }
            FinalCache::Siglip { post, head } => {
                if let (Some(h), Some(hc), Some(dp)) = (self.head.as_mut(), head, d_pooled) {
                    let dh = h.backward(*hc, dp)?; // (B*S, D)
                    ops::add_assign(&mut dx, &dh).ctx("vision backward", "head")?;
                }
                dx = post_layernorm.backward(post, &dx)?;
            }
        }
        Ok(dx)
    }
}
