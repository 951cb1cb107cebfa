//! The rendezvous store's server: rank 0 serves it, one thread per client connection.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::*;

#[derive(Default)]
struct State {
    map: HashMap<Vec<u8>, Vec<u8>>,
    /// Bytes of keys and values held.
    bytes: usize,
}

impl State {
    /// Sets `k` to `v`, keeping the store within [`MAX_STORE_BYTES`].
    fn put(&mut self, k: Vec<u8>, v: Vec<u8>) -> std::io::Result<()> {
        let freed = self.map.get(&k).map_or(0, |old| k.len() + old.len());
        let bytes = self.bytes - freed + k.len() + v.len();
        if bytes > MAX_STORE_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the store holds {MAX_STORE_BYTES} bytes at most"),
            ));
        }
        self.bytes = bytes;
        self.map.insert(k, v);
        Ok(())
    }
}

/// The most client connections served at once (a world has one or two per rank); past it
/// a connection is closed at once, so stray clients cannot pile up threads.
const MAX_CLIENTS: usize = 1 << 16;
/// The most bytes of keys and values the store holds (rendezvous data: addresses, NCCL
/// ids, config digests, is kilobytes per rank); a `set` past it closes that connection.
const MAX_STORE_BYTES: usize = 1 << 30;

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

/// Why `addr`'s port may be taken and what to do: another job's store, or (in the
/// kernel's ephemeral range, which it hands to outgoing connections) any connection
/// on the machine, which no earlier check could have seen.
fn port_in_use(addr: &str) -> String {
    let port = addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|x| x.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        });
    let mut what = "binding: the port is in use (another job's store on this machine? pick \
                    another MASTER_PORT / --master-port)"
        .to_string();
    if let (Some(p), Some((lo, hi))) = (port, range)
        && (lo..=hi).contains(&p)
    {
        what.push_str(&format!(
            "; {p} is in this machine's ephemeral range {lo}-{hi} \
             (net.ipv4.ip_local_port_range), which the kernel gives to outgoing \
             connections: a port below {lo} cannot be taken that way"
        ));
    }
    what
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
        let listener = TcpListener::bind(addr).map_err(|e| {
            let what = match e.kind() {
                std::io::ErrorKind::AddrInUse => port_in_use(addr),
                _ => "binding".to_string(),
            };
            io(&what)(e)
        })?;
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
        if shared.clients.load(Ordering::SeqCst) >= MAX_CLIENTS {
            continue;
        }
        let s = Arc::clone(&shared);
        // One thread per client: a world has one connection per rank.
        let _ = std::thread::Builder::new()
            .name("braid-store-conn".into())
            .spawn(move || serve(stream, s));
    }
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
            shared.lock().put(k, v)?;
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
            st.put(k, new.to_le_bytes().to_vec())?;
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
