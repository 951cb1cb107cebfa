//! The rendezvous store: a TCP key-value store served by rank 0 (set / get / wait / add,
//! every wait with a timeout), on which the processes of a world meet — the start
//! barrier, NCCL unique ids per group, and the check that every rank resolved the same
//! config and dataset.
//!
//! Protocol (one request, one reply, on a connection a client keeps open): a request is
//! an opcode byte, then length-prefixed fields (`u32` little-endian length + bytes); a
//! reply is a status byte, then one length-prefixed field. Keys and values are bytes.
//! Like torch's c10d TCPStore in spirit, not wire-compatible with it: Braid's store
//! listens on `MASTER_PORT + 1` under torchrun, whose agent already serves its own store
//! on `MASTER_PORT` (see [`crate::launch`]).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What went wrong with the store, naming the address, the key and how long was waited.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("rendezvous store at {addr}: {what}: {source}")]
    Io {
        addr: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rendezvous store at {addr}: waited {waited_s:.1} s for `{key}`: {hint}")]
    Timeout {
        addr: String,
        key: String,
        waited_s: f64,
        hint: String,
    },
    #[error("rendezvous store at {addr}: {msg}")]
    Protocol { addr: String, msg: String },
    /// Ranks that disagree on what they run (config, dataset): names both.
    #[error("{0}")]
    Mismatch(String),
    /// Another rank's setup failed and it said so ([`StoreClient::abort`]): every wait
    /// ends at once with its rank and message instead of running into its timeout.
    #[error("rank {rank} failed: {why}")]
    Aborted { rank: usize, why: String },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

impl StoreError {
    /// As the error of collective `op` on world rank `rank` of `size`: another rank's
    /// abort is [`crate::CommError::Poisoned`] by that rank (this one only followed), the
    /// rest [`crate::CommError::Invalid`].
    pub fn into_comm(self, op: &'static str, rank: usize, size: usize) -> crate::CommError {
        match self {
            StoreError::Aborted { rank: by, why } => {
                crate::CommError::Poisoned { op, rank, by, why }
            }
            e => crate::CommError::Invalid {
                op,
                rank,
                size,
                msg: e.to_string(),
            },
        }
    }
}

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;

const ST_OK: u8 = 0;
const ST_MISSING: u8 = 1;
const ST_TIMEOUT: u8 = 2;
const ST_ABORTED: u8 = 3;

/// The key the first failing rank sets (`"{rank}\n{why}"`, [`StoreClient::abort`]):
/// while it is set, a wait for any other key answers with it ([`ST_ABORTED`]).
const ABORT: &str = "!abort";
/// Counts the ranks that called [`StoreClient::abort`]: the first one sets [`ABORT`].
const ABORT_CALLS: &str = "!abort/calls";
/// Counts the ranks that learned of the abort (see [`StoreClient::abort_seen`]).
const ABORT_SEEN: &str = "!abort/seen";

/// Largest field accepted (a config or an NCCL id is far smaller): a corrupt length
/// never makes the server allocate gigabytes.
const MAX_FIELD: u32 = 64 << 20;

#[derive(Default)]
struct State {
    map: HashMap<Vec<u8>, Vec<u8>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    /// Client connections open now.
    clients: std::sync::atomic::AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking connection thread leaves the map consistent (each update is one
        // insert), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The store's server (rank 0 runs one). Dropping it stops accepting connections.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Client connections open now (the serving rank's own included).
    pub fn clients(&self) -> usize {
        self.shared.clients.load(Ordering::SeqCst)
    }
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreServer({})", self.addr)
    }
}

impl StoreServer {
    /// Listens on `addr` (`0.0.0.0:29501`; port 0 picks a free one, see [`Self::addr`]).
    pub fn bind(addr: &str) -> Result<Self> {
        let io = |what: &str| {
            let (addr, what) = (addr.to_string(), what.to_string());
            move |source| StoreError::Io { addr, what, source }
        };
        let listener = TcpListener::bind(addr).map_err(io("binding (is the port in use?)"))?;
        let local = listener
            .local_addr()
            .map_err(io("reading the bound address"))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            clients: std::sync::atomic::AtomicUsize::new(0),
        });
        let acc_shared = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name("braid-store".into())
            .spawn(move || accept_loop(listener, acc_shared))
            .map_err(io("starting the server thread"))?;
        Ok(StoreServer {
            addr: local,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        // Wake the acceptor with a connection of our own, then let it go.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        let s = Arc::clone(&shared);
        // One thread per client: a world has one connection per rank.
        let _ = std::thread::Builder::new()
            .name("braid-store-conn".into())
            .spawn(move || serve(stream, s));
    }
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_field(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = read_u32(r)?;
    if n > MAX_FIELD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("field of {n} bytes (limit {MAX_FIELD})"),
        ));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// The [`StoreError::Aborted`] of an [`ABORT`] value (`"{rank}\n{why}"`).
fn parse_abort(v: &[u8]) -> StoreError {
    let text = String::from_utf8_lossy(v);
    let (rank, why) = text.split_once('\n').unwrap_or(("?", &text));
    StoreError::Aborted {
        rank: rank.parse().unwrap_or(usize::MAX),
        why: why.to_string(),
    }
}

fn write_field(w: &mut Vec<u8>, f: &[u8]) {
    w.extend_from_slice(&(f.len() as u32).to_le_bytes());
    w.extend_from_slice(f);
}

/// Serves one client until it disconnects (or sends garbage: the connection is closed).
fn serve(mut stream: TcpStream, shared: Arc<Shared>) {
    /// Counts the connection while it is served.
    struct Open(Arc<Shared>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.clients.fetch_sub(1, Ordering::SeqCst);
        }
    }
    shared.clients.fetch_add(1, Ordering::SeqCst);
    let _open = Open(Arc::clone(&shared));
    let _ = stream.set_nodelay(true);
    loop {
        let mut op = [0u8; 1];
        if stream.read_exact(&mut op).is_err() {
            return;
        }
        let reply = match handle(op[0], &mut stream, &shared) {
            Ok(r) => r,
            Err(_) => return,
        };
        if stream.write_all(&reply).is_err() {
            return;
        }
    }
}

fn handle(op: u8, stream: &mut TcpStream, shared: &Shared) -> std::io::Result<Vec<u8>> {
    let mut reply = Vec::new();
    match op {
        OP_SET => {
            let (k, v) = (read_field(stream)?, read_field(stream)?);
            shared.lock().map.insert(k, v);
            shared.changed.notify_all();
            reply.push(ST_OK);
            write_field(&mut reply, &[]);
        }
        OP_GET => {
            let k = read_field(stream)?;
            match shared.lock().map.get(&k) {
                Some(v) => {
                    reply.push(ST_OK);
                    write_field(&mut reply, v);
                }
                None => {
                    reply.push(ST_MISSING);
                    write_field(&mut reply, &[]);
                }
            }
        }
        OP_WAIT => {
            let k = read_field(stream)?;
            let t = read_field(stream)?;
            let ms = u64::from(u32::from_le_bytes(t.as_slice().try_into().map_err(
                |_| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "wait: timeout is not 4 bytes",
                    )
                },
            )?));
            let deadline = Instant::now() + Duration::from_millis(ms);
            let mut st = shared.lock();
            loop {
                if let Some(v) = st.map.get(&k) {
                    reply.push(ST_OK);
                    write_field(&mut reply, v);
                    break;
                }
                if let Some(why) = st.map.get(ABORT.as_bytes()) {
                    reply.push(ST_ABORTED);
                    write_field(&mut reply, why);
                    break;
                }
                let now = Instant::now();
                if now >= deadline || shared.stop.load(Ordering::SeqCst) {
                    reply.push(ST_TIMEOUT);
                    write_field(&mut reply, &[]);
                    break;
                }
                st = shared
                    .changed
                    .wait_timeout(st, deadline - now)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
        }
        OP_ADD => {
            let k = read_field(stream)?;
            let d = read_field(stream)?;
            let delta = i64::from_le_bytes(d.as_slice().try_into().map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "add: delta is not 8 bytes")
            })?);
            let mut st = shared.lock();
            let cur = st
                .map
                .get(&k)
                .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                .map_or(0, i64::from_le_bytes);
            let new = cur.wrapping_add(delta);
            st.map.insert(k, new.to_le_bytes().to_vec());
            drop(st);
            shared.changed.notify_all();
            reply.push(ST_OK);
            write_field(&mut reply, &new.to_le_bytes());
        }
        _ => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "unknown opcode",
            ));
        }
    }
    Ok(reply)
}

/// A client of the store: one connection, requests in turn (wrap it in a mutex to share).
#[derive(Debug)]
pub struct StoreClient {
    addr: String,
    stream: TcpStream,
}

impl StoreClient {
    /// Connects to `addr` (`host:port`), retrying until `timeout` (rank 0 may not be up
    /// yet when the others start).
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        let start = Instant::now();
        let mut last_err = None;
        while start.elapsed() < timeout {
            let addrs: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(a) => a.collect(),
                Err(e) => {
                    last_err = Some(e);
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            for a in addrs {
                match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                    Ok(stream) => {
                        let _ = stream.set_nodelay(true);
                        return Ok(StoreClient {
                            addr: addr.to_string(),
                            stream,
                        });
                    }
                    Err(e) => last_err = Some(e),
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(StoreError::Timeout {
            addr: addr.to_string(),
            key: "(connect)".into(),
            waited_s: start.elapsed().as_secs_f64(),
            hint: format!(
                "no store answered ({}); is rank 0 running, and MASTER_ADDR/MASTER_PORT the same on every rank? (BRAID_STORE_TIMEOUT_S sets how long to wait)",
                last_err.map_or("no address".into(), |e| e.to_string())
            ),
        })
    }

    /// An IO error of a call: a read that timed out says so, and who serves the store.
    fn io(&self, what: &str) -> impl FnOnce(std::io::Error) -> StoreError + use<> {
        let (addr, what) = (self.addr.clone(), what.to_string());
        let waited = self
            .stream
            .read_timeout()
            .ok()
            .flatten()
            .map_or(0.0, |d| d.as_secs_f64());
        move |source| {
            match source.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => StoreError::Timeout {
                addr,
                key: what,
                waited_s: waited,
                hint: "the store did not answer: rank 0, which serves it, is stopped, overloaded or cut off".into(),
            },
            _ => StoreError::Io { addr, what, source },
        }
        }
    }

    /// The error for a reply that is not the store's (its first byte `first`): another
    /// service listens on the store's port. Quotes the start of what it sent.
    fn not_a_store(&mut self, first: u8) -> StoreError {
        let mut head = vec![first];
        let _ = self
            .stream
            .set_read_timeout(Some(Duration::from_millis(200)));
        let mut more = [0u8; 63];
        if let Ok(n) = self.stream.read(&mut more) {
            head.extend_from_slice(&more[..n]);
        }
        let text: String = String::from_utf8_lossy(&head)
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        StoreError::Protocol {
            addr: self.addr.clone(),
            msg: format!(
                "the server there is not Braid's store (it answered {:?}): another service listens on that port; check MASTER_ADDR/MASTER_PORT (under torchrun, Braid's store is on MASTER_PORT + 1; BRAID_STORE_PORT sets it)",
                text.trim()
            ),
        }
    }

    /// Sends one request and reads its reply: (status, field).
    fn call(
        &mut self,
        op: u8,
        fields: &[&[u8]],
        what: &str,
        read_timeout: Option<Duration>,
    ) -> Result<(u8, Vec<u8>)> {
        let mut req = vec![op];
        for f in fields {
            write_field(&mut req, f);
        }
        self.stream
            .set_read_timeout(read_timeout)
            .map_err(self.io(what))?;
        self.stream.write_all(&req).map_err(self.io(what))?;
        let mut st = [0u8; 1];
        self.stream.read_exact(&mut st).map_err(self.io(what))?;
        if st[0] > ST_ABORTED {
            return Err(self.not_a_store(st[0]));
        }
        let v = read_field(&mut self.stream).map_err(self.io(what))?;
        Ok((st[0], v))
    }

    /// This end's IP address: how the store's host reaches this process, so the address
    /// to give the other ranks of a world.
    pub fn local_ip(&self) -> Result<String> {
        self.stream
            .local_addr()
            .map(|a| a.ip().to_string())
            .map_err(self.io("reading the local address"))
    }

    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        self.call(
            OP_SET,
            &[key.as_bytes(), value],
            &format!("set `{key}`"),
            Some(Duration::from_secs(60)),
        )?;
        Ok(())
    }

    /// The value of `key`, or `None` if no rank set it yet.
    pub fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        let (st, v) = self.call(
            OP_GET,
            &[key.as_bytes()],
            &format!("get `{key}`"),
            Some(Duration::from_secs(60)),
        )?;
        Ok((st == ST_OK).then_some(v))
    }

    /// Waits until `key` is set and returns its value; [`StoreError::Timeout`] after
    /// `timeout`, with `hint` (who was expected to set it) in the message.
    pub fn wait(&mut self, key: &str, timeout: Duration, hint: &str) -> Result<Vec<u8>> {
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let start = Instant::now();
        // The server answers by the deadline; the socket gives it a margin more.
        let (st, v) = self.call(
            OP_WAIT,
            &[key.as_bytes(), &ms.to_le_bytes()],
            &format!("wait for `{key}`"),
            Some(timeout + Duration::from_secs(10)),
        )?;
        match st {
            ST_OK => Ok(v),
            ST_ABORTED => Err(parse_abort(&v)),
            _ => Err(StoreError::Timeout {
                addr: self.addr.clone(),
                key: key.to_string(),
                waited_s: start.elapsed().as_secs_f64(),
                hint: hint.to_string(),
            }),
        }
    }

    /// Tells every rank that this one (`rank`) failed to set up, with `why`: their
    /// waits on this store end at once ([`StoreError::Aborted`]). Only the first
    /// rank's call counts (true); later ones change nothing (false). The caller also
    /// counts as having seen the abort ([`Self::abort_seen`]).
    pub fn abort(&mut self, rank: usize, why: &str) -> Result<bool> {
        let first = self.add(ABORT_CALLS, 1)? == 1;
        if first {
            self.set(ABORT, format!("{rank}\n{why}").as_bytes())?;
        }
        self.add(ABORT_SEEN, 1)?;
        Ok(first)
    }

    /// The abort of [`Self::abort`], if a rank has called it: for loops that wait on
    /// something other than the store (sockets, NCCL) and poll it.
    pub fn aborted(&mut self) -> Result<Option<StoreError>> {
        Ok(self.get(ABORT)?.map(|v| parse_abort(&v)))
    }

    /// Counts this rank among those that learned of the abort and returns how many
    /// have: rank 0, which serves the store, waits for the others before it exits, so
    /// that each reads the failing rank's message rather than a closed connection.
    pub fn abort_seen(&mut self, delta: i64) -> Result<i64> {
        self.add(ABORT_SEEN, delta)
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        let (_, v) = self.call(
            OP_ADD,
            &[key.as_bytes(), &delta.to_le_bytes()],
            &format!("add to `{key}`"),
            Some(Duration::from_secs(60)),
        )?;
        let b: [u8; 8] = v.as_slice().try_into().map_err(|_| StoreError::Protocol {
            addr: self.addr.clone(),
            msg: format!("add to `{key}`: the reply is {} bytes, not 8", v.len()),
        })?;
        Ok(i64::from_le_bytes(b))
    }

    /// Returns once all `world` ranks have called it with the same `name`, or fails after
    /// `timeout` naming the ranks that never arrived.
    pub fn barrier(
        &mut self,
        name: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<()> {
        self.set(&format!("{name}/arrived/{rank}"), b"1")?;
        let n = self.add(&format!("{name}/count"), 1)?;
        let done = format!("{name}/done");
        if n as usize == world {
            self.set(&done, b"1")?;
        }
        match self.wait(&done, timeout, "") {
            Ok(_) => Ok(()),
            Err(StoreError::Timeout {
                addr,
                key,
                waited_s,
                ..
            }) => {
                let mut missing = Vec::new();
                for r in 0..world {
                    if self.get(&format!("{name}/arrived/{r}"))?.is_none() {
                        missing.push(r.to_string());
                    }
                }
                Err(StoreError::Timeout {
                    addr,
                    key,
                    waited_s,
                    hint: format!("rank(s) {} never reached `{name}`", missing.join(", ")),
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Every rank publishes `entries` (name -> value: the resolved config's keys, the
    /// dataset's hash, ...) under `name` and checks them against rank 0's; the first key
    /// that differs is a [`StoreError::Mismatch`] naming both ranks and both values.
    pub fn agree(
        &mut self,
        name: &str,
        rank: usize,
        entries: &[(String, String)],
        timeout: Duration,
    ) -> Result<()> {
        let encode = |e: &[(String, String)]| {
            let mut out = Vec::new();
            for (k, v) in e {
                write_field(&mut out, k.as_bytes());
                write_field(&mut out, v.as_bytes());
            }
            out
        };
        self.set(&format!("{name}/{rank}"), &encode(entries))?;
        if rank == 0 {
            return Ok(());
        }
        let theirs = self.wait(
            &format!("{name}/0"),
            timeout,
            "rank 0 publishes what it runs",
        )?;
        let mut r = theirs.as_slice();
        let mut zero = Vec::new();
        while !r.is_empty() {
            let k = read_field(&mut r).map_err(|e| self.protocol(name, e))?;
            let v = read_field(&mut r).map_err(|e| self.protocol(name, e))?;
            zero.push((
                String::from_utf8_lossy(&k).into_owned(),
                String::from_utf8_lossy(&v).into_owned(),
            ));
        }
        for (k, v) in entries {
            match zero.iter().find(|(k0, _)| k0 == k) {
                Some((_, v0)) if v0 == v => {}
                Some((_, v0)) => {
                    return Err(StoreError::Mismatch(format!(
                        "rank {rank} and rank 0 disagree on `{k}`: {v} here, {v0} on rank 0 (every rank must run the same {name})"
                    )));
                }
                None => {
                    return Err(StoreError::Mismatch(format!(
                        "rank {rank} has `{k}` = {v}, which rank 0 does not have (every rank must run the same {name})"
                    )));
                }
            }
        }
        if let Some((k, v0)) = zero
            .iter()
            .find(|(k0, _)| !entries.iter().any(|(k, _)| k == k0))
        {
            return Err(StoreError::Mismatch(format!(
                "rank 0 has `{k}` = {v0}, which rank {rank} does not have (every rank must run the same {name})"
            )));
        }
        Ok(())
    }

    fn protocol(&self, name: &str, e: std::io::Error) -> StoreError {
        StoreError::Protocol {
            addr: self.addr.clone(),
            msg: format!("`{name}`: {e}"),
        }
    }
}

impl Drop for StoreClient {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
