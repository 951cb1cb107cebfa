//! The pieces a simulated step is built from: each module's work in a batch, a lane's
//! 1F1B order and its tasks, the LLM's (interleaved) pipeline lanes, and the named
//! timeline a plan's `--trace` writes.

use crate::assign::BatchShape;
use crate::dims::{ModelDims, Module};
use crate::pipeline::interleaved_1f1b;
use crate::plan::cost::{Cost, StageCost};
use crate::plan::dag::Dag;
use crate::plan::layout::Layout;
use crate::zero_bubble::{SplitPass, zero_bubble_orders};

/// A simulated step's timeline: its lanes (label, GPUs each stands for) and every task
/// that took time, `(lane, name, start s, end s)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanTimeline {
    pub lanes: Vec<(String, usize)>,
    pub spans: Vec<(usize, String, f64, f64)>,
}

/// A load of tokens: their count, the sum of squared sequence lengths, the longest.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Load {
    pub tokens: f64,
    pub sq: f64,
}

impl Load {
    pub fn add(&mut self, t: f64) {
        self.tokens += t;
        self.sq += t * t;
    }
}

/// Each image's and clip's (row, encoder tokens, LLM tokens).
pub(crate) fn items(b: &BatchShape, model: &ModelDims, m: Module) -> Vec<(usize, f64, f64)> {
    let (per_row, sizes, ratio, stem) = match m {
        Module::Vision => (&b.row_images, &b.image_tokens, model.vision_llm_ratio, 1),
        Module::Audio => (&b.row_clips, &b.clip_frames, model.audio_llm_ratio, 2),
        Module::Llm => return Vec::new(),
    };
    let mut out = Vec::with_capacity(sizes.len());
    let mut k = 0;
    for (row, &n) in per_row.iter().enumerate() {
        for &s in &sizes[k..k + n] {
            out.push((row, s.div_ceil(stem) as f64, (s as f64 * ratio).ceil()));
        }
        k += n;
    }
    out
}

/// The largest token sum of `w` consecutive loads.
pub(crate) fn window_max(loads: &[Load], w: usize) -> f64 {
    let mut sum: f64 = loads.iter().take(w).map(|x| x.tokens).sum();
    let mut best = sum;
    for i in w..loads.len() {
        sum += loads[i].tokens - loads[i - w].tokens;
        best = best.max(sum);
    }
    best
}

/// Task ids of a lane's forwards and backwards per microbatch.
pub(crate) struct LaneTasks {
    pub lane: usize,
    pub f: Vec<usize>,
    pub b: Vec<usize>,
}

/// The `(replica, stage)` lane of a grid placed from GPU 0 that GPU `gpu` holds: a lane
/// holds one replica's stage, `tp x cp` consecutive GPUs (the grid order is TP, CP, DP,
/// PP), replica `gpu % (tp cp dp) / (tp cp)` of stage `gpu / (tp cp dp)` (of `pp - 1 -`
/// that with its stages `reversed`, as `braid_comm::Grid::with_stages_reversed` places them). The
/// stage is `pp` or more past the grid's GPUs.
pub(crate) fn lane_of(l: Layout, reversed: bool, gpu: usize) -> (usize, usize) {
    let per_stage = l.tp * l.cp * l.dp;
    let slice = gpu / per_stage;
    let stage = if reversed && slice < l.pp {
        l.pp - 1 - slice
    } else {
        slice
    };
    (gpu % per_stage / l.block(), stage)
}

/// The `(replica, stage)` lanes of two grids placed from the same first GPU that share
/// a GPU, each pair once; each grid with its stages reversed or not ([`lane_of`]).
pub(crate) fn sharing_lanes(
    a: (Layout, bool),
    b: (Layout, bool),
) -> Vec<((usize, usize), (usize, usize))> {
    let mut out: Vec<_> = (0..a.0.gpus().min(b.0.gpus()))
        .map(|gpu| (lane_of(a.0, a.1, gpu), lane_of(b.0, b.1, gpu)))
        .collect();
    out.dedup();
    out.sort_unstable();
    out.dedup();
    out
}

/// The lanes each GPU holds, one list per distinct set, for grids placed from the same
/// first GPU (colocated): `modules` gives each module's layout, whether its stages are
/// reversed, and its lanes `[replica][stage]`; GPU `x` is in the lane [`lane_of`] names.
pub(crate) fn device_groups(
    modules: &[(Layout, bool, &[Vec<LaneTasks>])],
    gpus: usize,
) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = (0..gpus)
        .map(|x| {
            modules
                .iter()
                .filter_map(|&(l, reversed, lanes)| {
                    let (r, s) = lane_of(l, reversed, x);
                    lanes.get(r).and_then(|st| st.get(s)).map(|t| t.lane)
                })
                .collect()
        })
        .collect();
    groups.sort_unstable();
    groups.dedup();
    groups
}

/// GPU-seconds each replica's lane waits for the busiest replica of its module stage:
/// `modules` holds each module's lanes as `[replica][stage]`, `busy` each lane's busy
/// seconds, `ranks` the GPUs a lane stands for.
pub(crate) fn imbalance_gpu_s(
    modules: &[&[Vec<LaneTasks>]],
    busy: &[f64],
    ranks: impl Fn(usize) -> usize,
) -> f64 {
    let mut out = 0.0;
    for reps in modules {
        for s in 0..reps.first().map_or(0, Vec::len) {
            let most = reps.iter().map(|r| busy[r[s].lane]).fold(0.0, f64::max);
            out += reps
                .iter()
                .map(|r| (most - busy[r[s].lane]) * ranks(r[s].lane) as f64)
                .sum::<f64>();
        }
    }
    out
}

/// 1F1B on a lane `depth` stages from the end of the pipeline: warm-up forwards, then
/// alternating, then cool-down backwards (stage 0 of `depth` in
/// [`crate::pipeline::interleaved_1f1b`]). `(forward?, microbatch)`.
pub(crate) fn one_f_one_b(m: usize, depth: usize, backward: bool) -> Vec<(bool, usize)> {
    crate::pipeline::interleaved_1f1b(0, depth, 1, m, backward)
        .into_iter()
        .map(|p| (p.forward, p.mb))
        .collect()
}

/// Pushes a stage lane's tasks (deps filled later); `module` and `stage` name them as
/// the trainer's timeline does ("llm fwd s0 mb3"; "llm fwd s0 c1 mb3" for chunk 1 of
/// `chunks`). `order` holds `(forward?, chunk * m + microbatch)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_lane(
    g: &mut Dag,
    ranks: usize,
    label: String,
    module: &str,
    stage: usize,
    order: &[(bool, usize)],
    cost: impl Fn(bool, usize) -> Cost,
    m: usize,
    chunks: usize,
) -> LaneTasks {
    let lane = g.lane(ranks, label);
    let n = m * chunks.max(1);
    let (mut f, mut b) = (vec![usize::MAX; n], vec![usize::MAX; n]);
    for &(fwd, i) in order {
        let id = g.push(lane, cost(fwd, i), &[]);
        g.name(id, || {
            let what = if fwd { "fwd" } else { "bwd" };
            if chunks > 1 {
                format!(
                    "{module} {what} s{stage} c{} mb{}",
                    i / m.max(1),
                    i % m.max(1)
                )
            } else {
                format!("{module} {what} s{stage} mb{i}")
            }
        });
        if fwd {
            f[i] = id;
        } else {
            b[i] = id;
        }
    }
    LaneTasks { lane, f, b }
}

/// Links a pipeline's stage lanes: each pass waits for the same pass on the stage
/// before (forward) or after (backward); with `m > 0` microbatches of several chunks
/// (tasks `chunk * m + microbatch`), also round the ring: the first stage's chunk k + 1
/// waits for the last stage's chunk k, and the last's backward of chunk k for the
/// first's of k + 1.
pub(crate) fn link_stages(g: &mut Dag, stages: &[LaneTasks], m: usize) {
    let mut set = |t: usize, dep: usize| {
        if t != usize::MAX && dep != usize::MAX {
            g.wait(t, dep);
        }
    };
    for s in 1..stages.len() {
        for i in 0..stages[s].f.len() {
            set(stages[s].f[i], stages[s - 1].f[i]);
            set(stages[s - 1].b[i], stages[s].b[i]);
        }
    }
    if let (Some(first), Some(last), true) = (stages.first(), stages.last(), m > 0) {
        for i in m..first.f.len() {
            set(first.f[i], last.f[i - m]);
            set(last.b[i - m], first.b[i]);
        }
    }
}

/// The LLM's lanes, `[replica][stage]`, linked: each stage runs the interleaved 1F1B
/// over its chunks (plain 1F1B with one), task `k * m + j` chunk k of microbatch j,
/// `loads[replica][j]` each microbatch's load. The LLM-centric baseline's encoders
/// (`centric`: encoder index and its cost, `enc_load[encoder][encoder replica]
/// [microbatch]`, `B_tp / tp x B_cp` encoder replicas to an LLM replica) run inside
/// stage 0's chunk 0.
#[allow(clippy::too_many_arguments)]
pub(crate) fn llm_pipeline_lanes(
    g: &mut Dag,
    sc: &StageCost,
    llm: Layout,
    loads: &[Vec<Load>],
    centric: &[(usize, StageCost)],
    enc_load: &[Vec<Vec<Load>>],
    split: bool,
) -> Vec<Vec<LaneTasks>> {
    let v = sc.chunks.max(1);
    let mut lanes = Vec::new();
    for (d, loads) in loads.iter().enumerate() {
        let m = loads.len();
        let mut stages = Vec::new();
        // Split: every stage's order from one run of the pipeline.
        let split_orders =
            (split && v == 1 && centric.is_empty()).then(|| zero_bubble_orders(llm.pp, m));
        for s in 0..llm.pp {
            if let Some(order) = split_orders.as_ref().and_then(|o| o.get(s)) {
                stages.push(split_stage_lane(g, sc, llm, (s, d), order, loads));
                continue;
            }
            let order: Vec<(bool, usize)> = interleaved_1f1b(s, llm.pp, v, m, true)
                .into_iter()
                .map(|p| (p.forward, p.chunk * m + p.mb))
                .collect();
            let cost = |fwd: bool, i: usize| {
                let (k, j) = (i / m, i % m);
                let x = loads[j];
                let mut t = if fwd {
                    sc.forward_chunk(s, k, x.tokens, x.sq)
                } else {
                    sc.backward_chunk(s, k, x.tokens, x.sq)
                };
                // Every chunk boundary but the model's ends sends (the ring wraps from
                // the last stage to the first).
                let (model_first, model_last) = (s == 0 && k == 0, s + 1 == llm.pp && k + 1 == v);
                t.comm += sc.send(x.tokens)
                    * f64::from(u8::from(if fwd { !model_first } else { !model_last }));
                if model_first && !centric.is_empty() {
                    // The busiest of the replica's first-stage GPUs: GPU `i` of its
                    // `tp * cp` runs each encoder's replica `i / tp` (at that encoder's
                    // TP), one encoder after the other, before the rows are exchanged.
                    let busiest = (0..llm.block())
                        .map(|i| {
                            centric.iter().fold(Cost::default(), |acc, (ek, ec)| {
                                // `ec.layout.dp`: the centric replicas, `llm.dp` times these.
                                let per = ec.layout.dp / llm.dp.max(1);
                                let r = d * per + i / ec.layout.tp.max(1);
                                let y = enc_load[*ek].get(r).map_or(Load::default(), |l| l[j]);
                                acc.plus(if fwd {
                                    ec.forward(0, y.tokens, y.sq)
                                } else {
                                    ec.backward(0, y.tokens, y.sq)
                                })
                            })
                        })
                        .max_by(|x, y| x.total().total_cmp(&y.total()))
                        .unwrap_or_default();
                    t = t.plus(busiest);
                }
                t
            };
            stages.push(stage_lane(
                g,
                llm.block(),
                format!("llm r{d} s{s}"),
                "llm",
                s,
                &order,
                cost,
                m,
                v,
            ));
        }
        link_stages(g, &stages, if v > 1 { loads.len() } else { 0 });
        lanes.push(stages);
    }
    lanes
}

/// Stage `s` of LLM replica `d` under zero-bubble pipelining, its passes in `order`
/// ([`zero_bubble_orders`]): each microbatch's forward, its backward less the weight
/// gradients (B), and those (W), named as the trainer's timeline names them ("llm wgt
/// s1 mb3").
fn split_stage_lane(
    g: &mut Dag,
    sc: &StageCost,
    llm: Layout,
    (s, d): (usize, usize),
    order: &[SplitPass],
    loads: &[Load],
) -> LaneTasks {
    let m = loads.len();
    let lane = g.lane(llm.block(), format!("llm r{d} s{s}"));
    let (mut f, mut b) = (vec![usize::MAX; m], vec![usize::MAX; m]);
    let (first, last) = (s == 0, s + 1 == llm.pp);
    for &pass in order {
        let (what, j) = match pass {
            SplitPass::Forward(j) => ("fwd", j),
            SplitPass::Backward(j) => ("bwd", j),
            SplitPass::Weight(j) => ("wgt", j),
        };
        let x = loads[j];
        let (bwd, wgt) = sc.split_backward_chunk(s, 0, x.tokens, x.sq);
        let cost = match pass {
            SplitPass::Forward(_) => {
                let mut t = sc.forward_chunk(s, 0, x.tokens, x.sq);
                t.comm += sc.send(x.tokens) * f64::from(u8::from(!first));
                t
            }
            SplitPass::Backward(_) => Cost {
                comm: bwd.comm + sc.send(x.tokens) * f64::from(u8::from(!last)),
                ..bwd
            },
            SplitPass::Weight(_) => wgt,
        };
        let id = g.push(lane, cost, &[]);
        g.name(id, || format!("llm {what} s{s} mb{j}"));
        match pass {
            SplitPass::Forward(_) => f[j] = id,
            SplitPass::Backward(_) => b[j] = id,
            SplitPass::Weight(_) => {}
        }
    }
    LaneTasks { lane, f, b }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_share_gpus_where_their_blocks_overlap() {
        let l = |tp, cp, pp, dp| Layout { tp, cp, pp, dp };
        // Same grid: each lane meets only itself.
        let same = sharing_lanes((l(2, 1, 2, 2), false), (l(2, 1, 2, 2), false));
        assert_eq!(
            same,
            vec![
                ((0, 0), (0, 0)),
                ((0, 1), (0, 1)),
                ((1, 0), (1, 0)),
                ((1, 1), (1, 1))
            ]
        );
        // 8 GPUs: dp8 against pp2 dp4 (stage 1 on GPUs 4-7) and against tp4 dp2.
        let pp = sharing_lanes((l(1, 1, 1, 8), false), (l(1, 1, 2, 4), false));
        assert_eq!(pp.len(), 8);
        assert!(pp.contains(&((5, 0), (1, 1))), "{pp:?}");
        let tp = sharing_lanes((l(1, 1, 1, 8), false), (l(4, 1, 1, 2), false));
        assert_eq!(tp.len(), 8);
        assert!(tp.iter().all(|&((r, _), (q, _))| q == r / 4), "{tp:?}");
        // Reversed, the pp2 grid's stage 1 is on GPUs 0-3 and its stage 0 on 4-7; the
        // replicas stay where they were.
        let rev = sharing_lanes((l(1, 1, 1, 8), false), (l(1, 1, 2, 4), true));
        assert_eq!(rev.len(), 8);
        assert!(rev.contains(&((5, 0), (1, 0))), "{rev:?}");
        assert!(rev.contains(&((1, 0), (1, 1))), "{rev:?}");
        for gpu in 0..8 {
            let (r, s) = lane_of(l(1, 1, 2, 4), true, gpu);
            assert_eq!((r, 1 - s), lane_of(l(1, 1, 2, 4), false, gpu));
        }
        // Past the grid's GPUs the stage is past its stages either way.
        assert_eq!(lane_of(l(1, 1, 2, 4), true, 9).1, 2);
    }
}
