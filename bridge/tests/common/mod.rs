//! Shared by the bridge tests: random routing tables, random embeddings and grads, and a plain reference of forward and backward written from the routes' definition alone.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use braid_bridge::{Dest, ItemRoute, Routes};
use braid_comm::local::{LocalComm, run_local};
use braid_kernels::{Device, Tensor};
use rand::Rng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

pub const TIMEOUT: Duration = Duration::from_secs(30);

/// A random table: world 1..=8, C 1..=5, 0..=6 items of 0, 1 or 2..=7 rows, random src,
/// grad_to of 1..=3 ranks (or empty: frozen), 1..=4 "CP shards" per item each asking
/// for a random subset of rows in random order (shards may overlap: fan-out), each
/// shard copied to 1..=3 "TP" ranks of which the first returns grads.
pub fn random_routes(rng: &mut ChaCha8Rng) -> Routes {
    let world = rng.random_range(1..=8);
    let width = rng.random_range(1..=5);
    let n_items = rng.random_range(0..=6);
    let items = (0..n_items)
        .map(|_| random_item(rng, world))
        .collect::<Vec<_>>();
    Routes::new(items, width, world).unwrap()
}

pub fn random_item(rng: &mut ChaCha8Rng, world: usize) -> ItemRoute {
    let rows = match rng.random_range(0..6) {
        0 => 0,
        1 => 1,
        _ => rng.random_range(2..=7),
    };
    let src = rng.random_range(0..world);
    let mut ranks: Vec<usize> = (0..world).collect();
    ranks.shuffle(rng);
    let grad_to = if rng.random_bool(0.25) {
        Vec::new()
    } else {
        let n = rng.random_range(1..=3.min(world));
        ranks[..n].to_vec()
    };
    ranks.shuffle(rng);
    let mut free = ranks.into_iter();
    let mut dst = Vec::new();
    for _ in 0..rng.random_range(1..=4) {
        let mut shard: Vec<u32> = (0..rows as u32).filter(|_| rng.random_bool(0.7)).collect();
        shard.shuffle(rng);
        for copy in 0..rng.random_range(1..=3) {
            let Some(rank) = free.next() else { break };
            dst.push(Dest {
                rank,
                rows: shard.clone(),
                grad: copy == 0 && !grad_to.is_empty(),
            });
        }
    }
    ItemRoute {
        rows,
        src,
        grad_to,
        dst,
    }
}

/// Random `(rows, C)` values per item, as host vectors.
pub fn random_embeddings(rng: &mut ChaCha8Rng, routes: &Routes) -> Vec<Vec<f32>> {
    routes
        .items()
        .iter()
        .map(|it| random_vec(rng, it.rows * routes.width()))
        .collect()
}

/// Values of mixed magnitudes, so that sums in another order round differently.
pub fn random_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-2.0f32..2.0) * 10f32.powi(rng.random_range(-3..=3)))
        .collect()
}

pub fn tensor(v: &[f32], rows: usize, c: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), [rows, c], Device::Cpu).unwrap()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Reference forward output of `rank`: for each item in order, the rows of the dest on
/// `rank` (at most one), in the dest's order. Returns (values (M, C), (item, row) list).
pub fn reference_forward(
    routes: &Routes,
    emb: &[Vec<f32>],
    rank: usize,
) -> (Vec<f32>, Vec<(usize, u32)>) {
    let c = routes.width();
    let mut out = Vec::new();
    let mut layout = Vec::new();
    for (i, it) in routes.items().iter().enumerate() {
        for d in it.dst.iter().filter(|d| d.rank == rank) {
            for &r in &d.rows {
                let r0 = r as usize * c;
                out.extend_from_slice(&emb[i][r0..r0 + c]);
                layout.push((i, r));
            }
        }
    }
    (out, layout)
}

/// Reference backward on `rank`: for each item whose grad_to holds `rank`, a zero
/// (rows, C) to which each grad dest adds its rows' grads, dests in ascending rank
/// order. `grads[d]` is rank d's (M_d, C) grad of its forward output.
pub fn reference_backward(
    routes: &Routes,
    grads: &[Vec<f32>],
    rank: usize,
) -> Vec<(usize, Vec<f32>)> {
    let c = routes.width();
    let mut out = Vec::new();
    for (i, it) in routes.items().iter().enumerate() {
        if !it.grad_to.contains(&rank) {
            continue;
        }
        let mut acc = vec![0.0f32; it.rows * c];
        let mut dests: Vec<&Dest> = it.dst.iter().filter(|d| d.grad).collect();
        dests.sort_by_key(|d| d.rank);
        for d in dests {
            let layout = layout_of(routes, d.rank);
            for &r in &d.rows {
                let m = layout.iter().position(|&x| x == (i, r)).unwrap();
                let g = &grads[d.rank][m * c..(m + 1) * c];
                let a = &mut acc[r as usize * c..(r as usize + 1) * c];
                a.iter_mut().zip(g).for_each(|(a, g)| *a += g);
            }
        }
        out.push((i, acc));
    }
    out
}

/// The (item, row) of each forward output row of `rank`, from the routes' definition.
pub fn layout_of(routes: &Routes, rank: usize) -> Vec<(usize, u32)> {
    let mut layout = Vec::new();
    for (i, it) in routes.items().iter().enumerate() {
        for d in it.dst.iter().filter(|d| d.rank == rank) {
            layout.extend(d.rows.iter().map(|&r| (i, r)));
        }
    }
    layout
}

/// What one rank saw: its forward output and its backward result, as host vectors.
pub type RankResult = (Vec<usize>, Vec<f32>, Vec<(usize, Vec<usize>, Vec<f32>)>);

/// Runs forward then backward on every rank of a LocalComm world with the given
/// embeddings (per item) and output grads (per rank).
pub fn run_bridge(routes: &Routes, emb: &[Vec<f32>], grads: &[Vec<f32>]) -> Vec<RankResult> {
    let c = routes.width();
    run_local(
        routes.world(),
        TIMEOUT,
        |comm: LocalComm| -> braid_bridge::Result<RankResult> {
            let rank = braid_comm::Comm::rank(&comm);
            let mine: Vec<(usize, Tensor)> = routes
                .produced_by(rank)
                .into_iter()
                .map(|i| (i, tensor(&emb[i], routes.items()[i].rows, c)))
                .collect();
            let refs: Vec<(usize, &Tensor)> = mine.iter().map(|(i, t)| (*i, t)).collect();
            let y = routes.forward(&comm, &refs)?;
            let m = grads[rank].len() / c;
            let dy = tensor(&grads[rank], m, c);
            let dx = routes.backward(&comm, &dy)?;
            Ok((
                y.dims().to_vec(),
                y.to_vec_f32().unwrap(),
                dx.into_iter()
                    .map(|(i, t)| (i, t.dims().to_vec(), t.to_vec_f32().unwrap()))
                    .collect(),
            ))
        },
    )
    .unwrap()
}

/// Random grads of every rank's forward output, (M_d, C) each.
pub fn random_grads(rng: &mut ChaCha8Rng, routes: &Routes) -> Vec<Vec<f32>> {
    (0..routes.world())
        .map(|d| random_vec(rng, routes.rows_received(d) * routes.width()))
        .collect()
}

/// Runs one case and checks every rank against the reference; returns the results.
pub fn check_case(
    case: u64,
    routes: &Routes,
    emb: &[Vec<f32>],
    grads: &[Vec<f32>],
) -> Vec<RankResult> {
    let c = routes.width();
    let results = run_bridge(routes, emb, grads);
    for (rank, (dims, y, dx)) in results.iter().enumerate() {
        let (want, layout) = reference_forward(routes, emb, rank);
        assert_eq!(
            routes.received(rank),
            layout,
            "case {case} rank {rank}: received()"
        );
        assert_eq!(
            dims,
            &[layout.len(), c],
            "case {case} rank {rank}: forward shape"
        );
        assert_eq!(
            bits(y),
            bits(&want),
            "case {case} rank {rank}: forward values"
        );

        let want = reference_backward(routes, grads, rank);
        assert_eq!(
            dx.len(),
            want.len(),
            "case {case} rank {rank}: backward items"
        );
        for ((i, dims, got), (wi, want)) in dx.iter().zip(&want) {
            assert_eq!(i, wi, "case {case} rank {rank}: backward item order");
            assert_eq!(
                dims,
                &[routes.items()[*i].rows, c],
                "case {case} rank {rank} item {i}"
            );
            assert_eq!(
                bits(got),
                bits(want),
                "case {case} rank {rank} item {i}: grad values"
            );
        }
    }
    // Every grad_to rank of an item holds bitwise the same grad.
    for (i, it) in routes.items().iter().enumerate() {
        let copies: Vec<&Vec<f32>> = it
            .grad_to
            .iter()
            .map(|&g| &results[g].2.iter().find(|(j, ..)| *j == i).unwrap().2)
            .collect();
        for w in copies.windows(2) {
            assert_eq!(
                bits(w[0]),
                bits(w[1]),
                "case {case} item {i}: grad_to copies differ"
            );
        }
    }
    results
}
