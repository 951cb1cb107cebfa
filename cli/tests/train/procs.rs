//! `braid train` as one process per rank: through `braid launch`, torchrun (real, or its
//! variables set by hand) and SLURM's variables, the same losses bit for bit as the same
//! layout on threads, and checkpoints that move between process and thread worlds (the
//! failing worlds: `proc_failures.rs`).

use super::*;

/// A port nobody listens on, nor on the next one (the store of one test's world: ranks
/// started with torchrun's variables by hand serve it on MASTER_PORT + 1, beside
/// torchrun's own store), from 20,000-32,767: below Linux's ephemeral range
/// (32,768-60,999), so the kernel never hands either to another test's `bind(":0")` or
/// outgoing connection between our pick and the store binding it (a port learned from
/// `bind(":0")` and dropped could be, and once was: "Address already in use"). Each test
/// process starts at its own offset and steps by 2, so no two picks share a port.
pub(super) fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 20_000;
    const PAIRS: u32 = 6_384;
    let start = std::process::id().wrapping_mul(97) % PAIRS;
    let free = |port: u32| std::net::TcpListener::bind(("0.0.0.0", port as u16)).is_ok();
    for _ in 0..PAIRS {
        let port = LOW + 2 * ((start + NEXT.fetch_add(1, Ordering::Relaxed)) % PAIRS);
        if free(port) && free(port + 1) {
            return port as u16;
        }
    }
    panic!("no two free ports in a row in {LOW}..{}", LOW + 2 * PAIRS)
}

/// `braid launch --nproc-per-node n -- train ...` of the fixture's run into `dir`.
pub(super) fn launch(n: usize, dir: &Path, extra: &[&str]) -> Command {
    launch_at(n, dir, extra, "127.0.0.1")
}

/// `braid train` of the fixture's run into `dir` as rank `rank` of a world of `world`
/// (4 to a node) with torchrun's variables set by hand, the store on `port`.
pub(super) fn by_hand(dir: &Path, sets: &[&str], rank: usize, world: &str, port: &str) -> Command {
    let mut c = train(dir, sets);
    c.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world)
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", "4")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port);
    c
}

/// Every module over both of 2 ranks, data-parallel.
const COLOCATED_DP2: [&str; 8] = [
    "--set",
    "parallel.placement=\"colocated\"",
    "--set",
    "parallel.llm.dp=2",
    "--set",
    "parallel.vision.dp=2",
    "--set",
    "parallel.audio.dp=2",
];

/// [`launch`] with the store on `master_addr`.
fn launch_at(n: usize, dir: &Path, extra: &[&str], master_addr: &str) -> Command {
    let mut c = braid();
    c.args([
        "launch",
        "--nproc-per-node",
        &n.to_string(),
        "--master-addr",
        master_addr,
        "--master-port",
    ])
    .arg(free_port().to_string())
    .args([
        "--grace-s",
        "20",
        "--",
        "train",
        "--config",
        &config(),
        "--set",
    ])
    .arg(format!("run.dir={}", dir.display()))
    .args(extra)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

/// `sets` on 4 threads in `runs/NAME`: the run the process runs are compared with.
fn threads_run(name: &str, sets: &[&str]) -> PathBuf {
    let dir = fixture().join(format!("runs/{name}"));
    let o = train(
        &dir,
        &[&["--set", "parallel.world_size=4"][..], sets].concat(),
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{name}: {}", text(&o));
    dir
}

/// The layouts run on threads (world size `n`) and as `n` processes; both metrics.jsonl
/// must agree bit for bit (losses, grad norms, lr: every logged number but the timings).
fn threads_and_processes_agree(name: &str, n: usize, layout: &[&str]) {
    reference(); // the dataset is packed once, by the reference run
    let threads = fixture().join(format!("runs/{name}-threads"));
    let mut sets = vec!["--set".to_string(), format!("parallel.world_size={n}")];
    for l in layout {
        sets.extend(["--set".to_string(), l.to_string()]);
    }
    let sets_ref: Vec<&str> = sets.iter().map(String::as_str).collect();
    let o = train(&threads, &sets_ref).output().unwrap();
    assert!(o.status.success(), "{name} on threads: {}", text(&o));
    let procs = fixture().join(format!("runs/{name}-procs"));
    let o = launch(n, &procs, &sets_ref[2..]).output().unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{name} as processes: {out}");
    assert!(
        out.contains("[rank 0]")
            && out.contains("processes (SocketComm: TCP between CPU processes"),
        "{out}"
    );
    assert_eq!(
        logged(&procs),
        logged(&threads),
        "{name}: processes vs threads"
    );
    assert!(
        procs.join("eval.json").exists() && procs.join("hf/llm").exists(),
        "{name}: rank 0 evaluates and exports"
    );
    if layout.contains(&"log.trace=true") {
        // Every process wrote its timeline, and rank 0 merged them after all were there.
        let merged = braid_train::trace::read(&procs.join("trace/trace.json")).unwrap();
        let pids: std::collections::BTreeSet<usize> = merged
            .trace_events
            .iter()
            .filter(|e| e.ph == "X")
            .map(|e| e.pid)
            .collect();
        assert_eq!(pids, (0..n).collect(), "{name}: a row per process");
    }
}

#[test]
fn tensor_parallel_processes_match_threads_bit_for_bit() {
    // Vision on rank 0, audio on rank 1, the LLM in TP 2 on ranks 2-3 (the fixture's
    // LLM gets 2 KV heads and a vocabulary of 262 so that TP 2 divides both).
    threads_and_processes_agree(
        "tp2",
        4,
        &[
            "parallel.llm.tp=2",
            "model.llm.kv_heads=2",
            "model.llm.vocab=262",
        ],
    );
}

#[test]
fn disjoint_encoders_and_uneven_dp_processes_match_threads_bit_for_bit() {
    // Vision on rank 0, audio on rank 1, the LLM's two data-parallel replicas on 2-3.
    threads_and_processes_agree("disjoint4", 4, &["parallel.llm.dp=2"]);
}

#[test]
fn context_parallel_processes_match_threads_bit_for_bit() {
    // The LLM's tokens split over two CP ranks (2-3).
    threads_and_processes_agree("cp2", 4, &["parallel.llm.cp=2"]);
}

#[test]
fn pipelined_overlapped_and_interleaved_processes_match_threads_bit_for_bit() {
    // The overlapped schedule's point-to-point bridge and encoder 1F1B: vision in two
    // stages on ranks 0-1, audio on 2, the LLM in two stages on 3-4.
    threads_and_processes_agree(
        "overlapped5",
        5,
        &[
            "parallel.schedule=\"overlapped\"",
            "model.vision.num_layers=2",
            "model.llm.layers=2",
            "parallel.vision.pp=2",
            "parallel.llm.pp=2",
        ],
    );
    // Interleaved 1F1B: two model chunks a stage round a ring of two (ranks 2-3), with
    // 3 microbatches a replica (a partial group of stages).
    threads_and_processes_agree(
        "interleaved4",
        4,
        &[
            "model.llm.layers=4",
            "parallel.llm.pp=2",
            "parallel.llm.virtual_stages=2",
            "train.batch_rows=6",
            "train.microbatches=3",
        ],
    );
}

#[test]
fn colocated_processes_match_threads_bit_for_bit() {
    // Every module over all 4 ranks, each with its own layout.
    threads_and_processes_agree(
        "colocated4",
        4,
        &[
            "parallel.placement=\"colocated\"",
            "parallel.llm.dp=4",
            "parallel.vision.dp=4",
            "parallel.audio.tp=2",
            "parallel.audio.dp=2",
            "log.trace=true",
        ],
    );
}

/// Colocated and overlapped, a module group of every rank (the LLM's TP of 2, its CP of
/// 3) runs its collectives while the step's point-to-point messages are in flight
/// between the same ranks: those go on the world's own channel, or the collective took
/// them (a probe's crash). And interleaved LLM stages (two model chunks on each of 2
/// stages, 4 layers): every message between the two processes goes both ways round the
/// ring, the stages' and the bridge's, taken in the sender's order.
#[test]
fn colocated_overlapped_processes_match_threads_bit_for_bit() {
    // TP 2 needs 2 KV heads and an even vocabulary (as in the TP test above).
    let tp2: &[&str] = &[
        "parallel.llm.tp=2",
        "model.llm.kv_heads=2",
        "model.llm.vocab=262",
    ];
    for (name, n, llm) in [
        ("co-ov-tp2", 2, tp2),
        ("co-ov-cp3", 3, &["parallel.llm.cp=3"][..]),
        (
            "co-ov-pp2-v2",
            2,
            &[
                "parallel.llm.pp=2",
                "parallel.llm.virtual_stages=2",
                "model.llm.layers=4",
            ][..],
        ),
    ] {
        let (vision, audio) = (
            format!("parallel.vision.dp={n}"),
            format!("parallel.audio.dp={n}"),
        );
        let mut layout = vec![
            "parallel.placement=\"colocated\"",
            "parallel.schedule=\"overlapped\"",
            &vision,
            &audio,
            "train.microbatches=2",
        ];
        layout.extend_from_slice(llm);
        threads_and_processes_agree(name, n, &layout);
    }
}

#[test]
fn centric_processes_match_threads_bit_for_bit() {
    // Megatron's layout: the encoders inside the LLM's first stage (here every rank:
    // TP 2 x DP 2), vision at the LLM's TP and audio at TP 1, each microbatch's
    // embeddings exchanged among its replica's processes, some to the encoding rank
    // itself.
    threads_and_processes_agree(
        "centric4",
        4,
        &[
            "parallel.placement=\"centric\"",
            "parallel.llm.tp=2",
            "model.llm.kv_heads=2",
            "model.llm.vocab=262",
            "parallel.llm.dp=2",
            "parallel.vision.tp=2",
            "parallel.vision.dp=2",
            "parallel.audio.dp=4",
            "train.microbatches=2",
        ],
    );
}

#[test]
fn torchrun_variables_set_by_hand_train_like_threads() {
    reference();
    // The LLM in two pipeline stages (of one layer each) on ranks 2-3.
    let pp = ["--set", "parallel.llm.pp=2", "--set", "model.llm.layers=2"];
    let threads = threads_run("pp2-threads", &pp);
    let dir = fixture().join("runs/pp2-torchrun");
    let port = free_port().to_string();
    let children: Vec<_> = (0..4)
        .map(|r| by_hand(&dir, &pp, r, "4", &port).spawn().unwrap())
        .collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    assert_eq!(logged(&dir), logged(&threads));
}

/// Through the real torchrun (PyTorch's launcher: its c10d rendezvous, its agent's store
/// on MASTER_PORT, its environment), elastic and static rendezvous alike: the same numbers
/// bit for bit as threads. PyTorch is too heavy for CI, so this runs where torchrun is:
/// `BRAID_TORCHRUN=$(which torchrun) cargo test -p braid --test train real_torchrun -- --ignored`.
#[test]
#[ignore = "needs PyTorch's torchrun: set BRAID_TORCHRUN to its path"]
fn real_torchrun_trains_like_threads_bit_for_bit() {
    let torchrun = std::env::var("BRAID_TORCHRUN").expect("BRAID_TORCHRUN=path/to/torchrun");
    reference();
    let layout = ["--set", "parallel.llm.dp=2"];
    let threads = threads_run("torchrun-threads", &layout);
    let port = free_port().to_string();
    let endpoint = format!("127.0.0.1:{}", free_port());
    let rendezvous: [(&str, Vec<&str>); 2] = [
        (
            "elastic",
            vec!["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint],
        ),
        (
            "static",
            vec![
                "--nnodes",
                "1",
                "--node-rank",
                "0",
                "--master-addr",
                "127.0.0.1",
            ],
        ),
    ];
    for (name, args) in rendezvous {
        let dir = fixture().join(format!("runs/torchrun-{name}"));
        let mut c = Command::new(&torchrun);
        c.args(["--nproc-per-node", "4"]).args(&args);
        if name == "static" {
            c.args(["--master-port", &port]);
        }
        let o = c
            .args([
                "--no-python",
                env!("CARGO_BIN_EXE_braid"),
                "train",
                "--config",
                &config(),
            ])
            .arg("--set")
            .arg(format!("run.dir={}", dir.display()))
            .args(layout)
            .output()
            .unwrap();
        let out = text(&o);
        assert!(o.status.success(), "torchrun ({name}): {out}");
        assert!(out.contains("4 processes (torchrun)"), "{name}: {out}");
        assert_eq!(
            logged(&dir),
            logged(&threads),
            "torchrun ({name}) vs threads"
        );
    }
}

/// Through the real `srun` (a SLURM allocation of one node: its task environment, no
/// MASTER_ADDR or MASTER_PORT set by hand), the same numbers bit for bit as threads; a
/// `scancel` mid-run stops every task with a checkpoint (SLURM's SIGTERM) and exit 143.
/// Runs where SLURM is: `BRAID_SRUN=$(which srun) cargo test -p braid --test train
/// real_srun -- --ignored` (`--overcommit`: the 4 tasks may share fewer cores).
#[test]
#[ignore = "needs a SLURM cluster: set BRAID_SRUN to srun's path"]
fn real_srun_trains_like_threads_and_checkpoints_on_scancel() {
    let srun = std::env::var("BRAID_SRUN").expect("BRAID_SRUN=path/to/srun");
    // Inside an allocation srun starts a step, whose name `scancel --name` does not match.
    assert!(
        std::env::var("SLURM_JOB_ID").is_err(),
        "run this test outside a SLURM allocation (it submits its own job)"
    );
    reference();
    let layout = ["--set", "parallel.llm.dp=2"];
    let threads = threads_run("srun-threads", &layout);
    let run = |dir: &Path, extra: &[&str]| {
        let mut c = Command::new(&srun);
        c.args(["-n", "4", "--overcommit", "--kill-on-bad-exit=1"])
            .args(["--job-name", &format!("braid-test-{}", std::process::id())])
            .args([env!("CARGO_BIN_EXE_braid"), "train", "--config", &config()])
            .arg("--set")
            .arg(format!("run.dir={}", dir.display()))
            .args(layout)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let dir = fixture().join("runs/srun");
    let o = run(&dir, &[]).output().unwrap();
    let out = text(&o);
    assert!(o.status.success(), "srun: {out}");
    assert!(out.contains("4 processes (SLURM)"), "{out}");
    assert_eq!(logged(&dir), logged(&threads), "srun vs threads");

    // scancel: SLURM sends SIGTERM to every task (SIGKILL after KillWait).
    let dir = fixture().join("runs/srun-scancel");
    let (code, out) = {
        let child = run(&dir, &["--set", "train.steps=1000"]).spawn().unwrap();
        wait_for_steps(&dir, 2);
        let name = format!("braid-test-{}", std::process::id());
        let k = Command::new("scancel")
            .args(["--name", &name])
            .status()
            .unwrap();
        assert!(k.success(), "scancel --name {name}");
        let o = child.wait_with_output().unwrap();
        (o.status.code(), text(&o))
    };
    assert_eq!(code, Some(143), "srun after scancel: {out}");
    assert!(out.contains("stopped by SIGTERM"), "{out}");
    assert!(
        std::fs::read_dir(dir.join("checkpoints")).is_ok_and(|mut d| d.next().is_some()),
        "no checkpoint after scancel: {out}"
    );
}

#[test]
fn a_checkpoint_of_4_processes_resumes_on_5_and_2_processes_and_on_threads() {
    let want = reference();
    let four = [
        "--set",
        "parallel.llm.dp=2",
        "--set",
        "checkpoint.interval=0",
    ];
    for (name, resume_on) in [
        ("procs-resume-5", 5),
        ("procs-resume-2", 2),
        ("procs-resume-threads", 0),
    ] {
        let dir = fixture().join(format!("runs/{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        let (code, out) = terminate_after(launch(4, &dir, &four), &dir, 2);
        // Every rank checkpoints the same step and exits 128 + SIGTERM; so does the launcher,
        // which reports the signal, not a rank's failure.
        assert_eq!(code, Some(143), "{out}");
        assert!(
            out.contains("braid launch: stopped by SIGTERM, forwarded to this node's 4 rank(s)")
                && !out.contains("failed first"),
            "{out}"
        );
        let ckpts: Vec<_> = std::fs::read_dir(dir.join("checkpoints"))
            .unwrap()
            .flatten()
            .collect();
        assert_eq!(ckpts.len(), 1, "one committed checkpoint: {out}");
        let o = match resume_on {
            0 => train(
                &dir,
                &[
                    "--set",
                    "parallel.world_size=4",
                    "--set",
                    "parallel.llm.dp=2",
                    "--resume",
                ],
            )
            .output()
            .unwrap(),
            // Another world size: three LLM replicas instead of two.
            5 => launch(5, &dir, &["--set", "parallel.llm.dp=3", "--resume"])
                .output()
                .unwrap(),
            // Fewer processes than modules: every module over both, each its own layout.
            _ => launch(2, &dir, &[&COLOCATED_DP2[..], &["--resume"]].concat())
                .output()
                .unwrap(),
        };
        assert!(o.status.success(), "{name}: {}", text(&o));
        let got = losses(&dir);
        let steps: Vec<u64> = got.iter().map(|x| x.0).collect();
        assert_eq!(
            got.len(),
            want.losses.len(),
            "{name}: steps {steps:?}\n{out}\n{}",
            text(&o)
        );
        super::ranks::assert_close_runs(name, &got, &want.losses);
    }
}

/// `braid launch` over two "machines" (two launchers on this one, like torchrun's static
/// mode: `--nnodes 2 --node-rank K --master-addr A --master-port P`), and SLURM's
/// variables set by hand (what `srun` gives each task): the same numbers bit for bit as
/// the same layout on threads.
#[test]
fn two_node_launch_and_slurm_variables_train_like_threads() {
    reference();
    let layout = ["--set", "parallel.llm.dp=2"];
    let threads = threads_run("nodes-threads", &layout);

    let dir = fixture().join("runs/two-nodes");
    let port = free_port().to_string();
    let nodes: Vec<_> = (0..2)
        .map(|node| {
            let mut c = braid();
            c.args(["launch", "--nproc-per-node", "2", "--nnodes", "2"])
                .args(["--node-rank", &node.to_string()])
                .args(["--master-addr", "127.0.0.1", "--master-port", &port])
                .args(["--", "train", "--config", &config(), "--set"])
                .arg(format!("run.dir={}", dir.display()))
                .args(layout)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    for (node, c) in nodes.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "node {node}: {}", text(&o));
    }
    assert_eq!(logged(&dir), logged(&threads), "two nodes vs threads");

    let dir = fixture().join("runs/slurm");
    let port = free_port().to_string();
    let tasks: Vec<_> = (0..4)
        .map(|r| {
            train(&dir, &layout)
                .env("SLURM_PROCID", r.to_string())
                .env("SLURM_NTASKS", "4")
                .env("SLURM_LOCALID", r.to_string())
                .env("SLURM_NTASKS_PER_NODE", "4")
                .env("SLURM_JOB_NODELIST", "localhost")
                .env("MASTER_PORT", &port)
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, c) in tasks.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "task {r}: {}", text(&o));
    }
    assert_eq!(logged(&dir), logged(&threads), "SLURM tasks vs threads");
}

/// Starts `cmd`, sends SIGTERM to it (the launcher, which forwards it) once metrics.jsonl
/// in `dir` has `after` steps, and returns its exit code and output.
pub(super) fn terminate_after(mut cmd: Command, dir: &Path, after: usize) -> (Option<i32>, String) {
    let child = cmd.spawn().unwrap();
    wait_for_steps(dir, after);
    let k = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(k.success());
    let o = child.wait_with_output().unwrap();
    (o.status.code(), text(&o))
}

/// Returns once `dir`'s metrics.jsonl has `steps` lines; panics after 120 s without them.
pub(super) fn wait_for_steps(dir: &Path, steps: usize) {
    let t = Instant::now();
    while !std::fs::read_to_string(dir.join("metrics.jsonl"))
        .is_ok_and(|m| m.lines().count() >= steps)
    {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no progress in {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// MASTER_ADDR an IPv6 literal (`::1`): rank 0 serves the store on IPv6, the ranks' socket
/// addresses are bracketed, and the world trains the same numbers as over IPv4. Skipped
/// where the machine has no IPv6 loopback.
#[test]
fn a_world_over_ipv6_trains_like_one_over_ipv4() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("no IPv6 loopback here: skipped");
        return;
    }
    reference();
    let run = |name: &str, addr: &str| {
        let dir = fixture().join(format!("runs/{name}"));
        let o = launch_at(2, &dir, &COLOCATED_DP2, addr).output().unwrap();
        assert!(o.status.success(), "{name}: {}", text(&o));
        assert!(
            text(&o).contains(&format!("2 processes (braid launch) on {addr}")),
            "{name}: {}",
            text(&o)
        );
        logged(&dir)
    };
    assert_eq!(run("ipv6-procs", "::1"), run("ipv4-procs", "127.0.0.1"));
}
