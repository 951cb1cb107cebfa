//! `braid train` as processes that fail: a world size the launcher disagrees with, a
//! rank that panics, is killed, stops or cannot set up its share ends every process in
//! time, and the launcher names it.

use super::procs::launch;
use super::*;

#[test]
fn a_world_size_that_disagrees_with_the_launcher_is_named() {
    reference();
    let dir = fixture().join("runs/procs-bad-world");
    let t = Instant::now();
    let o = launch(
        2,
        &dir,
        &[
            "--set",
            "parallel.world_size=4",
            "--set",
            "parallel.llm.dp=2",
        ],
    )
    .output()
    .unwrap();
    assert!(!o.status.success());
    let out = text(&o);
    assert!(
        out.contains("parallel.world_size") && out.contains("started 2 processes"),
        "{out}"
    );
    assert!(out.contains("braid launch: rank"), "{out}");
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
}

/// A plan file for 4 GPUs under 2 launched processes: rank 0 names both counts before any
/// work, and the other rank stops with its message at once.
#[test]
fn a_plan_for_another_world_than_the_launched_one_is_named() {
    reference();
    let dir = fixture().join("runs/procs-bad-plan");
    let plan = fixture().join("plan-4.toml");
    std::fs::write(
        &plan,
        "gpus = 4\ncluster = \"h100\"\nstep_time_s = 1.0\nbaseline_step_time_s = 1.0\n[plan]\nplacement = \"colocated\"\nschedule = \"phased\"\nmicrobatches = 1\nrecompute = false\nrecompute_encoders = false\nzero1 = false\n[plan.llm]\ntp = 1\ncp = 1\npp = 1\ndp = 4\n",
    )
    .unwrap();
    let t = Instant::now();
    let set = format!("parallel.plan={}", plan.display());
    let o = launch(2, &dir, &["--set", &set]).output().unwrap();
    // Rank 0 exits 2 (a config error), rank 1 exits 1 with rank 0's message: whichever
    // the launcher sees first is its code.
    assert!(!o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(
        out.contains("parallel.plan")
            && out.contains("planned for 4 GPUs")
            && out.contains("started 2 processes"),
        "{out}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}

#[test]
fn a_rank_that_panics_ends_every_process_and_the_launcher_names_it() {
    reference();
    let dir = fixture().join("runs/procs-panic");
    let t = Instant::now();
    // Vision, audio, then the LLM's three replicas on ranks 2-4; rank 3 panics.
    let o = launch(
        5,
        &dir,
        &[
            "--set",
            "parallel.llm.dp=3",
            "--set",
            "fault.panic_at=3",
            "--set",
            "fault.panic_rank=3",
            "--set",
            "parallel.timeout_s=600",
        ],
    )
    .output()
    .unwrap();
    let took = t.elapsed();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(took < Duration::from_secs(60), "took {took:?}: {out}");
    assert!(
        out.contains("rank 3 panicked") && out.contains("fault injection"),
        "{out}"
    );
    // The others stopped because rank 3 went away, and said so.
    assert!(out.contains("rank 3 on 127.0.0.1"), "{out}");
    assert!(out.contains("braid launch: rank 3 failed first"), "{out}");
    assert_eq!(losses(&dir).len(), 2, "{out}");
}

/// The pid of the `braid train` process of world rank `rank` whose run dir is `dir`
/// (found through /proc: its command line names the dir, its environment the rank).
fn rank_pid(dir: &Path, rank: usize) -> Option<u32> {
    let want_dir = format!("run.dir={}", dir.display());
    let want_rank = format!("RANK={rank}");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmd = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if !cmd.contains(&want_dir) || !cmd.contains(" train ") || cmd.contains(" launch ") {
            continue;
        }
        let env = std::fs::read(entry.path().join("environ")).unwrap_or_default();
        if env.split(|&b| b == 0).any(|kv| kv == want_rank.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Launches 5 processes (vision, audio, 3 LLM replicas), waits until `steps` steps are in
/// metrics.jsonl, then sends `signal` to rank 3; returns the launcher's output, how long
/// it took from the signal to the launcher's exit, and its exit code.
fn launch_and_signal(
    name: &str,
    signal: &str,
    steps: usize,
    timeout_s: u32,
) -> (String, Duration, Option<i32>) {
    reference();
    let dir = fixture().join(format!("runs/{name}"));
    let timeout = format!("parallel.timeout_s={timeout_s}");
    let child = launch(
        5,
        &dir,
        &[
            "--set",
            "parallel.llm.dp=3",
            "--set",
            &timeout,
            "--set",
            "train.steps=400",
        ],
    )
    .spawn()
    .unwrap();
    super::procs::wait_for_steps(&dir, steps);
    let pid = rank_pid(&dir, 3).expect("rank 3's process");
    let k = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(k.success());
    let t = Instant::now();
    let o = child.wait_with_output().unwrap();
    let took = t.elapsed();
    // Only if that pid is still rank 3 of this run: once the launcher has killed and
    // reaped it, the pid may belong to another test's process (pid_max can be 32768).
    if signal == "-STOP" && rank_pid(&dir, 3) == Some(pid) {
        let _ = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .stderr(Stdio::null())
            .status();
    }
    (text(&o), took, o.status.code())
}

#[test]
fn a_rank_killed_with_sigkill_ends_every_process_naming_it() {
    let (out, took, code) = launch_and_signal("procs-kill9", "-9", 3, 600);
    assert_ne!(code, Some(0), "{out}");
    assert!(took < Duration::from_secs(60), "took {took:?}: {out}");
    assert!(
        out.contains("braid launch: rank 3 failed first (killed by signal 9)"),
        "{out}"
    );
    assert!(
        out.contains("rank 3 on 127.0.0.1"),
        "the other ranks name it: {out}"
    );
}

/// SIGTERM sent to one rank directly (a scheduler signalling the processes, not the
/// launcher): every rank stops after the same step with a checkpoint and exits 143, and
/// the launcher says so instead of blaming rank 0.
#[test]
fn sigterm_to_one_rank_stops_the_world_and_blames_nobody() {
    let (out, took, code) = launch_and_signal("procs-sigterm-one", "-TERM", 3, 600);
    assert_eq!(code, Some(143), "{out}");
    assert!(took < Duration::from_secs(60), "took {took:?}: {out}");
    assert!(
        out.contains("stopped on a signal sent to the ranks directly")
            && !out.contains("failed first"),
        "{out}"
    );
}

#[test]
fn a_stopped_rank_ends_every_process_after_the_timeout_naming_it() {
    let (out, took, code) = launch_and_signal("procs-sigstop", "-STOP", 3, 5);
    assert_ne!(code, Some(0), "{out}");
    // The others time out after parallel.timeout_s = 5 s; the launcher then kills the
    // stopped rank at once, not after its grace period (20 s in these tests): a stopped
    // process does nothing in it.
    assert!(took < Duration::from_secs(19), "took {took:?}: {out}");
    assert!(out.contains("rank 3 on 127.0.0.1 sent nothing"), "{out}");
    assert!(
        out.contains("braid launch: rank 3 is stopped (SIGSTOP)"),
        "{out}"
    );
    // Named as the launcher's own kill, not as an outside SIGKILL.
    assert!(
        out.contains("braid launch: rank 3 failed first (stopped or hung while the others failed, so braid launch killed it)"),
        "{out}"
    );
}

/// A rank that cannot set its share up (here the vision ranks: their Hugging Face file is
/// cut short) stops every process at once, and the others name it, instead of waiting in
/// the first step's collectives until the timeout.
#[test]
fn a_rank_that_cannot_set_up_its_share_stops_every_process_at_once() {
    reference();
    let hf = fixture().join("runs/broken-vision");
    let _ = std::fs::remove_dir_all(&hf);
    std::fs::create_dir_all(&hf).unwrap();
    let exported = fixture().join("runs/ref/hf/vision");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(exported.join(f), hf.join(f)).unwrap();
    }
    let weights = hf.join("model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap();
    file.set_len(len / 2).unwrap();
    let dir = fixture().join("runs/broken-setup");
    let init = format!("model.vision={{ init = \"hf:{}\" }}", hf.display());
    let t = Instant::now();
    let o = launch(4, &dir, &["--set", "parallel.llm.dp=2", "--set", &init])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(t.elapsed().as_secs() < 60, "took {:?}: {out}", t.elapsed());
    assert!(out.contains("rank(s) [0] could not set up"), "{out}");
    assert!(
        out.contains("model.safetensors"),
        "the vision rank says why: {out}"
    );
}

/// `kill -9` on `braid launch` (nothing left to forward a signal or relay output): every
/// rank gets SIGHUP from the kernel (its parent-death signal), finishes its step,
/// checkpoints and exits, instead of training on unsupervised. The kernel may send that
/// signal two or three times (once per launcher thread the rank is handed to while the
/// launcher dies): with SIGTERM, whose second arrival means "exit at once", the ranks
/// ended with no checkpoint in 2 of ~8 CI runs and 6 of 6 tries of `configs/tiny.toml`.
/// Three runs here, each must checkpoint.
#[test]
fn the_ranks_stop_when_their_launcher_is_killed() {
    reference();
    for attempt in 0..3 {
        launcher_killed(attempt);
    }
}

/// One run of [`the_ranks_stop_when_their_launcher_is_killed`]: panics if a rank outlives
/// the launcher, trains on, or wrote no checkpoint.
fn launcher_killed(attempt: usize) {
    let dir = fixture().join(format!("runs/procs-launcher-kill9-{attempt}"));
    let mut child = launch(3, &dir, &["--set", "train.steps=400"])
        .spawn()
        .unwrap();
    super::procs::wait_for_steps(&dir, 2);
    let ranks: Vec<u32> = (0..3)
        .map(|r| rank_pid(&dir, r).expect("a rank's process"))
        .collect();
    child.kill().unwrap(); // SIGKILL to the launcher only
    let _ = child.wait();
    let t = Instant::now();
    while ranks
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists())
    {
        if t.elapsed() > Duration::from_secs(60) {
            for p in &ranks {
                let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
            }
            panic!("the ranks outlived their launcher by 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let steps = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert!(
        steps < 400,
        "stopped early, not trained to the end: {steps} steps"
    );
    // They stopped as on a forwarded signal: with a checkpoint of the last step, and
    // each rank's log says why.
    let logs: Vec<String> = (0..3)
        .map(|r| {
            std::fs::read_to_string(dir.join(format!("logs/rank-{r}.log"))).unwrap_or_default()
        })
        .collect();
    let checkpointed = std::fs::read_dir(dir.join("checkpoints")).is_ok_and(|d| {
        d.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("step-"))
    });
    assert!(
        checkpointed,
        "attempt {attempt}: no checkpoint written on the way out; the ranks' logs:\n{}",
        logs.join("\n---\n")
    );
    for (r, log) in logs.iter().enumerate() {
        assert!(
            log.contains("stopped by SIGHUP"),
            "attempt {attempt}, rank {r}: {log}"
        );
    }
}

/// A world set up by hand with torchrun's variables in which one rank's setup fails on
/// its own, before the ranks connect: rank 2 told another WORLD_SIZE (its config check
/// fails), or rank 3 given another learning rate (the same-config check fails). That rank
/// says so in the store, and every other rank stops at once with its rank and message
/// and exit code 3 (it only followed), instead of waiting `parallel.timeout_s` for it.
#[test]
fn a_rank_whose_setup_fails_stops_the_others_at_once_naming_it() {
    reference();
    type Case<'a> = (&'a str, usize, &'a str, &'a str, i32, &'a str);
    let cases: [Case; 2] = [
        (
            "world",
            2,
            "WORLD_SIZE=3",
            "log.interval=1",
            2,
            "parallel.world_size: 3",
        ),
        (
            "lr",
            3,
            "WORLD_SIZE=4",
            "optim.lr=0.002",
            1,
            "rank 3 and rank 0 disagree on `optim.lr`: 0.002 here, 0.003 on rank 0",
        ),
    ];
    for (name, bad, bad_env, bad_set, bad_code, why) in cases {
        let dir = fixture().join(format!("runs/procs-setup-fails-{name}"));
        let port = super::procs::free_port().to_string();
        let t = Instant::now();
        let children: Vec<_> = (0..4)
            .map(|r| {
                let set = if r == bad { bad_set } else { "log.interval=1" };
                let world = if r == bad {
                    bad_env.trim_start_matches("WORLD_SIZE=")
                } else {
                    "4"
                };
                let sets = [
                    "--set",
                    "parallel.llm.dp=2",
                    "--set",
                    "parallel.timeout_s=300",
                    "--set",
                    "train.steps=4",
                    "--set",
                    set,
                ];
                super::procs::by_hand(&dir, &sets, r, world, &port)
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outs: Vec<_> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let took = t.elapsed();
        assert!(took < Duration::from_secs(60), "{name}: took {took:?}");
        for (r, o) in outs.iter().enumerate() {
            let out = text(o);
            assert!(out.contains(why), "{name}: rank {r}: {out}");
            if r == bad {
                assert_eq!(o.status.code(), Some(bad_code), "{name}: rank {r}: {out}");
            } else {
                assert_eq!(o.status.code(), Some(3), "{name}: rank {r}: {out}");
                assert!(
                    out.contains(&format!("rank {bad} failed: ")),
                    "{name}: rank {r}: {out}"
                );
            }
        }
    }
}

/// Rank 0 started alone (the others never come) with a config its world cannot run: it
/// names the problem and exits within seconds, not after keeping the store up the full
/// 30 s for ranks that never connected.
#[test]
fn rank_0_alone_with_a_bad_config_exits_in_seconds() {
    reference(); // the dataset is packed: only the setup's own checks are timed
    let dir = fixture().join("runs/procs-alone");
    let t = Instant::now();
    let o = train(&dir, &[])
        .env("RANK", "0")
        .env("WORLD_SIZE", "4")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", super::procs::free_port().to_string())
        .output()
        .unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(out.contains("parallel.world_size: 4"), "{out}");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "{:?}: {out}",
        t.elapsed()
    );
}

/// Two SLURM jobs on one node given one MASTER_PORT: a rank of the second that reaches
/// the first job's store stops at once, naming both jobs and what to change, instead of
/// joining a stranger's world; the first job's rank 0 is not disturbed by it.
#[test]
fn a_rank_that_reaches_another_jobs_store_stops_naming_both_jobs() {
    reference();
    let port = super::procs::free_port().to_string();
    let task = |dir: &Path, rank: &str, job: &str| {
        let mut c = train(dir, &["--set", "parallel.llm.dp=2"]);
        c.env("SLURM_PROCID", rank)
            .env("SLURM_NTASKS", "4")
            .env("SLURM_LOCALID", rank)
            .env("SLURM_JOB_NODELIST", "localhost")
            .env("SLURM_JOB_ID", job)
            .env("MASTER_PORT", &port);
        c
    };
    let mut first = task(&fixture().join("runs/job-a"), "0", "5001")
        .spawn()
        .unwrap();
    let t = Instant::now();
    let o = task(&fixture().join("runs/job-b"), "1", "5002")
        .output()
        .unwrap();
    let out = text(&o);
    let alive = first.try_wait().unwrap().is_none();
    let _ = first.kill();
    let _ = first.wait();
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(t.elapsed() < Duration::from_secs(60), "{out}");
    assert!(
        out.contains("rank 1 (SLURM job 5002)")
            && out.contains("belongs to SLURM job 5001")
            && out.contains("MASTER_PORT"),
        "{out}"
    );
    assert!(
        alive,
        "the first job's rank 0 ended when the stray rank left"
    );
}

/// `braid launch` arguments no world can start with are refused before any rank starts,
/// naming the flag, and so is a launch from inside a launched rank.
#[test]
fn launch_refuses_bad_arguments_and_nesting_before_starting_anything() {
    for (args, says) in [
        (vec!["--nproc-per-node", "0"], "--nproc-per-node >= 1"),
        (
            vec!["--nproc-per-node", "2", "--master-port", "0"],
            "--master-port",
        ),
        (vec!["--nproc-per-node", "2", "--grace-s=-1"], "--grace-s"),
        (
            vec!["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2"],
            "--node-rank < --nnodes",
        ),
    ] {
        let o = braid()
            .arg("launch")
            .args(&args)
            .args(["--", "train", "--config", "missing.toml"])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(text(&o).contains(says), "{args:?}: {}", text(&o));
        assert!(
            !text(&o).contains("[rank "),
            "no rank started: {}",
            text(&o)
        );
    }
    let o = braid()
        .env("BRAID_LAUNCH", "1")
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "train",
            "--config",
            "missing.toml",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("already a rank of a `braid launch`"),
        "{}",
        text(&o)
    );
}

/// A stray rank with no job id (another job's, started by hand on the same port) that
/// reaches the store of a `braid launch` world is refused at once, naming the launch's
/// own job id, and the world trains on. (Without the id it joined, failed the config
/// check and took the world down with it.)
#[test]
fn a_stray_rank_cannot_join_a_braid_launch_world() {
    reference();
    let port = super::procs::free_port().to_string();
    let dir = fixture().join("runs/launch-guarded");
    let _ = std::fs::remove_dir_all(&dir);
    let mut world = braid();
    world
        .args(["launch", "--nproc-per-node", "4", "--master-port", &port])
        .args(["--", "train", "--config", &config(), "--set"])
        .arg(format!("run.dir={}", dir.display()))
        .args(["--set", "parallel.llm.dp=2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Whoever runs the tests (srun cargo test, a torchrun shell) must not lend them a job.
    let jobs = ["BRAID_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"];
    for var in jobs {
        world.env_remove(var);
    }
    let world = world.spawn().unwrap();
    let mut stray = train(
        &fixture().join("runs/launch-stray"),
        &["--set", "parallel.llm.dp=2"],
    );
    for var in jobs {
        stray.env_remove(var);
    }
    let stray = stray
        .env("RANK", "1")
        .env("WORLD_SIZE", "4")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        // Torchrun's variables put the store on MASTER_PORT + 1: this one dials the
        // launch's.
        .env("BRAID_STORE_PORT", &port)
        .output()
        .unwrap();
    let out = text(&stray);
    let world = world.wait_with_output().unwrap();
    assert_eq!(stray.status.code(), Some(2), "{out}");
    assert!(
        out.contains("rank 1 (no job id)") && out.contains("belongs to job launch-"),
        "{out}"
    );
    assert!(world.status.success(), "{}", text(&world));
}
