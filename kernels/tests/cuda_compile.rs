//! Every `.cu` kernel source compiles, without a GPU: through NVRTC with the options the
//! runtime uses (PTX for `compute_90a` and a cubin for `sm_90a`), the PTX assembles with
//! `ptxas -arch=sm_90a` with spills treated as errors, and the file compiles standalone
//! with `nvcc`.
//!
//! Needs the CUDA compiler wheels (`tools/cuda-tools.sh` fetches them; `../shared/gpu.md`):
//! `BRAID_CUDA_TOOLKIT` names the folder with `bin/ptxas`, `bin/nvcc`, `lib/libnvrtc.so.13`,
//! and `LD_LIBRARY_PATH` must include its `lib`. Without them the checks are skipped,
//! saying so on stderr — unless `BRAID_REQUIRE_CUDA_TOOLS=1` (set by `.ci/run`), which
//! makes a missing toolkit a failure, so CI can never skip them silently.

#![allow(clippy::expect_used, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use braid_kernels::cuda::compile::{self, Output, SOURCES};

/// The arch every kernel is checked for: the H200's (the runtime compiles for the
/// device's own architecture; sm_90a is what the GPU machines have).
const ARCH: &str = "sm_90a";

fn toolkit() -> Option<PathBuf> {
    let required = std::env::var("BRAID_REQUIRE_CUDA_TOOLS").is_ok_and(|v| v == "1");
    let dir = std::env::var_os("BRAID_CUDA_TOOLKIT").map(PathBuf::from);
    match dir {
        Some(d) if d.join("bin/ptxas").exists() => Some(d),
        Some(d) => panic!("BRAID_CUDA_TOOLKIT={} has no bin/ptxas", d.display()),
        None if required => panic!(
            "BRAID_REQUIRE_CUDA_TOOLS=1 but BRAID_CUDA_TOOLKIT is not set: run tools/cuda-tools.sh"
        ),
        None => {
            eprintln!(
                "SKIPPED: the CUDA compile checks need BRAID_CUDA_TOOLKIT (tools/cuda-tools.sh); \
                 CI runs them"
            );
            None
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-cuda-compile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Runs a tool; panics with its output unless it succeeds. Returns stderr + stdout.
fn run(tool: &Path, args: &[&str], what: &str) -> String {
    let out = Command::new(tool)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {}: {e}", tool.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

#[test]
fn every_kernel_compiles_through_nvrtc_as_the_runtime_does() {
    let Some(_tk) = toolkit() else { return };
    let (major, minor) = compile::nvrtc_version()
        .expect("NVRTC loads (is LD_LIBRARY_PATH set to the toolkit's lib?)");
    eprintln!("NVRTC {major}.{minor}");
    // tools/gpu/bundle.sh sets BRAID_PREBUILD_KERNELS to ship these cubins to the GPU
    // machine as its kernel cache (same names as the runtime's cache).
    let prebuild = std::env::var_os("BRAID_PREBUILD_KERNELS").map(std::path::PathBuf::from);
    for src in SOURCES {
        let cubin = compile::compile(src, ARCH, Output::Cubin).unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.len() > 16, "{}.cu: empty cubin", src.name);
        if let Some(dir) = &prebuild {
            std::fs::create_dir_all(dir).expect("prebuild dir");
            let name = compile::cache_file_name(src, ARCH).expect("cache name");
            std::fs::write(dir.join(name), &cubin).expect("write cubin");
        }
    }
}

#[test]
fn every_kernel_assembles_for_sm_90a_without_spills() {
    let Some(tk) = toolkit() else { return };
    let ptxas = tk.join("bin/ptxas");
    for src in SOURCES {
        let ptx = compile::compile(src, ARCH, Output::Ptx).unwrap_or_else(|e| panic!("{e}"));
        let ptx_path = scratch(&format!("{}.ptx", src.name));
        std::fs::write(&ptx_path, &ptx).expect("write ptx");
        let cubin = scratch(&format!("{}.cubin", src.name));
        let report = run(
            &ptxas,
            &[
                "-arch=sm_90a",
                "-v",
                "--warn-on-spills",
                "--warning-as-error",
                ptx_path.to_str().expect("utf-8 path"),
                "-o",
                cubin.to_str().expect("utf-8 path"),
            ],
            &format!("ptxas {}.ptx", src.name),
        );
        // --warn-on-spills makes any spill a warning and --warning-as-error a failure;
        // check the report too, so a tool change that drops the warning cannot hide one.
        for line in report.lines().filter(|l| l.contains("spill")) {
            assert!(
                line.contains(" 0 bytes spill stores") && line.contains(" 0 bytes spill loads"),
                "{}.cu spills: {line}",
                src.name
            );
        }
        eprintln!(
            "{}.cu: {} kernel(s) assembled",
            src.name,
            report.matches("Compiling entry function").count()
        );
    }
}

#[test]
fn every_kernel_compiles_standalone_with_nvcc() {
    let Some(tk) = toolkit() else { return };
    let nvcc = tk.join("bin/nvcc");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    for src in SOURCES {
        let file = dir.join(format!("{}.cu", src.name));
        let out = scratch(&format!("{}.nvcc.cubin", src.name));
        run(
            &nvcc,
            &[
                "-std=c++17",
                "-gencode",
                "arch=compute_90a,code=sm_90a",
                "-cubin",
                "-Xptxas",
                "--warn-on-spills,--warning-as-error",
                file.to_str().expect("utf-8 path"),
                "-o",
                out.to_str().expect("utf-8 path"),
            ],
            &format!("nvcc {}.cu", src.name),
        );
    }
}
