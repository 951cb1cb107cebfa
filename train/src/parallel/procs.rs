//! One process per rank: a world started by torchrun, SLURM or `braid launch`.
//!
//! The launcher's environment says which rank this process is
//! ([`braid_comm::launch::LaunchEnv`]); rank 0 serves the rendezvous store
//! ([`braid_comm::store`]). Rank 0 sets the run up first (it makes the datasets if
//! needed), the others after it; every rank then checks through the store that all
//! resolved the same config and see the same dataset, the ranks connect to each other
//! ([`SocketComm`]: TCP between CPU processes; [`NcclComm`] between GPU processes, each
//! on its local rank's GPU), and each trains its share ([`super::run::run_process`]). `parallel.world_size` comes from the
//! environment: a config that sets another value is an error naming both.

use std::sync::Arc;
use std::time::Duration;

use braid_comm::Comm;
use braid_comm::launch::LaunchEnv;
use braid_comm::nccl::NcclComm;
use braid_comm::socket::{SocketComm, SocketWorld};
use braid_comm::store::{StoreClient, StoreError, StoreServer};

use crate::config::RunConfig;
use crate::error::{Result, TrainError};
use crate::stop::StopFlag;
use crate::trainer::{Observer, RunSummary, Trainer};

/// How the processes talk, for the log and the summary (both transports).
pub const TRANSPORT: &str = "SocketComm (TCP) between CPU processes, for development and CI; \
     NcclComm (NCCL) between GPU processes";

/// The transport of a world on `parallel.device`, for the log and the summary.
pub fn transport(on_gpu: bool) -> &'static str {
    if on_gpu {
        "NcclComm: NCCL between GPU processes, one GPU each (LOCAL_RANK's)"
    } else {
        "SocketComm: TCP between CPU processes, for development and CI"
    }
}

/// This process's place in a world of processes, and its store connection.
#[derive(Debug)]
pub struct Processes {
    pub env: LaunchEnv,
    store: StoreClient,
    /// Rank 0 serves the store for as long as the run lasts.
    server: Option<StoreServer>,
}

fn store_err(e: braid_comm::store::StoreError) -> TrainError {
    TrainError::Other(e.to_string())
}

impl Processes {
    /// The world of the launcher's environment, or `None` (threads, as before).
    pub fn from_env() -> Result<Option<Self>> {
        let env = LaunchEnv::from_env().map_err(|e| {
            TrainError::Config(crate::config::invalid("environment", e.to_string()))
        })?;
        let Some(env) = env else { return Ok(None) };
        let server = if env.rank == 0 {
            resolves(&env)?;
            // Every interface of the address family MASTER_ADDR is in (an IPv6 literal:
            // IPv6, which Linux serves to IPv4 clients too).
            let any = if env.master_addr.contains(':') {
                "[::]"
            } else {
                "0.0.0.0"
            };
            Some(StoreServer::bind(&format!("{any}:{}", env.store_port)).map_err(store_err)?)
        } else {
            None
        };
        let mut store = connect(&env)?;
        same_job(&mut store, &env)?;
        Ok(Some(Processes { env, store, server }))
    }
}

/// This rank's connection to the rendezvous store. Rank 0 has just bound it on this
/// host, so a MASTER_ADDR that does not reach it within seconds names another host (or a
/// firewalled address): an error saying so, not the store's full wait in silence. The
/// other ranks wait for rank 0 up to `BRAID_STORE_TIMEOUT_S`, saying so after 10 s.
fn connect(env: &LaunchEnv) -> Result<StoreClient> {
    let addr = env.store_addr();
    if env.rank == 0 {
        return StoreClient::connect(&addr, env.store_timeout.min(Duration::from_secs(15)))
            .map_err(|e| {
                TrainError::Config(crate::config::invalid(
                    "environment",
                    format!(
                        "rank 0 serves the rendezvous store on this host, but cannot reach it at MASTER_ADDR={:?} ({addr}): set MASTER_ADDR (under SLURM, the job's first node) to an address of this host ({e})",
                        env.master_addr
                    ),
                ))
            });
    }
    let (rank, timeout) = (env.rank, env.store_timeout.as_secs_f64());
    StoreClient::connect_noting(&addr, env.store_timeout, Duration::from_secs(10), |waited| {
        eprintln!(
            "braid train: rank {rank}: still waiting for rank 0's rendezvous store at {addr} after {:.0} s (up to {timeout:.0} s, BRAID_STORE_TIMEOUT_S): is rank 0 running, and MASTER_ADDR/MASTER_PORT the same on every rank?",
            waited.as_secs_f64()
        );
    })
    .map_err(store_err)
}

/// Under SLURM, ranks that never connect are most often tasks never started: `braid
/// train` run in a batch script itself is one process of the job's SLURM_NTASKS.
fn never_started_hint(mut e: braid_comm::CommError, env: &LaunchEnv) -> braid_comm::CommError {
    if env.launcher == braid_comm::launch::Launcher::Slurm
        && let braid_comm::CommError::Timeout { missing, .. } = &mut e
        && missing.contains("never connected")
    {
        missing.push_str(
            " (under SLURM: were all SLURM_NTASKS tasks started with srun? `braid train` run in the batch script itself is one process)",
        );
    }
    e
}

/// The store key of the job rank 0 belongs to ("" where its launcher names none).
const JOB_KEY: &str = "!job";

/// Rank 0 posts its job; every other rank checks that the store it reached is its own
/// job's: two jobs on one node with one MASTER_PORT would otherwise mix their ranks.
fn same_job(store: &mut StoreClient, env: &LaunchEnv) -> Result<()> {
    let mine = env.job.clone().unwrap_or_default();
    if env.rank == 0 {
        return store.set(JOB_KEY, mine.as_bytes()).map_err(store_err);
    }
    let theirs = store
        .wait(
            JOB_KEY,
            env.store_timeout,
            "rank 0 names its job as soon as it serves the store",
        )
        .map_err(store_err)?;
    let theirs = String::from_utf8_lossy(&theirs);
    // Two named jobs must be the same. A rank with no id may still be this job's (a
    // node started over ssh lacks the SLURM job its first node saw), except at a store
    // that one machine's `braid launch` named: all of that world's ranks are the
    // launcher's children and carry its id. An empty BRAID_JOB_ID opts out.
    let opted_out = mine.is_empty() && std::env::var_os("BRAID_JOB_ID").is_some();
    let mismatch = if mine.is_empty() {
        braid_comm::launch::made_by_braid_launch(&theirs)
    } else {
        !theirs.is_empty() && theirs != mine.as_str()
    };
    if !opted_out && mismatch {
        let who = if mine.is_empty() {
            "no job id".to_string()
        } else {
            mine
        };
        return Err(TrainError::Config(crate::config::invalid(
            "environment",
            format!(
                "rank {} ({who}) reached the store at {}, which belongs to {theirs}: two jobs share a node and a port; give each job its own MASTER_PORT (or BRAID_STORE_PORT)",
                env.rank,
                env.store_addr()
            ),
        )));
    }
    Ok(())
}

/// Rank 0 dials its own store at MASTER_ADDR (so that the address it gives the others is
/// the one they reach it at): a name that does not resolve there is a config error within
/// seconds (DNS may lag a moment at a job's start), not the store's full wait.
fn resolves(env: &LaunchEnv) -> Result<()> {
    use std::net::ToSocketAddrs;
    let addr = env.store_addr();
    let start = std::time::Instant::now();
    loop {
        let found = addr.to_socket_addrs().and_then(|mut a| match a.next() {
            Some(_) => Ok(()),
            None => Err(std::io::Error::other("no address")),
        });
        match found {
            Ok(()) => return Ok(()),
            Err(e) if start.elapsed() >= Duration::from_secs(10) => {
                return Err(TrainError::Config(crate::config::invalid(
                    "environment",
                    format!(
                        "MASTER_ADDR={:?} does not resolve on rank 0, which serves the rendezvous store there ({e}): set it to this host's name or address",
                        env.master_addr
                    ),
                )));
            }
            Err(_) => {}
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Sets the run up as rank `env.rank` of the world and trains it.
/// A plan file sets the world size, and a launched world cannot take another: an error
/// naming both where they differ (rank 0 checks; the others stop with its message).
fn planned_world(cfg: &RunConfig, env: &LaunchEnv) -> Result<()> {
    let Some(spec) = cfg.parallel.plan.as_deref().filter(|s| *s != "auto") else {
        return Ok(());
    };
    let planned = crate::planning::PlanFile::read(std::path::Path::new(spec))?.gpus;
    if planned == env.world_size {
        return Ok(());
    }
    Err(TrainError::Config(crate::config::invalid(
        "parallel.plan",
        format!(
            "{spec} was planned for {planned} GPUs, but {} started {} processes: launch {planned}, or plan for {}",
            env.launcher, env.world_size, env.world_size
        ),
    )))
}

pub fn train(
    mut p: Processes,
    cfg: RunConfig,
    resume: bool,
    obs: &mut dyn Observer,
    stop: StopFlag,
) -> Result<RunSummary> {
    let (mut trainer, comm, described) = match set_up(&mut p, cfg, resume, obs) {
        Ok(t) => t,
        Err(e) => {
            p.fail_setup(&e);
            return Err(e);
        }
    };
    trainer.stop = stop;
    let mut summary = super::run::run_process(trainer, comm, obs)?;
    summary.world = Some(described);
    Ok(summary)
}

/// A store error of the setup: another rank's abort is that rank's failure, which this
/// one only follows ([`braid_comm::CommError::Poisoned`]: exit code 3 under a launcher).
fn setup_err(rank: usize) -> impl Fn(StoreError) -> TrainError {
    move |e| match e {
        StoreError::Aborted { .. } => TrainError::Comm(e.into_comm("setting the run up", rank, 0)),
        e => TrainError::Other(e.to_string()),
    }
}

impl Processes {
    /// After this rank's setup failed with `e`: a failure of its own is told to every
    /// rank through the store (their waits end at once with this rank's message instead
    /// of timing out); rank 0, which serves the store, keeps serving it until every rank
    /// has learned of the failure (at most 30 s).
    fn fail_setup(&mut self, e: &TrainError) {
        let followed = matches!(
            e,
            TrainError::Comm(
                braid_comm::CommError::Poisoned { .. } | braid_comm::CommError::Timeout { .. }
            )
        );
        let _ = if followed {
            self.store.abort_seen(1)
        } else {
            self.store.abort(self.env.rank, &e.to_string()).map(|_| 0)
        };
        let Some(server) = &self.server else { return };
        // Every rank has read it, or (after a few seconds for late starters) none but this
        // one is connected any more: no one is left to tell.
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            match self.store.abort_seen(0) {
                Ok(n) if n as usize >= self.env.world_size => break,
                Ok(_) if start.elapsed() > Duration::from_secs(3) && server.clients() <= 1 => {
                    break;
                }
                Ok(_) => std::thread::sleep(Duration::from_millis(50)),
                Err(_) => break,
            }
        }
    }
}

/// `text` (a TOML document or JSON) as dotted keys and their values, for
/// [`StoreClient::agree`]: ranks that differ are told the first key, not both documents.
fn flat_toml(text: &str) -> Result<Vec<(String, String)>> {
    fn walk(prefix: &str, v: &toml::Value, out: &mut Vec<(String, String)>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(&key, v, out);
                }
            }
            v => out.push((prefix.to_string(), v.to_string())),
        }
    }
    let table: toml::Table = text
        .parse()
        .map_err(|e| TrainError::Other(format!("the resolved config does not parse: {e}")))?;
    let mut out = Vec::new();
    walk("", &toml::Value::Table(table), &mut out);
    Ok(out)
}

/// Sets this rank up: rank 0 first (it makes the datasets if needed), then the others;
/// every rank checks that all resolved the same config and see the same dataset, and
/// the world connects. Returns the trainer, the world and its description.
fn set_up(
    p: &mut Processes,
    cfg: RunConfig,
    resume: bool,
    obs: &mut dyn Observer,
) -> Result<(Trainer, Arc<dyn Comm>, String)> {
    let env = p.env.clone();
    let store_err = setup_err(env.rank);
    cfg.parallel.check_device()?;
    let mut cfg = cfg;
    if cfg.parallel.world_size != 1 && cfg.parallel.world_size != env.world_size {
        return Err(TrainError::Config(crate::config::invalid(
            "parallel.world_size",
            format!(
                "{} in the config, but {} started {} processes (leave it unset under a launcher)",
                cfg.parallel.world_size, env.launcher, env.world_size
            ),
        )));
    }
    cfg.parallel.world_size = env.world_size;
    let timeout = Duration::from_secs_f64(cfg.parallel.timeout_s);
    let on_gpu = cfg.parallel.device == crate::config::Device::Cuda;
    let device = cfg.parallel.kernel_device();
    // Every rank's observer sees the run (the CLI's prints only on rank 0, but every rank
    // arms its signal handlers when training starts).
    const STATUS: &str = "setup/rank-0";
    let trainer = if env.rank == 0 {
        planned_world(&cfg, &env)?;
        let t = Trainer::new_rank(cfg, resume, obs, true, false)?;
        p.store.set(STATUS, b"ok").map_err(&store_err)?;
        t
    } else {
        obs.log(&format!(
            "rank {} of {}: waiting for rank 0 to set the run up",
            env.rank, env.world_size
        ));
        // Packing a dataset can take a while; a rank 0 that fails says so in the store
        // (the wait ends with its message), and one that dies ends it too (it serves
        // the store).
        p.store
            .wait(
                STATUS,
                env.setup_timeout,
                "rank 0 sets the run up (and packs the data if needed; BRAID_SETUP_TIMEOUT_S sets how long to wait)",
            )
            .map_err(&store_err)?;
        Trainer::new_rank(cfg, resume, obs, false, false)?
    };
    let mut entries = flat_toml(&trainer.config_toml)?;
    entries.push((
        "the dataset's shards (SHA-256 over dataset.json's list)".to_string(),
        trainer.data_fingerprint.clone(),
    ));
    entries.push((
        "the dataset's settings (dataset.json)".to_string(),
        trainer.data_json.clone(),
    ));
    p.store
        .agree("run", env.rank, &entries, timeout)
        .map_err(&store_err)?;
    let transport = transport(on_gpu);
    let (comm, hosts): (Arc<dyn Comm>, Vec<String>) = if on_gpu {
        // NCCL keeps a store connection of its own (ids of subgroups and channels).
        let store =
            StoreClient::connect(&env.store_addr(), env.store_timeout).map_err(&store_err)?;
        let host = p.store.local_ip().map_err(&store_err)?;
        let world = NcclComm::world(store, env.rank, env.world_size, device, timeout)?;
        (Arc::new(world), vec![host])
    } else {
        let host = p.store.local_ip().map_err(&store_err)?;
        let world = SocketWorld::connect(&mut p.store, env.rank, env.world_size, &host, timeout)
            .map_err(|e| never_started_hint(e, &env))?;
        let hosts = world.hosts().to_vec();
        (Arc::new(SocketComm::world(world)), hosts)
    };
    let mut hosts: Vec<&str> = hosts.iter().map(String::as_str).collect();
    hosts.sort_unstable();
    hosts.dedup();
    let described = format!(
        "{} processes ({}) on {}; {transport}",
        env.world_size,
        env.launcher,
        hosts.join(", ")
    );
    obs.log(&format!(
        "rank {} of {} ({}, store {}, {device}): {transport}",
        env.rank,
        env.world_size,
        env.launcher,
        env.store_addr()
    ));
    Ok((trainer, comm, described))
}
