//! The simulated step of one plan on one global batch: the batch is assigned (the
//! data-aware assigner; for the LLM-centric baseline the trainer's "centric" one, each
//! item kept inside its row's LLM replica), each lane's tasks are costed, laid out in the schedule's order
//! (1F1B per stage) and run by the event-driven [`Dag`]. Out come the step time, the
//! bubble fraction, per-module busy time and the peak memory per GPU.

use crate::assign::{Assigner, Replicas};
use crate::balance::{Centric, lpt_after};
use crate::cluster::Cluster;
use crate::dims::{ModelDims, Module};
use crate::pipeline::{feeder_lead, interleaved_1f1b, max_in_flight};
use crate::plan::cost::{Cost, StageCost};
use crate::plan::dag::Dag;
pub use crate::plan::lanes::PlanTimeline;
use crate::plan::lanes::{
    LaneTasks, Load, device_groups, imbalance_gpu_s, items, link_stages, llm_pipeline_lanes,
    one_f_one_b, sharing_lanes, stage_lane, window_max,
};
use crate::plan::layout::{Layout, Placement, Plan, Schedule};
use crate::plan::options::chunk0_held;
use crate::workload::{RowShape, shape_of};

/// What is being planned.
#[derive(Clone, Debug)]
pub struct Problem {
    pub model: ModelDims,
    pub cluster: Cluster,
    /// Modules trained with frozen weights.
    pub frozen: Vec<Module>,
    /// Compute seconds each rank spends per step reading and decoding its input: `braid
    /// train`'s ranks each run a loader over the whole global batch. It runs beside the
    /// step (prefetched), so it only costs where ranks share the device
    /// (`cluster.shared_compute`); 0 when unknown.
    pub input_s: f64,
    /// The runtime overlaps the gradient sync with compute (GPUs: NCCL beside the
    /// kernels); see [`StageCost::overlap_sync`]. `braid train`'s CPU ranks do not.
    pub overlap_sync: bool,
    /// TP runs with sequence parallelism (Megatron's, on GPUs); see
    /// [`StageCost::sequence_parallel`]. `braid train`'s TP does not.
    pub sequence_parallel: bool,
}

/// One simulated step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepSim {
    pub step_s: f64,
    /// Share of GPU time not computing (idle or waiting on communication).
    pub bubble: f64,
    /// Share of GPU time neither computing nor in a collective (TP, CP, PP sends, the
    /// exposed gradient sync): pipeline bubbles, waits for the slowest replica and for
    /// the bridge.
    pub idle: f64,
    /// Peak bytes on the fullest GPU.
    pub peak_memory: f64,
    /// Per module: mean busy seconds of its GPUs, its busiest GPU's, and its fullest
    /// GPU's bytes.
    pub busy: Vec<(Module, f64)>,
    pub busiest: Vec<(Module, f64)>,
    pub memory: Vec<(Module, f64)>,
    /// Seconds of the bridge (both ways) and of the slowest gradient sync.
    pub bridge_s: f64,
    pub dp_sync_s: f64,
    /// GPU-seconds of the step: computing or communicating on the stage lanes, of that
    /// the exposed gradient sync, and the time replicas of a module stage wait for their
    /// busiest peer (see [`crate::plan::bound`]).
    pub busy_gpu_s: f64,
    pub sync_gpu_s: f64,
    pub imbalance_gpu_s: f64,
}

impl Problem {
    fn stage_cost<'a>(&'a self, m: Module, layout: Layout, plan: &Plan) -> Option<StageCost<'a>> {
        let mut sc = self.cost(m, layout, plan.recomputes(m), plan.zero1)?;
        sc.first_gpu = plan.offset(m);
        if m == Module::Llm {
            sc.first_stage_layers = plan.llm_first_stage_layers;
            sc.chunks = plan.llm_virtual_stages.max(1);
            sc.split_backward = plan.llm_zero_bubble;
        }
        Some(sc)
    }

    /// Simulates `plan` on the global batch `rows`.
    pub fn simulate(&self, plan: &Plan, rows: &[RowShape]) -> Result<StepSim, String> {
        Ok(self.run(plan, rows, Dag::default())?.0)
    }

    /// [`Problem::simulate`] with the predicted timeline of every task.
    pub fn timeline(
        &self,
        plan: &Plan,
        rows: &[RowShape],
    ) -> Result<(StepSim, PlanTimeline), String> {
        let (sim, g, tl) = self.run(plan, rows, Dag::named())?;
        let timeline = PlanTimeline {
            lanes: g.lanes.iter().map(|l| (l.label.clone(), l.ranks)).collect(),
            spans: (0..g.tasks.len())
                .filter(|&i| tl.end[i] > tl.start[i])
                .map(|i| {
                    (
                        g.tasks[i].lane,
                        g.name_of(i).to_string(),
                        tl.start[i],
                        tl.end[i],
                    )
                })
                .collect(),
        };
        Ok((sim, timeline))
    }

    /// Builds `plan`'s step on `rows` into `g` and runs it.
    fn run(
        &self,
        plan: &Plan,
        rows: &[RowShape],
        mut g: Dag,
    ) -> Result<(StepSim, Dag, crate::plan::dag::Timeline), String> {
        let b = shape_of(rows);
        let (llm, m) = (plan.llm, plan.microbatches);
        let encoders: Vec<Module> = [Module::Vision, Module::Audio]
            .into_iter()
            .filter(|&e| self.model.module(e).is_some())
            .collect();
        // The LLM-centric baseline's encoder replicas follow from the LLM's layout and
        // their TP (whatever the plan's encoder layouts say).
        let centric_tp = |e: Module| plan.layout(e).map_or(llm.tp, |l| l.tp).max(1);
        let dp_of = |e: Module| match plan.placement {
            Placement::LlmCentric => llm.centric_encoder_dp(centric_tp(e)),
            _ => plan.layout(e).map_or(1, |l| l.dp),
        };
        let rep = Replicas {
            llm_dp: llm.dp,
            microbatches: m,
            vision_dp: dp_of(Module::Vision),
            audio_dp: dp_of(Module::Audio),
        };
        let costs = self.model.balanced();
        // The LLM-centric baseline deals its rows as the trainer's "centric" placement
        // does: balanced, each item on an encoder replica inside its row's LLM replica.
        let a = if plan.placement == Placement::LlmCentric {
            Centric(costs, costs).assign(&b, &rep)
        } else {
            costs.assign(&b, &rep)
        };
        // (B_dp, M) loads of the LLM and the LLM tokens its media bring (bridge volume).
        let mut llm_load = vec![vec![Load::default(); m]; llm.dp];
        let mut media = vec![vec![0.0; m]; llm.dp];
        for (r, &(d, i)) in a.rows.iter().enumerate() {
            let mb = i.min(m - 1);
            llm_load[d][mb].tokens += b.row_tokens[r] as f64;
            llm_load[d][mb].sq += b.row_sq[r] as f64;
        }
        let hidden = self.model.llm.hidden as f64;
        let overlapped = plan.schedule == Schedule::Overlapped;
        // Encoders run the items of LLM microbatch i as their chunk i: in the phased
        // schedule every chunk's forward before the bridge (GPipe), in the overlapped one
        // 1F1B with the LLM downstream, `lead` chunks ahead of the LLM's first stage
        // (what its chunk 0 takes before its first backward).
        let chunks = m;
        let lead = feeder_lead(llm.pp, plan.llm_virtual_stages.max(1), m);
        // Per encoder: (R_dp, chunks) loads (the LLM-centric baseline's replicas are
        // inside the LLM's: `B_dp x B_tp / tp x B_cp` of them).
        let mut enc_load: Vec<Vec<Vec<Load>>> = Vec::new();
        let mut enc_out: Vec<Vec<Vec<f64>>> = Vec::new(); // LLM tokens each replica sends
        for &e in &encoders {
            let its = items(&b, &self.model, e);
            let (reps, nchunks) = (dp_of(e), chunks);
            let mut load = vec![vec![Load::default(); nchunks]; reps];
            let mut out = vec![vec![0.0; nchunks]; reps];
            let chunk_of = |row: usize| {
                if nchunks > 1 {
                    a.rows[row].1.min(m - 1)
                } else {
                    0
                }
            };
            let mut by_chunk: Vec<Vec<usize>> = vec![Vec::new(); nchunks];
            // Overlapped: each chunk balanced on its own, as `PerMicrobatch` assigns.
            let mut before = vec![0.0; reps];
            for (k, it) in its.iter().enumerate() {
                by_chunk[chunk_of(it.0)].push(k);
                media[a.rows[it.0].0][a.rows[it.0].1.min(m - 1)] += it.2;
            }
            let assigned = if e == Module::Vision {
                &a.images
            } else {
                &a.clips
            };
            let tc = if e == Module::Vision {
                costs.vision
            } else {
                costs.audio
            };
            let cost_of = |k: usize| tc.of(its[k].1, its[k].1 * its[k].1);
            for (c, ks) in by_chunk.iter().enumerate() {
                let to: Vec<usize> = match plan.placement {
                    Placement::LlmCentric => ks.iter().map(|&k| assigned[k]).collect(),
                    _ if overlapped => {
                        let cs: Vec<f64> = ks.iter().map(|&k| cost_of(k)).collect();
                        lpt_after(&cs, &mut before)
                    }
                    _ => ks.iter().map(|&k| assigned[k]).collect(),
                };
                for (&k, r) in ks.iter().zip(to) {
                    load[r][c].add(its[k].1);
                    out[r][c] += its[k].2;
                }
            }
            enc_load.push(load);
            enc_out.push(out);
        }
        let link = self.cluster.link(plan.gpus());
        // The bridge of chunk c (or the whole step): the busiest sender or receiver.
        let bridge = |c: Option<usize>| -> f64 {
            let pick = |v: &[f64]| c.map_or_else(|| v.iter().sum(), |c| v[c]);
            let recv = media
                .iter()
                .map(|v| pick(v) / llm.cp as f64)
                .fold(0.0, f64::max);
            let send = enc_out
                .iter()
                .zip(&encoders)
                .flat_map(|(o, &e)| {
                    let n = plan.layout(e).map_or(1, |l| l.block()) as f64;
                    o.iter().map(move |v| pick(v) / n)
                })
                .fold(0.0, f64::max);
            link.send(recv.max(send) * hidden * self.cluster.compute_bytes)
        };

        let mut bridge_s = 0.0;
        // Encoder lanes (not in the baseline): [encoder][replica][stage].
        let mut enc_lanes: Vec<Vec<Vec<LaneTasks>>> = Vec::new();
        if plan.placement != Placement::LlmCentric {
            for (k, &e) in encoders.iter().enumerate() {
                let (Some(l), Some(sc)) = (
                    plan.layout(e),
                    plan.layout(e).and_then(|l| self.stage_cost(e, l, plan)),
                ) else {
                    return Err(format!("{} has no layout", e.name()));
                };
                let mut reps = Vec::new();
                for (r, load) in enc_load[k].iter().enumerate() {
                    let mut stages = Vec::new();
                    for s in 0..l.pp {
                        // Phased: every forward, then (after the LLM) every backward.
                        let depth = if overlapped {
                            l.pp - s + lead
                        } else {
                            usize::MAX
                        };
                        let order = one_f_one_b(chunks, depth, !sc.frozen);
                        let cost = |fwd: bool, c: usize| {
                            let x = load[c];
                            let send = if s > 0 { sc.send(x.tokens) } else { 0.0 };
                            let mut t = if fwd {
                                sc.forward(s, x.tokens, x.sq)
                            } else {
                                sc.backward(s, x.tokens, x.sq)
                            };
                            t.comm += send;
                            t
                        };
                        stages.push(stage_lane(
                            &mut g,
                            l.block(),
                            format!("{} r{r} s{s}", e.name()),
                            e.name(),
                            s,
                            &order,
                            cost,
                            chunks,
                            1,
                        ));
                    }
                    reps.push(stages);
                }
                enc_lanes.push(reps);
            }
        }
        // LLM lanes: [replica][stage].
        let sc = self.stage_cost(Module::Llm, llm, plan).ok_or("no LLM")?;
        let centric: Vec<(usize, StageCost)> = if plan.placement == Placement::LlmCentric {
            // Each encoder at its own TP (dividing the LLM's) on the LLM's first-stage
            // GPUs, a replica on every `tp` of them, each microbatch's items balanced over
            // a replica's and the rows exchanged among its ranks (the trainer's "centric").
            encoders
                .iter()
                .enumerate()
                .filter_map(|(k, &e)| {
                    let l = Layout {
                        tp: centric_tp(e),
                        cp: 1,
                        pp: 1,
                        dp: dp_of(e),
                    };
                    // Inside a 1F1B stage: per-block checkpoints, like the LLM.
                    let sc = StageCost {
                        checkpoint_stages: false,
                        ..self.stage_cost(e, l, plan)?
                    };
                    Some((k, sc))
                })
                .collect()
        } else {
            Vec::new()
        };
        // The LLM's pipelines, their stages linked along and round the ring.
        let v = sc.chunks.max(1);
        let llm_lanes = llm_pipeline_lanes(
            &mut g,
            &sc,
            llm,
            &llm_load,
            &centric,
            &enc_load,
            plan.llm_zero_bubble,
        );
        // Dependencies along each pipeline.
        let set = |g: &mut Dag, t: usize, dep: usize| {
            if t != usize::MAX && dep != usize::MAX {
                g.wait(t, dep);
            }
        };
        for stages in enc_lanes.iter().flatten() {
            link_stages(&mut g, stages, 0);
        }
        // The bridge between encoder last stages and LLM first stages.
        if !enc_lanes.is_empty() {
            let colocated = plan.placement == Placement::Colocated;
            for c in 0..if overlapped { chunks } else { 1 } {
                let t = bridge(overlapped.then_some(c));
                bridge_s += 2.0 * t;
                let lane = g.lane(0, format!("bridge {c}"));
                let fwd = g.push(
                    lane,
                    Cost {
                        compute: 0.0,
                        comm: t,
                    },
                    &[],
                );
                g.name(fwd, || match overlapped {
                    true => format!("bridge fwd mb{c}"),
                    false => "bridge fwd".into(),
                });
                let lane = g.lane(0, format!("bridge back {c}"));
                let bwd = g.push(
                    lane,
                    Cost {
                        compute: 0.0,
                        comm: t,
                    },
                    &[],
                );
                g.name(bwd, || match overlapped {
                    true => format!("bridge bwd mb{c}"),
                    false => "bridge bwd".into(),
                });
                let mbs: Vec<usize> = if overlapped {
                    vec![c]
                } else {
                    (0..m).collect()
                };
                for reps in &enc_lanes {
                    for stages in reps {
                        let last = &stages[stages.len() - 1];
                        for &i in &mbs {
                            set(&mut g, fwd, last.f[i]);
                            set(&mut g, last.b[i], bwd);
                        }
                    }
                }
                for stages in &llm_lanes {
                    for &i in &mbs {
                        set(&mut g, stages[0].f[i], fwd);
                        set(&mut g, bwd, stages[0].b[i]);
                    }
                }
            }
            // Colocated encoders take turns on the GPUs they share: on every pair of
            // stage lanes whose GPUs overlap, the second's forwards start after the
            // first's, and the first's backwards (all after the LLM, from chunk 0) after
            // the second's. Lanes on other GPUs run on.
            if let (true, false, [first, second], Some(l1), Some(l2)) = (
                colocated,
                overlapped,
                enc_lanes.as_slice(),
                encoders.first().and_then(|&e| plan.layout(e)),
                encoders.get(1).and_then(|&e| plan.layout(e)),
            ) {
                let rev = plan.reverse_encoder_stages;
                for (a, b) in sharing_lanes((l1, rev), (l2, rev)) {
                    let (one, two) = (&first[a.0][a.1], &second[b.0][b.1]);
                    set(&mut g, two.f[0], one.f[m - 1]);
                    set(&mut g, one.b[0], two.b[m - 1]);
                }
            }
            // Colocated and overlapped, each GPU runs its modules' passes in the step's
            // global order (the LLM's stages first in each round), as the trainer does.
            if colocated && overlapped {
                let mut first: Vec<usize> = (0..llm.pp)
                    .flat_map(|s| llm_lanes.iter().map(move |r| r[s].lane))
                    .collect();
                let mut modules: Vec<(Layout, bool, &[Vec<LaneTasks>])> =
                    vec![(llm, false, &llm_lanes)];
                for (k, &e) in encoders.iter().enumerate() {
                    let (Some(l), Some(reps)) = (plan.layout(e), enc_lanes.get(k)) else {
                        continue;
                    };
                    first.extend((0..l.pp).flat_map(|s| reps.iter().map(move |r| r[s].lane)));
                    modules.push((l, plan.reverse_encoder_stages, reps));
                }
                g.share_devices(&first, &device_groups(&modules, plan.gpus()))?;
            }
        }
        // The gradient sync after each lane's last backward: what of it the lane's last
        // backward and first forward do not hide (all of it without overlap).
        let mut dp_sync_s = 0.0f64;
        let mut sync_gpu_s = 0.0f64;
        let mut sync =
            |g: &mut Dag, st: &LaneTasks, scs: &[&StageCost], s: usize, chunks: usize| {
                // The windows the sync hides in: the last backward and the first forward of
                // each of the lane's chunks (chunk k's grads are final after its own last
                // backward, its weights needed at its own first forward): `ids` holds
                // `chunk * per + microbatch`, `per = ids.len() / chunks`.
                let pass = |ids: &[usize], last: bool| {
                    let per = ids.len() / chunks;
                    (0..chunks)
                        .filter_map(|k| {
                            let i = if last { (k + 1) * per } else { k * per + 1 };
                            ids.get(i.checked_sub(1)?)
                        })
                        .filter(|&&i| i != usize::MAX)
                        .map(|&i| g.tasks[i].cost.total())
                        .sum::<f64>()
                };
                let (bwd, fwd) = (pass(&st.b, true), pass(&st.f, false));
                let t: f64 = scs.iter().map(|sc| sc.exposed_sync(s, bwd, fwd)).sum();
                dp_sync_s = dp_sync_s.max(t);
                sync_gpu_s += t * g.lanes[st.lane].ranks as f64;
                let lane = st.lane;
                if t > 0.0 {
                    let id = g.push(
                        lane,
                        Cost {
                            compute: 0.0,
                            comm: t,
                        },
                        &[],
                    );
                    g.name(id, || "grad sync".into());
                }
            };
        for (k, &e) in encoders.iter().enumerate() {
            if let (Some(l), Some(reps)) = (plan.layout(e), enc_lanes.get(k))
                && let Some(esc) = self.stage_cost(e, l, plan)
            {
                for stages in reps {
                    for (s, st) in stages.iter().enumerate() {
                        sync(&mut g, st, &[&esc], s, 1);
                    }
                }
            }
        }
        for stages in &llm_lanes {
            for (s, st) in stages.iter().enumerate() {
                // LLM-centric: stage 0's GPUs also sync the encoders they run.
                let mut scs = vec![&sc];
                if s == 0 {
                    scs.extend(centric.iter().map(|(_, ec)| ec));
                }
                sync(&mut g, st, &scs, s, v);
            }
        }
        // The loaders: one per rank, decoding the next batch while the step runs; on a
        // shared device they take their share of it.
        if self.cluster.shared_compute && self.input_s > 0.0 {
            let lane = g.lane(plan.gpus(), "input");
            let id = g.push(
                lane,
                Cost {
                    compute: self.input_s,
                    comm: 0.0,
                },
                &[],
            );
            g.name(id, || "data".into());
        }
        let tl = g.simulate(self.cluster.shared_compute)?;

        // Busy time and memory per module.
        let gpus = plan.gpus() as f64;
        // GPU-seconds of per-lane seconds: computing, and computing or communicating.
        let gpu_seconds = |per_lane: &[f64]| -> f64 {
            g.lanes
                .iter()
                .zip(per_lane)
                .map(|(l, s)| l.ranks as f64 * s)
                .sum()
        };
        let (used, occupied) = (gpu_seconds(&tl.compute), gpu_seconds(&tl.busy));
        let module_busy = |lanes: &[&LaneTasks], n: usize| {
            lanes
                .iter()
                .map(|t| tl.busy[t.lane] * g.lanes[t.lane].ranks as f64)
                .sum::<f64>()
                / n.max(1) as f64
        };
        let most_busy =
            |lanes: &[&LaneTasks]| lanes.iter().map(|t| tl.busy[t.lane]).fold(0.0, f64::max);
        let mut busy = Vec::new();
        let mut busiest = Vec::new();
        let mut memory = Vec::new();
        let llm_refs: Vec<&LaneTasks> = llm_lanes.iter().flatten().collect();
        busy.push((Module::Llm, module_busy(&llm_refs, llm.gpus())));
        busiest.push((Module::Llm, most_busy(&llm_refs)));
        let max_mb = |d: &[Load]| d.iter().map(|x| x.tokens).fold(0.0, f64::max);
        let mut llm_mem = 0.0f64;
        for s in 0..llm.pp {
            let largest = llm_load.iter().map(|d| max_mb(d)).fold(0.0, f64::max);
            // Chunk activations held at once, each `1 / v` of the stage's.
            let held = max_in_flight(&interleaved_1f1b(s, llm.pp, v, m, true));
            let inflight = largest * held as f64 / v as f64;
            let mut bytes = sc.memory(s, inflight, largest).total();
            if s == 0 {
                for (k, ec) in &centric {
                    // The fullest CP rank's chunk.
                    let big = enc_load[*k].iter().map(|d| max_mb(d)).fold(0.0, f64::max);
                    bytes += ec
                        .memory(0, big * chunk0_held(llm.pp, v, m) as f64, big)
                        .total();
                }
            }
            llm_mem = llm_mem.max(bytes);
        }
        memory.push((Module::Llm, llm_mem));
        for (k, &e) in encoders.iter().enumerate() {
            let (Some(l), Some(reps)) = (plan.layout(e), enc_lanes.get(k)) else {
                continue;
            };
            let Some(esc) = self.stage_cost(e, l, plan) else {
                continue;
            };
            let refs: Vec<&LaneTasks> = reps.iter().flatten().collect();
            busy.push((e, module_busy(&refs, l.gpus())));
            busiest.push((e, most_busy(&refs)));
            let largest = enc_load[k].iter().map(|d| max_mb(d)).fold(0.0, f64::max);
            let whole = enc_load[k]
                .iter()
                .map(|d| d.iter().map(|x| x.tokens).sum::<f64>())
                .fold(0.0, f64::max);
            let mut mem = 0.0f64;
            for s in 0..l.pp {
                // Phased: every chunk's activations wait for the LLM; overlapped: 1F1B
                // keeps a window of consecutive chunks in flight.
                let held = if overlapped {
                    let w = (l.pp - s + lead).min(chunks).max(1);
                    enc_load[k]
                        .iter()
                        .map(|d| window_max(d, w))
                        .fold(0.0, f64::max)
                } else {
                    whole
                };
                mem = mem.max(esc.memory(s, held, largest).total());
            }
            memory.push((e, mem));
        }
        let peak_memory = if plan.placement == Placement::Colocated {
            memory.iter().map(|x| x.1).sum()
        } else {
            memory.iter().map(|x| x.1).fold(0.0, f64::max)
        };
        let modules: Vec<&[Vec<LaneTasks>]> = enc_lanes
            .iter()
            .map(Vec::as_slice)
            .chain([llm_lanes.as_slice()])
            .collect();
        let imbalance_gpu_s = imbalance_gpu_s(&modules, &tl.busy, |l| g.lanes[l].ranks);
        let sim = StepSim {
            step_s: tl.makespan,
            bubble: 1.0 - used / (gpus * tl.makespan).max(1e-30),
            idle: (1.0 - occupied / (gpus * tl.makespan).max(1e-30)).max(0.0),
            peak_memory,
            busy,
            busiest,
            memory,
            bridge_s,
            dp_sync_s,
            busy_gpu_s: occupied,
            sync_gpu_s,
            imbalance_gpu_s,
        };
        Ok((sim, g, tl))
    }
}
