//! Layout ops (transpose01, narrow_last), add_bias and the bias grad: against index arithmetic, any
//! dtype, errors.

use braid_kernels::assert_err;
use braid_kernels::{DType, Device, Error, Result, Tensor, ops};

fn iota(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32).collect()
}

fn transpose01_matches_indexing(dev: Device) -> Result<()> {
    let (a, b, c) = (3, 4, 5);
    let x = Tensor::from_vec(iota(a * b * c), [a, b, c], dev)?;
    let y = ops::transpose01(&x)?;
    assert_eq!(y.dims(), &[b, a, c]);
    let yv = y.to_vec_f32()?;
    for i in 0..a {
        for j in 0..b {
            for k in 0..c {
                assert_eq!(yv[(j * a + i) * c + k], ((i * b + j) * c + k) as f32);
            }
        }
    }
    // Its own inverse, and dtype-preserving.
    assert_eq!(ops::transpose01(&y)?.to_vec_f32()?, iota(a * b * c));
    let ids = Tensor::from_vec_u32((0..24).collect(), [2, 3, 4], dev)?;
    let t = ops::transpose01(&ids)?;
    assert_eq!(t.dtype(), DType::U32);
    assert_eq!(t.to_vec_u32()?[4..8], [12, 13, 14, 15]);
    assert_err!(
        ops::transpose01(&Tensor::from_vec(iota(6), [2, 3], dev)?),
        Error::Shape { .. }
    );
    Ok(())
}

fn narrow_last_matches_indexing(dev: Device) -> Result<()> {
    let x = Tensor::from_vec(iota(2 * 3 * 6), [2, 3, 6], dev)?;
    let y = ops::narrow_last(&x, 2, 3)?;
    assert_eq!(y.dims(), &[2, 3, 3]);
    let yv = y.to_vec_f32()?;
    for r in 0..6 {
        for k in 0..3 {
            assert_eq!(yv[r * 3 + k], (r * 6 + 2 + k) as f32);
        }
    }
    assert_eq!(ops::narrow_last(&x, 0, 6)?.to_vec_f32()?, iota(36));
    assert_eq!(ops::narrow_last(&x, 6, 0)?.dims(), &[2, 3, 0]);
    assert_err!(ops::narrow_last(&x, 4, 3), Error::Shape { .. });
    assert_err!(ops::narrow_last(&x, usize::MAX, 2), Error::Shape { .. });
    Ok(())
}

fn add_bias_adds_to_every_row(dev: Device) -> Result<()> {
    let mut y = Tensor::from_vec(iota(2 * 2 * 3), [2, 2, 3], dev)?;
    let b = Tensor::from_vec(vec![10.0, 20.0, 30.0], [3], dev)?;
    ops::add_bias(&mut y, &b)?;
    let want: Vec<f32> = (0..12)
        .map(|i| i as f32 + [10.0, 20.0, 30.0][i % 3])
        .collect();
    assert_eq!(y.to_vec_f32()?, want);
    let bad = Tensor::from_vec(vec![1.0; 4], [4], dev)?;
    assert_err!(ops::add_bias(&mut y, &bad), Error::Shape { .. });
    let h = ops::cast(&b, DType::BF16)?;
    assert_err!(ops::add_bias(&mut y, &h), Error::DType { .. });
    Ok(())
}

/// add_bias and linear_bwd's bias grad on a small input and a large one (400 x 96, split
/// over rayon's pool) against plain loops: exact for the add, f64 column sums for db.
fn bias_ops_small_and_large(dev: Device) -> Result<()> {
    let mut rng = braid_kernels::rng::Rng::new(5);
    let c = 96;
    for rows in [3usize, 400] {
        let y0 = rng.normal_vec(rows * c, 1.0);
        let b = rng.normal_vec(c, 1.0);
        let mut y = Tensor::from_vec(y0.clone(), [rows, c], dev)?;
        ops::add_bias(&mut y, &Tensor::from_vec(b.clone(), [c], dev)?)?;
        let want: Vec<f32> = y0.iter().enumerate().map(|(i, v)| v + b[i % c]).collect();
        assert_eq!(y.to_vec_f32()?, want, "add_bias, {rows} rows");
        // db += column sums of dy, through linear_bwd (x and w are only shapes here).
        let dy = Tensor::from_vec(y0.clone(), [rows, c], dev)?;
        let x = Tensor::full(1.0, [rows, 2], dev)?;
        let w = Tensor::full(1.0, [c, 2], dev)?;
        let mut db = Tensor::full(0.5, [c], dev)?;
        ops::linear_bwd(&dy, &x, &w, None, Some(&mut db))?;
        let sums: Vec<f32> = (0..c)
            .map(|j| (0.5 + (0..rows).map(|r| f64::from(y0[r * c + j])).sum::<f64>()) as f32)
            .collect();
        let got = db.to_vec_f32()?;
        for (j, (g, w)) in got.iter().zip(&sums).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "db[{j}], {rows} rows: {g} vs {w}"
            );
        }
    }
    Ok(())
}

braid_kernels::test_on_devices!(
    transpose01_matches_indexing,
    narrow_last_matches_indexing,
    add_bias_adds_to_every_row,
    bias_ops_small_and_large
);

fn gather_and_scatter_rows(dev: Device) -> Result<()> {
    // x (4, 3): row r = [10 r, 10 r + 1, 10 r + 2]
    let x = Tensor::from_vec(
        (0..12).map(|k| (10 * (k / 3) + k % 3) as f32).collect(),
        [4, 3],
        dev,
    )?;
    let idx = Tensor::from_vec_u32(vec![2, 0, 2], [3], dev)?;
    let g = ops::gather_rows(&x, &idx)?;
    assert_eq!(g.dims(), &[3, 3]);
    assert_eq!(
        g.to_vec_f32()?,
        vec![20.0, 21.0, 22.0, 0.0, 1.0, 2.0, 20.0, 21.0, 22.0]
    );
    // scatter: rows 3 and 1 overwritten, others untouched.
    let mut dst = x.try_clone()?;
    let src = Tensor::from_vec(vec![-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], [2, 3], dev)?;
    ops::scatter_rows(&mut dst, &Tensor::from_vec_u32(vec![3, 1], [2], dev)?, &src)?;
    assert_eq!(
        dst.to_vec_f32()?,
        vec![
            0.0, 1.0, 2.0, -4.0, -5.0, -6.0, 20.0, 21.0, 22.0, -1.0, -2.0, -3.0
        ]
    );
    // gather after scatter at the same rows returns src: the adjoint pair the
    // modality scatter uses.
    let back = ops::gather_rows(&dst, &Tensor::from_vec_u32(vec![3, 1], [2], dev)?)?;
    assert_eq!(back.to_vec_f32()?, src.to_vec_f32()?);
    // Errors: out of range, repeated, shapes, dtype; dst unchanged after a failure.
    let before = dst.to_vec_f32()?;
    assert_err!(
        ops::gather_rows(&x, &Tensor::from_vec_u32(vec![4], [1], dev)?),
        Error::Invalid { .. }
    );
    assert_err!(
        ops::scatter_rows(&mut dst, &Tensor::from_vec_u32(vec![1, 1], [2], dev)?, &src),
        Error::Invalid { .. }
    );
    assert_err!(
        ops::scatter_rows(&mut dst, &Tensor::from_vec_u32(vec![9, 1], [2], dev)?, &src),
        Error::Invalid { .. }
    );
    assert_eq!(dst.to_vec_f32()?, before);
    assert_err!(
        ops::scatter_rows(&mut dst, &Tensor::from_vec_u32(vec![1], [1], dev)?, &src),
        Error::Shape { .. }
    );
    assert_err!(
        ops::gather_rows(&x, &Tensor::from_vec(vec![0.0], [1], dev)?),
        Error::DType { .. }
    );
    assert_err!(
        ops::gather_rows(&Tensor::from_vec(vec![0.0; 4], [4], dev)?, &idx),
        Error::Shape { .. }
    );
    Ok(())
}

braid_kernels::test_on_devices!(gather_and_scatter_rows);

/// Tensors of several shapes packed into one flat buffer and back (a gradient bucket),
/// in every dtype, and every way a range can be wrong.
fn copy_range_packs_and_unpacks(dev: Device) -> Result<()> {
    let shapes: [&[usize]; 4] = [&[3, 4], &[7], &[2, 1, 5], &[1]];
    let parts: Vec<Tensor> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n: usize = s.iter().product();
            Tensor::from_vec((0..n).map(|k| (100 * i + k) as f32).collect(), *s, dev)
        })
        .collect::<Result<_>>()?;
    let total: usize = parts.iter().map(Tensor::elem_count).sum();
    for dtype in [DType::F32, DType::BF16] {
        let parts: Vec<Tensor> = parts
            .iter()
            .map(|p| ops::cast(p, dtype))
            .collect::<Result<_>>()?;
        let mut flat = Tensor::zeros([total], dtype, dev)?;
        let mut off = 0;
        for p in &parts {
            ops::copy_range(p, 0, &mut flat, off, p.elem_count())?;
            off += p.elem_count();
        }
        let want: Vec<f32> = parts
            .iter()
            .flat_map(|p| p.to_vec_f32().unwrap_or_default())
            .collect();
        assert_eq!(flat.to_vec_f32()?, want, "{dtype}: packed in order");
        // Unpack into fresh tensors of the original shapes.
        let mut off = 0;
        for p in &parts {
            let mut back = Tensor::zeros(p.shape().clone(), dtype, dev)?;
            ops::copy_range(&flat, off, &mut back, 0, p.elem_count())?;
            assert_eq!(back.to_host()?, p.to_host()?, "{dtype}: unpacked exactly");
            off += p.elem_count();
        }
    }
    let ids = Tensor::from_vec_u32(vec![5, 6, 7, 8], [4], dev)?;
    let mut dst = Tensor::zeros([6], DType::U32, dev)?;
    ops::copy_range(&ids, 1, &mut dst, 3, 3)?;
    assert_eq!(dst.to_vec_u32()?, vec![0, 0, 0, 6, 7, 8]);
    // Nothing to copy is fine, even at the very end.
    ops::copy_range(&ids, 4, &mut dst, 6, 0)?;
    // Out of range on either side, an overflowing range, a dtype mismatch.
    assert_err!(
        ops::copy_range(&ids, 2, &mut dst, 0, 3),
        Error::Shape { .. }
    );
    assert_err!(
        ops::copy_range(&ids, 0, &mut dst, 4, 3),
        Error::Shape { .. }
    );
    assert_err!(
        ops::copy_range(&ids, usize::MAX, &mut dst, 0, 2),
        Error::Shape { .. }
    );
    let mut f = Tensor::zeros([6], DType::F32, dev)?;
    assert_err!(ops::copy_range(&ids, 0, &mut f, 0, 1), Error::DType { .. });
    assert_eq!(
        dst.to_vec_u32()?,
        vec![0, 0, 0, 6, 7, 8],
        "failed copies change nothing"
    );
    Ok(())
}

braid_kernels::test_on_devices!(copy_range_packs_and_unpacks);
