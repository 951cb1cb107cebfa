//! The hardware a plan is for: GPUs per node, memory, the achieved matmul rate as a
//! function of GEMM size, and the bandwidth and latency of links inside and between
//! nodes. Read from a cluster TOML (`braid profile` writes one) or a preset.

use serde::{Deserialize, Serialize};

/// Bytes in a GiB, the unit cluster memory (`memory_gib`) and plan reports use.
pub const GIB: f64 = (1u64 << 30) as f64;

/// One measured point of the achieved matmul rate: GEMMs of `flops` (2·M·N·K) run at
/// `tflops`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RatePoint {
    pub flops: f64,
    pub tflops: f64,
}

/// A link: achieved bandwidth per GPU (GB/s, one direction) and latency per message.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub bandwidth_gbs: f64,
    pub latency_us: f64,
}

impl Link {
    /// Seconds to move `bytes` point to point.
    pub fn send(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        self.latency_us * 1e-6 + bytes / (self.bandwidth_gbs * 1e9)
    }

    /// Ring all-reduce of `bytes` per rank over `n` ranks.
    pub fn all_reduce(&self, bytes: f64, n: usize) -> f64 {
        2.0 * self.gather(bytes, n)
    }

    /// Ring all-gather (or reduce-scatter) whose full result is `bytes` per rank.
    pub fn gather(&self, bytes: f64, n: usize) -> f64 {
        if n <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let k = (n - 1) as f64;
        k * self.latency_us * 1e-6 + k / n as f64 * bytes / (self.bandwidth_gbs * 1e9)
    }
}

/// A cluster of identical nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    pub name: String,
    pub gpus_per_node: usize,
    /// Device memory per GPU.
    pub memory_gib: f64,
    /// The share of it a plan may fill (the rest: allocator slack, workspace, NCCL).
    #[serde(default = "default_usable")]
    pub usable_memory: f64,
    /// Achieved bf16 matmul rate by GEMM size, ascending in `flops`; interpolated
    /// log-log between points, flat beyond the ends.
    pub matmul: Vec<RatePoint>,
    /// Attention (flash) runs at this share of the matmul rate at the same size.
    #[serde(default = "default_attention")]
    pub attention_efficiency: f64,
    /// Attention's backward takes this many times its forward (flash attention's
    /// backward does 2.5x the forward's FLOPs, recomputing the scores).
    #[serde(default = "default_attention_backward")]
    pub attention_backward: f64,
    /// Fixed time per transformer block of a forward (kernel launches, synchronization).
    #[serde(default)]
    pub layer_overhead_us: f64,
    /// Fixed time per block of a backward; absent: twice `layer_overhead_us`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_overhead_us: Option<f64>,
    /// Non-matmul work of a block per activation value (token x hidden) per pass, in ns:
    /// norms, residuals, RoPE, activations, allocation. Memory-bound, so it does not
    /// shrink with GEMM size; on a CPU at small widths it rivals the matmuls. The GPU
    /// presets' value is the H200 calibration's (docs/planning.md), scaled by HBM
    /// bandwidth for the H100.
    #[serde(default)]
    pub elementwise_ns: f64,
    /// Inside a node (NVLink).
    pub intra: Link,
    /// Between nodes (InfiniBand / RoCE), per GPU.
    pub inter: Link,
    /// All ranks share one device's compute (ranks are threads on one CPU): concurrent
    /// ranks slow each other down. False for GPUs.
    #[serde(default)]
    pub shared_compute: bool,
    /// Bytes of an activation or weight value in the runtime's compute dtype: what TP,
    /// CP, PP, the bridge and the parameter all-gather move. 2 (bf16) on GPUs; 4 on
    /// Braid's CPU ranks, which compute in f32.
    #[serde(default = "default_compute_bytes")]
    pub compute_bytes: f64,
    /// The share of a block's elementwise work on full hidden-size rows (the norms and
    /// residual adds), which TP without sequence parallelism repeats on every TP rank
    /// instead of splitting (`braid profile` measures it; 0 in the GPU presets, whose
    /// plans assume sequence parallelism).
    #[serde(default)]
    pub replicated_elementwise: f64,
}

fn default_compute_bytes() -> f64 {
    2.0
}

fn default_usable() -> f64 {
    0.9
}
fn default_attention() -> f64 {
    0.6
}
fn default_attention_backward() -> f64 {
    2.0
}

/// The errors of a cluster description.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster {path}: {msg}")]
    Invalid { path: String, msg: String },
}

/// A cluster file's text: a regular file of at most 1 MiB (`braid profile` writes ~2 KiB),
/// so a device (`/dev/zero`), a folder or a FIFO nobody writes to fails at once instead
/// of reading until memory runs out or waiting forever.
fn read_cluster_file(path: &str) -> std::io::Result<String> {
    use std::io::Read;
    const MAX: u64 = 1 << 20;
    let refuse = |msg: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, msg);
    if !std::fs::metadata(path)?.is_file() {
        return Err(refuse("not a regular file (a device, a FIFO or a folder)"));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX {
        return Err(refuse("more than 1 MiB, not a cluster file"));
    }
    Ok(text)
}

impl Cluster {
    /// A built-in description by name: `h100` or `h200` (8-GPU HGX nodes, NDR InfiniBand).
    pub fn preset(name: &str) -> Option<Cluster> {
        let (memory_gib, name) = match name {
            "h100" => (80.0, "h100"),
            "h200" => (141.0 * 1e9 / GIB, "h200"),
            _ => return None,
        };
        // Measured on an H200 with PyTorch 2.11 / cuBLAS (CUDA 13.0):
        // `python3 tools/gpu_calibrate.py`, kept in balancer/tests/fixtures/h200.json and
        // checked by balancer/tests/gpu_calibration.rs. Each point is the median rate of
        // the reference models' GEMMs near that size; dense bf16 peak is 989 TFLOP/s.
        // The H100 SXM has the same tensor cores and clocks; its HBM (3.35 TB/s against
        // 4.8) makes the memory-bound work between the matmuls ~1.4x slower.
        let matmul = [
            (2.7e8, 23.0),
            (1e9, 95.0),
            (4.3e9, 380.0),
            (1.15e10, 460.0),
            (3.6e10, 600.0),
            (1e11, 640.0),
            (3e11, 660.0),
            (3e12, 675.0),
        ]
        .map(|(flops, tflops)| RatePoint { flops, tflops })
        .to_vec();
        let hbm_slowdown = if name == "h100" { 4.8 / 3.35 } else { 1.0 };
        Some(Cluster {
            name: name.to_string(),
            gpus_per_node: 8,
            memory_gib,
            usable_memory: default_usable(),
            matmul,
            // Fitted to the same file's flash-attention sweep and whole blocks (forward
            // and backward): the backward's fixed cost is eager PyTorch's per-kernel
            // launch cost (~40 kernels), which small encoder blocks cannot hide.
            attention_efficiency: 0.36,
            attention_backward: 2.5,
            layer_overhead_us: 40.0,
            backward_overhead_us: Some(360.0),
            elementwise_ns: 0.008 * hbm_slowdown,
            // NVLink 4 (450 GB/s each way; ~360 GB/s achieved bus bandwidth).
            intra: Link {
                bandwidth_gbs: 360.0,
                latency_us: 3.0,
            },
            // One 400 Gb/s NDR port per GPU (~45 GB/s achieved).
            inter: Link {
                bandwidth_gbs: 45.0,
                latency_us: 8.0,
            },
            shared_compute: false,
            compute_bytes: default_compute_bytes(),
            replicated_elementwise: 0.0,
        })
    }

    /// A preset name or a TOML file.
    pub fn load(spec: &str) -> Result<Cluster, ClusterError> {
        if let Some(c) = Cluster::preset(spec) {
            return Ok(c);
        }
        let bad = |msg: String| ClusterError::Invalid {
            path: spec.to_string(),
            msg,
        };
        let text = read_cluster_file(spec).map_err(|e| {
            bad(format!(
                "not a preset (h100, h200) and not a readable cluster file: {e}"
            ))
        })?;
        let c: Cluster = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        c.validate().map_err(bad)?;
        Ok(c)
    }

    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string(self).map_err(|e| format!("cluster {}: {e}", self.name))
    }

    /// Every field in range and finite (a NaN fails every test below); the message names
    /// the key.
    pub fn validate(&self) -> Result<(), String> {
        // Finite and above zero / at least zero: written so that NaN fails them.
        let pos = |x: f64| x > 0.0 && x.is_finite();
        let nonneg = |x: f64| x >= 0.0 && x.is_finite();
        if self.gpus_per_node == 0 {
            return Err("gpus_per_node must be at least 1".into());
        }
        let fraction = |x: f64| x > 0.0 && x <= 1.0;
        if !(pos(self.memory_gib) && fraction(self.usable_memory)) {
            return Err("memory_gib must be > 0 and usable_memory in (0, 1]".into());
        }
        if self.matmul.is_empty() {
            return Err("matmul needs at least one { flops, tflops } point".into());
        }
        let ascending =
            |w: &[RatePoint]| w[0].flops.partial_cmp(&w[1].flops) == Some(std::cmp::Ordering::Less);
        if self.matmul.windows(2).any(|w| !ascending(w))
            || self.matmul.iter().any(|p| !pos(p.flops) || !pos(p.tflops))
        {
            return Err("matmul points must be positive, finite and ascending in flops".into());
        }
        for (key, l) in [("intra", self.intra), ("inter", self.inter)] {
            if !pos(l.bandwidth_gbs) || !nonneg(l.latency_us) {
                return Err(format!(
                    "{key}.bandwidth_gbs must be > 0 and latency_us >= 0 (both finite)"
                ));
            }
        }
        if !nonneg(self.layer_overhead_us)
            || !nonneg(self.elementwise_ns)
            || self.backward_overhead_us.is_some_and(|x| !nonneg(x))
        {
            return Err(
                "layer_overhead_us, backward_overhead_us and elementwise_ns must be finite and >= 0"
                    .into(),
            );
        }
        if !pos(self.compute_bytes) || !(0.0..=1.0).contains(&self.replicated_elementwise) {
            return Err("compute_bytes must be > 0 and replicated_elementwise in [0, 1]".into());
        }
        if !pos(self.attention_backward) {
            return Err("attention_backward must be > 0".into());
        }
        // Below 0.1 % of the matmul rate (`braid profile`'s floor) no attention kernel
        // runs: a smaller figure is a slip that would plan steps of 1e300 s.
        if !(1e-3..=1.0).contains(&self.attention_efficiency) {
            return Err(
                "attention_efficiency must be in [0.001, 1] (a share of the matmul rate)".into(),
            );
        }
        self.check_units()
    }

    /// Finite values that no device has: most often a figure in the wrong unit (FLOP/s
    /// where TFLOP/s go, bytes where GiB go), which would plan steps of 1e-12 s or 1e200 s.
    /// Each upper limit lies two orders of magnitude or more beyond the fastest GPU
    /// announced (~1e5 dense FP4 TFLOP/s, ~1e4 GB/s of NVLink), each lower one below a
    /// slow CPU's profile.
    fn check_units(&self) -> Result<(), String> {
        // (key, value, least, most, unit)
        let mut ranges = vec![
            (
                "gpus_per_node".to_string(),
                self.gpus_per_node as f64,
                1.0,
                65536.0,
                "GPUs",
            ),
            ("memory_gib".into(), self.memory_gib, 1e-3, 1e5, "GiB"),
            (
                "layer_overhead_us".into(),
                self.layer_overhead_us,
                0.0,
                1e7,
                "us",
            ),
            (
                "backward_overhead_us".into(),
                self.backward_overhead_us(),
                0.0,
                1e7,
                "us",
            ),
            (
                "elementwise_ns".into(),
                self.elementwise_ns,
                0.0,
                1e7,
                "ns per value",
            ),
            (
                "compute_bytes".into(),
                self.compute_bytes,
                0.5,
                16.0,
                "bytes",
            ),
            (
                "attention_backward".into(),
                self.attention_backward,
                1e-2,
                1e2,
                "x the forward",
            ),
        ];
        for p in &self.matmul {
            ranges.push(("matmul flops".into(), p.flops, 1.0, 1e21, "FLOPs per GEMM"));
            ranges.push(("matmul tflops".into(), p.tflops, 1e-9, 1e7, "TFLOP/s"));
        }
        for (key, l) in [("intra", self.intra), ("inter", self.inter)] {
            ranges.push((
                format!("{key}.bandwidth_gbs"),
                l.bandwidth_gbs,
                1e-6,
                1e7,
                "GB/s",
            ));
            ranges.push((format!("{key}.latency_us"), l.latency_us, 0.0, 1e7, "us"));
        }
        match ranges
            .into_iter()
            .find(|(_, v, lo, hi, _)| !(lo..=hi).contains(&v))
        {
            Some((key, v, lo, hi, unit)) => Err(format!(
                "{key} = {v:e} is outside {lo:e}..={hi:e} {unit}: no device is that far out; is it in another unit?"
            )),
            None => Ok(()),
        }
    }

    /// Fixed time per block of a backward pass.
    pub fn backward_overhead_us(&self) -> f64 {
        self.backward_overhead_us
            .unwrap_or(2.0 * self.layer_overhead_us)
    }

    /// Bytes a plan may use per GPU.
    pub fn usable_bytes(&self) -> f64 {
        self.memory_gib * GIB * self.usable_memory
    }

    /// Achieved FLOP/s of a GEMM of `flops`.
    pub fn matmul_rate(&self, flops: f64) -> f64 {
        let pts = &self.matmul;
        let tf = if flops <= pts[0].flops {
            pts[0].tflops
        } else if let Some(w) = pts.windows(2).find(|w| flops <= w[1].flops) {
            let t = (flops.ln() - w[0].flops.ln()) / (w[1].flops.ln() - w[0].flops.ln());
            (w[0].tflops.ln() + t * (w[1].tflops.ln() - w[0].tflops.ln())).exp()
        } else {
            pts[pts.len() - 1].tflops
        };
        tf * 1e12
    }

    /// The link a point-to-point transfer between GPUs `span` consecutive GPUs apart
    /// uses: NVLink inside a node, else the sender's own NIC.
    pub fn link(&self, span: usize) -> Link {
        if span <= self.gpus_per_node {
            self.intra
        } else {
            self.inter
        }
    }

    /// The link a collective uses whose group spans `span` consecutive GPUs from GPU
    /// `start`, its members `stride` apart (a DP group of a TP-4 grid: stride 4). Inside
    /// a node, NVLink. Across nodes each member drives its own NIC: NCCL runs a ring
    /// channel per NIC and reduces inside the node over NVLink, so a node's members move
    /// its share together, and the ring runs at the fewest members any node holds times
    /// one NIC's bandwidth, up to NVLink's (8 per node on NDR: ~360 GB/s, what
    /// nccl-tests' multi-node all-reduce reaches; one per node: one NIC's 45 GB/s).
    pub fn group_link(&self, start: usize, span: usize, stride: usize) -> Link {
        let node = self.gpus_per_node.max(1);
        let end = start + span; // one past the last GPU
        if span == 0 || start / node == (end - 1) / node {
            return self.intra;
        }
        let stride = stride.max(1);
        // Members in [lo, hi): those start + i * stride inside it.
        let members = |lo: usize, hi: usize| {
            let first = lo.max(start).saturating_sub(start).div_ceil(stride);
            let last = (hi.min(end) - start).div_ceil(stride);
            last.saturating_sub(first)
        };
        let head = members(start, (start / node + 1) * node);
        let tail = members((end - 1) / node * node, end);
        let mut fewest = head.min(tail);
        if (end - 1) / node > start / node + 1 {
            fewest = fewest.min(members(
                (start / node + 1) * node,
                (start / node + 2) * node,
            ));
        }
        Link {
            bandwidth_gbs: (fewest.max(1) as f64 * self.inter.bandwidth_gbs)
                .min(self.intra.bandwidth_gbs),
            latency_us: self.inter.latency_us,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-edited cluster file with NaN, infinity or zero where a rate or a size goes
    /// is refused naming the key (NaN once passed `x <= 0.0` and hung `braid plan`).
    #[test]
    fn nan_infinite_and_zero_fields_are_refused() {
        type Edit = (&'static str, fn(&mut Cluster));
        let edits: [Edit; 8] = [
            ("intra.bandwidth_gbs", |c| c.intra.bandwidth_gbs = f64::NAN),
            ("inter.bandwidth_gbs", |c| {
                c.inter.latency_us = f64::INFINITY
            }),
            ("elementwise_ns", |c| c.elementwise_ns = f64::NAN),
            ("memory_gib", |c| c.memory_gib = f64::NAN),
            ("usable_memory", |c| c.usable_memory = 0.0),
            ("matmul", |c| c.matmul[0].tflops = f64::INFINITY),
            ("matmul", |c| c.matmul[1].flops = f64::NAN),
            ("attention_backward", |c| c.attention_backward = f64::NAN),
        ];
        for (key, edit) in edits {
            let mut c = Cluster::preset("h100").unwrap();
            edit(&mut c);
            let e = c.validate().unwrap_err();
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn presets_validate_and_interpolate() {
        let c = Cluster::preset("h100").unwrap();
        c.validate().unwrap();
        assert!((c.matmul_rate(1e11) / 640e12 - 1.0).abs() < 1e-12);
        let mid = c.matmul_rate(2e10);
        assert!(mid > 460e12 && mid < 600e12);
        assert_eq!(c.matmul_rate(1.0), 23e12);
        assert_eq!(c.matmul_rate(1e15), 675e12);
        assert_eq!(c.backward_overhead_us(), 360.0);
        assert!(Cluster::preset("h200").unwrap().memory_gib > 130.0);
        let back: Cluster = toml::from_str(&c.to_toml().unwrap()).unwrap();
        assert_eq!(back, c);
        assert!(c.inter.all_reduce(1e9, 8) > c.intra.all_reduce(1e9, 8));
        // A collective across nodes: each member in a node drives its own NIC, up to
        // NVLink's bandwidth; inside a node, NVLink.
        assert_eq!(c.group_link(0, 8, 1), c.intra);
        assert_eq!(c.group_link(8, 8, 1), c.intra);
        assert_eq!(c.group_link(0, 1024, 1).latency_us, c.inter.latency_us);
        // (start, span, stride, fewest members on a node): a full node's group reaches
        // NVLink's bandwidth; off the node boundary GPUs 8-35 leave node 4 with 4
        // members; GPUs 4-19 at stride 2 hold 2 in node 0, 4 in node 1, 2 in node 2.
        for (start, span, stride, members) in [
            (0, 16, 8, 1.0),
            (0, 64, 4, 2.0),
            (8, 28, 1, 4.0),
            (4, 16, 2, 2.0),
        ] {
            let bw = c.group_link(start, span, stride).bandwidth_gbs;
            assert_eq!(
                bw,
                members * c.inter.bandwidth_gbs,
                "{start} {span} {stride}"
            );
        }
        assert_eq!(
            c.group_link(0, 1024, 1).bandwidth_gbs,
            c.intra.bandwidth_gbs
        );
        // Inside one node even off its start.
        assert_eq!(c.group_link(12, 4, 1), c.intra);
        assert_eq!(c.intra.all_reduce(1e9, 1), 0.0);
    }

    /// A figure in the wrong unit (989e12 for an H100's 989 TFLOP/s, bytes for GiB) is
    /// refused naming the key, instead of planning 1e-12 s steps.
    #[test]
    fn values_in_the_wrong_unit_are_refused() {
        type Edit = (&'static str, fn(&mut Cluster));
        let edits: [Edit; 10] = [
            ("attention_efficiency", |c| c.attention_efficiency = 1e-308),
            ("matmul tflops", |c| c.matmul[2].tflops = 989e12),
            ("matmul tflops", |c| c.matmul[0].tflops = 1e-12),
            ("matmul flops", |c| c.matmul[0].flops = 0.5),
            ("memory_gib", |c| c.memory_gib = 80.0 * GIB),
            ("intra.bandwidth_gbs", |c| c.intra.bandwidth_gbs = 360e9),
            ("inter.latency_us", |c| c.inter.latency_us = 1e300),
            ("layer_overhead_us", |c| c.layer_overhead_us = 1e200),
            ("elementwise_ns", |c| c.elementwise_ns = 1e9),
            ("gpus_per_node", |c| c.gpus_per_node = usize::MAX),
        ];
        for (key, edit) in edits {
            let mut c = Cluster::preset("h100").unwrap();
            edit(&mut c);
            let e = c.validate().unwrap_err();
            assert!(e.contains(key), "{key}: {e}");
        }
        // The presets and a slow CPU's profile stay inside.
        let mut cpu = Cluster::preset("h200").unwrap();
        cpu.matmul.iter_mut().for_each(|p| p.tflops = 1e-6);
        cpu.intra.bandwidth_gbs = 0.5;
        cpu.memory_gib = 2.0;
        cpu.validate().unwrap();
    }

    #[test]
    fn bad_files_name_the_key() {
        let mut c = Cluster::preset("h100").unwrap();
        c.matmul.reverse();
        assert!(c.validate().unwrap_err().contains("ascending"));
        let e = Cluster::load("/nonexistent/c.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a preset"), "{e}");
        // A device or a folder fails at once (reading /dev/zero would never end).
        for path in ["/dev/zero", "/tmp"] {
            let e = Cluster::load(path).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{path}: {e}");
        }
    }
}
