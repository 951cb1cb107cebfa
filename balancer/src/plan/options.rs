//! Per-module options for the search: every layout of a module that fits on a GPU count
//! (TP dividing heads, KV heads, MLP and vocabulary inside a node; PP dividing the
//! layers; a row per LLM replica), costed analytically on the batch's mean loads: the
//! pipeline's time (one microbatch through every stage plus the rest at the slowest
//! stage), its gradient sync and its fullest GPU's memory.

use crate::dims::Module;
use crate::pipeline::{chunks_split_evenly, feeder_lead, warmup};
use crate::plan::cost::StageCost;
use crate::plan::layout::Layout;
use crate::plan::step::Problem;
use crate::plan::windows::{ChunkMedia, LlmRows};
use crate::workload::{RowShape, shape_of};

/// One module's option: a layout with its microbatch (chunk) count and estimates.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Opt {
    pub layout: Layout,
    pub microbatches: usize,
    pub recompute: bool,
    /// Model chunks per pipeline stage (the LLM's interleaved 1F1B; 1 elsewhere).
    pub chunks: usize,
    /// The LLM's: the microbatches an overlapped encoder must run ahead of its first
    /// stage ([`crate::pipeline::feeder_lead`], worked out once here: the search reads it
    /// for every combination); 0 elsewhere.
    pub lead: usize,
    /// Seconds of the pipeline, of the gradient sync after it, bytes on the fullest GPU.
    pub time: f64,
    pub sync: f64,
    pub mem: f64,
    /// Seconds of the slowest stage's forward and backward of one microbatch: the
    /// period at which a pipeline it joins (the overlapped schedule) takes microbatches.
    pub worst: f64,
}

/// The analytic estimate of one module's pipeline (see [`Problem::estimate`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PipeEst {
    pub time: f64,
    pub worst: f64,
    pub sync: f64,
    pub mem: f64,
}

/// Mean per-batch (tokens, sum of squared lengths) of each module, how many whole items
/// carry them (rows, images, clips), and the largest single item (tokens, squared
/// length; images and clips after the stem) that every batch holds: the least over the
/// batches of each batch's largest.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Totals {
    pub llm: (f64, f64),
    pub vision: (f64, f64),
    pub audio: (f64, f64),
    pub items: [f64; 3],
    pub largest: [(f64, f64); 3],
    /// Each module's smallest item (tokens, squared length) over the batches.
    pub smallest: [(f64, f64); 3],
    /// Each module's second-least tokens and second-least squared length of any item in
    /// one batch (each on its own; the least again in a batch of one item), the least
    /// over the batches: a pipeline's first and last chunks are two items apart.
    pub second: [(f64, f64); 3],
    /// Each module's least squared length per token of any item: a chunk of whole items
    /// holds at least this much attention per token.
    pub density: [f64; 3],
}

/// The least and second-least of `values` (the least twice for one value; 0 for none).
fn two_least(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut a, mut b) = (f64::INFINITY, f64::INFINITY);
    for v in values {
        if v < a {
            (a, b) = (v, a);
        } else if v < b {
            b = v;
        }
    }
    match (a.is_finite(), b.is_finite()) {
        (false, _) => (0.0, 0.0),
        (true, false) => (a, a),
        _ => (a, b),
    }
}

/// The index of module `m` in per-module arrays ([`Totals`]', the bound's layouts).
pub(crate) fn slot(m: Module) -> usize {
    match m {
        Module::Llm => 0,
        Module::Vision => 1,
        Module::Audio => 2,
    }
}

impl Totals {
    pub fn of(batches: &[Vec<RowShape>]) -> Totals {
        let n = batches.len().max(1) as f64;
        let mut sums = [(0.0, 0.0); 3];
        let mut items = [0.0; 3];
        let mut largest = [(f64::INFINITY, f64::INFINITY); 3];
        let mut smallest = [(f64::INFINITY, f64::INFINITY); 3];
        let mut second = [(f64::INFINITY, f64::INFINITY); 3];
        let mut density = [f64::INFINITY; 3];
        let least = |o: &mut (f64, f64), f: (f64, f64)| *o = (o.0.min(f.0), o.1.min(f.1));
        for rows in batches {
            let b = shape_of(rows);
            // Each module's items as (tokens, squared length); images and clips after
            // the stem.
            let media = |t: f64| (t, t * t);
            let per: [Vec<(f64, f64)>; 3] = [
                b.row_tokens
                    .iter()
                    .zip(&b.row_sq)
                    .map(|(&t, &q)| (t as f64, q as f64))
                    .collect(),
                b.image_tokens.iter().map(|&t| media(t as f64)).collect(),
                b.clip_frames
                    .iter()
                    .map(|&f| media(f.div_ceil(2) as f64))
                    .collect(),
            ];
            for (k, its) in per.iter().enumerate() {
                // A batch without the module's items has no largest item and runs no
                // pipeline of it (no fill): 0.
                let big = its.iter().copied().max_by(|x, y| x.0.total_cmp(&y.0));
                least(&mut largest[k], big.unwrap_or((0.0, 0.0)));
                // Tokens and squared lengths each at their least (the row with the
                // fewest tokens may hold one long sample, another many short ones).
                let (t, q) = (
                    two_least(its.iter().map(|x| x.0)),
                    two_least(its.iter().map(|x| x.1)),
                );
                least(&mut smallest[k], (t.0, q.0));
                least(&mut second[k], (t.1, q.1));
                for x in its.iter().filter(|x| x.0 > 0.0) {
                    density[k] = density[k].min(x.1 / x.0);
                }
                items[k] += its.len() as f64 / n;
                for x in its {
                    sums[k].0 += x.0 / n;
                    sums[k].1 += x.1 / n;
                }
            }
        }
        let seen = |x: (f64, f64)| if x.0.is_finite() { x } else { (0.0, 0.0) };
        Totals {
            llm: sums[0],
            vision: sums[1],
            audio: sums[2],
            items,
            largest: largest.map(seen),
            smallest: smallest.map(seen),
            second: second.map(seen),
            density: density.map(|d| if d.is_finite() { d } else { 0.0 }),
        }
    }

    /// Module `m` dealt out as whole items over `n` chunks in all, `slots` of which the
    /// step waits on and `mem_slots` of which memory holds at once: the fullest chunk's
    /// load (tokens, squared length) and the fullest held chunk against it.
    pub fn dealt(&self, m: Module, n: usize, slots: usize, mem_slots: usize) -> ((f64, f64), f64) {
        let g = self.granularity(m, slots);
        let peak = self.granularity(m, mem_slots) / g;
        let f = g / n.max(1) as f64;
        let total = self.module(m);
        ((total.0 * f, total.1 * f), peak)
    }

    /// The busiest of `slots` (replicas, or replicas x chunks) against the mean when
    /// whole items of module `m` are dealt out: with k items a slot on average, one gets
    /// ceil(k) (and with fewer items than slots, one item is 1/k times the mean).
    pub fn granularity(&self, m: Module, slots: usize) -> f64 {
        let k = self.items[slot(m)] / slots.max(1) as f64;
        if k > 0.0 { k.ceil() / k } else { 1.0 }
    }

    /// Module `m`'s largest single item (tokens, squared length).
    pub fn largest(&self, m: Module) -> (f64, f64) {
        self.largest[slot(m)]
    }

    /// Module `m`'s smallest single item (tokens, squared length): 0 when it has none.
    pub fn smallest(&self, m: Module) -> (f64, f64) {
        self.smallest[slot(m)]
    }

    /// Module `m`'s second-least item (see [`Totals::second`]): 0 when it has none.
    pub fn second(&self, m: Module) -> (f64, f64) {
        self.second[slot(m)]
    }

    /// Module `m`'s least squared length per token of any item: 0 when it has none.
    pub fn density(&self, m: Module) -> f64 {
        self.density[slot(m)]
    }

    pub fn module(&self, m: Module) -> (f64, f64) {
        match m {
            Module::Llm => self.llm,
            Module::Vision => self.vision,
            Module::Audio => self.audio,
        }
    }
}

/// What every option of one search shares: the batch's loads, the recomputation choices,
/// ZeRO-1, rows per batch, and whether encoders run 1F1B with the LLM (overlapped).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Knobs<'a> {
    pub totals: &'a Totals,
    pub recompute: &'a [bool],
    pub zero1: bool,
    pub rows: usize,
    pub overlapped: bool,
    /// The LLM's rows dealt off the sampled batches (the search's); `None`: its mean
    /// share, each replica's fullest by whole rows ([`Totals::dealt`]).
    pub llm_rows: Option<&'a LlmRows<'a>>,
}

/// Powers of two up to `max` that divide `n`.
fn pow2_divisors(n: usize, max: usize) -> Vec<usize> {
    (0..16)
        .map(|k| 1usize << k)
        .take_while(|&d| d <= max)
        .filter(|d| n.is_multiple_of(*d))
        .collect()
}

/// Every layout of module `m` on `g` GPUs.
pub(crate) fn layouts(p: &Problem, m: Module, g: usize, rows: usize) -> Vec<Layout> {
    let Some(d) = p.model.module(m) else {
        return Vec::new();
    };
    let node = p.cluster.gpus_per_node;
    // Any CP up to 8 for the LLM (the trainer splits a row into `2 cp` chunks for every
    // `cp`; a world of 3 nodes, 24 GPUs, runs the 7B fastest at cp3), 1 or 2 for the
    // encoders, whose items are short.
    let cps: &[usize] = if m == Module::Llm {
        &[1, 2, 3, 4, 5, 6, 7, 8]
    } else {
        &[1, 2]
    };
    let mut out = Vec::new();
    for tp in pow2_divisors(node, node) {
        for &cp in cps {
            for pp in (1..=d.layers.min(32)).filter(|&pp| d.layers % pp == 0) {
                let block = tp * cp * pp;
                if !g.is_multiple_of(block) || d.fits(tp, pp).is_err() {
                    continue;
                }
                let dp = g / block;
                if m == Module::Llm && dp > rows {
                    continue;
                }
                out.push(Layout { tp, cp, pp, dp });
            }
        }
    }
    out
}

/// The TPs module `m` may take inside a stage of TP `tp` (the LLM-centric baseline's
/// encoders, as the trainer's "centric" placement runs them): the divisors of `tp` its
/// heads, MLP and vocabulary allow, largest first (1 always).
pub(crate) fn encoder_tps(p: &Problem, m: Module, tp: usize) -> Vec<usize> {
    let Some(d) = p.model.module(m) else {
        return vec![1];
    };
    (1..=tp.max(1))
        .rev()
        .filter(|&t| tp.max(1).is_multiple_of(t) && (t == 1 || d.fits(t, 1).is_ok()))
        .collect()
}

impl Problem {
    pub(crate) fn cost(
        &self,
        m: Module,
        layout: Layout,
        recompute: bool,
        zero1: bool,
    ) -> Option<StageCost<'_>> {
        Some(StageCost {
            dims: self.model.module(m)?,
            layout,
            cluster: &self.cluster,
            recompute,
            zero1,
            frozen: self.frozen.contains(&m),
            checkpoint_stages: m != Module::Llm,
            overlap_sync: self.overlap_sync,
            sequence_parallel: self.sequence_parallel,
            first_stage_layers: None,
            chunks: 1,
            first_gpu: 0,
            split_backward: false,
        })
    }

    /// Time, slowest stage, sync and memory of a pipeline of `sc.layout.pp` stages
    /// running `mbs` microbatches of `load = (tokens, sq)` each. Stage `s` holds 1F1B's
    /// `pp - s + lead` microbatches' activations (`lead`: what the module downstream
    /// needs ahead, [`crate::pipeline::feeder_lead`] of the LLM for an overlapped
    /// encoder; `usize::MAX`: every microbatch, phased encoders).
    /// `extra` adds encoders' work (LLM-centric) to stage 0, each with its own load.
    /// `peak`: the fullest microbatch against `load` (whole rows or items are dealt out),
    /// which sets the memory; `window`, where given, the tokens one replica holds of the
    /// fullest `w` consecutive microbatches (an overlapped encoder's, read off the
    /// batches: [`crate::plan::windows::held_window`]), where the chunks' media differ.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn estimate(
        &self,
        sc: &StageCost,
        mbs: usize,
        load: (f64, f64),
        peak: f64,
        extra: &[(StageCost, (f64, f64))],
        lead: usize,
        window: Option<&dyn Fn(usize) -> f64>,
    ) -> PipeEst {
        let l = sc.layout;
        let v = sc.chunks.max(1);
        let (mut sum, mut worst, mut sync, mut mem) = (0.0, 0.0f64, 0.0f64, 0.0f64);
        for s in 0..l.pp {
            let (f, b) = (
                sc.forward(s, load.0, load.1).total(),
                sc.backward(s, load.0, load.1).total(),
            );
            // Each of a microbatch's chunks sends its boundary on (the ring's ends
            // aside, which this rounds up).
            let mut t = f + b + 2.0 * v as f64 * sc.send(load.0);
            let mut stage_sync = sc.exposed_sync(s, b, f);
            // Chunk activations held: 1F1B's `pp - s` (and `lead`) microbatches, or
            // the interleaved warm-up and one, each a `1 / v` of the stage's.
            let held = if v > 1 {
                (warmup(s, l.pp, v) + 1).min(v * mbs) as f64 / v as f64
            } else {
                (l.pp - s).saturating_add(lead).min(mbs) as f64
            };
            // A held chunk's working set is one chunk.
            // A window holds at least its fullest chunk (a window's mean item can be
            // smaller than its largest).
            let (big, held) = match window {
                Some(f) if v == 1 => {
                    let big = f(1).max(load.0 * peak);
                    (big, f(held as usize).max(big))
                }
                _ => (load.0 * peak, load.0 * peak * held),
            };
            let mut bytes = sc.memory(s, held, big).total();
            if s == 0 {
                for (ec, e) in extra {
                    let (ef, eb) = (
                        ec.forward(0, e.0, e.1).total(),
                        ec.backward(0, e.0, e.1).total(),
                    );
                    t += ef + eb;
                    bytes += ec
                        .memory(0, e.0 * chunk0_held(l.pp, v, mbs) as f64, e.0)
                        .total();
                    // The encoders' grads sync on the same GPUs, after the LLM's.
                    stage_sync += ec.exposed_sync(0, eb, ef);
                }
            }
            sum += t;
            worst = worst.max(t);
            sync = sync.max(stage_sync);
            mem = mem.max(bytes);
        }
        // 1F1B: every stage once, then a microbatch per slowest stage; interleaved, the
        // fill and drain are `1 / v` as long.
        PipeEst {
            time: (sum - worst) / v as f64 + mbs as f64 * worst,
            worst,
            sync,
            mem,
        }
    }

    /// Options for module `m` on `g` GPUs: the LLM with every microbatch count (powers of
    /// two up to its rows per replica, and that count); an encoder with `chunks` chunks
    /// (the LLM's microbatches), held to the end unless `overlapped`.
    /// `lead`: the microbatches an overlapped encoder runs ahead for the LLM
    /// ([`crate::pipeline::feeder_lead`]); `media`: an overlapped encoder's chunks
    /// ([`Problem::chunk_media`]), which set what its stages hold where given.
    pub(crate) fn options(
        &self,
        m: Module,
        g: usize,
        (chunks, lead): (usize, usize),
        media: Option<&ChunkMedia>,
        k: &Knobs,
    ) -> Vec<Opt> {
        let (t, rows) = (k.totals, k.rows);
        let mut out = Vec::new();
        for layout in layouts(self, m, g, rows) {
            // The windows a stage may hold (`pp - stage + lead` chunks at most), each
            // worked out once for the layout's replicas, not per stage and choice.
            let most = layout.pp.saturating_add(lead).min(chunks).max(1);
            let windows = media.map(|c| c.held(layout.dp));
            let held = |w: usize| {
                let all = windows.as_deref().unwrap_or(&[]);
                // Past the longest batch's chunks every window is the whole batch.
                all.get(w.clamp(1, most) - 1)
                    .or(all.last())
                    .copied()
                    .unwrap_or(0.0)
            };
            let window = media.is_some().then_some(&held as &dyn Fn(usize) -> f64);
            let per_rep = rows / layout.dp;
            let mbs: Vec<usize> = if m == Module::Llm {
                let mut v: Vec<usize> = (0..12)
                    .map(|k| 1usize << k)
                    .filter(|&x| x <= per_rep)
                    .collect();
                if v.last() != Some(&per_rep) {
                    v.push(per_rep);
                }
                v
            } else {
                vec![chunks.max(1)]
            };
            for &rc in k.recompute {
                let Some(sc) = self.cost(m, layout, rc, k.zero1) else {
                    continue;
                };
                for &mb in &mbs {
                    // Whole rows and items are dealt out: the step waits for the fullest
                    // LLM replica, for an overlapped encoder's fullest chunk, for a phased
                    // one's fullest replica; memory holds the fullest microbatches.
                    let (slots, mem_slots) = match (m, k.overlapped) {
                        (Module::Llm, _) => (layout.dp, layout.dp * mb),
                        (_, true) => (layout.dp * mb, layout.dp * mb),
                        (_, false) => (layout.dp, layout.dp),
                    };
                    let (load, peak) = match (m, k.llm_rows) {
                        (Module::Llm, Some(rows)) => rows.fullest(layout.dp, mb),
                        _ => t.dealt(m, layout.dp * mb, slots, mem_slots),
                    };
                    let lead = match (m, k.overlapped) {
                        (Module::Llm, _) => 0,
                        (_, true) => lead,
                        (_, false) => usize::MAX,
                    };
                    for v in llm_chunk_options(m, layout, mb, self) {
                        let sc = StageCost { chunks: v, ..sc };
                        let e = self.estimate(&sc, mb, load, peak, &[], lead, window);
                        out.push(Opt {
                            layout,
                            microbatches: mb,
                            recompute: rc,
                            chunks: v,
                            lead: match m {
                                Module::Llm => feeder_lead(layout.pp, v, mb),
                                _ => 0,
                            },
                            time: e.time,
                            sync: e.sync,
                            mem: e.mem,
                            worst: e.worst,
                        });
                    }
                }
            }
        }
        out
    }
}

/// Microbatches whose first-chunk activations stage 0 of `pp` holds at once with `v`
/// chunks a stage (where the LLM-centric baseline's encoders run): 1F1B's `pp`, the
/// interleaved order's `2 pp` (its warm-up runs two groups through chunk 0), at most `m`.
pub(crate) fn chunk0_held(pp: usize, v: usize, m: usize) -> usize {
    if v > 1 { (2 * pp).min(m) } else { pp.min(m) }
}

/// Model chunks per stage the LLM may take at `layout` with `mbs` microbatches: 1, and
/// with two or more stages and whole groups of microbatches (a multiple of the stages: a
/// partial last group gains less than the estimate's `1 / v` of the bubble), every count
/// that splits a stage's blocks evenly (what `parallel.llm.virtual_stages` accepts), under
/// either schedule. Encoders: 1.
fn llm_chunk_options(m: Module, layout: Layout, mbs: usize, p: &Problem) -> Vec<usize> {
    if m != Module::Llm {
        return vec![1];
    }
    llm_chunk_counts(p.model.llm.layers, layout.pp, mbs)
}

/// 1, and with `pp >= 2` stages and `mbs` a multiple of them every count of chunks that
/// splits a stage's `layers / pp` blocks evenly: what the search may give the LLM (and
/// so what the work-conserving bound must allow).
pub(crate) fn llm_chunk_counts(layers: usize, pp: usize, mbs: usize) -> Vec<usize> {
    if mbs == 0 || !mbs.is_multiple_of(pp.max(1)) {
        return vec![1];
    }
    (1..=layers / pp.max(1))
        .filter(|&v| v == 1 || chunks_split_evenly(layers, pp, v))
        .collect()
}

/// Keeps the options no other option beats in pipeline time, sync time and memory at
/// once (the sync counts separately: it can hide behind the encoders' backward).
pub(crate) fn pareto(mut v: Vec<Opt>) -> Vec<Opt> {
    v.sort_by(|a, b| a.time.total_cmp(&b.time).then(a.mem.total_cmp(&b.mem)));
    let beats = |k: &Opt, o: &Opt| {
        k.time <= o.time
            && k.sync <= o.sync
            && k.mem <= o.mem
            && (k.time < o.time || k.sync < o.sync || k.mem < o.mem)
    };
    let keep: Vec<bool> = v.iter().map(|o| !v.iter().any(|k| beats(k, o))).collect();
    v.into_iter()
        .zip(keep)
        .filter(|x| x.1)
        .map(|x| x.0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_items_load_the_fullest_slot_by_the_ceiling() {
        let t = Totals {
            llm: (0.0, 0.0),
            vision: (0.0, 0.0),
            audio: (0.0, 0.0),
            items: [1024.0, 13.0, 2.0],
            largest: [(0.0, 0.0); 3],
            smallest: [(0.0, 0.0); 3],
            second: [(0.0, 0.0); 3],
            density: [0.0; 3],
        };
        // 1,024 rows over 256 replicas: 4 each.
        assert_eq!(t.granularity(Module::Llm, 256), 1.0);
        // Over 10: some replica gets 103 rows against a mean of 102.4.
        assert!((t.granularity(Module::Llm, 10) - 103.0 / 102.4).abs() < 1e-12);
        // 13 images over 4 replicas: one gets 4 against a mean of 3.25.
        assert!((t.granularity(Module::Vision, 4) - 4.0 / 3.25).abs() < 1e-12);
        // 2 clips over 8 replicas: the two busy ones carry 4x the mean.
        assert_eq!(t.granularity(Module::Audio, 8), 4.0);
        // No items: nothing to deal out.
        let none = Totals {
            items: [0.0; 3],
            ..t
        };
        assert_eq!(none.granularity(Module::Audio, 8), 1.0);
    }

    #[test]
    fn the_largest_item_is_the_least_over_batches() {
        let row = |len: u32, images: Vec<u32>| RowShape {
            samples: vec![len],
            images,
            clips: vec![],
        };
        let a = vec![row(100, vec![16]), row(300, vec![])];
        let b = vec![row(200, vec![64, 8])];
        let t = Totals::of(&[a, b]);
        let [llm, vision, audio] =
            [Module::Llm, Module::Vision, Module::Audio].map(|m| t.largest(m));
        assert_eq!(llm, (200.0, 200.0 * 200.0));
        assert_eq!(vision.0, 16.0);
        // No clip in either batch.
        assert_eq!(audio, (0.0, 0.0));
        // The smallest: the least of any batch (rows 100 in a; images 16 in a, 8 in
        // b); a module with no item in some batch has no fill there: 0.
        let [llm, vision, audio] =
            [Module::Llm, Module::Vision, Module::Audio].map(|m| t.smallest(m));
        assert_eq!(llm, (100.0, 100.0 * 100.0));
        assert_eq!(vision, (8.0, 64.0));
        assert_eq!(audio, (0.0, 0.0));
        // The least attention per token of any item: the 100-token row; the 8-token image.
        let [llm, vision, audio] =
            [Module::Llm, Module::Vision, Module::Audio].map(|m| t.density(m));
        assert_eq!((llm, vision, audio), (100.0, 8.0, 0.0));
        // The second-least of one batch, least over the batches: rows 300 in a (200 is
        // b's only row: its least again); images 16 in a, 64 in b.
        let [llm, vision, audio] =
            [Module::Llm, Module::Vision, Module::Audio].map(|m| t.second(m));
        assert_eq!(llm, (200.0, 200.0 * 200.0));
        assert_eq!(vision, (16.0, 256.0));
        assert_eq!(audio, (0.0, 0.0));
    }
}
