//! LocalComm: every collective against a plain reference, on several world sizes;
//! determinism; subgroups; and the failure paths (timeout, poisoning, desync).

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_comm::local::{LocalComm, run_local};
use braid_comm::{Comm, CommError};
use braid_kernels::{Device, Shape, Tensor};

const T: Duration = Duration::from_secs(20);

/// Rank `r`'s test data: n values that differ per rank and are not exactly summable in
/// every order (so a wrong summation order would show).
fn data(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((r * 31 + i * 7) as f32).sin() * 10f32.powi((i % 5) as i32 - 2))
        .collect()
}

fn t(v: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims.to_vec(), Device::Cpu).unwrap()
}

#[test]
fn all_reduce_sums_in_rank_order_on_every_rank() {
    for size in [1, 2, 3, 5, 8] {
        let out = run_local(size, T, |c: LocalComm| {
            let mut x = t(data(c.rank(), 12), &[3, 4]);
            c.all_reduce_sum(&mut x)?;
            x.to_vec_f32().map_err(CommError::from)
        })
        .unwrap();
        let mut want = [0f32; 12];
        for r in 0..size {
            want.iter_mut().zip(data(r, 12)).for_each(|(s, x)| *s += x);
        }
        for (r, got) in out.iter().enumerate() {
            // Bitwise: the same order of additions as the reference, on every rank.
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "size {size} rank {r}"
            );
        }
    }
}

#[test]
fn gather_scatter_broadcast_match_references() {
    let size = 4;
    let out = run_local(size, T, |c: LocalComm| -> braid_comm::Result<_> {
        let r = c.rank();
        let g = c.all_gather(&t(data(r, 6), &[2, 3]))?;
        let rs = c.reduce_scatter_sum(&t(data(r, 8 * 3), &[8, 3]))?;
        let mut b = t(data(r, 5), &[5]);
        c.broadcast(&mut b, 2)?;
        Ok((
            g.dims().to_vec(),
            g.to_vec_f32()?,
            rs.to_vec_f32()?,
            b.to_vec_f32()?,
        ))
    })
    .unwrap();
    let gathered: Vec<f32> = (0..size).flat_map(|r| data(r, 6)).collect();
    let mut sum = [0f32; 24];
    for r in 0..size {
        sum.iter_mut().zip(data(r, 24)).for_each(|(s, x)| *s += x);
    }
    for (r, (gd, g, rs, b)) in out.into_iter().enumerate() {
        assert_eq!(gd, vec![8, 3]);
        assert_eq!(g, gathered);
        assert_eq!(rs, sum[r * 6..(r + 1) * 6].to_vec());
        assert_eq!(b, data(2, 5));
    }
}

#[test]
fn all_to_all_v_moves_ragged_parts_including_empty_ones() {
    let size = 5;
    // Rank s sends (s + d) % 3 rows of width 2 to rank d (so some parts are empty).
    let rows = |s: usize, d: usize| (s + d) % 3;
    let part = |s: usize, d: usize| data(s * 10 + d, rows(s, d) * 2);
    let out = run_local(size, T, |c: LocalComm| -> braid_comm::Result<_> {
        let s = c.rank();
        let parts = (0..size).map(|d| t(part(s, d), &[rows(s, d), 2])).collect();
        let got = c.all_to_all_v(parts)?;
        got.iter()
            .map(|x| Ok((x.dims().to_vec(), x.to_vec_f32()?)))
            .collect::<braid_comm::Result<Vec<_>>>()
    })
    .unwrap();
    for (d, got) in out.into_iter().enumerate() {
        for (s, (dims, v)) in got.into_iter().enumerate() {
            assert_eq!(dims, vec![rows(s, d), 2], "{s} -> {d}");
            assert_eq!(v, part(s, d), "{s} -> {d}");
        }
    }
}

#[test]
fn send_recv_keeps_order_and_checks_shape() {
    let out = run_local(3, T, |c: LocalComm| -> braid_comm::Result<_> {
        match c.rank() {
            0 => {
                for i in 0..4 {
                    c.send(&t(vec![i as f32; 2], &[2]), 2)?;
                }
                Ok(vec![])
            }
            1 => {
                c.send(&t(vec![9.0; 3], &[3]), 2)?;
                Ok(vec![])
            }
            _ => {
                let mut got = vec![];
                // Messages from 1 do not overtake those from 0 in their own queue.
                got.push(c.recv(&Shape::new([3]), 1)?.to_vec_f32()?[0]);
                for _ in 0..4 {
                    got.push(c.recv(&Shape::new([2]), 0)?.to_vec_f32()?[0]);
                }
                Ok(got)
            }
        }
    })
    .unwrap();
    assert_eq!(out[2], vec![9.0, 0.0, 1.0, 2.0, 3.0]);

    let e = run_local(2, T, |c: LocalComm| -> braid_comm::Result<()> {
        if c.rank() == 0 {
            c.send(&t(vec![1.0; 4], &[4]), 1)
        } else {
            c.recv(&Shape::new([2, 2]), 0).map(|_| ())
        }
    })
    .unwrap_err();
    assert_eq!(e.rank, 1);
    assert!(e.message.contains("expects [2, 2]"), "{e}");
}

#[test]
fn subgroups_run_side_by_side() {
    // Ranks {0, 2} and {1, 3} reduce in their own groups; then the reversed group
    // [3, 1] shows that group rank follows the member order.
    let out = run_local(4, T, |c: LocalComm| -> braid_comm::Result<_> {
        let r = c.rank();
        let members: Vec<usize> = if r.is_multiple_of(2) {
            vec![0, 2]
        } else {
            vec![3, 1]
        };
        let g: Arc<dyn Comm> = c.subgroup(&members)?;
        let mut x = t(vec![r as f32 + 1.0], &[1]);
        g.all_reduce_sum(&mut x)?;
        let gathered = g.all_gather(&t(vec![r as f32], &[1]))?.to_vec_f32()?;
        Ok((g.rank(), x.to_vec_f32()?[0], gathered))
    })
    .unwrap();
    assert_eq!(out[0], (0, 4.0, vec![0.0, 2.0]));
    assert_eq!(out[2], (1, 4.0, vec![0.0, 2.0]));
    assert_eq!(out[3], (0, 6.0, vec![3.0, 1.0]));
    assert_eq!(out[1], (1, 6.0, vec![3.0, 1.0]));

    let e = run_local(2, T, |c: LocalComm| c.subgroup(&[0]).map(|_| ())).unwrap_err();
    assert!(e.message.contains("not in"), "{e}");
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    let start = Instant::now();
    let e = run_local(3, Duration::from_millis(400), |c: LocalComm| {
        if c.rank() == 1 {
            return Ok(()); // never joins the barrier
        }
        c.barrier()
    })
    .unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(e.message.contains("timed out"), "{e}");
    assert!(e.message.contains("[1]"), "names the missing rank: {e}");
}

#[test]
fn a_panicking_rank_poisons_the_world() {
    let start = Instant::now();
    // Rank 2 panics; the others are blocked in an all-reduce it never reaches. The
    // timeout is long: they must stop because of the poison, not the deadline.
    let e = run_local(4, Duration::from_secs(60), |c: LocalComm| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(100));
            panic!("injected failure");
        }
        let mut x = t(vec![1.0], &[1]);
        c.all_reduce_sum(&mut x)
    })
    .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(e.rank, 2);
    assert!(e.message.contains("injected failure"), "{e}");
    for (r, why) in e.ranks.iter().filter(|(r, _)| *r != 2) {
        assert!(why.contains("rank 2 failed"), "rank {r}: {why}");
    }
    assert_eq!(e.ranks.len(), 4);
}

#[test]
fn a_rank_returning_an_error_poisons_the_world() {
    let e = run_local(3, Duration::from_secs(60), |c: LocalComm| {
        if c.rank() == 0 {
            return Err("bad batch".to_string());
        }
        c.barrier().map_err(|e| e.to_string())
    })
    .unwrap_err();
    assert_eq!(e.rank, 0);
    assert_eq!(e.message, "bad batch");
}

#[test]
fn ranks_out_of_step_are_reported() {
    let e = run_local(2, T, |c: LocalComm| -> braid_comm::Result<()> {
        let mut x = t(vec![1.0; 2], &[2]);
        if c.rank() == 0 {
            c.all_reduce_sum(&mut x)
        } else {
            c.all_gather(&x).map(|_| ())
        }
    })
    .unwrap_err();
    assert!(e.message.contains("out of step"), "{e}");
}

#[test]
fn mismatched_shapes_are_errors() {
    let e = run_local(2, T, |c: LocalComm| -> braid_comm::Result<()> {
        let mut x = t(vec![1.0; 2 + c.rank()], &[2 + c.rank()]);
        c.all_reduce_sum(&mut x)
    })
    .unwrap_err();
    assert!(e.message.contains("shape"), "{e}");
}
