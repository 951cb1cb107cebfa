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
use braid_comm::store::{StoreClient, StoreServer};

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
    _server: Option<StoreServer>,
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
            Some(StoreServer::bind(&format!("0.0.0.0:{}", env.store_port)).map_err(store_err)?)
        } else {
            None
        };
        let store =
            StoreClient::connect(&env.store_addr(), env.store_timeout).map_err(store_err)?;
        Ok(Some(Processes {
            env,
            store,
            _server: server,
        }))
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
    let env = p.env.clone();
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
    const SEEN: &str = "setup/seen";
    let mut trainer = if env.rank == 0 {
        match planned_world(&cfg, &env)
            .and_then(|()| Trainer::new_rank(cfg, resume, obs, true, false))
        {
            Ok(t) => {
                p.store.set(STATUS, b"ok").map_err(store_err)?;
                t
            }
            Err(e) => {
                let _ = p.store.set(STATUS, format!("error: {e}").as_bytes());
                // Keep serving the store until the other ranks have read the failure (at
                // most 30 s), so they stop with rank 0's message at once instead of
                // retrying to reach a store that is gone.
                let deadline = std::time::Instant::now() + Duration::from_secs(30);
                while std::time::Instant::now() < deadline {
                    match p.store.add(SEEN, 0) {
                        Ok(n) if n as usize + 1 >= env.world_size => break,
                        Ok(_) => std::thread::sleep(Duration::from_millis(50)),
                        Err(_) => break,
                    }
                }
                return Err(e);
            }
        }
    } else {
        let v = p
            .store
            .wait(
                STATUS,
                // Packing a dataset can take a while; a rank 0 that dies ends the wait at
                // once, since it serves the store.
                env.setup_timeout,
                "rank 0 sets the run up (and packs the data if needed; BRAID_SETUP_TIMEOUT_S sets how long to wait)",
            )
            .map_err(store_err)?;
        let _ = p.store.add(SEEN, 1);
        if v != b"ok" {
            // Rank 0's failure, not this rank's: a launcher names rank 0 (exit code 3 here).
            return Err(TrainError::Comm(braid_comm::CommError::Poisoned {
                op: "setting the run up",
                rank: env.rank,
                by: 0,
                why: String::from_utf8_lossy(&v).into_owned(),
            }));
        }
        Trainer::new_rank(cfg, resume, obs, false, false)?
    };
    trainer.stop = stop;
    let entries = [
        (
            "the resolved config".to_string(),
            trainer.config_toml.clone(),
        ),
        (
            "the dataset (dataset.json)".to_string(),
            trainer.data_json.clone(),
        ),
    ];
    p.store
        .agree("run", env.rank, &entries, timeout)
        .map_err(store_err)?;
    let transport = transport(on_gpu);
    let (comm, hosts): (Arc<dyn Comm>, Vec<String>) = if on_gpu {
        // NCCL keeps a store connection of its own (ids of subgroups and channels).
        let store =
            StoreClient::connect(&env.store_addr(), env.store_timeout).map_err(store_err)?;
        let host = p.store.local_ip().map_err(store_err)?;
        let world = NcclComm::world(store, env.rank, env.world_size, device, timeout)?;
        (Arc::new(world), vec![host])
    } else {
        let host = p.store.local_ip().map_err(store_err)?;
        let world = SocketWorld::connect(&mut p.store, env.rank, env.world_size, &host, timeout)?;
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
    let mut summary = super::run::run_process(trainer, comm, obs)?;
    summary.world = Some(described);
    Ok(summary)
}
