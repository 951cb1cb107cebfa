//! `braid train` on a device this machine does not have: a clear config error, before any
//! work. (The CUDA run itself is checked on the GPU machine by tools/gpu/check.sh.)

use super::*;

/// On a machine without an NVIDIA driver, `parallel.device=cuda` is a config error
/// (exit 2) that names the key and the missing driver library, before any work.
#[test]
fn cuda_without_a_driver_exits_2_naming_it() {
    if Path::new("/dev/nvidiactl").exists() {
        eprintln!("a GPU machine: the CUDA run itself is checked by tools/gpu/check.sh");
        return;
    }
    let dir = fixture().join("runs/cuda-here");
    let t = Instant::now();
    let o = train(&dir, &["--set", "parallel.device=cuda"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let msg = text(&o);
    assert!(
        msg.contains("parallel.device") && msg.contains("libcuda.so"),
        "{msg}"
    );
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(!dir.exists(), "a failed start left {}", dir.display());
}
