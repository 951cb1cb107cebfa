//! Pipeline stages and context parallelism of the Whisper encoder against the whole
//! encoder on one rank (same Init, same clips of 7, 10 and 4 frames): stages chained
//! through forward_stage / backward_stage (bitwise), CP 2 and 3, CP 2 x PP 2 with the
//! hidden states sent between stages, TP 2 x CP 2 — outputs on every rank, clip grads
//! summed over CP ranks, parameter grads summed over CP ranks (TP shards concatenated);
//! a stage's parameters are the full model's; misuse gives errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use braid_comm::Comm;
use braid_comm::local::{LocalComm, run_local};
use braid_encoders::{
    Act, AudioStageGrad, AudioStageInput, AudioStageOutput, WhisperEncoder, WhisperEncoderConfig,
};
use braid_kernels::{Device, Tensor};
use braid_nn::{Error, Init, Module, Shard};
use common::{TestResult, check, randn};

const TOL: f32 = 1e-5;
const TIMEOUT: Duration = Duration::from_secs(30);
const DEV: Device = Device::Cpu;
/// Mel frames of the clips: 4, 5 and 2 positions (T = 11); the last is shorter than
/// 2 * cp for cp = 2 and 3, so some CP chunks are empty.
const FRAMES: [usize; 3] = [7, 10, 4];
const LAYERS: usize = 3;

fn init() -> Init {
    Init::new(21, DEV).with_std(0.2)
}

fn config() -> WhisperEncoderConfig {
    WhisperEncoderConfig {
        num_mel_bins: 6,
        d_model: 16,
        encoder_layers: LAYERS,
        encoder_attention_heads: 4,
        encoder_ffn_dim: 32,
        max_source_positions: 10,
        act: Act::Gelu,
        layer_norm_eps: 1e-5,
    }
}

fn clips() -> Vec<Tensor> {
    FRAMES
        .iter()
        .enumerate()
        .map(|(i, &f)| Tensor::from_vec(randn(10 + i as u64, 6 * f), [6, f], DEV).unwrap())
        .collect()
}

fn total_tokens() -> usize {
    FRAMES
        .iter()
        .map(|&f| WhisperEncoderConfig::out_frames(f))
        .sum()
}

/// The output grad (T, D).
fn dy() -> Tensor {
    let n = total_tokens() * 16;
    Tensor::from_vec(randn(4, n), [total_tokens(), 16], DEV).unwrap()
}

/// name -> (grad, shard) on the host.
type Grads = BTreeMap<String, (Vec<f32>, Shard)>;

fn grads(m: &dyn Module) -> Grads {
    let mut out = Grads::new();
    m.visit_params(&mut |p| {
        let g = p.grad.as_ref().unwrap().to_vec_f32().unwrap();
        out.insert(p.name.clone(), (g, p.shard));
    });
    out
}

/// What one rank (or a chain of stages) computed; `hidden` only on last stages,
/// `dclips` only on first stages.
#[derive(Default)]
struct Run {
    hidden: Option<Vec<f32>>,
    dclips: Option<Vec<Vec<f32>>>,
    grads: Grads,
}

fn reference() -> TestResult<Run> {
    let mut m = WhisperEncoder::new(&init(), config())?;
    let (out, cache) = m.forward(&clips())?;
    let d = m.backward(cache, &dy())?;
    Ok(Run {
        hidden: Some(out.hidden.to_vec_f32()?),
        dclips: Some(d.iter().map(|t| t.to_vec_f32().unwrap()).collect()),
        grads: grads(&m),
    })
}

/// Sums the clip grads of `runs` that have them (rank order).
fn sum_dclips(runs: &[Run]) -> Vec<Vec<f32>> {
    let mut it = runs.iter().filter_map(|r| r.dclips.clone());
    let mut sum = it.next().expect("no first-stage rank");
    for d in it {
        for (s, x) in sum.iter_mut().zip(d) {
            s.iter_mut().zip(x).for_each(|(a, b)| *a += b);
        }
    }
    sum
}

/// Sums every parameter grad over `runs` by name (each name's holders in rank order).
fn sum_grads(runs: &[Grads]) -> Grads {
    let mut sum = Grads::new();
    for g in runs {
        for (name, (v, shard)) in g {
            match sum.get_mut(name) {
                Some((s, _)) => s.iter_mut().zip(v).for_each(|(a, b)| *a += b),
                None => {
                    sum.insert(name.clone(), (v.clone(), *shard));
                }
            }
        }
    }
    sum
}

fn compare(what: &str, got_hidden: &[Option<Vec<f32>>], dclips: &[Vec<f32>], g: &Grads) {
    let want = reference().unwrap();
    let wh = want.hidden.as_ref().unwrap();
    let mut last = 0;
    for (r, h) in got_hidden.iter().enumerate() {
        if let Some(h) = h {
            check(&format!("{what} rank {r}: hidden"), h, wh, TOL);
            last += 1;
        }
    }
    assert!(last > 0, "{what}: no rank returned the output");
    for (i, (d, w)) in dclips.iter().zip(want.dclips.as_ref().unwrap()).enumerate() {
        check(&format!("{what}: d clip {i} (summed)"), d, w, TOL);
    }
    assert_eq!(
        g.keys().collect::<Vec<_>>(),
        want.grads.keys().collect::<Vec<_>>(),
        "{what}: parameter names"
    );
    for (name, (w, _)) in &want.grads {
        check(&format!("{what}: d {name} (summed)"), &g[name].0, w, TOL);
    }
}

/// Stages `ranges` on one rank, chained: forward through all, backward from dy.
fn chain(ranges: &[Range<usize>]) -> TestResult<Run> {
    let mut stages = ranges
        .iter()
        .map(|r| {
            WhisperEncoder::stage(
                &init(),
                config(),
                r.clone(),
                Arc::new(braid_comm::SingleRank),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let clips = clips();
    let mut caches = Vec::new();
    let mut input = AudioStageInput::Clips(&clips);
    let mut hidden = None;
    for (s, st) in stages.iter().enumerate() {
        assert_eq!(st.hidden_tokens(&FRAMES)?, total_tokens());
        let (out, cache) = st.forward_stage(input, &FRAMES)?;
        caches.push(cache);
        input = match out {
            AudioStageOutput::Hidden(h) => AudioStageInput::Hidden(h),
            AudioStageOutput::Final(o) => {
                assert_eq!(s + 1, stages.len(), "only the last stage ends");
                assert_eq!(o.cu_seqlens, [0, 4, 9, 11]);
                hidden = Some(o.hidden.to_vec_f32()?);
                break;
            }
        };
    }
    let mut grad = dy();
    let mut dclips = None;
    for (st, cache) in stages.iter_mut().zip(caches).rev() {
        match st.backward_stage(cache, &grad)? {
            AudioStageGrad::Hidden(d) => grad = d,
            AudioStageGrad::Clips(d) => {
                dclips = Some(d.iter().map(|t| t.to_vec_f32().unwrap()).collect())
            }
        }
    }
    let grads = sum_grads(&stages.iter().map(|s| grads(s)).collect::<Vec<_>>());
    Ok(Run {
        hidden,
        dclips,
        grads,
    })
}

/// (a) Stages chained on one rank equal the whole encoder bit for bit: output, clip
/// grads, every parameter grad (each held by exactly one stage).
#[test]
fn stages_chained_equal_the_whole_encoder_bitwise() -> TestResult {
    let want = reference()?;
    #[allow(clippy::single_range_in_vec_init)] // one stage: the whole encoder
    let whole: &[Range<usize>] = &[0..LAYERS];
    for ranges in [
        whole,
        &[0..1, 1..LAYERS],
        &[0..2, 2..LAYERS],
        &[0..1, 1..2, 2..LAYERS],
    ] {
        let got = chain(ranges)?;
        assert_eq!(got.hidden, want.hidden, "{ranges:?}: hidden");
        assert_eq!(got.dclips, want.dclips, "{ranges:?}: d clips");
        assert_eq!(
            got.grads.keys().collect::<Vec<_>>(),
            want.grads.keys().collect::<Vec<_>>()
        );
        for (name, (g, _)) in &want.grads {
            assert_eq!(&got.grads[name].0, g, "{ranges:?}: d {name}");
        }
    }
    Ok(())
}

/// A stage holds the full model's same-named parameters (same Init), the stem only on
/// the first stage and the final norm only on the last.
#[test]
fn stage_parameters_are_the_full_models() -> TestResult {
    let full = WhisperEncoder::new(&init(), config())?;
    let mut want = BTreeMap::new();
    full.visit_params(&mut |p| {
        want.insert(p.name.clone(), p.value.to_vec_f32().unwrap());
    });
    let mut seen = 0;
    for r in [0..1, 1..2, 2..3] {
        let st = WhisperEncoder::stage(
            &init(),
            config(),
            r.clone(),
            Arc::new(braid_comm::SingleRank),
        )?;
        assert_eq!(st.stem.is_some(), r.start == 0);
        assert_eq!(st.layer_norm.is_some(), r.end == LAYERS);
        st.visit_params(&mut |p| {
            assert_eq!(
                p.value.to_vec_f32().unwrap(),
                want[&p.name],
                "{r:?}: {}",
                p.name
            );
            seen += 1;
        });
        let first = st.param_shapes()[0].0.clone();
        assert!(
            first.starts_with(if r.start == 0 { "conv1" } else { "layers." }),
            "{first}"
        );
    }
    assert_eq!(seen, want.len(), "every parameter in exactly one stage");
    Ok(())
}

/// One CP rank of the whole encoder: forward the clips, backward dy.
fn run_cp_rank(tp: Arc<dyn Comm>, cp: Arc<dyn Comm>) -> TestResult<Run> {
    let mut m = WhisperEncoder::with_group(&init(), config(), tp)?.with_cp(cp);
    let (out, cache) = m.forward(&clips())?;
    assert_eq!(out.cu_seqlens, [0, 4, 9, 11]);
    let d = m.backward(cache, &dy())?;
    Ok(Run {
        hidden: Some(out.hidden.to_vec_f32()?),
        dclips: Some(d.iter().map(|t| t.to_vec_f32().unwrap()).collect()),
        grads: grads(&m),
    })
}

/// (b) CP 2 and 3: every rank returns the full output; clip grads and parameter
/// grads summed over the CP ranks are the single rank's; the ranks' token counts
/// add up to T.
#[test]
fn cp_ranks_equal_one_rank() -> TestResult {
    for cp in [2, 3] {
        let runs = run_local(cp, TIMEOUT, |comm: LocalComm| {
            let n = WhisperEncoder::new(&init(), config())
                .map(|m| m.with_cp(Arc::new(comm.clone())))
                .and_then(|m| m.hidden_tokens(&FRAMES))
                .map_err(|e| e.to_string())?;
            run_cp_rank(Arc::new(braid_comm::SingleRank), Arc::new(comm))
                .map(|r| (n, r))
                .map_err(|e| e.to_string())
        })?;
        assert_eq!(runs.iter().map(|r| r.0).sum::<usize>(), total_tokens());
        let runs: Vec<Run> = runs.into_iter().map(|r| r.1).collect();
        let hidden: Vec<_> = runs.iter().map(|r| r.hidden.clone()).collect();
        let g = sum_grads(&runs.iter().map(|r| r.grads.clone()).collect::<Vec<_>>());
        compare(&format!("cp {cp}"), &hidden, &sum_dclips(&runs), &g);
    }
    Ok(())
}

/// (c) CP 2 x PP 2 on 4 ranks (stage s on ranks 2s, 2s + 1; stages of layers 0..1
/// and 1..3): each rank sends its hidden rows (T_local, D) to the same CP rank of the
/// next stage, and its input grad back.
#[test]
fn cp2_x_pp2_equals_one_rank() -> TestResult {
    let ranges = [0..1, 1..LAYERS];
    let runs = run_local(4, TIMEOUT, |comm: LocalComm| {
        let go = || -> TestResult<Run> {
            let r = comm.rank();
            let (s, c) = (r / 2, r % 2);
            let cp = comm.subgroup(&[2 * s, 2 * s + 1])?;
            assert_eq!(cp.rank(), c);
            let mut m = WhisperEncoder::stage(
                &init(),
                config(),
                ranges[s].clone(),
                Arc::new(braid_comm::SingleRank),
            )?
            .with_cp(cp);
            let t_local = m.hidden_tokens(&FRAMES)?;
            let clips = clips();
            let mut run = Run::default();
            if s == 0 {
                let (out, cache) = m.forward_stage(AudioStageInput::Clips(&clips), &FRAMES)?;
                let AudioStageOutput::Hidden(h) = out else {
                    panic!("stage 0 is not last")
                };
                assert_eq!(h.dims(), [t_local, 16]);
                comm.send(&h, r + 2)?;
                let dh = comm.recv(h.shape(), r + 2)?;
                let AudioStageGrad::Clips(d) = m.backward_stage(cache, &dh)? else {
                    panic!("stage 0 is first")
                };
                run.dclips = Some(d.iter().map(|t| t.to_vec_f32().unwrap()).collect());
            } else {
                let h = comm.recv(&[t_local, 16].into(), r - 2)?;
                let (out, cache) = m.forward_stage(AudioStageInput::Hidden(h), &FRAMES)?;
                let AudioStageOutput::Final(out) = out else {
                    panic!("stage 1 is last")
                };
                run.hidden = Some(out.hidden.to_vec_f32()?);
                let AudioStageGrad::Hidden(dh) = m.backward_stage(cache, &dy())? else {
                    panic!("stage 1 is not first")
                };
                comm.send(&dh, r - 2)?;
            }
            run.grads = grads(&m);
            Ok(run)
        };
        go().map_err(|e| e.to_string())
    })?;
    let hidden: Vec<_> = runs.iter().map(|r| r.hidden.clone()).collect();
    let g = sum_grads(&runs.iter().map(|r| r.grads.clone()).collect::<Vec<_>>());
    compare("cp 2 x pp 2", &hidden, &sum_dclips(&runs), &g);
    Ok(())
}

/// The full grads of one CP rank's TP group: split parameters concatenated along
/// their split dim (TP rank order), replicated ones taken from TP rank 0 (they are
/// equal on every TP rank).
fn gather_tp(tp_runs: &[&Grads], full_dims: &BTreeMap<String, Vec<usize>>) -> Grads {
    let mut out = Grads::new();
    for (name, (g0, shard)) in tp_runs[0] {
        let v = match *shard {
            Shard::Full => g0.clone(),
            Shard::Split { dim, size, .. } => {
                let full = &full_dims[name];
                let outer: usize = full[..dim].iter().product();
                let chunk = full[dim] / size * full[dim + 1..].iter().product::<usize>();
                let mut v = Vec::new();
                for o in 0..outer {
                    for run in tp_runs {
                        v.extend_from_slice(&run[name].0[o * chunk..(o + 1) * chunk]);
                    }
                }
                v
            }
        };
        out.insert(name.clone(), (v, Shard::Full));
    }
    out
}

/// (d) TP 2 x CP 2 on 4 ranks (TP fastest: TP groups {0, 1} and {2, 3}, CP groups
/// {0, 2} and {1, 3}).
#[test]
fn tp2_x_cp2_equals_one_rank() -> TestResult {
    let runs = run_local(4, TIMEOUT, |comm: LocalComm| {
        let go = || -> TestResult<Run> {
            let r = comm.rank();
            let tp = comm.subgroup(&[r / 2 * 2, r / 2 * 2 + 1])?;
            let cp = comm.subgroup(&[r % 2, r % 2 + 2])?;
            run_cp_rank(tp, cp)
        };
        go().map_err(|e| e.to_string())
    })?;
    let full = WhisperEncoder::new(&init(), config())?;
    let dims: BTreeMap<String, Vec<usize>> = full
        .param_shapes()
        .into_iter()
        .map(|(n, d)| (n, d.to_vec()))
        .collect();
    let per_cp: Vec<Grads> = [[0, 1], [2, 3]]
        .iter()
        .map(|g| gather_tp(&[&runs[g[0]].grads, &runs[g[1]].grads], &dims))
        .collect();
    assert!(runs[0].grads.values().any(|(_, s)| *s != Shard::Full));
    let hidden: Vec<_> = runs.iter().map(|r| r.hidden.clone()).collect();
    // Clip grads are replicated over TP: sum over one TP rank's CP group {0, 2}.
    let dclips = sum_dclips(&[&runs[0], &runs[2]].map(|r| Run {
        dclips: r.dclips.clone(),
        ..Run::default()
    }));
    compare("tp 2 x cp 2", &hidden, &dclips, &sum_grads(&per_cp));
    Ok(())
}

/// Misuse is an error, never a panic: empty or out-of-range stages, clips to a later
/// stage, hidden states to the first or of the wrong shape, frames that do not match
/// the clips, the whole-model calls on a stage, an output grad of the wrong shape.
#[test]
fn stage_misuse_is_an_error() -> TestResult {
    let single = || -> Arc<dyn Comm> { Arc::new(braid_comm::SingleRank) };
    for r in [1..1, 2..4, 0..LAYERS + 1] {
        let e = WhisperEncoder::stage(&init(), config(), r.clone(), single()).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{r:?}: {e}");
        assert!(e.to_string().contains("encoder_layers"), "{e}");
    }
    let clips = clips();
    let first = WhisperEncoder::stage(&init(), config(), 0..1, single())?;
    let mut last = WhisperEncoder::stage(&init(), config(), 1..LAYERS, single())?;
    let h = Tensor::zeros([total_tokens(), 16], braid_kernels::DType::F32, DEV)?;
    let e = last
        .forward_stage(AudioStageInput::Clips(&clips), &FRAMES)
        .unwrap_err();
    assert!(e.to_string().contains("no conv stem"), "{e}");
    let e = first
        .forward_stage(AudioStageInput::Hidden(h.try_clone()?), &FRAMES)
        .unwrap_err();
    assert!(e.to_string().contains("takes clips"), "{e}");
    let bad = Tensor::zeros([total_tokens() - 1, 16], braid_kernels::DType::F32, DEV)?;
    let e = last
        .forward_stage(AudioStageInput::Hidden(bad), &FRAMES)
        .unwrap_err();
    assert!(e.to_string().contains("T_local = 11"), "{e}");
    let e = first
        .forward_stage(AudioStageInput::Clips(&clips), &[7, 10, 5])
        .unwrap_err();
    assert!(e.to_string().contains("frames[2] = 5"), "{e}");
    let e = first
        .forward_stage(AudioStageInput::Clips(&clips), &[7, 10])
        .unwrap_err();
    assert!(matches!(e, Error::Input { .. }), "{e}");
    assert!(last.hidden_tokens(&[]).is_err());
    assert!(last.hidden_tokens(&[7, 0]).is_err());
    assert!(last.hidden_tokens(&[7, 21]).is_err());
    let e = first.forward(&clips).unwrap_err();
    assert!(e.to_string().contains("use forward_stage"), "{e}");
    let (_, cache) = last.forward_stage(AudioStageInput::Hidden(h), &FRAMES)?;
    let short = Tensor::zeros([3, 16], braid_kernels::DType::F32, DEV)?;
    let e = last.backward_stage(cache, &short).unwrap_err();
    assert!(e.to_string().contains("output grad must be (T = 11"), "{e}");
    Ok(())
}
