//! Bad routes and bad arguments give errors naming the item, the rank and what is wrong; a rank that fails stops its world instead of hanging it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use braid_bridge::{Dest, ItemRoute, Routes};
use braid_comm::local::{LocalComm, run_local};
use braid_comm::{Comm, SingleRank};
use braid_kernels::{DType, Device, Tensor, ops};
use common::tensor;

fn dest(rank: usize, rows: &[u32], grad: bool) -> Dest {
    Dest {
        rank,
        rows: rows.to_vec(),
        grad,
    }
}

fn item(rows: usize, src: usize, grad_to: &[usize], dst: Vec<Dest>) -> ItemRoute {
    ItemRoute {
        rows,
        src,
        grad_to: grad_to.to_vec(),
        dst,
    }
}

#[test]
fn bad_routes_are_rejected_naming_item_and_rank() {
    let good = || {
        item(
            3,
            0,
            &[0, 1],
            vec![dest(2, &[0, 2], true), dest(3, &[0, 2], false)],
        )
    };
    assert!(Routes::new(vec![good(), good()], 4, 4).is_ok());
    let cases = vec![
        (
            item(3, 4, &[0], vec![]),
            "src rank 4 is outside the world of 4 ranks",
        ),
        (
            item(3, 0, &[0, 7], vec![]),
            "grad_to rank 7 is outside the world of 4 ranks",
        ),
        (item(3, 0, &[1, 1], vec![]), "grad_to names rank 1 twice"),
        (
            item(3, 0, &[0], vec![dest(9, &[0], true)]),
            "dest rank 9 is outside the world of 4 ranks",
        ),
        (
            item(3, 0, &[0], vec![dest(2, &[0], true), dest(2, &[1], false)]),
            "rank 2 appears in two dests",
        ),
        (
            item(3, 0, &[0], vec![dest(2, &[3], true)]),
            "dest rank 2 asks for row 3 of an item of 3 rows",
        ),
        (
            item(3, 0, &[0], vec![dest(2, &[1, 0, 1], true)]),
            "dest rank 2 asks for row 1 twice",
        ),
        (
            item(3, 0, &[], vec![dest(1, &[0], true)]),
            "dest rank 1 has grad = true but grad_to is empty",
        ),
        (
            item(0, 0, &[], vec![dest(1, &[0], false)]),
            "dest rank 1 asks for row 0 of an item of 0 rows",
        ),
    ];
    for (bad, want) in cases {
        let e = Routes::new(vec![good(), bad], 4, 4)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("item 1") && e.contains(want),
            "{e:?} should say item 1: {want}"
        );
    }
    let e = Routes::new(vec![good()], 0, 4).unwrap_err().to_string();
    assert!(e.contains("width C must be >= 1"), "{e}");
    let e = Routes::new(vec![], 4, 0).unwrap_err().to_string();
    assert!(e.contains("world size must be >= 1"), "{e}");
}

/// Two ranks: item 0 from rank 0 and item 1 from rank 1, both to both ranks.
fn two_rank_routes() -> Routes {
    let both = |src| {
        item(
            2,
            src,
            &[src],
            vec![dest(0, &[0, 1], true), dest(1, &[1], false)],
        )
    };
    Routes::new(vec![both(0), both(1)], 3, 2).unwrap()
}

/// Runs forward on two ranks, rank 0 passing `bad` (built from its item tensors) and rank
/// 1 its item; returns rank 0's error message, checking rank 1 did not hang.
fn forward_error(bad: impl Fn(&Tensor, &Tensor) -> Vec<(usize, Tensor)> + Sync) -> String {
    let routes = two_rank_routes();
    let start = Instant::now();
    let e = run_local(
        2,
        Duration::from_secs(20),
        |comm: LocalComm| -> braid_bridge::Result<()> {
            let x0 = tensor(&[1., 2., 3., 4., 5., 6.], 2, 3);
            let x1 = tensor(&[7., 8., 9., 10., 11., 12.], 2, 3);
            let produced = if comm.rank() == 0 {
                bad(&x0, &x1)
            } else {
                vec![(1, x1)]
            };
            let refs: Vec<(usize, &Tensor)> = produced.iter().map(|(i, t)| (*i, t)).collect();
            routes.forward(&comm, &refs).map(|_| ())
        },
    )
    .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "rank 1 waited for the timeout"
    );
    assert_eq!(e.rank, 0, "{e}");
    assert!(
        e.message.contains("bridge forward on rank 0"),
        "{}",
        e.message
    );
    e.message
}

#[test]
fn forward_rejects_items_it_does_not_own_missing_repeated_or_misshapen() {
    let cp = |t: &Tensor| t.try_clone().unwrap();
    let e = forward_error(|x0, x1| vec![(0, cp(x0)), (1, cp(x1))]);
    assert!(e.contains("was given item 1, whose src is rank 1"), "{e}");
    let e = forward_error(|_, _| vec![]);
    assert!(
        e.contains("items [0] are missing: this rank is their src"),
        "{e}"
    );
    let e = forward_error(|x0, _| vec![(0, cp(x0)), (0, cp(x0))]);
    assert!(e.contains("was given item 0 twice"), "{e}");
    let e = forward_error(|x0, _| vec![(0, cp(x0)), (5, cp(x0))]);
    assert!(
        e.contains("item 5 does not exist (the step has 2 items)"),
        "{e}"
    );
    let e = forward_error(|_, _| vec![(0, tensor(&[0.; 8], 2, 4))]);
    assert!(
        e.contains("item 0 is [2, 4] but must be (rows, C) = [2, 3]"),
        "{e}"
    );
    let e = forward_error(|_, _| vec![(0, tensor(&[0.; 9], 3, 3))]);
    assert!(
        e.contains("item 0 is [3, 3] but must be (rows, C) = [2, 3]"),
        "{e}"
    );
    let e = forward_error(|x0, _| vec![(0, ops::cast(x0, DType::BF16).unwrap())]);
    assert!(
        e.contains("item 0 is bf16 but the routes exchange f32"),
        "{e}"
    );
}

#[test]
fn backward_rejects_a_grad_of_the_wrong_shape() {
    let routes = two_rank_routes();
    let e = run_local(
        2,
        Duration::from_secs(20),
        |comm: LocalComm| -> braid_bridge::Result<()> {
            let rank = comm.rank();
            let x = tensor(&[0.; 6], 2, 3);
            routes.forward(&comm, &[(rank, &x)])?;
            // Rank 0 received 4 rows, rank 1 two.
            let m = if rank == 0 { 3 } else { 2 };
            routes
                .backward(&comm, &tensor(&vec![0.; m * 3], m, 3))
                .map(|_| ())
        },
    )
    .unwrap_err();
    assert_eq!(e.rank, 0, "{e}");
    assert!(
        e.message
            .contains("bridge backward on rank 0: grad is [3, 3] but must be (rows, C) = [4, 3]"),
        "{}",
        e.message
    );
}

#[test]
fn the_comm_must_span_the_world() {
    let routes = two_rank_routes();
    let x = Tensor::zeros([2, 3], DType::F32, Device::Cpu).unwrap();
    let e = routes
        .forward(&SingleRank, &[(0, &x)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the comm has 1 ranks but the routes span a world of 2"),
        "{e}"
    );
}

#[test]
fn ranks_holding_different_routes_are_caught() {
    let routes = |rows: &[u32]| {
        Routes::new(vec![item(2, 0, &[], vec![dest(1, rows, false)])], 3, 2).unwrap()
    };
    let (a, b) = (routes(&[0, 1]), routes(&[0]));
    let e = run_local(
        2,
        Duration::from_secs(20),
        |comm: LocalComm| -> braid_bridge::Result<()> {
            let x = tensor(&[0.; 6], 2, 3);
            match comm.rank() {
                0 => a.forward(&comm, &[(0, &x)]).map(|_| ()),
                _ => b.forward(&comm, &[]).map(|_| ()),
            }
        },
    )
    .unwrap_err();
    assert_eq!(e.rank, 1, "{e}");
    assert!(
        e.message.contains(
            "rank 0 sent [2, 3] but the routes say [1, 3]: do all ranks hold the same routes?"
        ),
        "{}",
        e.message
    );
}
