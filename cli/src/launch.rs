//! `braid launch`: starts the processes of one machine of a world (like torchrun's static
//! mode), each `braid <command>` with torchrun's variables set; prefixes every line with
//! its rank, forwards SIGINT/SIGTERM, and exits non-zero naming the first rank that
//! failed. Ranks that outlive a failed one by more than the grace period are killed.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Args;

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Processes on this machine (one per GPU on a GPU machine).
    #[arg(long)]
    nproc_per_node: usize,
    /// Machines in the world.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This machine's index, 0..nnodes (rank = node_rank * nproc_per_node + local rank).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Host of rank 0 (node 0), reachable from every machine.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store on the master (1-65535: every rank dials the same).
    #[arg(long, default_value_t = 29500, value_parser = clap::value_parser!(u16).range(1..))]
    master_port: u16,
    /// Seconds the other ranks may outlive a failed one before they are killed (they stop
    /// on their own as soon as they notice; this bounds a hung one).
    #[arg(long, default_value_t = 60.0)]
    grace_s: f64,
    /// The braid command each process runs, after `--` (e.g. `-- train --config RUN.toml`).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// Handlers for SIGINT and SIGTERM, which record the last one received and count them
/// (forwarded to every child by [`supervise`]).
fn register_signals() -> Signals {
    let signal = Arc::new(AtomicUsize::new(0));
    let count = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let (last, counter) = (Arc::clone(&signal), Arc::clone(&count));
        // SAFETY: the action only stores to and adds to atomics, which is
        // async-signal-safe (no allocation, no lock).
        let registered = unsafe {
            signal_hook::low_level::register(sig, move || {
                last.store(sig as usize, Ordering::SeqCst);
                counter.fetch_add(1, Ordering::SeqCst);
            })
        };
        if let Err(e) = registered {
            eprintln!("braid launch: cannot handle signal {sig}: {e}");
        }
    }
    Signals { signal, count }
}

/// The last stop signal received (0: none) and how many have come: a second one means
/// "stop now", as it does to `braid train`.
struct Signals {
    signal: Arc<AtomicUsize>,
    count: Arc<AtomicUsize>,
}

fn send_signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a child we started and have not reaped (its pid is still ours).
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

/// A rank whose launcher dies (`kill -9`, an OOM kill) gets SIGHUP, which `braid train`
/// takes as a Ctrl-C forwarded by a living launcher would be: it finishes its step,
/// checkpoints and exits, instead of training on unsupervised, its output going nowhere
/// (its own process group keeps the terminal's signals from reaching it directly).
/// SIGHUP, not SIGTERM: the kernel sends the parent-death signal each time the rank is
/// handed to another thread of the dying launcher (its relay threads), so a killed
/// launcher can send it two or three times, and a second SIGTERM means "exit at once,
/// no checkpoint" (every rank ended that way, exit 143, in 6 of 6 tries on 2 cores).
#[cfg(target_os = "linux")]
fn stop_with_parent(cmd: &mut Command) {
    // SAFETY: getpid(2) is async-signal-safe; called in the launcher, before the fork.
    let launcher = unsafe { libc::getpid() };
    let hook = move || {
        // SAFETY: signal(2), prctl(2) and getppid(2) are async-signal-safe system calls,
        // which is all a pre_exec hook may make between fork and exec; none touches our
        // memory.
        unsafe {
            // Under `nohup` SIGHUP arrives ignored: a launcher dying while the rank sets
            // up must still end it (braid train takes SIGHUP over once it trains).
            if libc::signal(libc::SIGHUP, libc::SIG_DFL) == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGHUP) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher died before the line above: the signal will not come.
            if libc::getppid() != launcher {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
        }
        Ok(())
    };
    // SAFETY: the hook only makes the async-signal-safe calls above (no allocation on
    // its success path, no locks).
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, hook);
    }
}

#[cfg(not(target_os = "linux"))]
fn stop_with_parent(_cmd: &mut Command) {}

/// Copies a child's output to ours, a line at a time, each prefixed with its rank.
fn relay(
    stream: impl std::io::Read + Send + 'static,
    rank: usize,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    let text = text.trim_end_matches(['\n', '\r']);
                    // A progress bar redraws with '\r': keep the last frame of the line.
                    let text = text.rsplit('\r').next().unwrap_or(text);
                    let out = format!("[rank {rank}] {text}\n");
                    if to_stderr {
                        let _ = std::io::stderr().lock().write_all(out.as_bytes());
                    } else {
                        let _ = std::io::stdout().lock().write_all(out.as_bytes());
                    }
                }
            }
        }
    })
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "an unknown status".into(),
    }
}

/// The longest grace period `--grace-s` takes (a day): waits are `Instant`s, which
/// overflow long before an infinite one.
const MAX_GRACE_S: f64 = 86_400.0;

/// The most ranks `braid launch` starts on one machine (one per GPU, or CPU ranks).
const MAX_NPROC_PER_NODE: usize = 1024;

pub fn run(args: LaunchArgs) -> ExitCode {
    // A rank of a launch starting a launch of its own: its ranks would fight the outer
    // world for the port and the GPUs.
    if std::env::var_os("BRAID_LAUNCH").is_some() {
        eprintln!(
            "braid launch: already a rank of a `braid launch` (BRAID_LAUNCH is set): give the inner command without `launch`"
        );
        return ExitCode::from(2);
    }
    if args.nproc_per_node == 0 || args.nnodes == 0 || args.node_rank >= args.nnodes {
        eprintln!(
            "braid launch: need --nproc-per-node >= 1 and --node-rank < --nnodes (got {}, {} of {})",
            args.nproc_per_node, args.node_rank, args.nnodes
        );
        return ExitCode::from(2);
    }
    // Each rank is a process with two relay threads here: thousands would exhaust the
    // machine's threads midway (an abort that leaves the started ranks behind).
    if args.nproc_per_node > MAX_NPROC_PER_NODE {
        eprintln!(
            "braid launch: --nproc-per-node {} is more than {MAX_NPROC_PER_NODE} processes on one machine",
            args.nproc_per_node
        );
        return ExitCode::from(2);
    }
    // Checked before any rank starts: nothing may fail once they run unsupervised.
    let Some(world) = args.nproc_per_node.checked_mul(args.nnodes) else {
        eprintln!(
            "braid launch: --nproc-per-node {} x --nnodes {} ranks overflow",
            args.nproc_per_node, args.nnodes
        );
        return ExitCode::from(2);
    };
    if !(0.0..=MAX_GRACE_S).contains(&args.grace_s) {
        eprintln!(
            "braid launch: --grace-s {}: must be from 0 to {MAX_GRACE_S} seconds",
            args.grace_s
        );
        return ExitCode::from(2);
    }
    let exe: PathBuf = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("braid launch: cannot find this executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    // One machine's world is all this launcher's children: a job id of its own keeps a
    // stray rank of another job on the same port out of its rendezvous (without one, a
    // rank with another config joined, failed the config check and took the world down).
    // Several machines' launchers share no id unless the user sets BRAID_JOB_ID.
    let job_id = match std::env::var_os("BRAID_JOB_ID") {
        None if args.nnodes == 1 => Some(braid_comm::launch::new_launch_job_id()),
        _ => None,
    };
    let signals = register_signals();
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut relays = Vec::new();
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&args.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", args.master_port.to_string())
            .env("BRAID_LAUNCH", "1")
            .envs(job_id.iter().map(|id| ("BRAID_JOB_ID", id)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Own process group: a Ctrl-C in the terminal reaches the launcher only, which
        // forwards it once to every rank.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        stop_with_parent(&mut cmd);
        match cmd.spawn() {
            Ok(mut child) => {
                if let Some(o) = child.stdout.take() {
                    relays.push(relay(o, rank, false));
                }
                if let Some(e) = child.stderr.take() {
                    relays.push(relay(e, rank, true));
                }
                children.push((rank, child));
            }
            Err(e) => {
                eprintln!("braid launch: cannot start rank {rank}: {e}");
                for (_, c) in &mut children {
                    let _ = c.kill();
                }
                return ExitCode::FAILURE;
            }
        }
    }
    let (failures, forwarded, killed) = supervise(
        &mut children,
        &signals,
        Duration::from_secs_f64(args.grace_s),
        args.node_rank == 0,
    );
    for r in relays {
        let _ = r.join();
    }
    let by_signal = |st: &ExitStatus| {
        use std::os::unix::process::ExitStatusExt;
        forwarded != 0
            && (st.code() == Some(128 + forwarded as i32) || st.signal() == Some(forwarded as i32))
    };
    if forwarded != 0 && failures.iter().all(|(_, st)| by_signal(st)) {
        // The user's Ctrl-C or the scheduler's SIGTERM, which every rank obeyed: not a
        // rank's failure. Exit as a process stopped by that signal would (128 + N).
        let name = match forwarded as i32 {
            libc::SIGINT => "SIGINT",
            libc::SIGTERM => "SIGTERM",
            _ => "a signal",
        };
        eprintln!(
            "braid launch: stopped by {name}, forwarded to this node's {} rank(s); {} stopped on it",
            args.nproc_per_node,
            if failures.is_empty() {
                "they all exited 0".to_string()
            } else {
                format!("{} of them", failures.len())
            }
        );
        return ExitCode::from(u8::try_from(128 + forwarded).unwrap_or(1));
    }
    // A stop signal sent to the ranks directly (a scheduler signalling the processes, not
    // the launcher): they agree on a last step, checkpoint and all exit 128 + N, which is
    // no rank's failure either.
    let stop_codes = [128 + libc::SIGHUP, 128 + libc::SIGINT, 128 + libc::SIGTERM];
    let code = failures.first().and_then(|(_, st)| st.code());
    if failures.len() == children.len()
        && code.is_some_and(|c| stop_codes.contains(&c))
        && failures.iter().all(|(_, st)| st.code() == code)
    {
        let code = code.unwrap_or(1);
        eprintln!(
            "braid launch: every rank of this node stopped on a signal sent to the ranks directly, not through the launcher (exit code {code}; their logs say where they checkpointed)"
        );
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    match first_failure(&failures) {
        None => ExitCode::SUCCESS,
        Some((rank, status)) => {
            let how = if killed.contains(&rank) {
                "stopped or hung while the others failed, so braid launch killed it".to_string()
            } else {
                describe(status)
            };
            eprintln!("braid launch: rank {rank} failed first ({how}); {world} rank(s) in all");
            let code = status.code().unwrap_or(1).clamp(1, 255);
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
    }
}

/// Whether process `pid` is stopped (Linux: state `T` or `t` in `/proc/<pid>/stat`);
/// false where that cannot be read.
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // `pid (comm) state ...`: comm may hold spaces and parentheses, so the state
            // follows the last ')'.
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace()
                .next()
                .map(|st| st == "T" || st == "t")
        })
        .unwrap_or(false)
}

/// The rank that failed first by itself: ranks that exit with
/// [`crate::train::PEER_FAILED`] only stopped because another one failed, so the first
/// other failure is named (a rank the launcher had to kill, when all the others merely
/// timed out waiting for it).
fn first_failure(failures: &[(usize, ExitStatus)]) -> Option<(usize, ExitStatus)> {
    let follower = |st: &ExitStatus| st.code() == Some(i32::from(crate::train::PEER_FAILED));
    failures
        .iter()
        .find(|(_, st)| !follower(st))
        .or(failures.first())
        .copied()
}

/// Waits for every child; returns the ranks that failed (rank, status) in the order they
/// ended, the signal forwarded to them (0: none) and the ranks it killed. After a failure
/// the rest get `grace` to end on their own, then SIGKILL; a stop signal is forwarded
/// (each rank finishes its step and checkpoints), and a second one too (ranks exit at
/// once on it), after which the rest are killed 5 s later. Where rank
/// 0, which serves the rendezvous store (`serves_store`: this is node 0), fails, the others
/// cannot learn of it from the store, so they get SIGTERM at once.
fn supervise(
    children: &mut [(usize, Child)],
    signals: &Signals,
    grace: Duration,
    serves_store: bool,
) -> (Vec<(usize, ExitStatus)>, usize, Vec<usize>) {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut failures: Vec<(usize, ExitStatus)> = Vec::new();
    let mut forwarded = 0usize;
    let mut forwarded_count = 0usize;
    let mut killed: Vec<usize> = Vec::new();
    let mut deadline: Option<Instant> = None;
    let signal_rest = |children: &[(usize, Child)], done: &[Option<ExitStatus>], sig: i32| {
        for ((_, c), d) in children.iter().zip(done) {
            if d.is_none() {
                send_signal(c, sig);
            }
        }
    };
    while done.iter().any(Option::is_none) {
        let sig = signals.signal.load(Ordering::SeqCst);
        let count = signals.count.load(Ordering::SeqCst);
        // One signal forwarded a turn: two arriving within one turn still reach the
        // ranks as two (the second means "exit at once" to them too).
        if sig != 0 && count > forwarded_count {
            signal_rest(children, &done, sig as i32);
            forwarded = sig;
            forwarded_count += 1;
            // The first lets every rank finish its step and checkpoint, however long
            // that takes; after the second, whatever still runs in 5 s is stuck.
            if forwarded_count >= 2 {
                let soon = Instant::now() + Duration::from_secs(5);
                deadline = Some(deadline.map_or(soon, |d| d.min(soon)));
            }
        }
        let mut store_lost = false;
        for (i, (rank, c)) in children.iter_mut().enumerate() {
            if done[i].is_some() {
                continue;
            }
            if let Ok(Some(st)) = c.try_wait() {
                done[i] = Some(st);
                if !st.success() {
                    if failures.is_empty() {
                        let soon = Instant::now() + grace;
                        deadline = Some(deadline.map_or(soon, |d| d.min(soon)));
                        // Not when it stopped on a forwarded signal (the others are
                        // stopping too), nor when it stopped for another rank's failure
                        // (that rank's own message says what happened).
                        let follower = st.code() == Some(i32::from(crate::train::PEER_FAILED));
                        store_lost = *rank == 0 && serves_store && forwarded == 0 && !follower;
                    }
                    failures.push((*rank, st));
                }
            }
        }
        if store_lost && done.iter().any(Option::is_none) {
            eprintln!(
                "braid launch: rank 0, which serves the rendezvous store, failed: stopping the others now (SIGTERM)"
            );
            signal_rest(children, &done, libc::SIGTERM);
        }
        // A rank stopped by SIGSTOP does nothing in the grace period (its
        // SIGTERM waits until it is continued): once another rank has failed, waiting
        // `--grace-s` for it only delays the verdict.
        if !failures.is_empty() {
            for (i, (rank, c)) in children.iter_mut().enumerate() {
                if done[i].is_none() && !killed.contains(rank) && is_stopped(c.id()) {
                    eprintln!(
                        "braid launch: rank {rank} is stopped (SIGSTOP) while another rank has failed: killing it now"
                    );
                    let _ = c.kill();
                    killed.push(*rank);
                }
            }
        }
        if let Some(d) = deadline
            && Instant::now() >= d
        {
            for (i, (rank, c)) in children.iter_mut().enumerate() {
                if done[i].is_none() {
                    eprintln!("braid launch: rank {rank} still running: killing it (--grace-s)");
                    let _ = c.kill();
                    killed.push(*rank);
                }
            }
            deadline = None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (failures, forwarded, killed)
}
