//! The rendezvous store: set/get/wait/add between clients on threads (as ranks of
//! separate processes would use it over TCP), waits that time out naming the key and who
//! was missing, the barrier, and the same-config check naming the rank and the key.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use braid_comm::store::{StoreClient, StoreError, StoreServer};

fn server() -> (StoreServer, String) {
    let s = StoreServer::bind("127.0.0.1:0").expect("bind a free port");
    let addr = s.addr().to_string();
    (s, addr)
}

fn client(addr: &str) -> StoreClient {
    StoreClient::connect(addr, Duration::from_secs(5)).expect("connect")
}

#[test]
fn set_get_wait_and_add_across_clients() {
    let (_s, addr) = server();
    let mut a = client(&addr);
    let mut b = client(&addr);
    assert_eq!(a.get("k").unwrap(), None);
    a.set("k", b"value").unwrap();
    assert_eq!(b.get("k").unwrap().as_deref(), Some(&b"value"[..]));
    // A wait that another client satisfies later.
    let addr2 = addr.clone();
    let h = std::thread::spawn(move || {
        let mut c = client(&addr2);
        c.wait("late", Duration::from_secs(10), "the setter")
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(100));
    b.set("late", &[0, 1, 2, 255]).unwrap();
    assert_eq!(h.join().unwrap(), vec![0, 1, 2, 255]);
    // add is atomic across 8 clients x 50 increments.
    let hs: Vec<_> = (0..8)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut c = client(&addr);
                for _ in 0..50 {
                    c.add("n", 1).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(a.add("n", 0).unwrap(), 400);
    assert_eq!(a.add("n", -401).unwrap(), -1);
    // Large values (an NCCL id is 128 bytes; a resolved config a few KiB).
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    a.set("big", &big).unwrap();
    assert_eq!(b.wait("big", Duration::from_secs(1), "").unwrap(), big);
}

#[test]
fn a_wait_times_out_naming_the_key_and_the_hint() {
    let (_s, addr) = server();
    let mut a = client(&addr);
    let t = Instant::now();
    let e = a
        .wait(
            "nccl/id/tp-0",
            Duration::from_millis(300),
            "rank 0 makes the id",
        )
        .unwrap_err();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Timeout { .. }), "{msg}");
    assert!(
        msg.contains("nccl/id/tp-0") && msg.contains("rank 0 makes the id"),
        "{msg}"
    );
    // The connection still works after a timed-out wait.
    a.set("x", b"1").unwrap();
    assert!(a.get("x").unwrap().is_some());
}

#[test]
fn connecting_to_nothing_fails_in_time_with_a_hint() {
    // A port nobody listens on: bind one, learn it, drop the listener.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = Instant::now();
    let e =
        StoreClient::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(500)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
}

#[test]
fn clients_started_before_the_server_connect_once_it_is_up() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let a2 = addr.clone();
    let h = std::thread::spawn(move || {
        let mut c = StoreClient::connect(&a2, Duration::from_secs(10)).unwrap();
        c.wait("go", Duration::from_secs(10), "").unwrap()
    });
    std::thread::sleep(Duration::from_millis(300));
    let _s = StoreServer::bind(&addr).unwrap();
    client(&addr).set("go", b"now").unwrap();
    assert_eq!(h.join().unwrap(), b"now");
}

#[test]
fn a_port_in_use_is_named_with_what_to_do() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let e = StoreServer::bind(&format!("127.0.0.1:{port}")).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert!(
        msg.contains("in use") && msg.contains("--master-port"),
        "{msg}"
    );
    // Port 0 asks the kernel for a free port, which it takes from the ephemeral range.
    if std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").is_ok() {
        assert!(msg.contains("ephemeral range"), "{msg}");
    }
}

#[test]
fn barrier_waits_for_every_rank_and_names_the_missing_ones() {
    let (_s, addr) = server();
    let world = 4;
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                client(&addr).barrier("start", r, world, Duration::from_secs(10))
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap().unwrap();
    }
    // Ranks 1 and 3 never come.
    let addr = Arc::new(addr);
    let hs: Vec<_> = [0usize, 2]
        .into_iter()
        .map(|r| {
            let addr = Arc::clone(&addr);
            std::thread::spawn(move || {
                client(&addr).barrier("step-1", r, world, Duration::from_millis(400))
            })
        })
        .collect();
    for h in hs {
        let e = h.join().unwrap().unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("rank(s) 1, 3 never reached `step-1`"), "{msg}");
    }
}

#[test]
fn ranks_that_resolved_different_configs_are_named_with_the_key() {
    let (_s, addr) = server();
    let entries = |lr: &str, hash: &str| {
        vec![
            ("optim.lr".to_string(), lr.to_string()),
            ("dataset.json sha256".to_string(), hash.to_string()),
        ]
    };
    let t = Duration::from_secs(5);
    client(&addr)
        .agree("config", 0, &entries("0.001", "ab12"), t)
        .unwrap();
    client(&addr)
        .agree("config", 1, &entries("0.001", "ab12"), t)
        .unwrap();
    let e = client(&addr)
        .agree("config", 2, &entries("0.001", "ff00"), t)
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(
            "rank 2 and rank 0 disagree on `dataset.json sha256`: ff00 here, ab12 on rank 0"
        ),
        "{msg}"
    );
    let e = client(&addr)
        .agree("config", 3, &entries("0.002", "ab12")[..1], t)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("`optim.lr`: 0.002 here, 0.001 on rank 0"),
        "{e}"
    );
}

/// A rank whose setup fails says so once: every wait of every other rank ends at once
/// with its rank and message (not after the wait's timeout), the first abort wins, and
/// the ranks that learned of it are counted (rank 0 waits for them before it exits).
#[test]
fn an_abort_ends_every_wait_at_once_naming_the_failed_rank() {
    let (_s, addr) = server();
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let e = client(&addr)
                    .wait(&format!("never/{i}"), Duration::from_secs(60), "nobody")
                    .unwrap_err();
                (e, t.elapsed())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut failed = client(&addr);
    assert!(failed.aborted().unwrap().is_none());
    assert!(failed.abort(2, "cannot read its share").unwrap());
    assert!(!client(&addr).abort(3, "a later failure").unwrap());
    for w in waiters {
        let (e, took) = w.join().unwrap();
        assert!(took < Duration::from_secs(5), "{took:?}");
        match &e {
            StoreError::Aborted { rank, why } => {
                assert_eq!((*rank, why.as_str()), (2, "cannot read its share"));
            }
            other => panic!("{other}"),
        }
        assert_eq!(e.to_string(), "rank 2 failed: cannot read its share");
        assert!(matches!(
            e.into_comm("setting the run up", 1, 4),
            braid_comm::CommError::Poisoned { by: 2, rank: 1, .. }
        ));
    }
    // A key already set is still read: only waits that would block end.
    let mut c = client(&addr);
    c.set("there", b"1").unwrap();
    assert_eq!(c.wait("there", Duration::from_secs(1), "").unwrap(), b"1");
    assert!(matches!(
        c.aborted().unwrap(),
        Some(StoreError::Aborted { rank: 2, .. })
    ));
    // Both aborting ranks counted themselves; a follower adds itself.
    assert_eq!(c.abort_seen(0).unwrap(), 2);
    assert_eq!(c.abort_seen(1).unwrap(), 3);
}

#[test]
fn garbage_on_the_wire_closes_that_connection_only() {
    use std::io::Write;
    let (_s, addr) = server();
    let mut raw = std::net::TcpStream::connect(&addr).unwrap();
    // An unknown opcode, then a field that claims 4 GiB.
    raw.write_all(&[99, 0xff, 0xff, 0xff, 0xff]).unwrap();
    drop(raw);
    let mut raw = std::net::TcpStream::connect(&addr).unwrap();
    raw.write_all(&[1, 0xff, 0xff, 0xff, 0xff]).unwrap();
    drop(raw);
    let mut a = client(&addr);
    a.set("still", b"up").unwrap();
    assert_eq!(a.get("still").unwrap().as_deref(), Some(&b"up"[..]));
}

/// Another service on the store's port (an HTTP server, torch's TCPStore): the first
/// request fails at once saying so and quoting its answer, not with a field length read
/// out of its text.
#[test]
fn another_service_on_the_port_is_named_as_not_the_store() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let service = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut req = [0u8; 64];
        let _ = s.read(&mut req).unwrap();
        s.write_all(b"HTTP/1.0 400 Bad Request\r\nServer: SimpleHTTP/0.6\r\n\r\n")
            .unwrap();
        std::thread::sleep(Duration::from_millis(500));
    });
    let t = Instant::now();
    let e = client(&addr).set("run/0", b"x").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("not Braid's store") && msg.contains("HTTP/1.0 400 Bad Request"),
        "{msg}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    service.join().unwrap();
}

/// An abort set by something that is not a rank (a stray client writing `!abort` without
/// a rank) still ends the waits, and names "an unknown rank" rather than a huge number.
#[test]
fn an_abort_without_a_rank_names_an_unknown_rank() {
    let (_s, addr) = server();
    client(&addr)
        .set("!abort", b"junk-with-no-newline")
        .unwrap();
    let e = client(&addr)
        .wait("never", Duration::from_secs(5), "nobody")
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "an unknown rank failed: junk-with-no-newline"
    );
    let comm = e.into_comm("setting the run up", 1, 4).to_string();
    assert!(comm.contains("stopped: an unknown rank failed"), "{comm}");
}
