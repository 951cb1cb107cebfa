//! Mixed precision, op by op: bf16 inputs on the device under test against the f32
//! CPU reference computed on the same (bf16-rounded) values.
//!
//! Tolerances, relative to the largest entry of the reference:
//! - bf16 outputs (activations, input grads): 2e-2 — one bf16 rounding of the result
//!   (2^-8 relative) plus the f32 math's own differences;
//! - f32 accumulators fed by bf16 operands (weight, bias, norm, embedding grads; a
//!   GEMM's f32 `c`): 1e-5 on the CPU, where the f32 kernel sees exactly those operands,
//!   and 1e-4 elsewhere (a GPU sums the same exact products in another order).
//!
//! On the CPU the bf16 path is the f32 kernel on widened inputs with the outputs rounded
//! once, so there the bf16 results are also checked to be exactly that.

use braid_kernels::ops::{self, Activation, AttentionSpec, Conv1dSpec};
use braid_kernels::rng::Rng;
use braid_kernels::{DType, Device, Result, Tensor, test_on_devices};

#[path = "mixed_precision/checks.rs"]
mod checks;
use checks::*;

fn linear_bf16_with_f32_grads(dev: Device) -> Result<()> {
    let mut rng = Rng::new(7);
    for (n, k, m) in [(1, 1, 1), (5, 16, 24), (33, 64, 48), (128, 96, 200)] {
        let (x, w, b, dy) = (
            values(&mut rng, n * k, 1.0),
            values(&mut rng, m * k, 0.2),
            values(&mut rng, m, 0.5),
            values(&mut rng, n * m, 1.0),
        );
        let y_ref = ops::linear_fwd(
            &f32_cpu(&x, &[n, k])?,
            &f32_cpu(&w, &[m, k])?,
            Some(&f32_cpu(&b, &[m])?),
        )?;
        let (xb, wb, bb, dyb) = (
            bf16_on(&x, &[n, k], dev)?,
            bf16_on(&w, &[m, k], dev)?,
            bf16_on(&b, &[m], dev)?,
            bf16_on(&dy, &[n, m], dev)?,
        );
        let y = ops::linear_fwd(&xb, &wb, Some(&bb))?;
        // Two ops (GEMM, then the bias), so two roundings: tolerance only.
        assert_eq!(y.dtype(), DType::BF16);
        close("linear y", &y, &y_ref, 2e-2)?;
        let y_nb = ops::linear_fwd(&xb, &wb, None)?;
        let y_nb_ref = ops::linear_fwd(&f32_cpu(&x, &[n, k])?, &f32_cpu(&w, &[m, k])?, None)?;
        bf16_out("linear y without bias", dev, &y_nb, &y_nb_ref)?;

        // Grads: dw/db start non-zero (accumulation over microbatches) and stay f32.
        let dw0 = rng.normal_vec(m * k, 0.1);
        let db0 = rng.normal_vec(m, 0.1);
        let (mut dw_ref, mut db_ref) = (f32_cpu(&dw0, &[m, k])?, f32_cpu(&db0, &[m])?);
        let dx_ref = ops::linear_bwd(
            &f32_cpu(&dy, &[n, m])?,
            &f32_cpu(&x, &[n, k])?,
            &f32_cpu(&w, &[m, k])?,
            Some(&mut dw_ref),
            Some(&mut db_ref),
        )?;
        let mut dw = Tensor::from_vec(dw0, [m, k], dev)?;
        let mut db = Tensor::from_vec(db0, [m], dev)?;
        let dx = ops::linear_bwd(&dyb, &xb, &wb, Some(&mut dw), Some(&mut db))?;
        bf16_out("linear dx", dev, &dx, &dx_ref)?;
        f32_acc("linear dw", dev, &dw, &dw_ref)?;
        f32_acc("linear db", dev, &db, &db_ref)?;
    }
    Ok(())
}

fn batched_gemm_bf16(dev: Device) -> Result<()> {
    let mut rng = Rng::new(8);
    let (batch, m, n, k) = (3, 17, 9, 40);
    let a = values(&mut rng, batch * m * k, 1.0);
    let b = values(&mut rng, batch * k * n, 1.0);
    let c_ref = ops::matmul(
        &f32_cpu(&a, &[batch, m, k])?,
        &f32_cpu(&b, &[batch, k, n])?,
        false,
        false,
    )?;
    let c = ops::matmul(
        &bf16_on(&a, &[batch, m, k], dev)?,
        &bf16_on(&b, &[batch, k, n], dev)?,
        false,
        false,
    )?;
    bf16_out("matmul", dev, &c, &c_ref)?;
    // Transposed operands into an f32 c with beta = 1.
    let c0 = rng.normal_vec(batch * m * n, 1.0);
    let mut c_ref = f32_cpu(&c0, &[batch, m, n])?;
    let at = values(&mut rng, batch * k * m, 1.0);
    let bt = values(&mut rng, batch * n * k, 1.0);
    ops::matmul_into(
        &f32_cpu(&at, &[batch, k, m])?,
        &f32_cpu(&bt, &[batch, n, k])?,
        &mut c_ref,
        true,
        true,
        0.5,
        1.0,
    )?;
    let mut c = Tensor::from_vec(c0, [batch, m, n], dev)?;
    ops::matmul_into(
        &bf16_on(&at, &[batch, k, m], dev)?,
        &bf16_on(&bt, &[batch, n, k], dev)?,
        &mut c,
        true,
        true,
        0.5,
        1.0,
    )?;
    f32_acc("matmul_into f32 c", dev, &c, &c_ref)?;
    // An f32 a with a bf16 b is a mistake, not a silent cast.
    let spec_err = ops::matmul(
        &Tensor::from_vec(a.clone(), [batch, m, k], dev)?,
        &bf16_on(&b, &[batch, k, n], dev)?,
        false,
        false,
    );
    assert!(matches!(spec_err, Err(braid_kernels::Error::DType { .. })));
    Ok(())
}

fn norms_bf16_with_f32_grads(dev: Device) -> Result<()> {
    let mut rng = Rng::new(9);
    for (n, c) in [(1, 8), (7, 64), (130, 96)] {
        let x: Vec<f32> = values(&mut rng, n * c, 1.5)
            .iter()
            .map(|v| v + 0.5)
            .collect();
        let x = rounded(&x);
        let (w, b, dy) = (
            values(&mut rng, c, 1.0),
            values(&mut rng, c, 1.0),
            values(&mut rng, n * c, 1.0),
        );
        let (xc, wc, bc, dyc) = (
            f32_cpu(&x, &[n, c])?,
            f32_cpu(&w, &[c])?,
            f32_cpu(&b, &[c])?,
            f32_cpu(&dy, &[n, c])?,
        );
        let (xb, wb, bb, dyb) = (
            bf16_on(&x, &[n, c], dev)?,
            bf16_on(&w, &[c], dev)?,
            bf16_on(&b, &[c], dev)?,
            bf16_on(&dy, &[n, c], dev)?,
        );
        let (y_ref, mean_ref, rstd_ref) = ops::layer_norm_fwd(&xc, &wc, Some(&bc), 1e-5)?;
        let (y, mean, rstd) = ops::layer_norm_fwd(&xb, &wb, Some(&bb), 1e-5)?;
        bf16_out("layer norm y", dev, &y, &y_ref)?;
        f32_acc("layer norm mean", dev, &mean, &mean_ref)?;
        f32_acc("layer norm rstd", dev, &rstd, &rstd_ref)?;
        let (mut dw_ref, mut db_ref) =
            (f32_cpu(&vec![0.0; c], &[c])?, f32_cpu(&vec![0.0; c], &[c])?);
        let dx_ref = ops::layer_norm_bwd(
            &dyc,
            &xc,
            &wc,
            &mean_ref,
            &rstd_ref,
            Some(&mut dw_ref),
            Some(&mut db_ref),
        )?;
        let mut dw = Tensor::zeros([c], DType::F32, dev)?;
        let mut db = Tensor::zeros([c], DType::F32, dev)?;
        let dx = ops::layer_norm_bwd(&dyb, &xb, &wb, &mean, &rstd, Some(&mut dw), Some(&mut db))?;
        bf16_out("layer norm dx", dev, &dx, &dx_ref)?;
        f32_acc("layer norm dw", dev, &dw, &dw_ref)?;
        f32_acc("layer norm db", dev, &db, &db_ref)?;

        let (y_ref, rstd_ref) = ops::rms_norm_fwd(&xc, &wc, 1e-6)?;
        let (y, rstd) = ops::rms_norm_fwd(&xb, &wb, 1e-6)?;
        bf16_out("rms norm y", dev, &y, &y_ref)?;
        let mut dw_ref = f32_cpu(&vec![0.0; c], &[c])?;
        let dx_ref = ops::rms_norm_bwd(&dyc, &xc, &wc, &rstd_ref, Some(&mut dw_ref))?;
        let mut dw = Tensor::zeros([c], DType::F32, dev)?;
        let dx = ops::rms_norm_bwd(&dyb, &xb, &wb, &rstd, Some(&mut dw))?;
        bf16_out("rms norm dx", dev, &dx, &dx_ref)?;
        f32_acc("rms norm dw", dev, &dw, &dw_ref)?;
    }
    Ok(())
}

fn embedding_rope_activations_bf16(dev: Device) -> Result<()> {
    let mut rng = Rng::new(10);
    let (v, c, n) = (37, 16, 50);
    let table = values(&mut rng, v * c, 1.0);
    let ids: Vec<u32> = rng.index_vec(n, v as u32);
    let dy = values(&mut rng, n * c, 1.0);
    let idc = Tensor::from_vec_u32(ids.clone(), [n], Device::Cpu)?;
    let idd = Tensor::from_vec_u32(ids, [n], dev)?;
    let y_ref = ops::embedding_fwd(&idc, &f32_cpu(&table, &[v, c])?)?;
    let y = ops::embedding_fwd(&idd, &bf16_on(&table, &[v, c], dev)?)?;
    bf16_out("embedding y", dev, &y, &y_ref)?;
    let mut dt_ref = f32_cpu(&vec![0.0; v * c], &[v, c])?;
    ops::embedding_bwd(&f32_cpu(&dy, &[n, c])?, &idc, &mut dt_ref)?;
    let mut dt = Tensor::zeros([v, c], DType::F32, dev)?;
    ops::embedding_bwd(&bf16_on(&dy, &[n, c], dev)?, &idd, &mut dt)?;
    f32_acc("embedding dtable", dev, &dt, &dt_ref)?;

    // Row moves keep bf16 bits: scatter into a bf16 buffer and gather back.
    let mut buf = Tensor::zeros([v, c], DType::BF16, dev)?;
    let rows = Tensor::from_vec_u32(vec![3, 0, 36], [3], dev)?;
    let src = ops::gather_rows(&bf16_on(&table, &[v, c], dev)?, &rows)?;
    ops::scatter_rows(&mut buf, &rows, &src)?;
    let back = ops::gather_rows(&buf, &rows)?;
    assert_eq!(back.dtype(), DType::BF16);
    assert_eq!(
        back.to_host()?,
        src.to_host()?,
        "scatter/gather move bf16 rows exactly"
    );
    assert!(ops::scatter_rows(&mut buf, &rows, &ops::cast(&src, DType::F32)?).is_err());

    // RoPE: bf16 x with f32 tables, as the LLM runs it.
    let (t, nh, hs) = (9, 4, 16);
    let x = values(&mut rng, t * nh * hs, 1.0);
    let angles: Vec<f32> = (0..t * hs / 2).map(|i| i as f32 * 0.37).collect();
    let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
    let y_ref = ops::rope_fwd(
        &f32_cpu(&x, &[t, nh, hs])?,
        &f32_cpu(&cos, &[t, hs / 2])?,
        &f32_cpu(&sin, &[t, hs / 2])?,
    )?;
    let y = ops::rope_fwd(
        &bf16_on(&x, &[t, nh, hs], dev)?,
        &Tensor::from_vec(cos, [t, hs / 2], dev)?,
        &Tensor::from_vec(sin, [t, hs / 2], dev)?,
    )?;
    bf16_out("rope", dev, &y, &y_ref)?;

    let (rows, cols) = (12, 40);
    let a = values(&mut rng, rows * cols, 2.0);
    let g = values(&mut rng, rows * cols, 1.0);
    let (ac, gc) = (f32_cpu(&a, &[rows, cols])?, f32_cpu(&g, &[rows, cols])?);
    let (ab, gb) = (
        bf16_on(&a, &[rows, cols], dev)?,
        bf16_on(&g, &[rows, cols], dev)?,
    );
    for act in [
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::QuickGelu,
        Activation::Silu,
    ] {
        bf16_out(
            "activation fwd",
            dev,
            &ops::activation_fwd(&ab, act)?,
            &ops::activation_fwd(&ac, act)?,
        )?;
        bf16_out(
            "activation bwd",
            dev,
            &ops::activation_bwd(&gb, &ab, act)?,
            &ops::activation_bwd(&gc, &ac, act)?,
        )?;
    }
    bf16_out(
        "swiglu",
        dev,
        &ops::swiglu_fwd(&ab, &gb)?,
        &ops::swiglu_fwd(&ac, &gc)?,
    )?;
    let (dg, du) = ops::swiglu_bwd(&gb, &ab, &gb)?;
    let (dg_ref, du_ref) = ops::swiglu_bwd(&gc, &ac, &gc)?;
    bf16_out("swiglu dgate", dev, &dg, &dg_ref)?;
    bf16_out("swiglu dup", dev, &du, &du_ref)?;
    let s = ops::softmax_fwd(&ab)?;
    let s_ref = ops::softmax_fwd(&ac)?;
    bf16_out("softmax", dev, &s, &s_ref)?;
    // The backward of the bf16 run takes its own (rounded) y.
    let ds_ref = ops::softmax_bwd(
        &gc,
        &ops::cast(&ops::cast(&s_ref, DType::BF16)?, DType::F32)?,
    )?;
    close("softmax bwd", &ops::softmax_bwd(&gb, &s)?, &ds_ref, 2e-2)?;
    Ok(())
}

fn attention_bf16(dev: Device) -> Result<()> {
    let mut rng = Rng::new(11);
    for (hs, nh, nkv, causal) in [(64, 4, 2, true), (80, 2, 2, false), (128, 4, 1, true)] {
        let cu = [0usize, 5, 37, 70];
        let t = *cu.last().unwrap_or(&0);
        let spec = AttentionSpec {
            causal,
            scale: 1.0 / (hs as f32).sqrt(),
        };
        let q = values(&mut rng, t * nh * hs, 1.0);
        let k = values(&mut rng, t * nkv * hs, 1.0);
        let v = values(&mut rng, t * nkv * hs, 1.0);
        let dout = values(&mut rng, t * nh * hs, 1.0);
        let (qc, kc, vc) = (
            f32_cpu(&q, &[t, nh, hs])?,
            f32_cpu(&k, &[t, nkv, hs])?,
            f32_cpu(&v, &[t, nkv, hs])?,
        );
        let (qb, kb, vb) = (
            bf16_on(&q, &[t, nh, hs], dev)?,
            bf16_on(&k, &[t, nkv, hs], dev)?,
            bf16_on(&v, &[t, nkv, hs], dev)?,
        );
        let (out_ref, lse_ref) = ops::attention_fwd(&qc, &kc, &vc, &cu, &spec)?;
        let (out, lse) = ops::attention_fwd(&qb, &kb, &vb, &cu, &spec)?;
        bf16_out("attention out", dev, &out, &out_ref)?;
        assert_eq!(lse.dtype(), DType::F32);
        close("attention lse", &lse, &lse_ref, 1e-4)?;
        // The backward sees what the bf16 forward kept: its rounded out.
        let out_r = ops::cast(&out, DType::F32)?.into_device(Device::Cpu)?;
        let (dq_r, dk_r, dv_r) = ops::attention_bwd(
            &f32_cpu(&dout, &[t, nh, hs])?,
            &qc,
            &kc,
            &vc,
            &out_r,
            &lse.into_device(Device::Cpu)?,
            &cu,
            &spec,
        )?;
        let (_, lse) = ops::attention_fwd(&qb, &kb, &vb, &cu, &spec)?;
        let (dq, dk, dv) = ops::attention_bwd(
            &bf16_on(&dout, &[t, nh, hs], dev)?,
            &qb,
            &kb,
            &vb,
            &out,
            &lse,
            &cu,
            &spec,
        )?;
        for (name, g, r) in [("dq", &dq, &dq_r), ("dk", &dk, &dk_r), ("dv", &dv, &dv_r)] {
            assert_eq!(g.dtype(), DType::BF16, "attention {name}");
            close(name, g, r, 2e-2)?;
        }
    }
    Ok(())
}

fn losses_bf16(dev: Device) -> Result<()> {
    let mut rng = Rng::new(12);
    let (n, v) = (21, 300);
    let logits = values(&mut rng, n * v, 3.0);
    let mut targets: Vec<u32> = rng.index_vec(n, v as u32);
    targets[3] = u32::MAX; // ignored
    let tc = Tensor::from_vec_u32(targets.clone(), [n], Device::Cpu)?;
    let td = Tensor::from_vec_u32(targets.clone(), [n], dev)?;
    let (l_ref, d_ref) =
        ops::cross_entropy_fwd_bwd(&f32_cpu(&logits, &[n, v])?, &tc, u32::MAX, 0.1)?;
    let (l, d) = ops::cross_entropy_fwd_bwd(&bf16_on(&logits, &[n, v], dev)?, &td, u32::MAX, 0.1)?;
    assert_eq!(l.dtype(), DType::F32, "losses stay f32");
    f32_acc("cross entropy losses", dev, &l, &l_ref)?;
    bf16_out("cross entropy dlogits", dev, &d, &d_ref)?;

    // Vocab-parallel: two shards of the vocabulary, partials f32, grads bf16.
    let half_v = v / 2;
    let shard = |lo: usize| -> Vec<f32> {
        (0..n)
            .flat_map(|i| logits[i * v + lo..i * v + lo + half_v].to_vec())
            .collect()
    };
    let (s0, s1) = (shard(0), shard(half_v));
    let p_ref: Vec<Tensor> = [(&s0, 0), (&s1, half_v)]
        .iter()
        .map(|(s, lo)| ops::vocab_loss_partials(&f32_cpu(s, &[n, half_v])?, &tc, *lo, u32::MAX))
        .collect::<Result<_>>()?;
    let p: Vec<Tensor> = [(&s0, 0), (&s1, half_v)]
        .iter()
        .map(|(s, lo)| {
            ops::vocab_loss_partials(&bf16_on(s, &[n, half_v], dev)?, &td, *lo, u32::MAX)
        })
        .collect::<Result<_>>()?;
    for (a, b) in p.iter().zip(&p_ref) {
        assert_eq!(a.dtype(), DType::F32);
        close("vocab partials", a, b, 1e-5)?;
    }
    let gather = |ps: &[Tensor], d: Device| -> Result<Tensor> {
        let mut all = ps[0].to_vec_f32()?;
        all.extend(ps[1].to_vec_f32()?);
        Tensor::from_vec(all, [2, 3, n], d)
    };
    let (l_ref, d_ref) = ops::vocab_loss_finish(
        &f32_cpu(&s1, &[n, half_v])?,
        &tc,
        &gather(&p_ref, Device::Cpu)?,
        half_v,
        u32::MAX,
        0.1,
    )?;
    let (l, d) = ops::vocab_loss_finish(
        &bf16_on(&s1, &[n, half_v], dev)?,
        &td,
        &gather(&p, dev)?,
        half_v,
        u32::MAX,
        0.1,
    )?;
    f32_acc("vocab losses", dev, &l, &l_ref)?;
    bf16_out("vocab dlogits", dev, &d, &d_ref)?;
    Ok(())
}

fn conv_and_patchify_bf16(dev: Device) -> Result<()> {
    let mut rng = Rng::new(13);
    let (b, ci, l, co, k) = (2, 6, 15, 8, 3);
    let spec = Conv1dSpec {
        stride: 2,
        padding: 1,
    };
    let lo = spec.out_len(l, k).unwrap_or(0);
    let x = values(&mut rng, b * ci * l, 1.0);
    let w = values(&mut rng, co * ci * k, 0.3);
    let bias = values(&mut rng, co, 0.3);
    let dy = values(&mut rng, b * co * lo, 1.0);
    let (xc, wc, bc) = (
        f32_cpu(&x, &[b, ci, l])?,
        f32_cpu(&w, &[co, ci, k])?,
        f32_cpu(&bias, &[co])?,
    );
    let (xb, wb, bb) = (
        bf16_on(&x, &[b, ci, l], dev)?,
        bf16_on(&w, &[co, ci, k], dev)?,
        bf16_on(&bias, &[co], dev)?,
    );
    let y = ops::conv1d_fwd(&xb, &wb, Some(&bb), &spec)?;
    bf16_out(
        "conv1d y",
        dev,
        &y,
        &ops::conv1d_fwd(&xc, &wc, Some(&bc), &spec)?,
    )?;
    let (mut dw_ref, mut db_ref) = (
        f32_cpu(&vec![0.0; co * ci * k], &[co, ci, k])?,
        f32_cpu(&vec![0.0; co], &[co])?,
    );
    let dx_ref = ops::conv1d_bwd(
        &f32_cpu(&dy, &[b, co, lo])?,
        &xc,
        &wc,
        &spec,
        Some(&mut dw_ref),
        Some(&mut db_ref),
    )?;
    let mut dw = Tensor::zeros([co, ci, k], DType::F32, dev)?;
    let mut db = Tensor::zeros([co], DType::F32, dev)?;
    let dx = ops::conv1d_bwd(
        &bf16_on(&dy, &[b, co, lo], dev)?,
        &xb,
        &wb,
        &spec,
        Some(&mut dw),
        Some(&mut db),
    )?;
    bf16_out("conv1d dx", dev, &dx, &dx_ref)?;
    f32_acc("conv1d dw", dev, &dw, &dw_ref)?;
    f32_acc("conv1d db", dev, &db, &db_ref)?;

    let img = values(&mut rng, 2 * 3 * 8 * 12, 1.0);
    let p = ops::patchify_fwd(&bf16_on(&img, &[2, 3, 8, 12], dev)?, 4)?;
    let p_ref = ops::patchify_fwd(&f32_cpu(&img, &[2, 3, 8, 12])?, 4)?;
    bf16_out("patchify", dev, &p, &p_ref)?;
    close("patchify is a copy", &p, &p_ref, 0.0)?;
    Ok(())
}

fn elementwise_and_adamw_copy(dev: Device) -> Result<()> {
    let mut rng = Rng::new(14);
    let n = 70_001; // past the parallel threshold
    let (a, bvals) = (values(&mut rng, n, 1.0), values(&mut rng, n, 1.0));
    let (ab, bb) = (bf16_on(&a, &[n], dev)?, bf16_on(&bvals, &[n], dev)?);
    bf16_out(
        "add",
        dev,
        &ops::add(&ab, &bb)?,
        &ops::add(&f32_cpu(&a, &[n])?, &f32_cpu(&bvals, &[n])?)?,
    )?;
    // An f32 grad gathers bf16 terms unrounded.
    let g0 = rng.normal_vec(n, 1.0);
    let mut acc = Tensor::from_vec(g0.clone(), [n], dev)?;
    ops::add_assign(&mut acc, &ab)?;
    let mut acc_ref = f32_cpu(&g0, &[n])?;
    ops::add_assign(&mut acc_ref, &f32_cpu(&a, &[n])?)?;
    f32_acc("f32 += bf16", dev, &acc, &acc_ref)?;
    let mut sb = ab.try_clone()?;
    ops::scale_assign(&mut sb, 0.37)?;
    let mut s_ref = f32_cpu(&a, &[n])?;
    ops::scale_assign(&mut s_ref, 0.37)?;
    bf16_out("scale bf16", dev, &sb, &s_ref)?;

    // The fused AdamW writes the compute copy: exactly the updated master, rounded.
    let spec = ops::AdamWSpec {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
    };
    let (p0, g) = (rng.normal_vec(n, 1.0), rng.normal_vec(n, 1.0));
    let mk = |v: &[f32]| Tensor::from_vec(v.to_vec(), [n], dev);
    let (mut p, mut m, mut v) = (mk(&p0)?, mk(&vec![0.01; n])?, mk(&vec![0.02; n])?);
    let mut copy = Tensor::zeros([n], DType::BF16, dev)?;
    ops::adamw_step_with_copy(&mut p, &mk(&g)?, &mut m, &mut v, &mut copy, &spec)?;
    let (mut p2, mut m2, mut v2) = (mk(&p0)?, mk(&vec![0.01; n])?, mk(&vec![0.02; n])?);
    ops::adamw_step(&mut p2, &mk(&g)?, &mut m2, &mut v2, &spec)?;
    assert_eq!(
        p.to_vec_f32()?,
        p2.to_vec_f32()?,
        "the master update is unchanged"
    );
    assert_eq!(m.to_vec_f32()?, m2.to_vec_f32()?);
    assert_eq!(
        copy.to_host()?,
        ops::cast(&p2, DType::BF16)?.to_host()?,
        "the compute copy is the updated master rounded to nearest even"
    );
    // The copy must be bf16 and of the param's shape.
    let mut wrong = Tensor::zeros([n], DType::F32, dev)?;
    assert!(
        ops::adamw_step_with_copy(&mut p, &mk(&g)?, &mut m, &mut v, &mut wrong, &spec).is_err()
    );
    let mut short = Tensor::zeros([n - 1], DType::BF16, dev)?;
    assert!(
        ops::adamw_step_with_copy(&mut p, &mk(&g)?, &mut m, &mut v, &mut short, &spec).is_err()
    );
    Ok(())
}

test_on_devices!(
    linear_bf16_with_f32_grads,
    batched_gemm_bf16,
    norms_bf16_with_f32_grads,
    embedding_rope_activations_bf16,
    attention_bf16,
    losses_bf16,
    conv_and_patchify_bf16,
    elementwise_and_adamw_copy,
);
