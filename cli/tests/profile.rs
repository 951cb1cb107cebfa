//! `braid profile --quick` end to end: the cluster TOML it writes loads with
//! `Cluster::load`, its rates are positive and its sizes ascending, and a bad `--out`
//! folder fails naming the path.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use braid_balancer::cluster::Cluster;
mod common;
use common::braid;

#[test]
fn quick_profile_writes_a_cluster_the_planner_loads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cpu.toml");
    let out = braid(&["profile", "--quick", "--out", path.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("matmul"), "progress on stderr: {stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("wrote"), "{stdout}");
    // No temporary file is left beside it.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

    let c = Cluster::load(path.to_str().unwrap()).unwrap();
    assert!(c.name.starts_with("cpu-"), "{}", c.name);
    assert!(c.shared_compute);
    assert!(c.memory_gib > 0.0);
    assert!(c.matmul.len() >= 3, "{:?}", c.matmul);
    assert!(c.matmul.windows(2).all(|w| w[0].flops < w[1].flops));
    assert!(
        c.matmul
            .iter()
            .all(|p| p.tflops > 0.0 && p.tflops.is_finite())
    );
    assert!(c.attention_efficiency > 0.0 && c.attention_efficiency <= 1.0);
    assert!(c.layer_overhead_us >= 0.0 && c.elementwise_ns >= 0.0);
    assert!(c.intra.bandwidth_gbs > 0.0 && c.intra.latency_us >= 0.0);
    assert_eq!(c.intra, c.inter);
    // Braid's CPU ranks compute in f32; the norms' and residuals' share is measured.
    assert_eq!(c.compute_bytes, 4.0);
    assert!((0.0..=1.0).contains(&c.replicated_elementwise));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("replicated_elementwise"), "{text}");
}

#[test]
fn a_missing_out_folder_fails_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("no-such-folder").join("cpu.toml");
    let out = braid(&["profile", "--quick", "--out", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("no-such-folder"), "{stderr}");
}
