//! Tensor parallelism of the LLM: the model on tp ranks (blocks split by heads and MLP
//! columns, embedding and lm_head by vocabulary rows, vocab-parallel loss) equals the
//! single-rank model on the same Init — loss, logits (shards put side by side), the
//! modality-embedding grad and every parameter grad (shards concatenated along their
//! split dim) — tied and untied, for tp = 2 and 4; a 2-stage pipeline under TP equals
//! the whole model; sizes that do not split are errors naming the key.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use braid_comm::local::run_local;
use braid_comm::testing::run_on_ranks;
use braid_comm::{Comm, SingleRank};
use braid_kernels::rng::Rng;
use braid_kernels::{Device, Tensor};
use braid_llm::{
    Family, Llm, LlmConfig, LlmStage, ModalityEmbeds, RopeScaling, RopeSpec, StageInput,
    next_token_targets, vocab_parallel_loss,
};
use braid_nn::{Embedding, Init, Module, SeqInfo, VocabParallelEmbedding};
use common::{TestResult, rel_err};

const TOL: f32 = 1e-5;
/// A collective that waits longer fails the test (naming the ranks) instead of hanging.
const TIMEOUT: Duration = Duration::from_secs(30);

/// GQA 8/4 (tp = 4 leaves one KV head a rank), biases everywhere, V = 16.
fn config(tie: bool) -> LlmConfig {
    LlmConfig {
        family: Family::Llama,
        vocab: 16,
        hidden: 16,
        intermediate: 32,
        layers: 2,
        heads: 8,
        kv_heads: 4,
        head_dim: 4,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 32,
        rope: RopeSpec {
            theta: 10_000.0,
            scaling: RopeScaling::Default,
        },
        tie_embeddings: tie,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
    }
}

/// std 0.3: O(1) signal through every path.
fn init() -> Init {
    Init::new(11, Device::Cpu).with_std(0.3)
}

const PLACEHOLDER: u32 = 9;

/// Two packed rows; ids span the whole vocabulary (every TP rank holds some), two
/// placeholders get modality rows.
struct Batch {
    ids: Vec<u32>,
    lens: Vec<usize>,
    positions: Vec<u32>,
    embeds: Vec<f32>,
    targets: Vec<u32>,
}

fn batch(c: usize) -> Batch {
    let ids = vec![1, PLACEHOLDER, 15, 4, 7, 12, PLACEHOLDER, 2, 14];
    let lens = vec![4, 5];
    let positions = vec![1, 6];
    let embeds = Rng::new(3).normal_vec(positions.len() * c, 1.0);
    let targets = next_token_targets(&ids, &SeqInfo::packed(&lens), None).unwrap();
    Batch {
        ids,
        lens,
        positions,
        embeds,
        targets,
    }
}

/// One parameter on the host: (dims, value, grad).
type HostParams = BTreeMap<String, (Vec<usize>, Vec<f32>, Vec<f32>)>;

/// Every parameter of `modules`; a name held by several (a tied head's copy of the
/// embedding on the last stage) gets the sum of their grads.
fn params(modules: &[&dyn Module]) -> HostParams {
    let mut out = HostParams::new();
    for m in modules {
        m.visit_params(&mut |p| {
            let g = p.grad.as_ref().unwrap().to_vec_f32().unwrap();
            match out.get_mut(&p.name) {
                Some((_, _, acc)) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                None => {
                    let v = p.value.to_vec_f32().unwrap();
                    out.insert(p.name.clone(), (p.value.dims().to_vec(), v, g));
                }
            }
        });
    }
    out
}

/// What one rank (or the single-rank model) computed.
struct Run {
    loss: f32,
    /// (T, V/tp)
    logits: Vec<f32>,
    /// (M, C)
    dmod: Vec<f32>,
    params: HostParams,
}

fn modality(b: &Batch) -> TestResult<ModalityEmbeds> {
    let m = b.positions.len();
    Ok(ModalityEmbeds {
        positions: Tensor::from_vec_u32(b.positions.clone(), [m], Device::Cpu)?,
        embeds: Tensor::from_vec(b.embeds.clone(), [m, b.embeds.len() / m], Device::Cpu)?,
    })
}

/// Forward, loss (vocab-parallel over the model's group), backward of the whole model.
fn run_whole(cfg: &LlmConfig, group: Arc<dyn Comm>, b: &Batch) -> TestResult<Run> {
    let mut llm = Llm::with_group(cfg, &init(), group)?;
    let ids = Tensor::from_vec_u32(b.ids.clone(), [b.ids.len()], Device::Cpu)?;
    let seq = SeqInfo::packed(&b.lens);
    let me = modality(b)?;
    let (logits, _) = llm.forward(&ids, &seq, Some(&me))?;
    let (out, cache) = llm.loss(&ids, &seq, Some(&me), &b.targets, None)?;
    let dmod = llm
        .backward(cache, &out.dlogits)?
        .ok_or("no modality grad")?;
    Ok(Run {
        loss: out.loss,
        logits: logits.to_vec_f32()?,
        dmod: dmod.to_vec_f32()?,
        params: params(&[&llm]),
    })
}

/// The same through two pipeline stages (layers 0..1, 1..2) sharing the TP group:
/// the hidden states go forward, their grad back.
fn run_stages(cfg: &LlmConfig, group: Arc<dyn Comm>, b: &Batch) -> TestResult<Run> {
    let mut s0 = LlmStage::new(cfg, 0..1, &init(), Arc::clone(&group))?;
    let mut s1 = LlmStage::new(cfg, 1..2, &init(), Arc::clone(&group))?;
    assert_eq!(s1.embed_tokens.is_some(), cfg.tie_embeddings);
    let ids = Tensor::from_vec_u32(b.ids.clone(), [b.ids.len()], Device::Cpu)?;
    let seq = SeqInfo::packed(&b.lens);
    let me = modality(b)?;
    // The host copy of the ids, as the trainer passes it (no device read under TP).
    let input = StageInput::Tokens {
        ids: &ids,
        host_ids: Some(&b.ids),
        modality: Some(&me),
    };
    let (h, c0) = s0.forward(input, &seq)?;
    let (logits, c1) = s1.forward(StageInput::Hidden(h), &seq)?;
    let start = s1.vocab_range().start;
    let out = vocab_parallel_loss(s1.tp_group().as_ref(), &logits, start, &b.targets, None)?;
    let dh = s1.backward(c1, &out.dlogits)?.ok_or("no hidden grad")?;
    let dmod = s0.backward(c0, &dh)?.ok_or("no modality grad")?;
    Ok(Run {
        loss: out.loss,
        logits: logits.to_vec_f32()?,
        dmod: dmod.to_vec_f32()?,
        params: params(&[&s0, &s1]),
    })
}

/// Concatenates the ranks' `shards` (each `dims`) along the one dim where they differ
/// from `full`; `None` when they are full (replicated).
fn concat(full: &[usize], shards: &[(&[usize], &[f32])]) -> Option<Vec<f32>> {
    let dims = shards[0].0;
    let d = (0..full.len()).find(|&i| dims[i] != full[i])?;
    assert_eq!(
        dims[d] * shards.len(),
        full[d],
        "shard dims {dims:?} of {full:?}"
    );
    let outer: usize = full[..d].iter().product();
    let chunk = dims[d] * full[d + 1..].iter().product::<usize>();
    let mut out = Vec::with_capacity(full.iter().product());
    for o in 0..outer {
        for (_, s) in shards {
            out.extend_from_slice(&s[o * chunk..(o + 1) * chunk]);
        }
    }
    Some(out)
}

/// Logits (T, V/tp) of each rank side by side -> (T, V).
fn concat_columns(shards: &[Vec<f32>], t: usize) -> Vec<f32> {
    let vl = shards[0].len() / t;
    (0..t)
        .flat_map(|i| {
            shards
                .iter()
                .flat_map(move |s| s[i * vl..(i + 1) * vl].iter().copied())
        })
        .collect()
}

#[track_caller]
fn close(what: &str, got: &[f32], want: &[f32]) {
    let e = rel_err(got, want);
    assert!(e <= TOL, "{what}: relative error {e:e} > {TOL:e}");
}

/// The ranks' runs against the single-rank one.
fn compare(tp: usize, reference: &Run, runs: &[Run], t: usize) {
    for (r, run) in runs.iter().enumerate() {
        assert!(
            (run.loss - reference.loss).abs() <= TOL * reference.loss.abs(),
            "tp {tp} rank {r}: loss {} vs {}",
            run.loss,
            reference.loss
        );
        close(
            &format!("tp {tp} rank {r}: d modality"),
            &run.dmod,
            &reference.dmod,
        );
    }
    let shards: Vec<Vec<f32>> = runs.iter().map(|r| r.logits.clone()).collect();
    close(
        &format!("tp {tp}: logits"),
        &concat_columns(&shards, t),
        &reference.logits,
    );
    for (name, (dims, value, grad)) in &reference.params {
        let held: Vec<_> = runs
            .iter()
            .map(|r| r.params.get(name).unwrap_or_else(|| panic!("no {name}")))
            .collect();
        let vals: Vec<_> = held
            .iter()
            .map(|p| (p.0.as_slice(), p.1.as_slice()))
            .collect();
        let grads: Vec<_> = held
            .iter()
            .map(|p| (p.0.as_slice(), p.2.as_slice()))
            .collect();
        match (concat(dims, &vals), concat(dims, &grads)) {
            (Some(v), Some(g)) => {
                // The shards are cut from the same full draw: exactly the weights.
                assert_eq!(&v, value, "tp {tp}: {name} shards");
                close(&format!("tp {tp}: d {name} (gathered)"), &g, grad);
            }
            _ => {
                for (r, (v, g)) in vals.iter().zip(&grads).enumerate() {
                    assert_eq!(v.1, value.as_slice(), "tp {tp} rank {r}: {name}");
                    close(
                        &format!("tp {tp} rank {r}: d {name} (replicated)"),
                        g.1,
                        grad,
                    );
                }
            }
        }
    }
    assert_eq!(
        runs[0].params.len(),
        reference.params.len(),
        "parameter sets differ"
    );
}

type Runner = fn(&LlmConfig, Arc<dyn Comm>, &Batch) -> TestResult<Run>;

fn check_tp(tie: bool, tps: &[usize], runner: Runner) -> TestResult {
    let cfg = config(tie);
    let b = batch(cfg.hidden);
    let reference = run_whole(&cfg, Arc::new(SingleRank), &b)?;
    for &tp in tps {
        let runs = run_local(tp, TIMEOUT, |r| {
            runner(&cfg, Arc::new(r), &b).map_err(|e| e.to_string())
        })?;
        compare(tp, &reference, &runs, b.ids.len());
    }
    Ok(())
}

#[test]
fn untied_model_on_tp_ranks_equals_one_rank() -> TestResult {
    check_tp(false, &[2, 4], run_whole)
}

#[test]
fn tied_model_on_tp_ranks_equals_one_rank() -> TestResult {
    check_tp(true, &[2, 4], run_whole)
}

/// Layers 0..1 then 1..2, each split over the same TP group, equal the whole model;
/// with tied embeddings the two stages' copies of the table sum to its grad.
#[test]
fn two_pipeline_stages_under_tp_equal_the_whole_model() -> TestResult {
    check_tp(true, &[1, 2], run_stages)?;
    check_tp(false, &[2], run_stages)
}

/// A group of one is the plain `Embedding` bit for bit; on 4 ranks (ranks 1..3 hold
/// none of the ids) the summed rows and the gathered table grad equal it too.
#[test]
fn vocab_parallel_embedding_equals_embedding() -> TestResult {
    let (v, c) = (16, 3);
    let ids = vec![0u32, 3, 1, 3, 2];
    let dy = Rng::new(5).normal_vec(ids.len() * c, 1.0);
    let reference = |mut e: Embedding| -> TestResult<(Vec<f32>, Vec<f32>)> {
        let idt = Tensor::from_vec_u32(ids.clone(), [ids.len()], Device::Cpu)?;
        let (y, cache) = e.forward(&idt)?;
        e.backward(
            cache,
            &Tensor::from_vec(dy.clone(), [ids.len(), c], Device::Cpu)?,
        )?;
        Ok((y.to_vec_f32()?, e.weight.grad.unwrap().to_vec_f32()?))
    };
    let (want_y, want_g) = reference(Embedding::new(&init(), "e", v, c)?)?;
    let run = |group: Arc<dyn Comm>, ids: &[u32]| -> Result<_, String> {
        let f = || -> TestResult<_> {
            let mut e = VocabParallelEmbedding::new(&init(), "e", v, c, group)?;
            let idt = Tensor::from_vec_u32(ids.to_vec(), [ids.len()], Device::Cpu)?;
            let (y, cache) = e.forward(&idt)?;
            e.backward(
                cache,
                &Tensor::from_vec(dy.clone(), [ids.len(), c], Device::Cpu)?,
            )?;
            let g = e.weight.grad.take().unwrap().to_vec_f32()?;
            Ok((y.to_vec_f32()?, e.weight.value.to_vec_f32()?, g))
        };
        f().map_err(|e| e.to_string())
    };
    let (y, _, g) = run(Arc::new(SingleRank), &ids)?;
    assert_eq!((y, g), (want_y.clone(), want_g.clone()), "group of one");
    let runs = run_local(4, TIMEOUT, |r| run(Arc::new(r), &ids))?;
    let full = Embedding::new(&init(), "e", v, c)?
        .weight
        .value
        .to_vec_f32()?;
    let values: Vec<f32> = runs.iter().flat_map(|r| r.1.clone()).collect();
    assert_eq!(values, full, "shards concatenate to the table");
    let grads: Vec<f32> = runs.iter().flat_map(|r| r.2.clone()).collect();
    assert_eq!(grads, want_g, "gathered table grad");
    for r in &runs {
        assert_eq!(r.0, want_y, "rows on every rank");
    }
    // Host ids given beside the device ids (as the trainer does) pick the same rows;
    // host ids that do not match the device ids' count are an error.
    let hosted = run_local(4, TIMEOUT, |r| {
        let e = VocabParallelEmbedding::new(&init(), "e", v, c, Arc::new(r))
            .map_err(|e| e.to_string())?;
        let idt = Tensor::from_vec_u32(ids.clone(), [ids.len()], Device::Cpu)
            .map_err(|e| e.to_string())?;
        let y = e
            .forward_with_host_ids(&idt, Some(&ids))
            .map_err(|e| e.to_string())?
            .0;
        let short = e.forward_with_host_ids(&idt, Some(&ids[1..]));
        assert!(short.is_err_and(|e| e.to_string().contains("4 host ids for 5 device ids")));
        y.to_vec_f32().map_err(|e| e.to_string())
    })?;
    for y in &hosted {
        assert_eq!(y, &want_y, "rows from host ids");
    }
    // An id past the vocabulary is an error on every rank, not a silent zero row.
    let bad = run_on_ranks(2, |r| run(Arc::new(r), &[1, 16]));
    for e in bad {
        let e = e.unwrap_err();
        assert!(e.contains("ids[1] = 16 is out of range"), "{e}");
    }
    Ok(())
}

#[test]
fn sizes_that_do_not_split_are_errors_naming_the_key() {
    let mut cfg = config(false);
    cfg.vocab = 509;
    for e in run_on_ranks(2, |r| {
        LlmStage::new(&cfg, 0..2, &init(), Arc::new(r)).unwrap_err()
    }) {
        let e = e.to_string();
        assert!(e.contains("model.llm.vocab"), "{e}");
        assert!(e.contains("vocab = 509 is not divisible by tp = 2"), "{e}");
    }
    let mut cfg = config(false);
    cfg.kv_heads = 2;
    for e in run_on_ranks(4, |r| {
        Llm::with_group(&cfg, &init(), Arc::new(r)).unwrap_err()
    }) {
        let e = e.to_string();
        assert!(e.contains("kv_heads = 2 is not divisible by tp = 4"), "{e}");
    }
}
