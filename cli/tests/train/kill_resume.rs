//! `kill -9` at moments spread over a run, and a crash inside a checkpoint write: `--resume`
//! logs the uninterrupted run's bits, and a torn checkpoint is never taken.

use super::*;

/// Lines the run in `dir` has logged so far (0 before its `metrics.jsonl` exists).
fn lines_logged(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("metrics.jsonl")).map_or(0, |t| t.lines().count())
}

/// Runs `train` in `dir`, SIGKILLs it `then` after it has logged `after_lines` lines of metrics, and
/// resumes until a run succeeds. Returns how many runs died (0: it finished first).
/// The kill is anchored to the run's own progress, not to another run's wall time: a
/// reference timed under a loaded machine would otherwise put most kills past the end.
fn run_with_kill(dir: &Path, after_lines: usize, then: Duration, first_extra: &[&str]) -> usize {
    let mut child = train(dir, first_extra).spawn().unwrap();
    let mut reached: Option<Instant> = None;
    let mut deaths = 0;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            if status.success() {
                return deaths;
            }
            deaths += 1;
            assert!(deaths < 5, "too many failed attempts");
            child = train(dir, &["--resume"]).spawn().unwrap();
            continue;
        }
        if deaths == 0 && reached.is_none() && lines_logged(dir) >= after_lines {
            reached = Some(Instant::now());
        }
        if deaths == 0 && reached.is_some_and(|t| t.elapsed() >= then) {
            child.kill().unwrap(); // SIGKILL
            let _ = child.wait();
            deaths += 1;
            child = train(dir, &["--resume"]).spawn().unwrap();
            continue;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn resume_after_kill_9_anywhere_reproduces_the_losses_bit_for_bit() {
    let Reference {
        logged: ref_logged,
        took,
        ..
    } = reference();
    let lines = ref_logged.len();
    // Ten kills spread over the run (a fixed pseudo-random sequence): once it has logged
    // 0..lines - 1 lines, then a fraction of a line's mean time, so they land inside
    // steps, evals and checkpoint writes alike.
    let per_line = *took / lines as u32;
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut killed = 0;
    for trial in 0..10 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let after = (x % (lines as u64 - 1)) as usize;
        let then = per_line.mul_f64(((x >> 16) % 1000) as f64 / 1000.0);
        let dir = fixture().join(format!("runs/kill-{trial}"));
        let _ = std::fs::remove_dir_all(&dir);
        killed += run_with_kill(&dir, after, then, &[]);
        assert_eq!(
            &logged(&dir),
            ref_logged,
            "trial {trial}: killed {then:?} after line {after}"
        );
    }
    assert!(
        killed >= 5,
        "only {killed} of 10 trials were killed mid-run"
    );
}

#[test]
fn a_crash_inside_a_checkpoint_write_resumes_from_the_previous_one() {
    let ref_losses = &reference().losses;
    let dir = fixture().join("runs/abort");
    let _ = std::fs::remove_dir_all(&dir);
    let o = train(&dir, &["--set", "fault.abort_during_checkpoint_at=6"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    // Only complete checkpoints are visible; the torn one is a .tmp folder.
    let names: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(
        names.contains(&".tmp-step-00000006".to_string()),
        "{names:?}"
    );
    assert!(!names.contains(&"step-00000006".to_string()), "{names:?}");
    let o = train(&dir, &["--resume"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("step 4"), "{}", text(&o));
    // The torn checkpoint is removed, and the resume says so.
    assert!(
        text(&o).contains(".tmp-step-00000006: its save never finished"),
        "{}",
        text(&o)
    );
    assert!(!dir.join("checkpoints/.tmp-step-00000006").exists());
    assert_eq!(&losses(&dir), ref_losses);
    assert_eq!(logged(&dir), reference().logged);
}

/// A NaN in the newest checkpoint's weights (a damaged file, or a run saved after it
/// diverged) is refused on `--resume`, naming the file and the tensor and the checkpoint
/// before it, which resuming takes once the damaged one is moved aside.
#[test]
fn a_nan_in_a_checkpoint_is_refused_naming_the_one_before_it() {
    let dir = fixture().join("runs/nan-checkpoint");
    let _ = std::fs::remove_dir_all(&dir);
    let o = train(&dir, &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let mut steps: Vec<PathBuf> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    steps.sort();
    let [.., before, newest] = steps.as_slice() else {
        panic!("two checkpoints expected: {steps:?}")
    };
    // The first value of the first tensor: past the 8-byte header length and the header.
    let file = newest.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let meta: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let (name, entry) = meta
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, _)| *k != "__metadata__")
        .unwrap();
    let at = 8 + header + entry["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&file, bytes).unwrap();
    let o = train(&dir, &["--resume"]).output().unwrap();
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.contains(&format!("tensor `{name}`: holds NaN")),
        "{out}"
    );
    assert!(
        out.contains(&format!("the checkpoint before it is {}", before.display())),
        "{out}"
    );
    // Moved aside, the one before resumes.
    std::fs::rename(newest, dir.join("damaged")).unwrap();
    let o = train(&dir, &["--resume"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
}
