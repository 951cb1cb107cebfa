//! The simulator's colocated overlapped step: every GPU runs its modules' passes one at a time, in the step's global order, with encoder passes between the LLM's, with one model chunk per LLM stage or several (interleaved).
#![allow(clippy::unwrap_used)]

use braid_balancer::{Layout, Placement, Plan, Schedule};

mod common;
use common::{plan, small};

/// The GPUs of a lane "<module> r<replica> s<stage>" of layout `l` (grid order TP, CP,
/// DP, PP, every grid from GPU 0; stage `s` on slice `pp - 1 - s` where `reversed`).
fn gpus_of(l: Layout, reversed: bool, label: &str) -> std::ops::Range<usize> {
    let num = |p: &str| {
        let t = label.split(' ').find(|t| t.starts_with(p)).unwrap();
        t[1..].parse::<usize>().unwrap()
    };
    let slice = if reversed {
        l.pp - 1 - num("s")
    } else {
        num("s")
    };
    let start = slice * l.tp * l.cp * l.dp + num("r") * l.tp * l.cp;
    start..start + l.tp * l.cp
}

#[test]
fn every_gpu_runs_one_pass_at_a_time_and_encoders_fill_the_llm_waits() {
    let (p, w) = small();
    let batch = w.batch(0);
    let lay = |tp, cp, pp, dp| Layout { tp, cp, pp, dp };
    let (mut checked, mut interleaved, mut virtual_stages) = (0, 0, 0);
    for (llm, vision, audio) in [
        (lay(2, 1, 2, 4), lay(1, 1, 1, 16), lay(1, 1, 1, 16)),
        (lay(2, 2, 4, 1), lay(1, 1, 2, 8), lay(1, 1, 2, 8)),
        (lay(1, 2, 4, 2), lay(2, 1, 2, 4), lay(1, 1, 4, 4)),
        (lay(4, 1, 2, 2), lay(1, 2, 4, 2), lay(2, 1, 1, 8)),
    ] {
        let runs = [2, 4, 8]
            .into_iter()
            .flat_map(|m| [(m, 1), (m, 2)])
            .flat_map(|(m, v)| [(m, v, false), (m, v, true)]);
        for (m, v, rev) in runs {
            if v > 1 && llm.pp < 2 {
                continue;
            }
            let plan = Plan {
                placement: Placement::Colocated,
                schedule: Schedule::Overlapped,
                vision: Some(vision),
                audio: Some(audio),
                llm_virtual_stages: v,
                reverse_encoder_stages: rev,
                llm_zero_bubble: false,
                ..plan(llm, m)
            };
            plan.check(&p.model, &p.cluster, 16, batch.len()).unwrap();
            let (sim, tl) = p.timeline(&plan, &batch).unwrap();
            let at = format!(
                "llm {llm:?} v{v} vision {vision:?} audio {audio:?} {m} mb, reversed {rev}"
            );
            // Every pass of every lane ran: the interleaved LLM's `v` chunks of each
            // microbatch forward and backward on every stage.
            let llm_passes = tl
                .spans
                .iter()
                .filter(|(_, name, ..)| name.starts_with("llm "))
                .count();
            assert_eq!(llm_passes, 2 * v * m * llm.pp * llm.dp, "{at}");
            virtual_stages += usize::from(v > 1);
            let layout_of = |label: &str| match label.split(' ').next() {
                Some("llm") => Some((llm, false)),
                Some("vision") => Some((vision, rev)),
                Some("audio") => Some((audio, rev)),
                _ => None,
            };
            let mut busiest = 0.0f64;
            for gpu in 0..16 {
                // Every compute span on this GPU, in time order.
                let mut spans: Vec<(f64, f64, &str)> = tl
                    .spans
                    .iter()
                    .filter(|(lane, name, ..)| {
                        let label = &tl.lanes[*lane].0;
                        !name.contains("grad sync")
                            && layout_of(label)
                                .is_some_and(|(l, r)| gpus_of(l, r, label).contains(&gpu))
                    })
                    .map(|(_, name, a, b)| (*a, *b, name.as_str()))
                    .collect();
                spans.sort_by(|x, y| x.0.total_cmp(&y.0));
                for s in spans.windows(2) {
                    assert!(
                        s[1].0 >= s[0].1 - 1e-9,
                        "{at}, GPU {gpu}: {} and {} overlap",
                        s[0].2,
                        s[1].2
                    );
                }
                busiest = busiest.max(spans.iter().map(|s| s.1 - s.0).sum());
                // An encoder pass between two of the LLM's on this GPU.
                let llm_at: Vec<usize> = (0..spans.len())
                    .filter(|&i| spans[i].2.starts_with("llm"))
                    .collect();
                if let (Some(&a), Some(&b)) = (llm_at.first(), llm_at.last()) {
                    interleaved += usize::from(spans[a..b].iter().any(|s| !s.2.starts_with("llm")));
                }
            }
            assert!(
                sim.step_s >= busiest - 1e-9,
                "{at}: {} < {busiest}",
                sim.step_s
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 48);
    assert_eq!(virtual_stages, 24);
    assert!(interleaved > 100, "only {interleaved} GPUs interleave");
}

/// Each encoder recomputes on its own (`parallel.vision.recompute`,
/// `parallel.audio.recompute`): a plan whose audio encoder keeps its activations while
/// the ViT recomputes holds and spends, per module, what the plans with both or neither
/// recomputing do for that module.
#[test]
fn each_encoder_recomputes_on_its_own() {
    let (p, w) = small();
    let batch = w.batch(0);
    let lay = |tp, cp, pp, dp| Layout { tp, cp, pp, dp };
    let with = |encoders: bool, audio: Option<bool>| {
        let plan = Plan {
            placement: Placement::Colocated,
            schedule: Schedule::Overlapped,
            recompute_encoders: encoders,
            recompute_audio: audio,
            vision: Some(lay(1, 1, 2, 8)),
            audio: Some(lay(1, 1, 2, 8)),
            ..plan(lay(2, 1, 2, 4), 4)
        };
        plan.check(&p.model, &p.cluster, 16, batch.len()).unwrap();
        p.simulate(&plan, &batch).unwrap()
    };
    let of = |v: &[(braid_balancer::Module, f64)], m| v.iter().find(|x| x.0 == m).unwrap().1;
    let (both, neither, vision_only) =
        (with(true, None), with(false, None), with(true, Some(false)));
    let (vision, audio) = (
        braid_balancer::Module::Vision,
        braid_balancer::Module::Audio,
    );
    assert_eq!(of(&vision_only.memory, vision), of(&both.memory, vision));
    assert_eq!(of(&vision_only.memory, audio), of(&neither.memory, audio));
    assert_eq!(of(&vision_only.busy, audio), of(&neither.busy, audio));
    assert_eq!(of(&vision_only.busy, vision), of(&both.busy, vision));
    // Recomputing saves memory and costs time.
    assert!(of(&both.memory, audio) < of(&neither.memory, audio));
    assert!(of(&both.busy, audio) > of(&neither.busy, audio));
    // And the other way round.
    let audio_only = with(false, Some(true));
    assert_eq!(of(&audio_only.memory, audio), of(&both.memory, audio));
    assert_eq!(of(&audio_only.memory, vision), of(&neither.memory, vision));
}
