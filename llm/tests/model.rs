//! The model on tiny random configs: modality scatter (finite differences, and no grad
//! for placeholder tokens), packed rows == separate rows, 2 pipeline stages chained ==
//! the full model (tied and untied), and the input checks.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use braid_comm::SingleRank;
use braid_kernels::rng::Rng;
use braid_kernels::testing::{FdTolerance, check_grad, dot};
use braid_kernels::{Device, Tensor};
use braid_llm::{Llm, LlmStage, ModalityEmbeds, StageInput};
use braid_nn::{Init, Module, SeqInfo};
use common::{TestResult, grads, rel_err, tiny_config};

/// Init with std 0.3 so every path carries O(1) signal for finite differences.
fn init(dev: Device) -> Init {
    Init::new(7, dev).with_std(0.3)
}

fn randn(seed: u64, n: usize) -> Vec<f32> {
    Rng::new(seed).normal_vec(n, 1.0)
}

fn ids_tensor(ids: &[u32], dev: Device) -> TestResult<Tensor> {
    Ok(Tensor::from_vec_u32(ids.to_vec(), [ids.len()], dev)?)
}

/// Modality rows replace placeholder embeddings: d(embeds) by finite differences, the
/// placeholder token's table row gets no grad, and everything equals feeding the
/// scattered embeddings directly.
fn modality_scatter(dev: Device) -> TestResult {
    let cfg = tiny_config(false, true);
    let (c, v) = (cfg.hidden, cfg.vocab);
    let mut llm = Llm::new(&cfg, &init(dev))?;
    let placeholder = 10u32;
    let ids = [1u32, placeholder, 2, 3, 4, placeholder, 5];
    let positions = [1u32, 5];
    let seq = SeqInfo::packed(&[4, 3]);
    let t = ids.len();
    let m = positions.len();
    let e = randn(1, m * c);
    let r = randn(2, t * v);
    let idt = ids_tensor(&ids, dev)?;
    let modality = |e: &[f32]| -> TestResult<ModalityEmbeds> {
        Ok(ModalityEmbeds {
            positions: Tensor::from_vec_u32(positions.to_vec(), [m], dev)?,
            embeds: Tensor::from_vec(e.to_vec(), [m, c], dev)?,
        })
    };
    let rt = Tensor::from_vec(r.clone(), [t, v], dev)?;
    let me = modality(&e)?;
    let (logits, cache) = llm.forward(&idt, &seq, Some(&me))?;
    let de = llm
        .backward(cache, &rt)?
        .ok_or("no modality grad")?
        .to_vec_f32()?;
    check_grad("d modality embeds", &e, &de, FdTolerance::default(), |ep| {
        let me = modality(ep).map_err(|e| braid_kernels::Error::invalid("fd", e.to_string()))?;
        let (y, _) = llm
            .forward(&idt, &seq, Some(&me))
            .map_err(|e| braid_kernels::Error::invalid("fd", e.to_string()))?;
        Ok(dot(&y.to_vec_f32()?, &r))
    })?;
    let token_grads = grads(&llm);
    let table_grad = &token_grads[0];
    assert_eq!(table_grad.0, "embed_tokens.weight");
    let row = &table_grad.1[placeholder as usize * c..(placeholder as usize + 1) * c];
    assert!(row.iter().all(|&g| g == 0.0), "placeholder row got a grad");
    assert!(table_grad.1.iter().any(|&g| g != 0.0));

    // Same thing through forward_embeds: the table rows with the modality rows in place.
    let table = llm
        .stage
        .embed_tokens
        .as_ref()
        .ok_or("no table")?
        .weight
        .value
        .to_vec_f32()?;
    let mut h = Vec::with_capacity(t * c); // (T, C)
    for (i, &id) in ids.iter().enumerate() {
        match positions.iter().position(|&p| p as usize == i) {
            Some(j) => h.extend_from_slice(&e[j * c..(j + 1) * c]),
            None => h.extend_from_slice(&table[id as usize * c..(id as usize + 1) * c]),
        }
    }
    llm.zero_grads()?;
    let (logits2, cache2) = llm.forward_embeds(Tensor::from_vec(h, [t, c], dev)?, &seq)?;
    assert_eq!(logits.to_vec_f32()?, logits2.to_vec_f32()?);
    let dh = llm
        .backward(cache2, &rt)?
        .ok_or("no embeds grad")?
        .to_vec_f32()?;
    for (j, &p) in positions.iter().enumerate() {
        assert_eq!(
            de[j * c..(j + 1) * c],
            dh[p as usize * c..(p as usize + 1) * c]
        );
    }
    for ((n1, g1), (n2, g2)) in token_grads.iter().zip(grads(&llm)).skip(1) {
        assert_eq!((n1, g1), (&n2, &g2));
    }
    Ok(())
}

/// Two samples packed into one row == each alone: logits, and grads summed.
fn packed_equals_separate(dev: Device) -> TestResult {
    let cfg = tiny_config(true, false);
    let v = cfg.vocab;
    let lens = [5usize, 3];
    let ids: Vec<u32> = (0..8u32).map(|i| (i * 7 + 3) % v as u32).collect();
    let r = randn(3, 8 * v);
    let mut packed = Llm::new(&cfg, &init(dev))?;
    let seq = SeqInfo::packed(&lens);
    let (lp, cache) = packed.forward(&ids_tensor(&ids, dev)?, &seq, None)?;
    packed.backward(cache, &Tensor::from_vec(r.clone(), [8, v], dev)?)?;
    let mut alone = Llm::new(&cfg, &init(dev))?;
    let mut logits = Vec::new();
    let mut start = 0;
    for &l in &lens {
        let seq = SeqInfo::single(l);
        let (y, cache) = alone.forward(&ids_tensor(&ids[start..start + l], dev)?, &seq, None)?;
        logits.extend(y.to_vec_f32()?);
        let dy = Tensor::from_vec(r[start * v..(start + l) * v].to_vec(), [l, v], dev)?;
        alone.backward(cache, &dy)?;
        start += l;
    }
    let e = rel_err(&lp.to_vec_f32()?, &logits);
    assert!(e <= 1e-6, "logits rel err {e:e}");
    for ((name, gp), (_, ga)) in grads(&packed).into_iter().zip(grads(&alone)) {
        let e = rel_err(&gp, &ga);
        assert!(e <= 1e-5, "grad of {name}: rel err {e:e}");
    }
    Ok(())
}

/// Stages 0..1 and 1..3 chained == the full model: identical logits and grads (the
/// tied table's grad is the sum of its two copies').
fn stages_chain_to_full_model(dev: Device) -> TestResult {
    for tie in [false, true] {
        let cfg = tiny_config(tie, true);
        let v = cfg.vocab;
        let seq = SeqInfo::packed(&[4, 2]);
        let ids = ids_tensor(&[1, 2, 3, 4, 5, 6], dev)?;
        let r = Tensor::from_vec(randn(4, 6 * v), [6, v], dev)?;
        let mut full = Llm::new(&cfg, &init(dev))?;
        let (want, cache) = full.forward(&ids, &seq, None)?;
        full.backward(cache, &r)?;
        let mut s0 = LlmStage::new(&cfg, 0..1, &init(dev), Arc::new(SingleRank))?;
        let mut s1 = LlmStage::new(&cfg, 1..3, &init(dev), Arc::new(SingleRank))?;
        assert!(s0.is_first() && !s0.is_last() && s1.is_last() && !s1.is_first());
        assert!(s0.norm.is_none() && s0.lm_head.is_none());
        assert_eq!(s1.embed_tokens.is_some(), tie, "tied head copy");
        let (h, c0) = s0.forward(
            StageInput::Tokens {
                ids: &ids,
                host_ids: None,
                modality: None,
            },
            &seq,
        )?;
        assert_eq!(h.dims(), [6, cfg.hidden]);
        let (got, c1) = s1.forward(StageInput::Hidden(h), &seq)?;
        assert_eq!(got.to_vec_f32()?, want.to_vec_f32()?);
        let dh = s1.backward(c1, &r)?.ok_or("no hidden grad")?;
        assert!(s0.backward(c0, &dh)?.is_none());
        let mut staged: Vec<(String, Vec<f32>)> = grads(&s0);
        for (name, g) in grads(&s1) {
            match staged.iter_mut().find(|(n, _)| *n == name) {
                Some((_, acc)) => acc.iter_mut().zip(&g).for_each(|(a, b)| *a += b),
                None => staged.push((name, g)),
            }
        }
        let full_grads = grads(&full);
        assert_eq!(staged.len(), full_grads.len());
        for (name, g) in full_grads {
            let (_, s) = staged.iter().find(|(n, _)| *n == name).ok_or("missing")?;
            let e = rel_err(s, &g);
            assert!(e <= 1e-6, "tie {tie}: grad of {name}: rel err {e:e}");
        }
    }
    Ok(())
}

/// Wrong inputs are errors, not panics.
fn bad_inputs(dev: Device) -> TestResult {
    let cfg = tiny_config(false, false);
    let llm = Llm::new(&cfg, &init(dev))?;
    let seq = SeqInfo::single(3);
    // ids length differs from the SeqInfo.
    assert!(llm.forward(&ids_tensor(&[1, 2], dev)?, &seq, None).is_err());
    // f32 ids.
    let f = Tensor::from_vec(vec![1.0, 2.0, 3.0], [3], dev)?;
    assert!(llm.forward(&f, &seq, None).is_err());
    // id >= V.
    assert!(
        llm.forward(&ids_tensor(&[1, 2, 99], dev)?, &seq, None)
            .is_err()
    );
    // modality position past T, and embeds of the wrong width.
    let ids = ids_tensor(&[1, 2, 3], dev)?;
    let bad_pos = ModalityEmbeds {
        positions: Tensor::from_vec_u32(vec![3], [1], dev)?,
        embeds: Tensor::zeros([1, cfg.hidden], braid_kernels::DType::F32, dev)?,
    };
    assert!(llm.forward(&ids, &seq, Some(&bad_pos)).is_err());
    let bad_width = ModalityEmbeds {
        positions: Tensor::from_vec_u32(vec![0], [1], dev)?,
        embeds: Tensor::zeros([1, cfg.hidden + 1], braid_kernels::DType::F32, dev)?,
    };
    assert!(llm.forward(&ids, &seq, Some(&bad_width)).is_err());
    // hidden states of the wrong shape; token ids into a stage without the embedding.
    let h = Tensor::zeros([3, cfg.hidden + 1], braid_kernels::DType::F32, dev)?;
    assert!(llm.forward_embeds(h, &seq).is_err());
    let s1 = LlmStage::new(&cfg, 1..3, &init(dev), Arc::new(SingleRank))?;
    let input = StageInput::Tokens {
        ids: &ids,
        host_ids: None,
        modality: None,
    };
    assert!(s1.forward(input, &seq).is_err());
    // empty or out-of-range layer ranges.
    assert!(LlmStage::new(&cfg, 2..2, &init(dev), Arc::new(SingleRank)).is_err());
    assert!(LlmStage::new(&cfg, 1..4, &init(dev), Arc::new(SingleRank)).is_err());
    Ok(())
}

braid_kernels::test_on_devices!(
    modality_scatter,
    packed_equals_separate,
    stages_chain_to_full_model,
    bad_inputs,
);
