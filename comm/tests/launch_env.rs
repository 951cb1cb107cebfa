//! The launcher's environment: torchrun's variables, `braid launch`'s, SLURM's (host list
//! included), and a clear error naming the variable for every malformed or missing one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use braid_comm::launch::{LaunchEnv, Launcher, first_host};

fn env(pairs: &[(&str, &str)]) -> Result<Option<LaunchEnv>, String> {
    let m: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    LaunchEnv::from_vars(|k| m.get(k).cloned()).map_err(|e| e.to_string())
}

#[test]
fn no_launcher_variables_means_threads() {
    assert_eq!(env(&[]).unwrap(), None);
    assert_eq!(
        env(&[("PATH", "/bin"), ("SLURM_JOB_ID", "7")]).unwrap(),
        None
    );
}

#[test]
fn torchrun_variables() {
    let e = env(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "32"),
        ("LOCAL_RANK", "5"),
        ("LOCAL_WORLD_SIZE", "8"),
        ("MASTER_ADDR", "node01"),
        ("MASTER_PORT", "29400"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.launcher, Launcher::Torchrun);
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (5, 32, 5, Some(8))
    );
    // torchrun's agent serves its own store on MASTER_PORT: Braid's is on the next port.
    assert_eq!(e.store_addr(), "node01:29401");
    let e = env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "h"),
        ("BRAID_STORE_PORT", "40000"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.store_addr(), "h:40000");
    // An IPv6 literal gets brackets before the port (bracketed already: kept).
    for (addr, want) in [("fd00::1", "[fd00::1]:29501"), ("[::1]", "[::1]:29501")] {
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", addr)])
            .unwrap()
            .unwrap();
        assert_eq!(e.store_addr(), want);
    }
}

/// How long a rank dials rank 0's store (120 s) and waits for rank 0 to set the run up
/// (an hour: it may pack the data) unless `BRAID_STORE_TIMEOUT_S` / `BRAID_SETUP_TIMEOUT_S`
/// say otherwise; a value that is no positive number of seconds up to the key's limit is
/// refused by name, under every launcher.
#[test]
fn the_store_and_setup_timeouts_come_from_the_environment() {
    let torchrun = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")];
    let slurm = [
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "n[1-2]"),
    ];
    type Pick = fn(&LaunchEnv) -> Duration;
    let keys: [(&str, u64, &str, &str, Pick); 2] = [
        ("BRAID_STORE_TIMEOUT_S", 120, "86400", "(0, 86400]", |e| {
            e.store_timeout
        }),
        (
            "BRAID_SETUP_TIMEOUT_S",
            3600,
            "604800",
            "(0, 604800]",
            |e| e.setup_timeout,
        ),
    ];
    for base in [&torchrun[..], &slurm[..]] {
        for (key, default, max, range, pick) in keys {
            let with = |t: Option<&str>| {
                let mut v = base.to_vec();
                if let Some(t) = t {
                    v.push((key, t));
                }
                env(&v)
            };
            let e = with(None).unwrap().unwrap();
            assert_eq!(pick(&e), Duration::from_secs(default), "{key}");
            for (t, secs) in [("900", 900.0), (" 0.5 ", 0.5), (max, max.parse().unwrap())] {
                let e = with(Some(t)).unwrap().unwrap();
                assert_eq!(pick(&e), Duration::from_secs_f64(secs), "{key}={t:?}");
            }
            let above = format!("{}", max.parse::<u64>().unwrap() + 1);
            for t in ["0", "-5", "nan", "inf", &above, "1e30", "ten", ""] {
                let msg = with(Some(t)).unwrap_err();
                assert!(
                    msg.contains(&format!("{key}={t:?}")) && msg.contains(range),
                    "{key}={t:?}: {msg}"
                );
            }
        }
    }
}

#[test]
fn braid_launch_sets_the_same_variables() {
    let e = env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29600"),
        ("BRAID_LAUNCH", "1"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.launcher, Launcher::Braid);
    assert_eq!(e.store_addr(), "127.0.0.1:29600");
}

#[test]
fn slurm_variables_and_host_lists() {
    let e = env(&[
        ("SLURM_PROCID", "9"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NTASKS_PER_NODE", "8(x2)"),
        ("SLURM_JOB_NODELIST", "gpu[017-018]"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.launcher, Launcher::Slurm);
    assert_eq!(
        (e.rank, e.world_size, e.local_rank, e.local_world_size),
        (9, 16, 1, Some(8))
    );
    assert_eq!(e.store_addr(), "gpu017:29500");
    let e = env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "a,b"),
        ("MASTER_ADDR", "login1"),
        ("MASTER_PORT", "1234"),
    ])
    .unwrap()
    .unwrap();
    assert_eq!(e.store_addr(), "login1:1234");
    for (list, first) in [
        ("node[01-04,07],gpu9", "node01"),
        ("rack[1-2]-n[3-4]", "rack1-n3"),
        ("a,b", "a"),
        ("single", "single"),
        ("n[7,9]", "n7"),
        (" x[10-12] ", "x10"),
    ] {
        assert_eq!(first_host(list).as_deref(), Some(first), "{list}");
    }
    // Lists SLURM never writes are refused, not read as a host that cannot resolve.
    for bad in [
        "", "n[]", "a[3-1]", "a[1-2", "a]", "a[x-y]", "a b", "a[", "[]", "a[,]", ",", "a[-]",
        "a[[1]]",
    ] {
        assert_eq!(first_host(bad), None, "{bad:?}");
    }
}

#[test]
fn bad_or_missing_variables_are_named() {
    for (vars, needle) in [
        (vec![("RANK", "0")], "WORLD_SIZE is not set"),
        (vec![("WORLD_SIZE", "2")], "RANK is not set"),
        (vec![("RANK", "x"), ("WORLD_SIZE", "2")], "RANK=\"x\""),
        (
            vec![("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
            "RANK=2 is not below WORLD_SIZE=2",
        ),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "0"), ("MASTER_ADDR", "h")],
            "WORLD_SIZE=0",
        ),
        (
            vec![("RANK", "0"), ("WORLD_SIZE", "2")],
            "MASTER_ADDR is not set",
        ),
        (
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "99999999999999999999"),
                ("MASTER_ADDR", "h"),
            ],
            "WORLD_SIZE=\"99999999999999999999\" is far too large a count",
        ),
        (
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2000000"),
                ("MASTER_ADDR", "h"),
            ],
            "WORLD_SIZE=2000000: more ranks than Braid runs (at most 1048576)",
        ),
        (
            vec![
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2000000"),
                ("SLURM_JOB_NODELIST", "a"),
            ],
            "SLURM_NTASKS=2000000: more ranks",
        ),
        (
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "99999"),
            ],
            "MASTER_PORT=\"99999\"",
        ),
        (
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "0"),
            ],
            "MASTER_PORT=0: every rank must dial the same port",
        ),
        (
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("LOCAL_RANK", "3"),
                ("LOCAL_WORLD_SIZE", "2"),
            ],
            "LOCAL_RANK=3",
        ),
        (
            vec![("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
            "SLURM_JOB_NODELIST",
        ),
        (
            vec![
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_JOB_NODELIST", "a"),
                ("SLURM_NTASKS_PER_NODE", "(x2)"),
            ],
            "SLURM_NTASKS_PER_NODE",
        ),
    ] {
        let e = env(&vars).unwrap_err();
        assert!(e.contains(needle), "{vars:?}: {e}");
    }
}

/// The job a rank belongs to: under srun its job and step (a het job's leader); under
/// torchrun or `braid launch` torchrun's run id unless its default, else the SLURM job
/// alone (one srun step per node is common); `BRAID_JOB_ID` first (empty: no check). Under
/// SLURM without MASTER_PORT, a store port from the job and step: the same for every task
/// of a step, apart for two jobs or steps.
#[test]
fn the_job_and_slurm_s_port_come_from_the_job_id() {
    let slurm = |job: &str, extra: &[(&str, &str)]| {
        let mut v = vec![
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "node[01-02]"),
            ("SLURM_JOB_ID", job),
        ];
        v.extend_from_slice(extra);
        env(&v).unwrap().unwrap()
    };
    let a = slurm("4242", &[]);
    assert_eq!(a.job.as_deref(), Some("SLURM job 4242"));
    assert_eq!(a.store_addr(), "node01:14242");
    let b = slurm("4243", &[("SLURM_STEP_ID", "3")]);
    assert_eq!(b.job.as_deref(), Some("SLURM job 4243.3"));
    assert_eq!(b.store_port, 10_000 + ((4243 + 3 * 7919) % 20_000) as u16);
    assert_ne!(
        b.store_port,
        slurm("4243", &[("SLURM_STEP_ID", "4")]).store_port
    );
    let het = slurm(
        "501",
        &[("SLURM_HET_JOB_ID", "500"), ("SLURM_STEP_ID", "0")],
    );
    assert_eq!(het.job.as_deref(), Some("SLURM job 500.0"));
    assert_eq!(het.store_port, 10_500);
    // 10000-29999 for every id; MASTER_PORT and BRAID_STORE_PORT still first.
    assert_eq!(slurm("39999", &[]).store_port, 29999);
    assert_eq!(slurm("40000", &[]).store_port, 10000);
    assert_eq!(slurm("7", &[("MASTER_PORT", "29500")]).store_port, 29500);
    assert_eq!(
        slurm("7", &[("BRAID_STORE_PORT", "31000")]).store_port,
        31000
    );
    assert_eq!(
        slurm("x12", &[]).store_port,
        29500,
        "not a number: the default"
    );
    assert_eq!(
        slurm("7", &[("BRAID_JOB_ID", "mine")]).job.as_deref(),
        Some("job mine")
    );
    assert_eq!(
        slurm("7", &[("BRAID_JOB_ID", "")]).job,
        None,
        "empty: no check"
    );
    // torchrun inside srun, one step per node: the run id, else the SLURM job without
    // the step.
    let torch = |extra: &[(&str, &str)]| {
        let mut v = vec![
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("MASTER_ADDR", "h"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_ID", "1"),
        ];
        v.extend_from_slice(extra);
        let e = env(&v).unwrap().unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        e.job
    };
    assert_eq!(torch(&[]).as_deref(), Some("SLURM job 77"));
    assert_eq!(
        torch(&[("TORCHELASTIC_RUN_ID", "abc")]).as_deref(),
        Some("torchrun run abc")
    );
    assert_eq!(
        torch(&[("TORCHELASTIC_RUN_ID", "none")]).as_deref(),
        Some("SLURM job 77")
    );
    let plain = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")])
        .unwrap()
        .unwrap();
    assert_eq!(plain.job, None);
}
