//! Embedding lookup and scatter-add backward: reference, finite differences, `+=` with
//! repeated ids, out-of-range ids, errors, determinism.

use braid_kernels::assert_err;
use braid_kernels::ops::{self, embedding_bwd, embedding_fwd};
use braid_kernels::rng::Rng;
use braid_kernels::testing::in_pool;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, dot};
use braid_kernels::{DType, Device, Error, Result, Tensor};

fn tensor(v: &[f32], shape: &[usize], dev: Device) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape, dev)
}

/// dtable + scatter-add of dy, in f64.
fn bwd_ref(prev: &[f32], dy: &[f32], ids: &[u32], c: usize) -> Vec<f32> {
    let mut acc: Vec<f64> = vec![0.0; prev.len()];
    for (n, &id) in ids.iter().enumerate() {
        for j in 0..c {
            acc[id as usize * c + j] += dy[n * c + j] as f64;
        }
    }
    prev.iter().zip(acc).map(|(&p, a)| p + a as f32).collect()
}

fn embedding_fwd_matches_reference(dev: Device) -> Result<()> {
    let mut rng = Rng::new(21);
    let (v, c) = (7, 5);
    let table = rng.normal_vec(v * c, 1.0);
    let ids = vec![3u32, 0, 6, 3, 3, 1];
    let y = embedding_fwd(
        &Tensor::from_vec_u32(ids.clone(), [2, 3], dev)?,
        &tensor(&table, &[v, c], dev)?,
    )?;
    assert_eq!(y.dims(), &[2, 3, c]);
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| table[id as usize * c..(id as usize + 1) * c].to_vec())
        .collect();
    assert_eq!(y.to_vec_f32()?, want, "a lookup is a copy: bitwise equal");
    let y1 = embedding_fwd(
        &Tensor::from_vec_u32(ids, [6], dev)?,
        &tensor(&table, &[v, c], dev)?,
    )?;
    assert_eq!(y1.dims(), &[6, c]);
    Ok(())
}

fn embedding_bwd_accumulates_repeated_ids(dev: Device) -> Result<()> {
    let mut rng = Rng::new(22);
    let (v, c) = (6, 4);
    let ids = vec![2u32, 5, 2, 0, 2, 5, 1];
    let dy = rng.normal_vec(ids.len() * c, 1.0);
    let prev = rng.normal_vec(v * c, 1.0);
    let mut dtable = tensor(&prev, &[v, c], dev)?;
    let idt = Tensor::from_vec_u32(ids.clone(), [ids.len()], dev)?;
    embedding_bwd(&tensor(&dy, &[ids.len(), c], dev)?, &idt, &mut dtable)?;
    let got = dtable.to_vec_f32()?;
    assert_close("dtable", &got, &bwd_ref(&prev, &dy, &ids, c), 1e-6, 1e-6);
    // Rows no id points at are untouched.
    assert_eq!(got[3 * c..5 * c], prev[3 * c..5 * c]);
    Ok(())
}

fn embedding_bwd_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(23);
    let (v, c) = (5, 3);
    let table = rng.normal_vec(v * c, 1.0);
    let ids = Tensor::from_vec_u32(vec![4, 1, 4, 0], [2, 2], dev)?;
    let r = rng.normal_vec(4 * c, 1.0);
    let mut dtable = Tensor::zeros([v, c], DType::F32, dev)?;
    embedding_bwd(&tensor(&r, &[2, 2, c], dev)?, &ids, &mut dtable)?;
    check_grad(
        "dtable",
        &table,
        &dtable.to_vec_f32()?,
        FdTolerance::default(),
        |tp| {
            Ok(dot(
                &embedding_fwd(&ids, &tensor(tp, &[v, c], dev)?)?.to_vec_f32()?,
                &r,
            ))
        },
    )?;
    Ok(())
}

fn embedding_out_of_range_ids(dev: Device) -> Result<()> {
    let table = Tensor::full(1.0, [10, 4], dev)?;
    let ids = Tensor::from_vec_u32(vec![1, 9, 10, 3, 12], [5], dev)?;
    let msg = match embedding_fwd(&ids, &table) {
        Err(Error::Invalid { msg, .. }) => msg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    };
    // The first bad id, its position and V are named.
    assert!(
        msg.contains("id 10") && msg.contains("position 2") && msg.contains("V = 10"),
        "{msg}"
    );
    let dy = Tensor::full(1.0, [5, 4], dev)?;
    let mut dtable = Tensor::zeros([10, 4], DType::F32, dev)?;
    match embedding_bwd(&dy, &ids, &mut dtable) {
        Err(Error::Invalid { msg, .. }) => {
            assert!(msg.contains("id 10") && msg.contains("position 2"), "{msg}")
        }
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
    assert!(
        dtable.to_vec_f32()?.iter().all(|&v| v == 0.0),
        "a failed backward wrote into dtable"
    );
    let max = Tensor::from_vec_u32(vec![u32::MAX], [1], dev)?;
    assert_err!(embedding_fwd(&max, &table), Error::Invalid { .. });
    Ok(())
}

fn embedding_errors(dev: Device) -> Result<()> {
    let table = Tensor::full(1.0, [10, 4], dev)?;
    let ids = Tensor::from_vec_u32(vec![1, 2, 3], [3], dev)?;
    let fids = Tensor::full(1.0, [3], dev)?;
    assert_err!(embedding_fwd(&fids, &table), Error::DType { .. });
    let utable = Tensor::from_vec_u32(vec![0; 40], [10, 4], dev)?;
    assert_err!(embedding_fwd(&ids, &utable), Error::DType { .. });
    let btable = ops::cast(&table, DType::BF16)?;
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(embedding_fwd(&ids, &btable).is_ok());
    assert_err!(
        embedding_fwd(&ids, &Tensor::full(1.0, [40], dev)?),
        Error::Shape { .. }
    );
    let scalar_id = Tensor::from_vec_u32(vec![1], (), dev)?;
    assert_err!(embedding_fwd(&scalar_id, &table), Error::Shape { .. });

    let mut dtable = Tensor::zeros([10, 4], DType::F32, dev)?;
    let dy = Tensor::full(1.0, [3, 4], dev)?;
    assert_err!(
        embedding_bwd(&Tensor::full(1.0, [3, 5], dev)?, &ids, &mut dtable),
        Error::Shape { .. }
    );
    assert_err!(
        embedding_bwd(&Tensor::full(1.0, [2, 4], dev)?, &ids, &mut dtable),
        Error::Shape { .. }
    );
    assert_err!(embedding_bwd(&dy, &fids, &mut dtable), Error::DType { .. });
    let mut bdtable = ops::cast(&dtable, DType::BF16)?;
    let bdy = ops::cast(&dy, DType::BF16)?;
    assert_err!(embedding_bwd(&bdy, &ids, &mut bdtable), Error::DType { .. });
    // bf16 grads sum into the f32 accumulator (mixed precision).
    embedding_bwd(&bdy, &ids, &mut dtable)?;
    let mut flat = Tensor::zeros([40], DType::F32, dev)?;
    assert_err!(embedding_bwd(&dy, &ids, &mut flat), Error::Shape { .. });
    Ok(())
}

fn embedding_deterministic_across_threads(dev: Device) -> Result<()> {
    let mut rng = Rng::new(24);
    let (v, c, n) = (50, 96, 4096);
    // Heavily repeated ids: most rows of the grad sum many contributions.
    let mut ids = rng.index_vec(n, 8);
    ids.extend(rng.index_vec(256, v as u32));
    let n = ids.len();
    let idt = Tensor::from_vec_u32(ids.clone(), [n], dev)?;
    let table = Tensor::randn([v, c], 1.0, &mut rng, dev)?;
    let dy_host = rng.normal_vec(n * c, 1.0);
    let dy = tensor(&dy_host, &[n, c], dev)?;
    let run = || -> Result<Vec<Vec<f32>>> {
        let mut dtable = Tensor::full(0.25, [v, c], dev)?;
        embedding_bwd(&dy, &idt, &mut dtable)?;
        Ok(vec![
            embedding_fwd(&idt, &table)?.to_vec_f32()?,
            dtable.to_vec_f32()?,
        ])
    };
    let one = in_pool(1, run)?;
    let four = in_pool(4, run)?;
    assert!(
        one == four && four == run()?,
        "embedding depends on the thread count"
    );
    let want = bwd_ref(&vec![0.25; v * c], &dy_host, &ids, c);
    assert_close("dtable (many repeats)", &one[1], &want, 1e-5, 1e-6);
    Ok(())
}

braid_kernels::test_on_devices!(
    embedding_fwd_matches_reference,
    embedding_bwd_accumulates_repeated_ids,
    embedding_bwd_finite_differences,
    embedding_out_of_range_ids,
    embedding_errors,
    embedding_deterministic_across_threads,
);
