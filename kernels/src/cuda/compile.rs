//! The `.cu` sources under `kernels/cuda/`, compiled at run time by NVRTC for the
//! device's architecture, once per process, and cached on disk keyed by the source's
//! hash, the architecture and NVRTC's version.
//!
//! The kernels include no headers (bf16 is handled as raw bits, tensor-core products as
//! inline PTX), so NVRTC needs nothing at run time but its own libraries. CI compiles
//! every source through [`compile`] with [`nvrtc_options`] — exactly what the runtime
//! does — and assembles the PTX with `ptxas -arch=sm_90a`, spills being errors
//! (`kernels/tests/cuda_compile.rs`).

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::PathBuf;

use cudarc::nvrtc::{result as nvrtc, sys};

/// One `.cu` file, embedded in the binary.
#[derive(Debug)]
pub struct KernelSource {
    /// The file's stem ("norm" for `kernels/cuda/norm.cu`).
    pub name: &'static str,
    pub code: &'static str,
}

/// `kernels/cuda/common.cuh`, pasted in place of each source's `#include "common.cuh"`.
pub static COMMON_HEADER: &str = include_str!("../../cuda/common.cuh");
const COMMON_INCLUDE: &str = "#include \"common.cuh\"";

impl KernelSource {
    /// The text NVRTC compiles: the file with the shared header pasted in.
    pub fn full_source(&self) -> String {
        let Some(at) = self.code.find(COMMON_INCLUDE) else {
            return self.code.to_string();
        };
        // A #line directive after the pasted header, so NVRTC's errors name the .cu
        // file's own line numbers.
        let next_line = self.code[..at].matches('\n').count() + 2;
        let rest = &self.code[at + COMMON_INCLUDE.len()..];
        format!(
            "{}{COMMON_HEADER}\n#line {next_line} \"{}.cu\"{rest}",
            &self.code[..at],
            self.name
        )
    }
}

macro_rules! cuda_source {
    ($ident:ident, $name:literal) => {
        pub static $ident: KernelSource = KernelSource {
            name: $name,
            code: include_str!(concat!("../../cuda/", $name, ".cu")),
        };
    };
}

cuda_source!(MEMORY, "memory");
cuda_source!(ELEMENTWISE, "elementwise");
cuda_source!(LAYOUT, "layout");
cuda_source!(EMBEDDING, "embedding");
cuda_source!(NORM, "norm");
cuda_source!(ROPE, "rope");
cuda_source!(ACTIVATION, "activation");
cuda_source!(ATTENTION, "attention");
cuda_source!(LOSS, "loss");
cuda_source!(CONV, "conv");
cuda_source!(OPTIM, "optim");
cuda_source!(VOCAB_LOSS, "vocab_loss");

/// Every source, for the compile checks.
pub static SOURCES: [&KernelSource; 12] = [
    &MEMORY,
    &ELEMENTWISE,
    &LAYOUT,
    &EMBEDDING,
    &NORM,
    &ROPE,
    &ACTIVATION,
    &ATTENTION,
    &LOSS,
    &CONV,
    &OPTIM,
    &VOCAB_LOSS,
];

/// What NVRTC is asked to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// PTX for a virtual architecture (`compute_90a`): what CI assembles with `ptxas`.
    Ptx,
    /// A cubin for a real one (`sm_90a`): what the runtime loads.
    Cubin,
}

/// The options the runtime compiles with, for `arch` given as `sm_90a` (the cubin's
/// architecture; PTX output uses the matching `compute_90a`).
///
/// No `--use_fast_math`: the kernels pick their fast intrinsics (`exp2f` in the
/// attention's online softmax) where accuracy allows, and keep IEEE division and square
/// root elsewhere so that f32 results stay within 1e-5 of the CPU backend.
pub fn nvrtc_options(arch: &str, output: Output) -> Vec<String> {
    let arch = match output {
        Output::Cubin => arch.to_string(),
        Output::Ptx => arch.replacen("sm_", "compute_", 1),
    };
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--fmad=true".into(),
        "--device-as-default-execution-space".into(),
        "--generate-line-info".into(),
    ]
}

/// NVRTC's version, (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// Compiles `src` for `arch` (`sm_90a`). The error carries NVRTC's log.
pub fn compile(src: &KernelSource, arch: &str, output: Output) -> Result<Vec<u8>, String> {
    // SAFETY: is_culib_present only tries to dlopen the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "NVRTC (libnvrtc.so.13) was not found; set LD_LIBRARY_PATH to the folder that holds it"
                .into(),
        );
    }
    let code = CString::new(src.full_source())
        .map_err(|_| format!("{}.cu contains a NUL byte", src.name))?;
    let file_name = CString::new(format!("{}.cu", src.name)).map_err(|e| e.to_string())?;
    let prog = nvrtc::create_program(&code, Some(&file_name))
        .map_err(|e| format!("{}.cu: nvrtcCreateProgram: {e:?}", src.name))?;
    let options = nvrtc_options(arch, output);
    // SAFETY: `prog` was just created and is destroyed once, below, whatever happens.
    let result = unsafe { compile_program(prog, src, &options, output) };
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result
}

/// # Safety
/// `prog` must be a live program from `create_program`.
unsafe fn compile_program(
    prog: sys::nvrtcProgram,
    src: &KernelSource,
    options: &[String],
    output: Output,
) -> Result<Vec<u8>, String> {
    // SAFETY: `prog` is live (the caller's contract).
    let compiled = unsafe { nvrtc::compile_program(prog, options) };
    if let Err(e) = compiled {
        // SAFETY: as above; the log is a NUL-terminated C string.
        let log = unsafe { nvrtc::get_program_log(prog) }
            .map(|l| c_chars_to_string(&l))
            .unwrap_or_default();
        return Err(format!(
            "{}.cu failed to compile ({e:?}) with {}:\n{log}",
            src.name,
            options.join(" ")
        ));
    }
    match output {
        Output::Ptx => {
            // SAFETY: the program compiled.
            let ptx = unsafe { nvrtc::get_ptx(prog) }.map_err(|e| format!("nvrtcGetPTX: {e:?}"))?;
            Ok(c_chars_to_string(&ptx).into_bytes())
        }
        Output::Cubin => {
            let mut size = 0usize;
            // SAFETY: the program compiled for a real architecture; out-pointer valid.
            unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` has the size NVRTC just reported.
            unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast::<c_char>()) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            Ok(cubin)
        }
    }
}

fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
}

/// FNV-1a, 64 bits: a stable hash for cache keys (std's hasher may change across Rust
/// releases; a changed key only means a recompile, but a stable one avoids it).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are kept: `$BRAID_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/braid/kernels`, else `~/.cache/braid/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("BRAID_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("braid/kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/braid/kernels"))
}

/// The file name of `src`'s cubin for `arch` in the cache: keyed by the source's hash
/// (header included), the architecture, NVRTC's version and the options.
pub fn cache_file_name(src: &KernelSource, arch: &str) -> Result<String, String> {
    let (major, minor) = nvrtc_version()?;
    let options = nvrtc_options(arch, Output::Cubin).join(" ");
    let version = format!("{major}.{minor}");
    let full = src.full_source();
    let key = fnv1a(&[
        full.as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
        options.as_bytes(),
    ]);
    Ok(format!(
        "{}-{arch}-nvrtc{version}-{key:016x}.cubin",
        src.name
    ))
}

/// The cubin of `src` for `arch`, from the disk cache or compiled (and then cached).
/// A cache that cannot be read or written is skipped, never an error: it only saves time.
pub(crate) fn cached_cubin(src: &KernelSource, arch: &str) -> Result<Vec<u8>, String> {
    let name = cache_file_name(src, arch)?;
    let path = cache_dir().map(|d| d.join(name));
    if let Some(p) = &path
        && let Ok(bytes) = std::fs::read(p)
        && !bytes.is_empty()
    {
        return Ok(bytes);
    }
    let cubin = compile(src, arch, Output::Cubin)?;
    if let Some(p) = &path
        && let Some(dir) = p.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        // Written to a temporary name and renamed, so a reader never sees half a file
        // (several ranks of one machine may compile the same kernel at once, as processes
        // or as threads of one: the name is unique to this call).
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = p.with_extension(format!("tmp{}-{n}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() && std::fs::rename(&tmp, p).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(cubin)
}
