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

/// A GPU run's checkpoint answers on a CPU: `braid generate` reads the config saved with
/// it (`device = "cuda"`) without running on that device. And `braid plan` plans a
/// `"cuda"` config on a machine without a GPU (a login node).
#[test]
fn a_cuda_config_plans_and_its_checkpoint_generates_without_a_gpu() {
    let _ = reference();
    let src = fixture().join("runs/ref/checkpoints/step-00000012");
    let dst = fixture().join("runs/cuda-ckpt/checkpoints/step-00000012");
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
    let saved = std::fs::read_to_string(dst.join("config.toml")).unwrap();
    assert_eq!(saved.matches("device = \"cpu\"").count(), 1, "{saved}");
    let cuda = saved.replace("device = \"cpu\"", "device = \"cuda\"");
    std::fs::write(dst.join("config.toml"), &cuda).unwrap();
    let o = run(&[
        "generate",
        "--checkpoint",
        dst.to_str().unwrap(),
        "--prompt",
        "What is it?",
        "--max-new-tokens",
        "3",
    ]);
    assert!(o.status.success(), "{}", text(&o));

    let cfg = fixture().join("cuda-plan.toml");
    std::fs::write(&cfg, &cuda).unwrap();
    let packed = fixture().join("packed");
    let o = run(&[
        "plan",
        "--config",
        cfg.to_str().unwrap(),
        "--data",
        packed.to_str().unwrap(),
        "--gpus",
        "8",
        "--out",
        fixture().join("cuda-plan-out.toml").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("braid plan"), "{}", text(&o));
    assert!(fixture().join("cuda-plan-out.toml").is_file());
}
