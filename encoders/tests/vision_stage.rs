//! Pipeline stages and context parallelism of the ViT (CLIP with its class token,
//! SigLIP with its pooling head), 3 images, against the single-rank whole model on the
//! same Init: two stages chained equal it bit for bit (outputs, d pixels, every param
//! grad); CP 2 and 3 give its outputs on every rank, and its d pixels and param grads
//! as sums over the CP ranks; CP 2 x PP 2 (hidden states sent between stages) and
//! TP 2 x CP 2 likewise; bad stages and inputs are errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use braid_comm::local::{LocalComm, run_local};
use braid_comm::{Comm, SingleRank};
use braid_encoders::{
    Act, VisionConfig, VisionEncoder, VisionFamily, VisionStageInput, VisionStageOutput,
};
use braid_kernels::{Device, Shape, Tensor};
use braid_nn::{Init, Module};
use common::{TestResult, check, randn};

const TOL: f32 = 1e-5;
const TIMEOUT: Duration = Duration::from_secs(30);
const DEV: Device = Device::Cpu;
/// Images per batch.
const B: usize = 3;
const FAMILIES: [VisionFamily; 2] = [VisionFamily::Clip, VisionFamily::Siglip];

fn init() -> Init {
    Init::new(21, DEV).with_std(0.2)
}

/// 8x8 images in 2x2 patches: N = 16 patches, S = 17 (CLIP) or 16 tokens.
fn config(family: VisionFamily) -> VisionConfig {
    VisionConfig {
        family,
        hidden_size: 16,
        intermediate_size: 32,
        num_layers: 2,
        num_heads: 4,
        num_channels: 3,
        image_size: 8,
        patch_size: 2,
        act: match family {
            VisionFamily::Clip => Act::QuickGelu,
            VisionFamily::Siglip => Act::GeluPytorchTanh,
        },
        layer_norm_eps: 1e-5,
        use_head: family == VisionFamily::Siglip,
    }
}

/// name -> (value, grad) on the host.
type Params = BTreeMap<String, (Vec<f32>, Vec<f32>)>;

fn params(m: &dyn Module) -> Params {
    let mut out = Params::new();
    m.visit_params(&mut |p| {
        let v = p.value.to_vec_f32().unwrap();
        let g = p.grad.as_ref().unwrap().to_vec_f32().unwrap();
        out.insert(p.name.clone(), (v, g));
    });
    out
}

/// The same inputs on every rank: pixels (B, C, H, W), d last_hidden_state (B, S, D)
/// and d pooler_output (B, D).
struct Inputs {
    px: Tensor,
    dl: Tensor,
    dp: Tensor,
}

fn inputs(cfg: &VisionConfig) -> TestResult<Inputs> {
    let (c, side, d, s) = (3, 8, cfg.hidden_size, cfg.num_positions());
    Ok(Inputs {
        px: Tensor::from_vec(randn(1, B * c * side * side), [B, c, side, side], DEV)?,
        dl: Tensor::from_vec(randn(2, B * s * d), [B, s, d], DEV)?,
        dp: Tensor::from_vec(randn(3, B * d), [B, d], DEV)?,
    })
}

/// What one rank (or a chain of stages) computed.
#[derive(Default)]
struct Run {
    /// last_hidden_state, pooler_output (last stage)
    out: Option<(Vec<f32>, Vec<f32>)>,
    /// d pixel_values (first stage)
    dpx: Option<Vec<f32>>,
    params: Params,
}

/// Forward + backward of a whole model (any TP/CP) from pixels.
fn whole(model: &mut VisionEncoder, x: &Inputs) -> TestResult<Run> {
    let (out, cache) = model.forward(&x.px)?;
    let dpx = model.backward(cache, &x.dl, Some(&x.dp))?;
    Ok(Run {
        out: Some((
            out.last_hidden_state.to_vec_f32()?,
            out.pooler_output.ok_or("no pooler output")?.to_vec_f32()?,
        )),
        dpx: Some(dpx.to_vec_f32()?),
        params: params(model),
    })
}

fn reference(cfg: &VisionConfig, x: &Inputs) -> TestResult<Run> {
    whole(&mut VisionEncoder::new(&init(), cfg.clone())?, x)
}

/// `check` of a parameter grad, except a key bias: it adds the same score to every
/// key of a query and cancels in the softmax, so its true grad is 0 and both sides hold
/// round-off that no relative measure can compare.
#[track_caller]
fn grad_close(what: &str, name: &str, got: &[f32], want: &[f32]) {
    if name.ends_with("k_proj.bias") {
        let max = got.iter().chain(want).fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(max < 1e-5, "{what}: should be ~0, got {max:e}");
    } else {
        check(what, got, want, TOL);
    }
}

fn add(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

/// The sums over `runs` of d pixels and of each parameter's grad (over the runs that
/// hold it), and the one output they hold: what a trainer sees after summing over CP
/// (and gathering the stages).
fn sum_runs(runs: &[&Run]) -> Run {
    let mut sum = Run::default();
    for r in runs {
        if let Some(o) = &r.out {
            if let Some(s) = &sum.out {
                // Every CP rank returns the same output, bit for bit.
                assert!(s == o, "CP ranks' outputs differ");
            }
            sum.out = Some(o.clone());
        }
        if let Some(d) = &r.dpx {
            match &mut sum.dpx {
                Some(s) => add(s, d),
                None => sum.dpx = Some(d.clone()),
            }
        }
        for (name, (v, g)) in &r.params {
            match sum.params.get_mut(name) {
                Some((sv, sg)) => {
                    assert_eq!(sv, v, "{name} differs between ranks");
                    add(sg, g);
                }
                None => {
                    sum.params.insert(name.clone(), (v.clone(), g.clone()));
                }
            }
        }
    }
    sum
}

/// `got` equals `want` within TOL: outputs, d pixels, every parameter's value
/// (exactly) and grad.
fn compare(what: &str, got: &Run, want: &Run) {
    let (o, w) = (got.out.as_ref().unwrap(), want.out.as_ref().unwrap());
    check(&format!("{what}: last_hidden_state"), &o.0, &w.0, TOL);
    check(&format!("{what}: pooler_output"), &o.1, &w.1, TOL);
    let (d, wd) = (got.dpx.as_ref().unwrap(), want.dpx.as_ref().unwrap());
    check(&format!("{what}: d pixel_values"), d, wd, TOL);
    assert_eq!(
        got.params.keys().collect::<Vec<_>>(),
        want.params.keys().collect::<Vec<_>>(),
        "{what}: parameter names"
    );
    for (name, (v, g)) in &got.params {
        let (wv, wg) = &want.params[name];
        assert_eq!(v, wv, "{what}: {name}");
        grad_close(&format!("{what}: d {name}"), name, g, wg);
    }
}

/// Stages 0..1 and 1..2 on one rank, chained through forward_stage/backward_stage.
fn two_stages(cfg: &VisionConfig, x: &Inputs) -> TestResult<(Run, Run)> {
    let mut s0 = VisionEncoder::stage(&init(), cfg.clone(), 0..1, Arc::new(SingleRank))?;
    let mut s1 = VisionEncoder::stage(&init(), cfg.clone(), 1..2, Arc::new(SingleRank))?;
    assert!(s0.is_first() && !s0.is_last() && !s1.is_first() && s1.is_last());
    let (VisionStageOutput::Hidden(h), c0) =
        s0.forward_stage(VisionStageInput::Pixels(&x.px), B)?
    else {
        return Err("stage 0 returned the final output".into());
    };
    assert_eq!(h.dims(), [s0.hidden_tokens(B)?, cfg.hidden_size]);
    let (VisionStageOutput::Final(out), c1) = s1.forward_stage(VisionStageInput::Hidden(h), B)?
    else {
        return Err("stage 1 returned hidden states".into());
    };
    let dh = s1.backward_stage(c1, &x.dl, Some(&x.dp))?;
    let dpx = s0.backward_stage(c0, &dh, None)?;
    let first = Run {
        out: None,
        dpx: Some(dpx.to_vec_f32()?),
        params: params(&s0),
    };
    let last = Run {
        out: Some((
            out.last_hidden_state.to_vec_f32()?,
            out.pooler_output.ok_or("no pooler output")?.to_vec_f32()?,
        )),
        dpx: None,
        params: params(&s1),
    };
    Ok((first, last))
}

#[test]
fn two_stages_equal_the_whole_model_bitwise() -> TestResult {
    for family in FAMILIES {
        let cfg = config(family);
        let x = inputs(&cfg)?;
        let want = reference(&cfg, &x)?;
        let (first, last) = two_stages(&cfg, &x)?;
        // The stages split the parameters: none held twice, together all of them.
        assert!(first.params.keys().all(|k| !last.params.contains_key(k)));
        let got = sum_runs(&[&first, &last]);
        let what = format!("{family:?} stages 0..1 + 1..2");
        compare(&what, &got, &want);
        // Same ops in the same order: bit for bit.
        assert!(got.out == want.out, "{what}: outputs differ");
        assert!(got.dpx == want.dpx, "{what}: d pixels differ");
        for (name, (_, g)) in &got.params {
            assert!(*g == want.params[name].1, "{what}: d {name} differs");
        }
        // The whole model through forward_stage is forward.
        let m = VisionEncoder::new(&init(), cfg.clone())?;
        let (VisionStageOutput::Final(o), _) =
            m.forward_stage(VisionStageInput::Pixels(&x.px), B)?
        else {
            return Err("the whole model returned hidden states".into());
        };
        assert!(o.last_hidden_state.to_vec_f32()? == want.out.as_ref().unwrap().0);
    }
    Ok(())
}

#[test]
fn cp_2_and_3_equal_one_rank() -> TestResult {
    for family in FAMILIES {
        let cfg = config(family);
        let x = inputs(&cfg)?;
        let want = reference(&cfg, &x)?;
        for cp in [2, 3] {
            let runs = run_local(cp, TIMEOUT, |comm: LocalComm| -> Result<_, String> {
                let go = || -> TestResult<Run> {
                    let mut m = VisionEncoder::new(&init(), cfg.clone())?.with_cp(Arc::new(comm));
                    assert_eq!(m.cp_size(), cp);
                    whole(&mut m, &x)
                };
                go().map_err(|e| e.to_string())
            })?;
            // Only CP rank 0 adds the replicated post-norm/head grads.
            for r in &runs[1..] {
                for (name, (_, g)) in &r.params {
                    if name.starts_with("post_layernorm") || name.starts_with("head.") {
                        assert!(g.iter().all(|&v| v == 0.0), "{family:?} cp {cp}: d {name}");
                    }
                }
            }
            let got = sum_runs(&runs.iter().collect::<Vec<_>>());
            compare(&format!("{family:?} cp {cp}"), &got, &want);
        }
    }
    Ok(())
}

/// World rank w: stage w / 2, CP rank w % 2; CP rank r of stage 0 sends its hidden
/// states to CP rank r of stage 1, and gets their grads back.
#[test]
fn cp_2_by_pp_2_equals_one_rank() -> TestResult {
    for family in FAMILIES {
        let cfg = config(family);
        let x = inputs(&cfg)?;
        let want = reference(&cfg, &x)?;
        let runs = run_local(4, TIMEOUT, |comm: LocalComm| -> Result<_, String> {
            let go = || -> TestResult<Run> {
                let w = comm.rank();
                let (pp, c) = (w / 2, w % 2);
                let cp = comm.subgroup(&[2 * pp, 2 * pp + 1])?;
                let mut m =
                    VisionEncoder::stage(&init(), cfg.clone(), pp..pp + 1, Arc::new(SingleRank))?
                        .with_cp(cp);
                let d = cfg.hidden_size;
                let rows = Shape::from(vec![m.hidden_tokens(B)?, d]);
                if pp == 0 {
                    let (out, cache) = m.forward_stage(VisionStageInput::Pixels(&x.px), B)?;
                    let VisionStageOutput::Hidden(h) = out else {
                        return Err("stage 0 returned the final output".into());
                    };
                    comm.send(&h, 2 + c)?;
                    let dh = comm.recv(&rows, 2 + c)?;
                    let dpx = m.backward_stage(cache, &dh, None)?;
                    Ok(Run {
                        out: None,
                        dpx: Some(dpx.to_vec_f32()?),
                        params: params(&m),
                    })
                } else {
                    let h = comm.recv(&rows, c)?;
                    let (out, cache) = m.forward_stage(VisionStageInput::Hidden(h), B)?;
                    let VisionStageOutput::Final(out) = out else {
                        return Err("stage 1 returned hidden states".into());
                    };
                    let dh = m.backward_stage(cache, &x.dl, Some(&x.dp))?;
                    comm.send(&dh, c)?;
                    Ok(Run {
                        out: Some((
                            out.last_hidden_state.to_vec_f32()?,
                            out.pooler_output.ok_or("no pooler")?.to_vec_f32()?,
                        )),
                        dpx: None,
                        params: params(&m),
                    })
                }
            };
            go().map_err(|e| e.to_string())
        })?;
        let got = sum_runs(&runs.iter().collect::<Vec<_>>());
        compare(&format!("{family:?} cp 2 x pp 2"), &got, &want);
    }
    Ok(())
}

/// TP fastest (world rank = tp + 2 * cp): each TP rank's results, summed over its CP
/// group, equal the TP-only run's on 2 ranks; outputs equal the single rank's.
#[test]
fn tp_2_by_cp_2_equals_tp_2() -> TestResult {
    for family in FAMILIES {
        let cfg = config(family);
        let x = inputs(&cfg)?;
        let want = reference(&cfg, &x)?;
        let tp_only = run_local(2, TIMEOUT, |comm: LocalComm| -> Result<_, String> {
            let go = || -> TestResult<Run> {
                whole(
                    &mut VisionEncoder::with_group(&init(), cfg.clone(), Arc::new(comm))?,
                    &x,
                )
            };
            go().map_err(|e| e.to_string())
        })?;
        let both = run_local(4, TIMEOUT, |comm: LocalComm| -> Result<_, String> {
            let go = || -> TestResult<Run> {
                let w = comm.rank();
                let (t, c) = (w % 2, w / 2);
                let tp = comm.subgroup(&[2 * c, 2 * c + 1])?;
                let cp = comm.subgroup(&[t, t + 2])?;
                whole(
                    &mut VisionEncoder::with_group(&init(), cfg.clone(), tp)?.with_cp(cp),
                    &x,
                )
            };
            go().map_err(|e| e.to_string())
        })?;
        for t in 0..2 {
            let got = sum_runs(&[&both[t], &both[t + 2]]);
            let what = format!("{family:?} tp 2 x cp 2, tp rank {t}");
            compare(&what, &got, &tp_only[t]);
            let (o, w) = (got.out.as_ref().unwrap(), want.out.as_ref().unwrap());
            check(&format!("{what}: output vs one rank"), &o.0, &w.0, TOL);
            check(&format!("{what}: pooled vs one rank"), &o.1, &w.1, TOL);
        }
    }
    Ok(())
}

#[test]
fn bad_stages_and_inputs_are_errors() -> TestResult {
    let cfg = config(VisionFamily::Siglip);
    let one = || Arc::new(SingleRank);
    for layers in [1..1, 0..3, 2..3] {
        let e = VisionEncoder::stage(&init(), cfg.clone(), layers.clone(), one()).unwrap_err();
        assert!(e.to_string().contains("non-empty range within 0..2"), "{e}");
    }
    let x = inputs(&cfg)?;
    let s0 = VisionEncoder::stage(&init(), cfg.clone(), 0..1, one())?;
    let s1 = VisionEncoder::stage(&init(), cfg.clone(), 1..2, one())?;
    let e = s1
        .forward_stage(VisionStageInput::Pixels(&x.px), B)
        .unwrap_err();
    assert!(e.to_string().contains("not pixels"), "{e}");
    let h = Tensor::zeros([5, 16], braid_kernels::DType::F32, DEV)?;
    let e = s1
        .forward_stage(VisionStageInput::Hidden(h.try_clone()?), B)
        .unwrap_err();
    assert!(e.to_string().contains("(N_local, D) = [48, 16]"), "{e}");
    let e = s0
        .forward_stage(VisionStageInput::Hidden(h), B)
        .unwrap_err();
    assert!(e.to_string().contains("takes pixel_values"), "{e}");
    let e = s0
        .forward_stage(VisionStageInput::Pixels(&x.px), 2)
        .unwrap_err();
    assert!(e.to_string().contains("hold 3 images, b = 2"), "{e}");
    assert!(s0.forward(&x.px).is_err());
    // 16 tokens an image over 17 CP ranks: some rank holds none, and says so.
    let runs = run_local(17, TIMEOUT, |comm: LocalComm| -> Result<_, String> {
        let m = VisionEncoder::new(&init(), cfg.clone())
            .map_err(|e| e.to_string())?
            .with_cp(Arc::new(comm));
        Ok(m.hidden_tokens(B).map_err(|e| e.to_string()))
    })?;
    let errs: Vec<_> = runs.into_iter().filter_map(|r| r.err()).collect();
    assert!(!errs.is_empty());
    assert!(errs[0].contains("holds no token"), "{}", errs[0]);
    Ok(())
}
