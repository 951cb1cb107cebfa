//! `braid plan --json`: the pick, the baseline and the bound as one JSON object.

use braid_balancer::Module;
use braid_balancer::cluster::GIB;
use braid_balancer::plan::bound::Gap;
use braid_balancer::plan::search::Found;
use serde_json::{Value, json};

use super::explain::explain;
use super::{PlanArgs, Report, of_module};

fn module_json(f: &Found, m: Module) -> Value {
    let Some(l) = f.plan.layout(m) else {
        return Value::Null;
    };
    let mem = of_module(&f.sim.memory, m).map(|x| x / GIB);
    let busy = of_module(&f.sim.busy, m);
    let busiest = of_module(&f.sim.busiest, m);
    json!({"tp": l.tp, "cp": l.cp, "pp": l.pp, "dp": l.dp, "gpus": l.gpus(),
           "first_gpu": f.plan.offset(m), "memory_gib": mem, "busy_s": busy,
           "busy_max_s": busiest})
}

fn found_json(f: &Found) -> Value {
    json!({
        "step_time_s": f.sim.step_s,
        "placement": f.plan.placement,
        "schedule": f.plan.schedule,
        "microbatches": f.plan.microbatches,
        "recompute": f.plan.recompute,
        "recompute_encoders": f.plan.recompute_encoders,
        "recompute_audio": f.plan.recomputes(Module::Audio),
        "llm_first_stage_layers": f.plan.llm_first_stage_layers,
        "llm_virtual_stages": f.plan.llm_virtual_stages,
        "reverse_encoder_stages": f.plan.reverse_encoder_stages,
        "llm_zero_bubble": f.plan.llm_zero_bubble,
        "bubble": f.sim.bubble,
        "idle": f.sim.idle,
        "peak_memory_gib": f.sim.peak_memory / GIB,
        "llm": module_json(f, Module::Llm),
        "vision": module_json(f, Module::Vision),
        "audio": module_json(f, Module::Audio),
    })
}

pub(super) fn to_json(r: &Report, a: &PlanArgs) -> Value {
    let (p, alone, closest, trained, g) = (r.p, r.alone, r.closest, r.trained, &r.gap);
    let o = &p.outcome;
    let mut v = found_json(&o.best);
    let extra = json!({
        "bound_step_time_s": g.bound_s,
        "from_bound": o.best.sim.step_s / g.bound_s.max(1e-12),
        "bound_work_s": g.bound.work_s,
        "bound_path_s": g.bound.path_s,
        "bound_sync_s": g.bound.sync_s,
        "bound_layouts": bound_layouts_json(g),
        "gap_memory_forced_s": g.memory_forced_s,
        "gap_grad_sync_s": g.grad_sync_s,
        "gap_imbalance_s": g.imbalance_s,
        "gap_bridge_s": g.bridge_s,
        "gap_bubbles_s": g.bubbles_s,
        "gpus": p.gpus,
        "asked_gpus": p.asked_gpus,
        "schedule_step_times_s": p
            .schedule_steps
            .iter()
            .map(|(s, t)| (s.name().to_string(), json!(t)))
            .collect::<serde_json::Map<String, Value>>(),
        "cluster": p.cluster,
        "overlap_grad_sync": p.problem.overlap_sync,
        "sequence_parallel": p.problem.sequence_parallel,
        "baseline_step_time_s": o.baseline.sim.step_s,
        "speedup": o.baseline.sim.step_s / o.best.sim.step_s,
        "search_step_time_s": o.searched.sim.step_s,
        "search": found_json(&o.searched),
        "brute_force_step_time_s": o.brute.as_ref().map(|b| b.sim.step_s),
        "check_simulated": o.checked.as_ref().map(|c| c.0),
        "check_step_time_s": o.checked.as_ref().map(|c| c.1.sim.step_s),
        "search_s": o.search_s,
        "combinations": o.combinations,
        "simulated": o.simulated,
        "baseline": found_json(&o.baseline),
        "baseline_gpus": o.baseline.plan.gpus(),
        "baseline_kind": "llm-centric: every encoder in the LLM's first pipeline stage at a TP dividing the LLM's (baseline.vision/audio.tp), a replica on every encoder-TP of the stage's GPUs, rows balanced and each microbatch's items balanced over its LLM replica's encoder replicas (what parallel.placement = \"centric\" runs)",
        "llm_alone_step_time_s": alone.map(|f| f.sim.step_s),
        "speedup_ceiling": alone.map(|f| o.baseline.sim.step_s / f.sim.step_s),
        "llm_alone_from_bound": alone.map(|f| f.sim.step_s / g.bound_s.max(1e-12)),
        "plan_file": a.out.display().to_string(),
        "baseline_plan_file": a.baseline_out.as_ref().map(|p| p.display().to_string()),
        "closest_to_baseline": closest.map(|f| json!({
            "plan": found_json(f),
            "step_time_s": f.sim.step_s,
            "peak_memory_gib": f.sim.peak_memory / GIB,
            "fits": f.sim.peak_memory <= p.problem.cluster.usable_bytes(),
        })),
        "explanation": explain(p, alone, closest, g),
    });
    if let (Value::Object(m), Value::Object(e)) = (&mut v, extra) {
        m.extend(e);
        // The pick as `braid train` runs it, where that differs (`as_trained`).
        let trained = trained.map(|t| {
            json!({
                "step_time_s": t.step_s,
                "peak_memory_gib": t.peak_memory / GIB,
                "fits": t.peak_memory <= p.problem.cluster.usable_bytes(),
                // The repeated norms' time is modelled only where the cluster measured
                // their share (`replicated_elementwise`; 0 on the GPU presets).
                "time_modelled": p.problem.cluster.replicated_elementwise > 0.0,
            })
        });
        m.insert("as_trained".into(), trained.unwrap_or(Value::Null));
    }
    v
}

/// Each module's layout in the bound, by module name.
fn bound_layouts_json(g: &Gap) -> Value {
    let mut out = serde_json::Map::new();
    for b in g.bound.layouts() {
        let l = b.layout;
        out.insert(
            b.module.name().to_string(),
            json!({"tp": l.tp, "cp": l.cp, "pp": l.pp, "dp": l.dp, "gpus": l.gpus(),
                   "virtual_stages": b.virtual_stages,
                   "first_stage_layers": b.first_stage_layers,
                   "recompute": b.recompute, "busy_gpu_s": b.work_gpu_s,
                   "critical_path_s": b.path_s}),
        );
    }
    Value::Object(out)
}
