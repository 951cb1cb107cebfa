//! `braid train` as one process per rank: through `braid launch` and through torchrun's
//! variables set by hand, the same losses bit for bit as the same layout on threads; a
//! rank that panics or is killed ends every process in time, and the launcher names it.

use super::*;

/// A port nobody listens on right now (the store of one test's world).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `braid launch --nproc-per-node n -- train ...` of the fixture's run into `dir`.
fn launch(n: usize, dir: &Path, extra: &[&str]) -> Command {
    let mut c = braid();
    c.args(["launch", "--nproc-per-node", &n.to_string(), "--master-port"])
        .arg(free_port().to_string())
        .args(["--grace-s", "20", "--", "train", "--config", &config(), "--set"])
        .arg(format!("run.dir={}", dir.display()))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
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
    assert!(out.contains("[rank 0]") && out.contains("processes over TCP"), "{out}");
    assert_eq!(logged(&procs), logged(&threads), "{name}: processes vs threads");
    assert!(procs.join("eval.json").exists() && procs.join("hf/llm").exists(), "{name}: rank 0 evaluates and exports");
}

#[test]
fn tensor_parallel_processes_match_threads_bit_for_bit() {
    threads_and_processes_agree("tp2", 2, &["parallel.llm.tp=2"]);
}

#[test]
fn disjoint_encoders_and_uneven_dp_processes_match_threads_bit_for_bit() {
    // Vision on rank 0, audio on rank 1, the LLM's two data-parallel replicas on 2-3.
    threads_and_processes_agree("disjoint4", 4, &["parallel.llm.dp=2"]);
}

#[test]
fn torchrun_variables_set_by_hand_train_like_threads() {
    reference();
    let threads = fixture().join("runs/pp2-threads");
    let o = train(&threads, &["--set", "parallel.world_size=2", "--set", "parallel.llm.pp=2"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let dir = fixture().join("runs/pp2-torchrun");
    let port = free_port().to_string();
    let children: Vec<_> = (0..2)
        .map(|r| {
            train(&dir, &["--set", "parallel.llm.pp=2"])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    assert_eq!(logged(&dir), logged(&threads));
}

#[test]
fn a_world_size_that_disagrees_with_the_launcher_is_named() {
    reference();
    let dir = fixture().join("runs/procs-bad-world");
    let t = Instant::now();
    let o = launch(2, &dir, &["--set", "parallel.world_size=4", "--set", "parallel.llm.dp=4"]).output().unwrap();
    assert!(!o.status.success());
    let out = text(&o);
    assert!(out.contains("parallel.world_size") && out.contains("started 2 processes"), "{out}");
    assert!(out.contains("braid launch: rank"), "{out}");
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
}

#[test]
fn a_rank_that_panics_ends_every_process_and_the_launcher_names_it() {
    reference();
    let dir = fixture().join("runs/procs-panic");
    let t = Instant::now();
    let o = launch(
        3,
        &dir,
        &["--set", "parallel.llm.dp=3", "--set", "fault.panic_at=3", "--set", "fault.panic_rank=2", "--set", "parallel.timeout_s=600"],
    )
    .output()
    .unwrap();
    let took = t.elapsed();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(took < Duration::from_secs(60), "took {took:?}: {out}");
    assert!(out.contains("rank 2 panicked") && out.contains("fault injection"), "{out}");
    // The others stopped because rank 2 went away, and said so.
    assert!(out.contains("rank 2 on"), "{out}");
    assert!(out.contains("braid launch: rank 2 failed first"), "{out}");
    assert_eq!(losses(&dir).len(), 2, "{out}");
}
