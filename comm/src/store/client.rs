//! A rank's connection to the rendezvous store: set / get / wait / add, the barrier, the
//! same-config check and the abort of a rank whose setup failed.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::*;

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
        Self::connect_noting(addr, timeout, Duration::MAX, |_| {})
    }

    /// [`StoreClient::connect`], calling `on_slow` once with the time waited if no store
    /// has answered after `notice_after` (a rank says what it waits for instead of
    /// staying silent for the whole timeout).
    pub fn connect_noting(
        addr: &str,
        timeout: Duration,
        notice_after: Duration,
        mut on_slow: impl FnMut(Duration),
    ) -> Result<Self> {
        let start = Instant::now();
        let mut last_err = None;
        let mut noticed = false;
        while start.elapsed() < timeout {
            if !noticed && start.elapsed() >= notice_after {
                noticed = true;
                on_slow(start.elapsed());
            }
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
                hint: "the store did not answer: rank 0, which serves it, is stopped, overloaded or cut off, or another program that waits silently holds the port".into(),
            },
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe => StoreError::Io {
                addr,
                what: format!(
                    "{what} (the store closed the connection: rank 0, which serves it, exited or was killed; its log says why)"
                ),
                source,
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

    /// [`Self::aborted`], waiting up to `timeout` for an abort to come (the server holds
    /// the call until then, so nothing polls): for a rank that saw a peer vanish and asks
    /// whether it left because of a failure that is about to be posted.
    pub fn aborted_within(&mut self, timeout: Duration) -> Result<Option<StoreError>> {
        match self.wait(ABORT, timeout, "") {
            Ok(v) => Ok(Some(parse_abort(&v))),
            Err(e @ StoreError::Aborted { .. }) => Ok(Some(e)),
            Err(StoreError::Timeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
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
