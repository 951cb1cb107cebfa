//! `SocketComm`: the ranks of a world as processes on CPU, over TCP — for development
//! and CI only (NCCL is the transport at scale).
//!
//! - **Deterministic, and the same bits as [`crate::local::LocalComm`].** Every reduction
//!   gathers the members' contributions and sums them in rank order on every rank, so a
//!   multi-process run matches the threads run bit for bit.
//! - **Nothing hangs.** A reader thread per peer drains its connection into per-group
//!   queues, so sends never block on a busy receiver. A peer whose connection closes (it
//!   exited, panicked, was killed) makes every wait on it fail at once, naming the rank and
//!   its host; a peer that stops answering (SIGSTOP) fails the wait after the timeout.
//! - **Set up through the rendezvous store**: each rank listens on a free port, publishes
//!   `host:port` under `socket/<rank>`, connects to the ranks below it and accepts the
//!   ones above; the connection opens with the connecting rank's number.
//!
//! Groups are keyed by their member list, as in `LocalComm` and NCCL communicators: the
//! members of a group call it in one program order, so one FIFO per (peer, group) pairs
//! every message with its receive.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use braid_kernels::Tensor;
use braid_kernels::tensor::CpuStorage;

use crate::store::StoreClient;
use crate::{CommError, Result};

mod collectives;
mod frame;

use frame::{Frame, encode_frame, read_frame};

/// Messages from one peer, by group, and whether the peer is gone (and why).
#[derive(Default)]
struct Inbox {
    queues: HashMap<u64, VecDeque<Frame>>,
    gone: Option<String>,
}

struct Peer {
    rank: usize,
    host: String,
    writer: Mutex<BufWriter<TcpStream>>,
    inbox: Mutex<Inbox>,
    arrived: Condvar,
    stream: TcpStream,
}

impl Peer {
    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The process's connections to every other rank of the world.
pub struct SocketWorld {
    rank: usize,
    size: usize,
    timeout: Duration,
    /// By world rank; `None` at this rank's own index.
    peers: Vec<Option<Arc<Peer>>>,
    hosts: Vec<String>,
}

impl fmt::Debug for SocketWorld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SocketWorld(rank {} of {})", self.rank, self.size)
    }
}

fn io_err(
    op: &'static str,
    rank: usize,
    size: usize,
    what: String,
) -> impl FnOnce(std::io::Error) -> CommError {
    move |e| CommError::Invalid {
        op,
        rank,
        size,
        msg: format!("{what}: {e}"),
    }
}

impl SocketWorld {
    /// Connects world rank `rank` of `size` to every other rank through `store`.
    /// `host` is how the other ranks reach this one (the address its store connection
    /// uses is a good choice). Every wait, here and in the collectives, is `timeout`.
    pub fn connect(
        store: &mut StoreClient,
        rank: usize,
        size: usize,
        host: &str,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        const OP: &str = "socket rendezvous";
        let io = |what: String| io_err(OP, rank, size, what);
        let store_err = |e: crate::store::StoreError| e.into_comm(OP, rank, size);
        let listener = TcpListener::bind((host, 0)).map_err(io(format!("listening on {host}")))?;
        let port = listener
            .local_addr()
            .map_err(io("reading the listener's port".into()))?
            .port();
        store
            .set(
                &format!("socket/{rank}"),
                crate::launch::host_port(host, port).as_bytes(),
            )
            .map_err(store_err)?;
        let mut hosts = vec![String::new(); size];
        hosts[rank] = host.to_string();
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        // Connect to the ranks below; they accept.
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let addr = store
                .wait(
                    &format!("socket/{peer}"),
                    timeout,
                    &format!("rank {peer} publishes its address"),
                )
                .map_err(store_err)?;
            let addr = String::from_utf8_lossy(&addr).into_owned();
            hosts[peer] = addr.rsplit_once(':').map_or(addr.clone(), |(h, _)| {
                h.trim_start_matches('[').trim_end_matches(']').to_string()
            });
            // A peer that is gone may have left because a rank failed (the peer itself,
            // whose abort may reach the store a moment after its listener closed): then
            // that failure is this rank's error, not the refused connection.
            let gone = |store: &mut StoreClient, e: std::io::Error, what: String| match store
                .aborted_within(Duration::from_secs(2))
            {
                Ok(Some(a)) => store_err(a),
                _ => io(what)(e),
            };
            // Bounded by the timeout: a firewall that drops packets would otherwise hold
            // this rank in the kernel's connect for minutes.
            let mut s = match connect_within(&addr, timeout) {
                Ok(s) => s,
                Err(e) => {
                    return Err(gone(
                        store,
                        e,
                        format!("connecting to rank {peer} at {addr}"),
                    ));
                }
            };
            let mut hello = GREETING.to_vec();
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            if let Err(e) = s.write_all(&hello) {
                return Err(gone(store, e, format!("greeting rank {peer}")));
            }
            *slot = Some(s);
        }
        // Accept the ranks above; each says who it is.
        listener
            .set_nonblocking(true)
            .map_err(io("listener".into()))?;
        let deadline = Instant::now() + timeout;
        let mut waiting = size - rank - 1;
        // A rank whose setup failed says so in the store: stop waiting for it then.
        let mut next_poll = Instant::now();
        while waiting > 0 {
            // Checked every turn: strays arriving back to back must not keep the loop from
            // its deadline.
            if Instant::now() >= deadline {
                let missing: Vec<usize> =
                    (rank + 1..size).filter(|&p| streams[p].is_none()).collect();
                return Err(CommError::Timeout {
                    op: OP,
                    rank,
                    group: (0..size).collect(),
                    waited_s: timeout.as_secs_f64(),
                    missing: format!("rank(s) {} never connected", crate::rank_list(&missing)),
                });
            }
            if Instant::now() >= next_poll {
                if let Some(e) = store.aborted().map_err(store_err)? {
                    return Err(store_err(e));
                }
                next_poll = Instant::now() + Duration::from_millis(200);
            }
            match listener.accept() {
                Ok((mut s, from)) => {
                    s.set_nonblocking(false)
                        .map_err(io("accepted socket".into()))?;
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        continue;
                    }
                    s.set_read_timeout(Some(left.min(GREETING_WAIT)))
                        .map_err(io("accepted socket".into()))?;
                    // A connection that is not a rank (a port scanner, a health check, a
                    // stray request) sends no greeting or another one: it is dropped and
                    // the ranks are still awaited.
                    let mut b = [0u8; GREETING.len() + 4];
                    if s.read_exact(&mut b).is_err() || b[..GREETING.len()] != GREETING[..] {
                        continue;
                    }
                    s.set_read_timeout(None)
                        .map_err(io("accepted socket".into()))?;
                    let mut r = [0u8; 4];
                    r.copy_from_slice(&b[GREETING.len()..]);
                    let peer = u32::from_le_bytes(r) as usize;
                    if peer <= rank || peer >= size || streams[peer].is_some() {
                        let msg = if streams.get(peer).is_some_and(Option::is_some) {
                            format!(
                                "two processes say they are rank {peer} ({} and {from}): each rank's RANK must be different",
                                hosts[peer]
                            )
                        } else {
                            format!("{from} says it is rank {peer}")
                        };
                        return Err(CommError::Invalid {
                            op: OP,
                            rank,
                            size,
                            msg,
                        });
                    }
                    hosts[peer] = from.ip().to_string();
                    streams[peer] = Some(s);
                    waiting -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                // A client that reset before it was accepted: not a rank's failure.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(io("accepting".into())(e)),
            }
        }
        let mut peers = Vec::with_capacity(size);
        for (p, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let reader = s.try_clone().map_err(io(format!("socket of rank {p}")))?;
            let writer = s.try_clone().map_err(io(format!("socket of rank {p}")))?;
            let peer = Arc::new(Peer {
                rank: p,
                host: hosts[p].clone(),
                writer: Mutex::new(BufWriter::new(writer)),
                inbox: Mutex::new(Inbox::default()),
                arrived: Condvar::new(),
                stream: s,
            });
            let rp = Arc::clone(&peer);
            std::thread::Builder::new()
                .name(format!("braid-socket-{p}"))
                .spawn(move || read_loop(reader, rp))
                .map_err(io("starting a reader thread".into()))?;
            peers.push(Some(peer));
        }
        Ok(Arc::new(SocketWorld {
            rank,
            size,
            timeout,
            peers,
            hosts,
        }))
    }

    /// Every rank's host, by world rank.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// Host of world rank `r`, for messages.
    pub fn host(&self, r: usize) -> &str {
        self.hosts.get(r).map_or("?", String::as_str)
    }
}

impl Drop for SocketWorld {
    fn drop(&mut self) {
        for p in self.peers.iter().flatten() {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
    }
}

/// What a rank sends first on a connection to a lower rank, before its rank (u32 LE).
const GREETING: &[u8; 8] = b"braid-sk";
/// How long an accepted connection may take to greet before it is dropped as a stray.
const GREETING_WAIT: Duration = Duration::from_secs(10);

/// Connects to `addr` (`host:port`), each of its resolved addresses within `timeout`.
fn connect_within(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    let deadline = Instant::now() + timeout;
    for a in addr.to_socket_addrs()? {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "no address to connect to")
    }))
}

/// Reads frames until the connection ends, then marks the peer gone.
fn read_loop(stream: TcpStream, peer: Arc<Peer>) {
    let mut r = BufReader::new(stream);
    let why = loop {
        match read_frame(&mut r) {
            Ok(f) => {
                let mut inbox = peer.inbox();
                inbox.queues.entry(f.group).or_default().push_back(f);
                drop(inbox);
                peer.arrived.notify_all();
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break "its connection closed (the process exited or was killed)".to_string();
            }
            Err(e) => break format!("its connection failed: {e}"),
        }
    };
    peer.inbox().gone = Some(why);
    peer.arrived.notify_all();
}

/// FNV-1a of a member list: the group's key on the wire (same members, same key).
fn group_key(members: &[usize]) -> u64 {
    let bytes = members.iter().flat_map(|&m| (m as u64).to_le_bytes());
    fnv1a(0xcbf2_9ce4_8422_2325, bytes)
}

/// The key of channel `name` of the group keyed `key` ([`crate::Comm::channel`]): FNV-1a
/// on from the group's key over nine 0xff bytes (no rank's 8 bytes are all 0xff, so no
/// member list continues so) and the name.
fn channel_key(key: u64, name: &str) -> u64 {
    fnv1a(key, [0xffu8; 9].into_iter().chain(name.bytes()))
}

/// FNV-1a (64-bit) of `bytes`, from state `h`.
fn fnv1a(mut h: u64, bytes: impl IntoIterator<Item = u8>) -> u64 {
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// One group of a [`SocketWorld`]: the whole world or a subgroup.
#[derive(Clone)]
pub struct SocketComm {
    world: Arc<SocketWorld>,
    /// World ranks of the members, in group order.
    members: Vec<usize>,
    /// This rank's index in `members`.
    rank: usize,
    key: u64,
}

impl fmt::Debug for SocketComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SocketComm(rank {} of group {:?})",
            self.rank, self.members
        )
    }
}

impl SocketComm {
    /// The whole world as a group.
    pub fn world(world: Arc<SocketWorld>) -> Self {
        let members: Vec<usize> = (0..world.size).collect();
        let rank = world.rank;
        SocketComm {
            key: group_key(&members),
            world,
            members,
            rank,
        }
    }

    fn err(&self, op: &'static str, msg: impl Into<String>) -> CommError {
        CommError::Invalid {
            op,
            rank: self.world.rank,
            size: self.members.len(),
            msg: msg.into(),
        }
    }

    fn peer(&self, op: &'static str, member: usize) -> Result<&Arc<Peer>> {
        let w = *self.members.get(member).ok_or_else(|| {
            self.err(
                op,
                format!(
                    "rank {member} is not in this group of {}",
                    self.members.len()
                ),
            )
        })?;
        self.world
            .peers
            .get(w)
            .and_then(Option::as_ref)
            .ok_or_else(|| self.err(op, format!("no connection to world rank {w}")))
    }

    fn send_to(
        &self,
        op: &'static str,
        member: usize,
        dims: &[usize],
        data: &CpuStorage,
    ) -> Result<()> {
        let p = self.peer(op, member)?;
        let bytes = encode_frame(self.key, dims, data);
        let mut w = p.writer.lock().unwrap_or_else(|e| e.into_inner());
        w.write_all(&bytes)
            .and_then(|()| w.flush())
            .map_err(|e| self.gone(op, p, &format!("sending failed: {e}")))
    }

    fn gone(&self, op: &'static str, p: &Peer, why: &str) -> CommError {
        CommError::Poisoned {
            op,
            rank: self.world.rank,
            by: p.rank,
            why: format!("rank {} on {}: {why}", p.rank, p.host),
        }
    }

    fn recv_from(&self, op: &'static str, member: usize) -> Result<Frame> {
        let p = self.peer(op, member)?;
        let start = Instant::now();
        let mut inbox = p.inbox();
        loop {
            if let Some(f) = inbox
                .queues
                .get_mut(&self.key)
                .and_then(VecDeque::pop_front)
            {
                return Ok(f);
            }
            if let Some(why) = &inbox.gone {
                return Err(self.gone(op, p, why));
            }
            let waited = start.elapsed();
            if waited >= self.world.timeout {
                return Err(CommError::Timeout {
                    op,
                    rank: self.world.rank,
                    group: self.members.clone(),
                    waited_s: waited.as_secs_f64(),
                    missing: format!(
                        "rank {} on {} sent nothing (stopped or hung?)",
                        p.rank, p.host
                    ),
                });
            }
            inbox = p
                .arrived
                .wait_timeout(inbox, self.world.timeout - waited)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Every member's `t` (this rank's own included, not sent), in member order.
    fn gather_all(&self, op: &'static str, t: &Tensor) -> Result<Vec<(Vec<usize>, CpuStorage)>> {
        let mine = t.to_host()?;
        for m in 0..self.members.len() {
            if m != self.rank {
                self.send_to(op, m, t.dims(), &mine)?;
            }
        }
        let mut all = Vec::with_capacity(self.members.len());
        for m in 0..self.members.len() {
            if m == self.rank {
                all.push((t.dims().to_vec(), mine.clone()));
            } else {
                let f = self.recv_from(op, m)?;
                if f.dims != t.dims() {
                    return Err(self.err(
                        op,
                        format!(
                            "rank {m} sent shape {:?}, this rank has {}",
                            f.dims,
                            t.shape()
                        ),
                    ));
                }
                all.push((f.dims, f.data));
            }
        }
        Ok(all)
    }
}
