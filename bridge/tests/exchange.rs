//! Forward and backward on random routing tables over LocalComm worlds of 1..8 ranks, against the plain reference of tests/common.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use braid_bridge::{Dest, ItemRoute, Routes};
use braid_comm::SingleRank;
use braid_kernels::{Device, Tensor};
use common::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[test]
fn random_routes_forward_and_backward_match_reference() {
    let mut rng = ChaCha8Rng::seed_from_u64(0xb71d6e);
    let (mut moved, mut fanned_in) = (0, 0);
    for case in 0..200 {
        let routes = random_routes(&mut rng);
        let emb = random_embeddings(&mut rng, &routes);
        let grads = random_grads(&mut rng, &routes);
        check_case(case, &routes, &emb, &grads);
        moved += routes.stats().rows_sent_off_rank;
        // Rows that three or more grad copies return (a summed fan-out whose order matters).
        fanned_in += routes
            .items()
            .iter()
            .map(|it| {
                let mut n = vec![0; it.rows];
                it.dst
                    .iter()
                    .filter(|d| d.grad)
                    .flat_map(|d| &d.rows)
                    .for_each(|&r| n[r as usize] += 1);
                n.into_iter().filter(|&k| k > 2).count()
            })
            .sum::<usize>();
    }
    // The generator exercises what it is meant to.
    assert!(
        moved > 1000 && fanned_in > 50,
        "moved {moved}, fanned in {fanned_in}"
    );
}

#[test]
fn results_do_not_depend_on_thread_timing() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for case in 0..20 {
        let routes = random_routes(&mut rng);
        let emb = random_embeddings(&mut rng, &routes);
        let grads = random_grads(&mut rng, &routes);
        let a = check_case(case, &routes, &emb, &grads);
        let b = run_bridge(&routes, &emb, &grads);
        assert_eq!(a, b, "case {case}");
    }
}

/// Corner tables: nothing moves; all ranks frozen; an item nobody asks for; one rank
/// both sending and receiving its own rows; a row asked for by every rank.
#[test]
fn corner_tables() {
    let dest = |rank, rows: &[u32], grad| Dest {
        rank,
        rows: rows.to_vec(),
        grad,
    };
    let item = |rows, src, grad_to: &[usize], dst| ItemRoute {
        rows,
        src,
        grad_to: grad_to.to_vec(),
        dst,
    };
    let tables = [
        Routes::new(vec![], 3, 4).unwrap(),
        Routes::new(vec![item(0, 1, &[1], vec![dest(2, &[], true)])], 3, 4).unwrap(),
        Routes::new(vec![item(2, 0, &[0, 1], vec![])], 2, 3).unwrap(),
        Routes::new(
            vec![item(
                3,
                1,
                &[],
                vec![dest(0, &[2, 0], false), dest(1, &[1], false)],
            )],
            2,
            2,
        )
        .unwrap(),
        Routes::new(
            vec![
                item(4, 2, &[2], vec![dest(2, &[3, 1, 0], true)]),
                item(
                    2,
                    2,
                    &[0, 2],
                    vec![
                        dest(0, &[1], true),
                        dest(1, &[1], true),
                        dest(2, &[1], true),
                    ],
                ),
                item(1, 0, &[1], vec![dest(2, &[0], true)]),
            ],
            4,
            3,
        )
        .unwrap(),
    ];
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (case, routes) in tables.iter().enumerate() {
        let emb = random_embeddings(&mut rng, routes);
        let grads = random_grads(&mut rng, routes);
        check_case(case as u64, routes, &emb, &grads);
    }
}

#[test]
fn one_rank_works_with_single_rank_comm() {
    let routes = Routes::new(
        vec![ItemRoute {
            rows: 3,
            src: 0,
            grad_to: vec![0],
            dst: vec![Dest {
                rank: 0,
                rows: vec![2, 0],
                grad: true,
            }],
        }],
        2,
        1,
    )
    .unwrap();
    let x = Tensor::from_vec(vec![0., 1., 2., 3., 4., 5.], [3, 2], Device::Cpu).unwrap();
    let y = routes.forward(&SingleRank, &[(0, &x)]).unwrap();
    assert_eq!(y.to_vec_f32().unwrap(), vec![4., 5., 0., 1.]);
    let dy = Tensor::from_vec(vec![1., 2., 3., 4.], [2, 2], Device::Cpu).unwrap();
    let dx = routes.backward(&SingleRank, &dy).unwrap();
    assert_eq!(dx.len(), 1);
    assert_eq!(dx[0].0, 0);
    assert_eq!(dx[0].1.to_vec_f32().unwrap(), vec![3., 4., 0., 0., 1., 2.]);
}

#[test]
fn stats_count_rows() {
    let routes = Routes::new(
        vec![
            ItemRoute {
                rows: 4,
                src: 0,
                grad_to: vec![0, 1],
                dst: vec![
                    Dest {
                        rank: 0,
                        rows: vec![0, 1],
                        grad: true,
                    },
                    Dest {
                        rank: 2,
                        rows: vec![2, 3],
                        grad: true,
                    },
                    Dest {
                        rank: 3,
                        rows: vec![2, 3],
                        grad: false,
                    },
                ],
            },
            ItemRoute {
                rows: 1,
                src: 1,
                grad_to: vec![],
                dst: vec![Dest {
                    rank: 2,
                    rows: vec![0],
                    grad: false,
                }],
            },
        ],
        8,
        4,
    )
    .unwrap();
    let s = routes.stats();
    assert_eq!(s.rows_requested, 7);
    assert_eq!(s.rows_sent_off_rank, 5);
    assert_eq!(s.max_rows_received, 3);
    assert_eq!(s.max_rows_received_off_rank, 3);
    // rank 0's copy: 2 rows to rank 1; rank 2's copy: 2 rows to ranks 0 and 1.
    assert_eq!(s.grad_rows_sent_off_rank, 2 + 4);
}
