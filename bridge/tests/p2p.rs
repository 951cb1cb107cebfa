//! The point-to-point bridge (subsets of a step's items, messages between only the ranks involved) against the collective forward and backward on random tables.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use braid_bridge::Routes;
use braid_comm::Comm;
use braid_comm::local::{LocalComm, run_local};
use braid_kernels::{Shape, Tensor};
use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sends `msgs` (a message to this rank itself stays here), then receives from
/// `sources`; returns every message this rank got.
fn swap(
    comm: &LocalComm,
    msgs: Vec<(usize, Tensor)>,
    sources: &[(usize, usize)],
    c: usize,
) -> Vec<(usize, Tensor)> {
    let rank = comm.rank();
    let mut got = Vec::new();
    for (peer, t) in msgs {
        if peer == rank {
            got.push((peer, t));
        } else {
            comm.send(&t, peer).unwrap();
        }
    }
    for &(peer, n) in sources.iter().filter(|(p, _)| *p != rank) {
        got.push((peer, comm.recv(&Shape::new([n, c]), peer).unwrap()));
    }
    got
}

/// Forward then backward of `routes` (all of it, or a subset) as messages, on every rank.
fn run_p2p(routes: &Routes, emb: &[Vec<f32>], grads: &[Vec<f32>]) -> Vec<RankResult> {
    let c = routes.width();
    run_local(
        routes.world(),
        TIMEOUT,
        |comm: LocalComm| -> braid_bridge::Result<RankResult> {
            let rank = comm.rank();
            let mine: Vec<(usize, Tensor)> = routes
                .produced_by(rank)
                .into_iter()
                .map(|i| (i, tensor(&emb[i], routes.items()[i].rows, c)))
                .collect();
            let refs: Vec<(usize, &Tensor)> = mine.iter().map(|(i, t)| (*i, t)).collect();
            let sends = routes.forward_sends(rank, &refs)?;
            let peers: Vec<usize> = sends.iter().map(|s| s.0).collect();
            assert_eq!(peers, routes.forward_targets(rank), "rank {rank}");
            let got = swap(&comm, sends, &routes.forward_sources(rank), c);
            let y = routes.forward_gather(rank, got)?;
            let m = grads[rank].len() / c;
            let dy = tensor(&grads[rank], m, c);
            let sends = routes.backward_sends(rank, &dy)?;
            let peers: Vec<usize> = sends.iter().map(|s| s.0).collect();
            assert_eq!(peers, routes.backward_targets(rank), "rank {rank}");
            let got = swap(&comm, sends, &routes.backward_sources(rank), c);
            let dx = routes.backward_gather(rank, got)?;
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

#[test]
fn messages_give_the_collectives_bits() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x9292);
    for case in 0..150 {
        let routes = random_routes(&mut rng);
        let emb = random_embeddings(&mut rng, &routes);
        let grads = random_grads(&mut rng, &routes);
        let want = check_case(case, &routes, &emb, &grads);
        assert_eq!(run_p2p(&routes, &emb, &grads), want, "case {case}");
    }
}

/// A step's items split into random ascending groups (the overlapped schedule's
/// microbatches): each group's messages move exactly that group's rows and grads.
#[test]
fn subsets_move_their_own_items() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5b5e7);
    let mut checked = 0;
    for case in 0..150 {
        let routes = random_routes(&mut rng);
        let n = routes.items().len();
        let groups = rng.random_range(1..=3);
        let group: Vec<usize> = (0..n).map(|_| rng.random_range(0..groups)).collect();
        for g in 0..groups {
            let items: Vec<usize> = (0..n).filter(|&i| group[i] == g).collect();
            let sub = routes.subset(&items).unwrap();
            assert_eq!(sub.items().len(), items.len());
            let emb: Vec<Vec<f32>> = {
                let all = random_embeddings(&mut rng, &routes);
                items.iter().map(|&i| all[i].clone()).collect()
            };
            let grads = random_grads(&mut rng, &sub);
            // The subset's messages against the reference of the subset's own table,
            // whose item j is item items[j] of the step.
            let got = run_p2p(&sub, &emb, &grads);
            assert_eq!(got, check_case(case, &sub, &emb, &grads), "case {case}");
            for rank in 0..routes.world() {
                let whole: Vec<(usize, u32)> = routes
                    .received(rank)
                    .into_iter()
                    .filter(|(i, _)| group[*i] == g)
                    .collect();
                let mapped: Vec<(usize, u32)> = sub
                    .received(rank)
                    .into_iter()
                    .map(|(j, r)| (items[j], r))
                    .collect();
                assert_eq!(mapped, whole, "case {case} rank {rank}: subset rows");
            }
            checked += items.len();
        }
    }
    assert!(checked > 200, "only {checked} items checked");
}

#[test]
fn bad_subsets_and_messages_are_errors() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let routes = loop {
        let r = random_routes(&mut rng);
        if r.items().len() >= 2 && r.items()[0].dst.iter().any(|d| !d.rows.is_empty()) {
            break r;
        }
    };
    let err = routes.subset(&[1, 0]).unwrap_err().to_string();
    assert!(err.contains("ascend"), "{err}");
    let err = routes.subset(&[99]).unwrap_err().to_string();
    assert!(err.contains("item 99"), "{err}");
    // A receiver missing a message its routes promise names the silent peer.
    let d = &routes.items()[0]
        .dst
        .iter()
        .find(|d| !d.rows.is_empty())
        .unwrap();
    let err = routes
        .forward_gather(d.rank, Vec::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no message from rank"), "{err}");
}
