//! SocketComm, the CPU transport between processes (here: threads, each with its own
//! sockets, as separate processes would have): every collective against the same
//! references as LocalComm's tests and bitwise equal to LocalComm; subgroups; and the
//! failure paths — a peer that goes away fails every wait on it at once, naming it; one
//! that stays silent fails after the timeout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_comm::local::{LocalComm, run_local};
use braid_comm::socket::{SocketComm, SocketWorld};
use braid_comm::store::{StoreClient, StoreServer};
use braid_comm::{Comm, CommError};
use braid_kernels::{Device, Shape, Tensor};

fn data(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((r * 31 + i * 7) as f32).sin() * 10f32.powi((i % 5) as i32 - 2))
        .collect()
}

fn t(v: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims.to_vec(), Device::Cpu).unwrap()
}

/// Runs `body` on `size` ranks, each with its own store connection and sockets.
fn run_sockets<T: Send + 'static>(
    size: usize,
    timeout: Duration,
    body: impl Fn(SocketComm) -> braid_comm::Result<T> + Send + Sync + 'static,
) -> Vec<braid_comm::Result<T>> {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let body = Arc::new(body);
    let hs: Vec<_> = (0..size)
        .map(|r| {
            let (addr, body) = (addr.clone(), Arc::clone(&body));
            std::thread::spawn(move || {
                let mut store = StoreClient::connect(&addr, Duration::from_secs(10)).unwrap();
                let world = SocketWorld::connect(&mut store, r, size, "127.0.0.1", timeout)?;
                body(SocketComm::world(world))
            })
        })
        .collect();
    let out = hs.into_iter().map(|h| h.join().unwrap()).collect();
    drop(server);
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn all_reduce_is_bitwise_the_threads_result_on_every_size() {
    for size in [1, 2, 3, 5] {
        let f = |c: &dyn Comm| -> braid_comm::Result<Vec<f32>> {
            let mut x = t(data(c.rank(), 12), &[3, 4]);
            c.all_reduce_sum(&mut x)?;
            Ok(x.to_vec_f32()?)
        };
        let sockets = run_sockets(size, Duration::from_secs(20), move |c| f(&c));
        let threads = run_local(size, Duration::from_secs(20), move |c: LocalComm| f(&c)).unwrap();
        let mut want = [0f32; 12];
        for r in 0..size {
            want.iter_mut().zip(data(r, 12)).for_each(|(s, x)| *s += x);
        }
        for (r, got) in sockets.into_iter().enumerate() {
            let got = got.unwrap();
            assert_eq!(bits(&got), bits(&want), "size {size} rank {r}");
            assert_eq!(
                bits(&got),
                bits(&threads[r]),
                "size {size} rank {r} vs threads"
            );
        }
    }
}

#[test]
fn gather_scatter_broadcast_all_to_all_and_p2p() {
    let size = 4;
    let out = run_sockets(
        size,
        Duration::from_secs(20),
        |c| -> braid_comm::Result<_> {
            let r = c.rank();
            let g = c.all_gather(&t(data(r, 6), &[2, 3]))?;
            let rs = c.reduce_scatter_sum(&t(data(r, 8 * 3), &[8, 3]))?;
            let mut b = t(data(r, 5), &[5]);
            c.broadcast(&mut b, 2)?;
            // Ragged parts, including empty ones: rank r sends (r + j) % 3 rows to rank j.
            let parts = (0..c.size())
                .map(|j| {
                    t(
                        vec![(r * 10 + j) as f32; ((r + j) % 3) * 2],
                        &[(r + j) % 3, 2],
                    )
                })
                .collect();
            let got = c.all_to_all_v(parts)?;
            let a2a: Vec<(Vec<usize>, Vec<f32>)> = got
                .iter()
                .map(|x| (x.dims().to_vec(), x.to_vec_f32().unwrap()))
                .collect();
            // A ring of sends, several in flight: order kept per pair.
            let next = (r + 1) % c.size();
            let prev = (r + c.size() - 1) % c.size();
            for k in 0..3 {
                c.send(&t(vec![(r * 100 + k) as f32; 2], &[2]), next)?;
            }
            let mut ring = Vec::new();
            for _ in 0..3 {
                ring.push(c.recv(&Shape::new([2]), prev)?.to_vec_f32()?[0]);
            }
            let shape_err = c.barrier().and_then(|()| {
                if r == 0 {
                    c.send(&t(vec![1.0; 3], &[3]), 1)
                } else if r == 1 {
                    c.recv(&Shape::new([4]), 0).map(|_| ())
                } else {
                    Ok(())
                }
            });
            Ok((
                g.to_vec_f32()?,
                rs.to_vec_f32()?,
                b.to_vec_f32()?,
                a2a,
                ring,
                shape_err.is_err(),
            ))
        },
    );
    let gathered: Vec<f32> = (0..size).flat_map(|r| data(r, 6)).collect();
    let mut sum = [0f32; 24];
    for r in 0..size {
        sum.iter_mut().zip(data(r, 24)).for_each(|(s, x)| *s += x);
    }
    for (r, o) in out.into_iter().enumerate() {
        let (g, rs, b, a2a, ring, shape_err) = o.unwrap();
        assert_eq!(g, gathered);
        assert_eq!(bits(&rs), bits(&sum[r * 6..(r + 1) * 6]));
        assert_eq!(b, data(2, 5));
        for (j, (dims, v)) in a2a.into_iter().enumerate() {
            let rows = (j + r) % 3;
            assert_eq!(dims, vec![rows, 2], "rank {r} from {j}");
            assert!(v.iter().all(|&x| x == (j * 10 + r) as f32));
        }
        let prev = (r + size - 1) % size;
        assert_eq!(
            ring,
            (0..3).map(|k| (prev * 100 + k) as f32).collect::<Vec<_>>()
        );
        assert_eq!(
            shape_err,
            r == 1,
            "rank {r}: a shape mismatch is an error on the receiver"
        );
    }
}

#[test]
fn subgroups_run_side_by_side() {
    let out = run_sockets(4, Duration::from_secs(20), |c| -> braid_comm::Result<_> {
        let r = c.rank();
        // Two pairs {0, 2} and {1, 3}, and the pair reversed: [2, 0] is another group.
        let pair: Vec<usize> = if r % 2 == 0 { vec![0, 2] } else { vec![1, 3] };
        let g = c.subgroup(&pair)?;
        let mut x = t(vec![r as f32 + 1.0; 3], &[3]);
        g.all_reduce_sum(&mut x)?;
        let mut w = t(vec![1.0], &[1]);
        c.all_reduce_sum(&mut w)?;
        Ok((g.rank(), g.size(), x.to_vec_f32()?[0], w.to_vec_f32()?[0]))
    });
    for (r, o) in out.into_iter().enumerate() {
        let (gr, gs, x, w) = o.unwrap();
        assert_eq!((gr, gs), (r / 2, 2));
        assert_eq!(x, if r % 2 == 0 { 1.0 + 3.0 } else { 2.0 + 4.0 });
        assert_eq!(w, 4.0);
    }
}

/// A channel of a group ([`Comm::channel`]) queues its messages apart: a send on it, not
/// yet received while every member runs a collective on the group (and on a subgroup of
/// every member, keyed like the group), is not taken for the collective's. Sent on the
/// group itself, it would be.
#[test]
fn a_channel_keeps_its_messages_apart_from_the_groups_collectives() {
    for on_channel in [true, false] {
        let out = run_sockets(
            2,
            Duration::from_secs(20),
            move |c| -> braid_comm::Result<_> {
                let p2p = if on_channel {
                    c.channel("p2p")?
                } else {
                    Arc::new(c.clone())
                };
                let all = c.subgroup(&[0, 1])?;
                if c.rank() == 0 {
                    p2p.send(&t(vec![7.0; 5], &[5]), 1)?;
                }
                let mut x = t(vec![c.rank() as f32 + 1.0; 3], &[3]);
                all.all_reduce_sum(&mut x)?;
                c.all_reduce_sum(&mut x)?;
                let got = if c.rank() == 1 {
                    p2p.recv(&Shape::new([5]), 0)?.to_vec_f32()?
                } else {
                    Vec::new()
                };
                Ok((x.to_vec_f32()?, got))
            },
        );
        if on_channel {
            let (x1, got) = out[1].as_ref().unwrap();
            assert_eq!(out[0].as_ref().unwrap().0, vec![6.0; 3]);
            assert_eq!((x1.clone(), got.clone()), (vec![6.0; 3], vec![7.0; 5]));
        } else {
            assert!(out.iter().any(Result::is_err), "{out:?}");
        }
    }
}

#[test]
fn a_peer_that_goes_away_fails_every_wait_on_it_at_once() {
    let t0 = Instant::now();
    let out = run_sockets(3, Duration::from_secs(30), |c| -> braid_comm::Result<()> {
        if c.rank() == 1 {
            // "Dies": returns, dropping its sockets, without joining the collective.
            return Ok(());
        }
        let mut x = t(vec![1.0], &[1]);
        c.all_reduce_sum(&mut x)
    });
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "took {took:?}: the closed connection must end the wait"
    );
    for r in [0, 2] {
        let e = out[r].as_ref().unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, CommError::Poisoned { by: 1, .. }),
            "rank {r}: {msg}"
        );
        assert!(
            msg.contains("rank 1 on 127.0.0.1") && msg.contains("closed"),
            "rank {r}: {msg}"
        );
    }
}

#[test]
fn a_silent_peer_times_out_naming_it() {
    let t0 = Instant::now();
    let out = run_sockets(
        2,
        Duration::from_millis(700),
        |c| -> braid_comm::Result<()> {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_secs(2)); // hung, connection still open
                return Ok(());
            }
            let mut x = t(vec![1.0], &[1]);
            c.all_reduce_sum(&mut x)
        },
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
    let e = out[0].as_ref().unwrap_err();
    assert!(matches!(e, CommError::Timeout { .. }), "{e}");
    assert!(
        e.to_string().contains("rank 1 on 127.0.0.1 sent nothing"),
        "{e}"
    );
}

/// Two processes given the same RANK: rank 0 names the rank and both addresses at once,
/// and an abort on the store (what a failed rank leaves) ends the others' waits with it.
#[test]
fn two_processes_with_the_same_rank_are_named() {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let t = Instant::now();
    let hs: Vec<_> = [0usize, 1, 1]
        .into_iter()
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut store = StoreClient::connect(&addr, Duration::from_secs(10)).unwrap();
                let out =
                    SocketWorld::connect(&mut store, r, 3, "127.0.0.1", Duration::from_secs(20))
                        .map(|_| ());
                if let Err(e) = &out
                    && r == 0
                {
                    store.abort(0, &e.to_string()).unwrap();
                }
                (r, out)
            })
        })
        .collect();
    let outs: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    let (_, zero) = &outs[0];
    let msg = zero.as_ref().unwrap_err().to_string();
    assert!(msg.contains("two processes say they are rank 1"), "{msg}");
    for (r, out) in &outs[1..] {
        let e = out.as_ref().unwrap_err();
        assert!(
            matches!(e, CommError::Poisoned { by: 0, .. }),
            "rank {r}: {e}"
        );
    }
}

/// Connections on a rank's port that are not ranks (an HTTP request, a client that closes
/// at once) are dropped and the real rank is still awaited; a peer whose frame claims more
/// bytes than any tensor (2^61 elements) fails the collective at once, naming that rank,
/// instead of panicking a reader thread and leaving the wait to its timeout.
#[test]
fn strays_are_dropped_and_a_malformed_frame_names_its_rank() {
    use std::io::Write;
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr().to_string();
    let a0 = addr.clone();
    let zero = std::thread::spawn(move || {
        let mut store = StoreClient::connect(&a0, Duration::from_secs(10)).unwrap();
        let world =
            SocketWorld::connect(&mut store, 0, 2, "127.0.0.1", Duration::from_secs(30)).unwrap();
        let comm = SocketComm::world(world);
        let t0 = Instant::now();
        let mut x = t(vec![1.0; 4], &[4]);
        let e = comm.all_reduce_sum(&mut x).unwrap_err();
        (e.to_string(), t0.elapsed())
    });
    let mut store = StoreClient::connect(&addr, Duration::from_secs(10)).unwrap();
    let listen = store
        .wait("socket/0", Duration::from_secs(10), "rank 0's address")
        .unwrap();
    let listen = String::from_utf8(listen).unwrap();
    // Two strays, then a peer that greets as rank 1 and sends an impossible frame.
    let mut http = std::net::TcpStream::connect(&listen).unwrap();
    http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    drop(std::net::TcpStream::connect(&listen).unwrap());
    let mut fake = std::net::TcpStream::connect(&listen).unwrap();
    fake.write_all(b"braid-sk").unwrap();
    fake.write_all(&1u32.to_le_bytes()).unwrap();
    let mut frame = Vec::new();
    frame.extend_from_slice(&0u64.to_le_bytes()); // group
    frame.push(0); // f32
    frame.extend_from_slice(&1u32.to_le_bytes()); // one dimension
    frame.extend_from_slice(&(1u64 << 61).to_le_bytes());
    fake.write_all(&frame).unwrap();
    let (msg, took) = zero.join().unwrap();
    assert!(took < Duration::from_secs(10), "{took:?}: {msg}");
    assert!(
        msg.contains("rank 1") && msg.contains("malformed frame"),
        "{msg}"
    );
    drop(server);
}
