//! Ctrl-C and SIGTERM during `braid train`: the step in flight finishes, its checkpoint is
//! written and named, braid exits with 128 + the signal, and `--resume` logs the same
//! bits as the uninterrupted run; on several ranks every rank stops after the same step.

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::mpsc;

use super::*;

/// Sends `signal` (`INT`, `TERM`) to `child` with the system's `kill`; false when the
/// process was already gone.
fn send(child: &Child, signal: &str) -> bool {
    Command::new("kill")
        .args([format!("-{signal}"), child.id().to_string()])
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// Spawns `cmd`, sends `signals` (one after the other, `gap` apart) once the log shows step
/// `after`, and returns the exit code and everything it printed.
fn interrupt(
    mut cmd: Command,
    after: u64,
    signals: &[&str],
    gap: Duration,
) -> (Option<i32>, String) {
    let mut child = cmd.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let mut out = String::new();
    let want = format!("step {after}/");
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("no `{want}` line: {out}"));
        out.push_str(&line);
        out.push('\n');
        if line.starts_with(&want) {
            break;
        }
    }
    for (i, s) in signals.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(gap);
        }
        let sent = send(&child, s);
        assert!(sent || i > 0, "kill -{s} failed");
    }
    let status = child.wait().unwrap();
    reader.join().unwrap();
    out.extend(rx.try_iter().map(|l| l + "\n"));
    (status.code(), out)
}

/// The step named in "stopped by SIG... after step N".
fn stopped_step(out: &str, signal: &str) -> u64 {
    let at = out
        .find(&format!("stopped by {signal} after step "))
        .unwrap_or_else(|| panic!("no stop message: {out}"));
    let rest = &out[at..];
    let n: String = rest
        .trim_start_matches(|c: char| !c.is_ascii_digit())
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    n.parse().unwrap()
}

#[test]
fn ctrl_c_checkpoints_the_step_and_resume_continues_bit_for_bit() {
    let want = reference();
    let dir = fixture().join("runs/sigint");
    let _ = std::fs::remove_dir_all(&dir);
    // No checkpoint but the last: the one the signal writes is the only way to resume.
    let (code, out) = interrupt(
        train(&dir, &["--set", "checkpoint.interval=0"]),
        3,
        &["INT"],
        Duration::ZERO,
    );
    assert_eq!(code, Some(130), "{out}");
    let step = stopped_step(&out, "SIGINT");
    assert!((3..12).contains(&step), "stopped after step {step}: {out}");
    let ckpt = dir.join(format!("checkpoints/step-{step:08}"));
    assert!(out.contains(&ckpt.display().to_string()), "{out}");
    for f in [
        "model.safetensors",
        "optim.safetensors",
        "state.json",
        "config.toml",
    ] {
        assert!(ckpt.join(f).is_file(), "{f}: {out}");
    }
    // Nothing the end of a run writes.
    assert!(!dir.join("hf").exists() && !dir.join("eval.json").exists());
    assert_eq!(logged(&dir), want.logged[..step as usize], "{out}");

    let o = train(&dir, &["--resume"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(&format!("step {step})")), "{}", text(&o));
    assert_eq!(logged(&dir), want.logged);
}

#[test]
fn sigterm_stops_every_rank_after_the_same_step() {
    reference();
    let dir = fixture().join("runs/sigterm-ranks");
    let _ = std::fs::remove_dir_all(&dir);
    let ranks = [
        "--set",
        "parallel.world_size=4",
        "--set",
        "parallel.llm.dp=2",
        "--set",
        "checkpoint.interval=0",
    ];
    let (code, out) = interrupt(train(&dir, &ranks), 2, &["TERM"], Duration::ZERO);
    assert_eq!(code, Some(143), "{out}");
    let step = stopped_step(&out, "SIGTERM");
    // One complete checkpoint, of that step, written by every rank together.
    let names: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, [format!("step-{step:08}")], "{out}");
    assert_eq!(logged(&dir).len() as u64, step);
    let o = train(&dir, &[&ranks[..], &["--resume"]].concat())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(logged(&dir).len(), 12);
}

#[test]
fn a_second_ctrl_c_exits_at_once() {
    reference();
    let dir = fixture().join("runs/sigint-twice");
    let _ = std::fs::remove_dir_all(&dir);
    // The second signal comes while the first is still being honoured (the step in flight
    // or its checkpoint): braid exits with 130 without finishing either.
    let (code, out) = interrupt(
        train(&dir, &["--set", "checkpoint.interval=0"]),
        2,
        &["INT", "INT"],
        Duration::from_millis(1),
    );
    assert_eq!(code, Some(130), "{out}");
    assert!(
        !out.contains("stopped by"),
        "the second signal waited: {out}"
    );
    // Whatever was on disk resumes to the uninterrupted run's bits.
    let o = train(&dir, &["--resume"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(logged(&dir), reference().logged);
}
