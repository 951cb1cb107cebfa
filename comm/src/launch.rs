//! Which rank of which world this process is, from the launcher's environment:
//! torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`; `braid launch` sets the same ones) or SLURM's
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`, the first
//! host of `SLURM_JOB_NODELIST`). No such variable: `None`, a world of threads as before.

use std::fmt;

/// Where the world's description came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun, or `braid launch` (which sets torchrun's variables and `BRAID_LAUNCH=1`).
    Torchrun,
    Braid,
    Slurm,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Braid => "braid launch",
            Launcher::Slurm => "SLURM",
        })
    }
}

/// This process's place in a multi-process world.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub launcher: Launcher,
    pub rank: usize,
    pub world_size: usize,
    /// Rank on this machine: the GPU ordinal it uses.
    pub local_rank: usize,
    pub local_world_size: Option<usize>,
    /// Host of rank 0, which serves the rendezvous store.
    pub master_addr: String,
    /// The port the store listens on (see [`LaunchEnv::store_port`]).
    pub store_port: u16,
    /// How long a rank keeps dialing rank 0's store before giving up:
    /// `BRAID_STORE_TIMEOUT_S` (seconds, default [`DEFAULT_STORE_TIMEOUT_S`]); raise it
    /// where nodes start far apart (a slow container pull on rank 0's node).
    pub store_timeout: std::time::Duration,
    /// How long a rank waits for rank 0 to set the run up (pack the dataset when it is
    /// missing, check the config): `BRAID_SETUP_TIMEOUT_S` (seconds, default
    /// [`DEFAULT_SETUP_TIMEOUT_S`]); raise it where packing takes longer than an hour.
    pub setup_timeout: std::time::Duration,
    /// The job this rank belongs to, where the launcher names one ([`job_id`]): rank 0
    /// posts it in its store and every other rank checks it, so a rank that dialed
    /// another job's store (two jobs on one node, one port) stops naming both jobs
    /// instead of joining a stranger's world.
    pub job: Option<String>,
}

/// A launcher variable that is missing or malformed: names it and its value.
#[derive(Debug, thiserror::Error)]
#[error("launcher environment ({launcher}): {msg}")]
pub struct LaunchEnvError {
    pub launcher: &'static str,
    pub msg: String,
}

/// torch's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// How long a rank dials rank 0's store by default, in seconds.
pub const DEFAULT_STORE_TIMEOUT_S: f64 = 120.0;

/// How long a rank waits for rank 0 to set the run up by default, in seconds.
pub const DEFAULT_SETUP_TIMEOUT_S: f64 = 3600.0;

/// A duration variable: seconds in (0, `max`], `default` when unset.
struct Seconds {
    key: &'static str,
    default: f64,
    max: f64,
}

/// `BRAID_STORE_TIMEOUT_S`: up to a day.
const STORE_TIMEOUT: Seconds = Seconds {
    key: "BRAID_STORE_TIMEOUT_S",
    default: DEFAULT_STORE_TIMEOUT_S,
    max: 86_400.0,
};

/// `BRAID_SETUP_TIMEOUT_S`: up to a week (packing a large dataset).
const SETUP_TIMEOUT: Seconds = Seconds {
    key: "BRAID_SETUP_TIMEOUT_S",
    default: DEFAULT_SETUP_TIMEOUT_S,
    max: 604_800.0,
};

impl Seconds {
    fn read(
        &self,
        var: &impl Fn(&str) -> Option<String>,
        name: &'static str,
    ) -> Result<std::time::Duration, LaunchEnvError> {
        let Some(v) = var(self.key) else {
            return Ok(std::time::Duration::from_secs_f64(self.default));
        };
        match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s <= self.max => Ok(std::time::Duration::from_secs_f64(s)),
            _ => Err(err(
                name,
                format!(
                    "{}={v:?} is not a number of seconds in (0, {}]",
                    self.key, self.max
                ),
            )),
        }
    }
}

impl LaunchEnv {
    /// Reads this process's environment.
    pub fn from_env() -> Result<Option<Self>, LaunchEnvError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `var` (tests pass a map).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, LaunchEnvError> {
        if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            let braid = var("BRAID_LAUNCH").is_some_and(|v| v == "1");
            return torchrun(
                &var,
                if braid {
                    Launcher::Braid
                } else {
                    Launcher::Torchrun
                },
            )
            .map(Some);
        }
        if var("SLURM_PROCID").is_some() && var("SLURM_NTASKS").is_some() {
            return slurm(&var).map(Some);
        }
        Ok(None)
    }

    /// `host:port` of the rendezvous store.
    pub fn store_addr(&self) -> String {
        host_port(&self.master_addr, self.store_port)
    }
}

/// `host:port`, with an IPv6 literal in brackets (`[fd00::1]:29500`; bracketed already:
/// kept).
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn err(launcher: &'static str, msg: impl Into<String>) -> LaunchEnvError {
    LaunchEnvError {
        launcher,
        msg: msg.into(),
    }
}

/// The most ranks a world may have (a million GPUs): the per-rank tables rank 0 builds
/// stay small, and a mistyped WORLD_SIZE is an error, not an allocation.
pub const MAX_WORLD: usize = 1 << 20;

fn number(
    var: &impl Fn(&str) -> Option<String>,
    launcher: &'static str,
    key: &str,
) -> Result<Option<usize>, LaunchEnvError> {
    match var(key) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|e| {
            let why = match e.kind() {
                std::num::IntErrorKind::PosOverflow => "is far too large a count",
                _ => "is not a non-negative integer",
            };
            err(launcher, format!("{key}={v:?} {why}"))
        }),
    }
}

fn required(
    var: &impl Fn(&str) -> Option<String>,
    launcher: &'static str,
    key: &str,
    why: &str,
) -> Result<usize, LaunchEnvError> {
    number(var, launcher, key)?.ok_or_else(|| err(launcher, format!("{key} is not set ({why})")))
}

/// The store's port: `BRAID_STORE_PORT` if set; under torchrun `MASTER_PORT + 1`,
/// because torchrun's agent already serves its own c10d store on `MASTER_PORT`
/// (`TORCHELASTIC_USE_AGENT_STORE=True`) and Braid's store speaks its own protocol;
/// else `MASTER_PORT` (default 29500).
fn store_port(
    var: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
    name: &'static str,
) -> Result<u16, LaunchEnvError> {
    // Port 0 would bind an ephemeral port that no other rank can know.
    let parse = |key: &str, v: String| match v.trim().parse::<u16>() {
        Ok(0) => Err(err(
            name,
            format!("{key}=0: every rank must dial the same port; pick one from 1 to 65535"),
        )),
        Ok(p) => Ok(p),
        Err(_) => Err(err(name, format!("{key}={v:?} is not a port number"))),
    };
    if let Some(p) = var("BRAID_STORE_PORT") {
        return parse("BRAID_STORE_PORT", p);
    }
    let master = match var("MASTER_PORT") {
        Some(p) => parse("MASTER_PORT", p)?,
        None if launcher == Launcher::Slurm => slurm_port(var),
        None => DEFAULT_MASTER_PORT,
    };
    let agent_store =
        var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if launcher == Launcher::Torchrun || agent_store {
        return master
            .checked_add(1)
            .ok_or_else(|| err(name, format!("MASTER_PORT={master}: no port above it for Braid's store (set BRAID_STORE_PORT)")));
    }
    Ok(master)
}

/// The SLURM job a rank runs in: a heterogeneous job's leader (`SLURM_HET_JOB_ID`, older
/// releases `SLURM_PACK_JOB_ID`), else `SLURM_JOB_ID`.
fn slurm_job(var: &impl Fn(&str) -> Option<String>) -> Option<String> {
    ["SLURM_HET_JOB_ID", "SLURM_PACK_JOB_ID", "SLURM_JOB_ID"]
        .iter()
        .find_map(|k| clean(var(k)))
}

fn clean(v: Option<String>) -> Option<String> {
    v.map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// The job a world's ranks share, as far as the launcher says: `BRAID_JOB_ID` where set
/// (empty: no check); under SLURM's own launch its job and step (every task of a world
/// is in one step); under torchrun or `braid launch` torchrun's `--rdzv-id`
/// (`TORCHELASTIC_RUN_ID`, unless its default "none"), else the SLURM job alone (one
/// world's nodes may each be a step of their own: `srun -N1 ... torchrun` per node);
/// `None` where nothing names one.
pub fn job_id(var: &impl Fn(&str) -> Option<String>, launcher: Launcher) -> Option<String> {
    if let Some(v) = var("BRAID_JOB_ID") {
        return clean(Some(v)).map(|id| format!("job {id}"));
    }
    if launcher == Launcher::Slurm {
        let job = slurm_job(var)?;
        return Some(match clean(var("SLURM_STEP_ID")) {
            Some(step) => format!("SLURM job {job}.{step}"),
            None => format!("SLURM job {job}"),
        });
    }
    clean(var("TORCHELASTIC_RUN_ID"))
        .filter(|id| id != "none")
        .map(|id| format!("torchrun run {id}"))
        .or_else(|| slurm_job(var).map(|job| format!("SLURM job {job}")))
}

/// A fresh job id for one machine's `braid launch` world (its BRAID_JOB_ID): the launcher's
/// pid and the time, so two launches on one node never share one.
pub fn new_launch_job_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{LAUNCH_JOB}{}-{nanos}", std::process::id())
}

/// Whether `job` (as [`job_id`] names it) is one [`new_launch_job_id`] made: every rank of
/// such a world is that launcher's child and carries it.
pub fn made_by_braid_launch(job: &str) -> bool {
    job.strip_prefix("job ")
        .is_some_and(|id| id.starts_with(LAUNCH_JOB))
}

const LAUNCH_JOB: &str = "launch-";

/// Under SLURM without MASTER_PORT: a port from the job's id and step (10000-29999, below
/// Linux's ephemeral range), so that two jobs, or two steps of one, sharing a node do not
/// both take 29500; every task of the step sees the same ids. [`DEFAULT_MASTER_PORT`]
/// without a numeric job id. Another service on the port is refused by name at bind.
fn slurm_port(var: &impl Fn(&str) -> Option<String>) -> u16 {
    let Some(job) = slurm_job(var).and_then(|j| j.parse::<u64>().ok()) else {
        return DEFAULT_MASTER_PORT;
    };
    let step = clean(var("SLURM_STEP_ID"))
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(0);
    10_000 + (job.wrapping_add(step.wrapping_mul(7919)) % 20_000) as u16
}

fn check_rank(
    name: &'static str,
    rank: usize,
    world: usize,
    rank_key: &str,
    world_key: &str,
) -> Result<(), LaunchEnvError> {
    if world == 0 {
        return Err(err(
            name,
            format!("{world_key}=0: a world has at least one rank"),
        ));
    }
    if world > MAX_WORLD {
        return Err(err(
            name,
            format!("{world_key}={world}: more ranks than Braid runs (at most {MAX_WORLD})"),
        ));
    }
    if rank >= world {
        return Err(err(
            name,
            format!("{rank_key}={rank} is not below {world_key}={world}"),
        ));
    }
    Ok(())
}

fn torchrun(
    var: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
) -> Result<LaunchEnv, LaunchEnvError> {
    let name = if launcher == Launcher::Braid {
        "braid launch"
    } else {
        "torchrun"
    };
    let rank = required(var, name, "RANK", "WORLD_SIZE is")?;
    let world_size = required(var, name, "WORLD_SIZE", "RANK is")?;
    check_rank(name, rank, world_size, "RANK", "WORLD_SIZE")?;
    let local_rank = number(var, name, "LOCAL_RANK")?.unwrap_or(0);
    let local_world_size = number(var, name, "LOCAL_WORLD_SIZE")?;
    if let Some(l) = local_world_size
        && local_rank >= l
    {
        return Err(err(
            name,
            format!("LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={l}"),
        ));
    }
    let master_addr = var("MASTER_ADDR")
        .filter(|s| !s.trim().is_empty())
        .ok_or_else(|| {
            err(
                name,
                "MASTER_ADDR is not set (the host of rank 0, where the rendezvous store runs)",
            )
        })?;
    Ok(LaunchEnv {
        launcher,
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr: master_addr.trim().to_string(),
        store_port: store_port(var, launcher, name)?,
        job: job_id(var, launcher),
        store_timeout: STORE_TIMEOUT.read(var, name)?,
        setup_timeout: SETUP_TIMEOUT.read(var, name)?,
    })
}

fn slurm(var: &impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, LaunchEnvError> {
    const NAME: &str = "SLURM";
    let rank = required(var, NAME, "SLURM_PROCID", "SLURM_NTASKS is")?;
    let world_size = required(var, NAME, "SLURM_NTASKS", "SLURM_PROCID is")?;
    check_rank(NAME, rank, world_size, "SLURM_PROCID", "SLURM_NTASKS")?;
    let local_rank = number(var, NAME, "SLURM_LOCALID")?.unwrap_or(0);
    // "8", "8(x4)" or "2,1": the first node's count (every node of a homogeneous job).
    let local_world_size = match var("SLURM_NTASKS_PER_NODE") {
        None => None,
        Some(v) => {
            let head: String = v.trim().chars().take_while(char::is_ascii_digit).collect();
            Some(head.parse::<usize>().map_err(|_| {
                err(
                    NAME,
                    format!("SLURM_NTASKS_PER_NODE={v:?} does not start with a task count"),
                )
            })?)
        }
    };
    // The node count is not checked against SLURM_LOCALID or SLURM_NTASKS: `srun -n 2`
    // inside an allocation made with `--ntasks-per-node=8` inherits the allocation's 8.
    let master_addr = match var("MASTER_ADDR").filter(|s| !s.trim().is_empty()) {
        Some(a) => a.trim().to_string(),
        None => {
            let list = var("SLURM_JOB_NODELIST")
                .or_else(|| var("SLURM_NODELIST"))
                .ok_or_else(|| err(NAME, "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: no host for rank 0's store"))?;
            first_host(&list)
                .ok_or_else(|| err(NAME, format!("SLURM_JOB_NODELIST={list:?} names no host")))?
        }
    };
    Ok(LaunchEnv {
        launcher: Launcher::Slurm,
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        store_port: store_port(var, Launcher::Slurm, NAME)?,
        job: job_id(var, Launcher::Slurm),
        store_timeout: STORE_TIMEOUT.read(var, NAME)?,
        setup_timeout: SETUP_TIMEOUT.read(var, NAME)?,
    })
}

/// The first host of a SLURM host list: `node[01-04,07],gpu9` -> `node01`,
/// `rack[1-2]-n[3-4]` -> `rack1-n3`, `a,b` -> `a`. `None` for a list SLURM would not
/// write (an unclosed or stray bracket, a range that runs backwards or is not numeric,
/// blanks inside), so the error names SLURM_JOB_NODELIST rather than a host that does
/// not resolve.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let name_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_');
    let mut host = String::new();
    let mut chars = list.chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                let group: String = chars.by_ref().take_while(|&c| c != ']').collect();
                host.push_str(&first_of_group(&group)?);
            }
            c if name_char(c) => host.push(c),
            _ => return None,
        }
    }
    // The rest of the list must be well formed too (a stray bracket is a typo).
    let mut depth = 0i32;
    for c in list.chars() {
        depth += match c {
            '[' => 1,
            ']' => -1,
            _ => 0,
        };
        if !(0..=1).contains(&depth) {
            return None;
        }
    }
    (depth == 0 && !host.is_empty()).then_some(host)
}

/// The first value of a bracket group of a SLURM host list (`01-04,07` -> `01`): digits,
/// or a range of digits that does not run backwards; `None` otherwise.
fn first_of_group(group: &str) -> Option<String> {
    let first = group.split(',').next()?;
    let (lo, hi) = first.split_once('-').unwrap_or((first, first));
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(lo) || !digits(hi) || lo.parse::<u64>().ok()? > hi.parse::<u64>().ok()? {
        return None;
    }
    Some(lo.to_string())
}
