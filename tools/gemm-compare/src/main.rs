//! Side-by-side f32 GEMM benchmark: `gemm` 0.19, `faer` 0.24, `matrixmultiply` 0.3 and
//! Braid's own `ops::matmul` (end to end: validation + zeroed output allocation + gemm).
//!
//! Every product is row-major `C (M, N) = A (M, K) @ B (K, N)`. Each thread count runs
//! in its own child process because `matrixmultiply` reads `MATMUL_NUM_THREADS` once per
//! process; the parent merges the children's results into one table.
//!
//! Usage: `gemm-compare [--threads 1,2] [--budget-ms 400] [--shapes 256x256x256,...]`

use std::num::NonZeroUsize;
use std::process::{Command, ExitCode};
use std::time::Instant;

use braid_kernels::{Device, Tensor};

/// The libraries in table order.
const LIBS: [&str; 4] = ["gemm", "faer", "matrixmultiply", "braid::matmul"];

/// Default shapes, as (M, N, K): square sizes, then the ones a transformer block with
/// B*T = 4096 tokens and C = 512 runs (QKV/proj, MLP up, MLP down).
const DEFAULT_SHAPES: &str =
    "256x256x256,1024x1024x1024,2048x2048x2048,4096x512x512,4096x2048x512,4096x512x2048";

/// Fewest and most timed repetitions per library and case.
const MIN_REPS: usize = 5;
const MAX_REPS: usize = 200;

#[derive(Clone, Debug)]
struct Opts {
    threads: Vec<usize>,
    shapes: Vec<(usize, usize, usize)>,
    /// Target wall time per (case, library); sets the repetition count.
    budget_ms: f64,
}

/// One measured (case, library): what the child prints and the parent parses.
#[derive(Clone, Debug)]
struct Row {
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
    lib: String,
    reps: usize,
    median_s: f64,
    /// Fastest repetition: the least disturbed by other processes on a shared machine.
    best_s: f64,
    /// Max |C_lib - C_gemm| over the whole output.
    max_diff: f64,
    /// Max |C_lib - C_f64| over sampled entries, against an f64 dot product.
    ref_err: f64,
}

impl Row {
    /// GFLOP/s at the median (`best` = false) or the fastest repetition.
    fn gflops(&self, best: bool) -> f64 {
        let s = if best { self.best_s } else { self.median_s };
        2.0 * (self.m * self.n * self.k) as f64 / s / 1e9
    }

    fn to_line(&self) -> String {
        format!(
            "ROW\t{}\t{}\t{}\t{}\t{}\t{}\t{:e}\t{:e}\t{:e}\t{:e}",
            self.m,
            self.n,
            self.k,
            self.threads,
            self.lib,
            self.reps,
            self.median_s,
            self.best_s,
            self.max_diff,
            self.ref_err
        )
    }

    fn from_line(line: &str) -> Option<Row> {
        let f: Vec<&str> = line.strip_prefix("ROW\t")?.split('\t').collect();
        if f.len() != 10 {
            return None;
        }
        Some(Row {
            m: f[0].parse().ok()?,
            n: f[1].parse().ok()?,
            k: f[2].parse().ok()?,
            threads: f[3].parse().ok()?,
            lib: f[4].to_string(),
            reps: f[5].parse().ok()?,
            median_s: f[6].parse().ok()?,
            best_s: f[7].parse().ok()?,
            max_diff: f[8].parse().ok()?,
            ref_err: f[9].parse().ok()?,
        })
    }
}

fn parse_shapes(s: &str) -> Result<Vec<(usize, usize, usize)>, String> {
    s.split(',')
        .map(|t| {
            let d: Vec<usize> = t
                .split('x')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<_, _>>()
                .map_err(|e| format!("bad shape `{t}`: {e}"))?;
            match d[..] {
                [m, n, k] if m > 0 && n > 0 && k > 0 => Ok((m, n, k)),
                _ => Err(format!("shape `{t}` must be MxNxK with positive sizes")),
            }
        })
        .collect()
}

fn parse_args() -> Result<(Opts, Option<usize>), String> {
    let mut opts = Opts {
        threads: vec![1, 2],
        shapes: parse_shapes(DEFAULT_SHAPES)?,
        budget_ms: 400.0,
    };
    let mut child = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--threads" => {
                opts.threads = val()?
                    .split(',')
                    .map(|t| t.trim().parse::<usize>().map_err(|e| e.to_string()))
                    .collect::<Result<_, _>>()?;
                if opts.threads.iter().any(|&t| t == 0) {
                    return Err("thread counts must be >= 1".into());
                }
            }
            "--shapes" => opts.shapes = parse_shapes(&val()?)?,
            "--budget-ms" => opts.budget_ms = val()?.parse().map_err(|e| format!("{e}"))?,
            // Internal: run one thread count and print ROW lines.
            "--child" => child = Some(val()?.parse().map_err(|e| format!("{e}"))?),
            "-h" | "--help" => {
                println!(
                    "gemm-compare [--threads 1,2] [--budget-ms 400] [--shapes MxNxK,...]\n\
                     default shapes: {DEFAULT_SHAPES}"
                );
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument `{a}` (try --help)")),
        }
    }
    Ok((opts, child))
}

/// Deterministic uniform values in [-1, 1) (xorshift64*), so runs are comparable.
fn fill(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let r = s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 random bits
            (r as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}

/// The inputs of one case plus each library's output buffer.
struct Case {
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
    a: Vec<f32>, // (M, K)
    b: Vec<f32>, // (K, N)
    ta: Tensor,  // (M, K), Braid's copy of `a`
    tb: Tensor,  // (K, N)
}

impl Case {
    /// Runs library `lib` once; Braid allocates its output, the others write into `c` (M, N).
    fn run(&self, lib: usize, c: &mut Vec<f32>) -> Result<(), String> {
        let (m, n, k, t) = (self.m, self.n, self.k, self.threads);
        match lib {
            0 => {
                let par = if t > 1 {
                    gemm::Parallelism::Rayon(t)
                } else {
                    gemm::Parallelism::None
                };
                // SAFETY: a is (m, k), b is (k, n), c is (m, n), all contiguous row-major
                // with exactly those lengths (checked in `bench_case`), so every index the
                // (col stride, row stride) pairs below form is in bounds; c is a distinct
                // mutable buffer, so it aliases neither input.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        self.a.as_ptr(),
                        1,
                        k as isize,
                        self.b.as_ptr(),
                        1,
                        n as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        par,
                    )
                };
            }
            1 => {
                let par = match NonZeroUsize::new(t) {
                    Some(nt) if t > 1 => faer::Par::Rayon(nt),
                    _ => faer::Par::Seq,
                };
                let dst = faer::MatMut::from_row_major_slice_mut(c.as_mut_slice(), m, n);
                let lhs = faer::MatRef::from_row_major_slice(&self.a, m, k);
                let rhs = faer::MatRef::from_row_major_slice(&self.b, k, n);
                faer::linalg::matmul::matmul(dst, faer::Accum::Replace, lhs, rhs, 1.0f32, par);
            }
            2 => {
                // SAFETY: same layouts as the gemm call above; beta = 0 means c is only
                // written, and the row/col strides (n, 1), (k, 1), (n, 1) stay in bounds.
                unsafe {
                    matrixmultiply::sgemm(
                        m,
                        k,
                        n,
                        1.0,
                        self.a.as_ptr(),
                        k as isize,
                        1,
                        self.b.as_ptr(),
                        n as isize,
                        1,
                        0.0,
                        c.as_mut_ptr(),
                        n as isize,
                        1,
                    )
                };
            }
            _ => {
                let y = braid_kernels::ops::matmul(&self.ta, &self.tb, false, false)
                    .map_err(|e| e.to_string())?;
                // Keep the output alive until after the timer stops only when asked for
                // it: `c` empty means "timing run", a drop of y is part of the cost.
                if !c.is_empty() {
                    *c = y.to_vec_f32().map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let h = v.len() / 2;
    if v.len() % 2 == 1 {
        v[h]
    } else {
        0.5 * (v[h - 1] + v[h])
    }
}

fn bench_case(
    (m, n, k): (usize, usize, usize),
    threads: usize,
    budget_s: f64,
) -> Result<Vec<Row>, String> {
    let a = fill(m * k, (m * 31 + k) as u64);
    let b = fill(k * n, (n * 17 + k + 7) as u64);
    let ta = Tensor::from_vec(a.clone(), [m, k], Device::Cpu).map_err(|e| e.to_string())?;
    let tb = Tensor::from_vec(b.clone(), [k, n], Device::Cpu).map_err(|e| e.to_string())?;
    let case = Case {
        m,
        n,
        k,
        threads,
        a,
        b,
        ta,
        tb,
    };

    // Warmup: one call per library (faults pages in, fills gemm's packing caches) that
    // also keeps the result for the correctness check. Poisoned with NaN so a library
    // that writes nothing cannot pass.
    let mut outs: Vec<Vec<f32>> = Vec::new();
    let mut warm = Vec::new();
    for lib in 0..LIBS.len() {
        let mut c = vec![f32::NAN; m * n];
        let t0 = Instant::now();
        case.run(lib, &mut c)?;
        warm.push(t0.elapsed().as_secs_f64());
        if c.len() != m * n {
            return Err(format!("{}: output has {} elements", LIBS[lib], c.len()));
        }
        outs.push(c);
    }

    // Correctness: whole output against gemm's, plus sampled entries against f64.
    let samples: Vec<(usize, usize)> = (0..64)
        .map(|s| ((s * 7919 + 13) % m, (s * 104_729 + 5) % n))
        .collect();
    let exact: Vec<f64> = samples
        .iter()
        .map(|&(i, j)| {
            (0..k)
                .map(|p| f64::from(case.a[i * k + p]) * f64::from(case.b[p * n + j]))
                .sum()
        })
        .collect();
    let max_diffs: Vec<f64> = outs
        .iter()
        .map(|c| {
            c.iter()
                .zip(&outs[0])
                .map(|(x, y)| f64::from((x - y).abs()))
                .fold(0.0, |acc: f64, d| {
                    if d.is_nan() {
                        f64::INFINITY
                    } else {
                        acc.max(d)
                    }
                })
        })
        .collect();
    let ref_errs: Vec<f64> = outs
        .iter()
        .map(|c| {
            samples
                .iter()
                .zip(&exact)
                .map(|(&(i, j), e)| (f64::from(c[i * n + j]) - e).abs())
                .fold(0.0, |acc: f64, d| {
                    if d.is_nan() {
                        f64::INFINITY
                    } else {
                        acc.max(d)
                    }
                })
        })
        .collect();
    drop(outs);

    // Timed rounds, libraries interleaved inside each round so a burst of background
    // load (other builds on this machine) hits all of them alike.
    let slowest = warm.iter().cloned().fold(0.0, f64::max);
    let reps = ((budget_s / slowest.max(1e-9)).round() as usize).clamp(MIN_REPS, MAX_REPS);
    let mut bufs: Vec<Vec<f32>> = (0..LIBS.len())
        .map(|lib| {
            if lib == 3 {
                Vec::new()
            } else {
                vec![0.0; m * n]
            }
        })
        .collect();
    let mut times = vec![Vec::with_capacity(reps); LIBS.len()];
    for _ in 0..reps {
        for (lib, buf) in bufs.iter_mut().enumerate() {
            let t0 = Instant::now();
            case.run(lib, buf)?;
            times[lib].push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(times
        .into_iter()
        .enumerate()
        .map(|(lib, t)| Row {
            m,
            n,
            k,
            threads,
            lib: LIBS[lib].to_string(),
            reps,
            best_s: t.iter().cloned().fold(f64::INFINITY, f64::min),
            median_s: median(t),
            max_diff: max_diffs[lib],
            ref_err: ref_errs[lib],
        })
        .collect())
}

fn run_child(opts: &Opts, threads: usize) -> Result<(), String> {
    let mm = std::env::var("MATMUL_NUM_THREADS").unwrap_or_default();
    if mm != threads.to_string() {
        return Err(format!(
            "MATMUL_NUM_THREADS is `{mm}`, expected {threads} (run without --child)"
        ));
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| e.to_string())?;
    pool.install(|| {
        for &shape in &opts.shapes {
            for row in bench_case(shape, threads, opts.budget_ms / 1e3)? {
                println!("{}", row.to_line());
            }
            eprintln!(
                "  done {}x{}x{} threads={threads}",
                shape.0, shape.1, shape.2
            );
        }
        Ok(())
    })
}

/// Accepted |error| for a K-long f32 dot product of values in [-1, 1): a wrong call
/// (transposed operand, missing block) is off by O(sqrt(K)), rounding by ~1e-7 * K.
fn tolerance(k: usize) -> f64 {
    1e-5 * k as f64
}

/// Prints one markdown table of GFLOP/s, at the median repetition or the fastest one
/// (`best`); the median table also carries the correctness columns. Returns false when
/// some library's output is out of tolerance.
fn print_table(rows: &[Row], best: bool) -> bool {
    let mut ok = true;
    if best {
        println!(
            "\nBest-of-reps GFLOP/s (fastest repetition: least disturbed by other load); ratio to the row's best in parentheses.\n"
        );
        println!("| M x N x K | threads | {} | reps |", LIBS.join(" | "));
        println!("|---|---|{}---|", "---|".repeat(LIBS.len()));
    } else {
        println!(
            "\nMedian GFLOP/s (2*M*N*K / median time); ratio to the row's best library in parentheses.\n"
        );
        println!(
            "| M x N x K | threads | {} | reps | max abs diff vs gemm | max err vs f64 |",
            LIBS.join(" | ")
        );
        println!("|---|---|{}---|---|---|", "---|".repeat(LIBS.len()));
    }
    let mut keys: Vec<(usize, usize, usize, usize)> =
        rows.iter().map(|r| (r.m, r.n, r.k, r.threads)).collect();
    keys.dedup();
    for key in keys {
        let group: Vec<&Row> = rows
            .iter()
            .filter(|r| (r.m, r.n, r.k, r.threads) == key)
            .collect();
        let top = group.iter().map(|r| r.gflops(best)).fold(0.0, f64::max);
        let cells: Vec<String> = LIBS
            .iter()
            .map(|lib| match group.iter().find(|r| r.lib == *lib) {
                Some(r) => format!("{:.1} ({:.2})", r.gflops(best), r.gflops(best) / top),
                None => "-".into(),
            })
            .collect();
        let shape = format!("{}x{}x{} | {}", key.0, key.1, key.2, key.3);
        let reps = group.first().map_or(0, |r| r.reps);
        if best {
            println!("| {shape} | {} | {reps} |", cells.join(" | "));
            continue;
        }
        let max_diff = group.iter().map(|r| r.max_diff).fold(0.0, f64::max);
        let ref_err = group.iter().map(|r| r.ref_err).fold(0.0, f64::max);
        let tol = tolerance(key.2);
        let verdict = if max_diff <= tol && ref_err <= tol {
            ""
        } else {
            ok = false;
            " **WRONG**"
        };
        println!(
            "| {shape} | {} | {reps} | {max_diff:.1e}{verdict} | {ref_err:.1e} |",
            cells.join(" | "),
        );
        for r in &group {
            if r.max_diff > tol || r.ref_err > tol {
                println!(
                    "  ^ {} disagrees: max diff vs gemm {:e}, vs f64 {:e} (tolerance {tol:e})",
                    r.lib, r.max_diff, r.ref_err
                );
            }
        }
    }
    ok
}

fn main() -> ExitCode {
    let (opts, child) = match parse_args() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("gemm-compare: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(t) = child {
        return match run_child(&opts, t) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("gemm-compare child (threads={t}): {e}");
                ExitCode::FAILURE
            }
        };
    }

    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("gemm-compare: cannot find own executable: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shapes: Vec<String> = opts
        .shapes
        .iter()
        .map(|(m, n, k)| format!("{m}x{n}x{k}"))
        .collect();
    eprintln!(
        "gemm-compare: shapes {} | threads {:?} | ~{} ms per (case, library) | gemm avx512 microkernels: {}",
        shapes.join(","),
        opts.threads,
        opts.budget_ms,
        cfg!(feature = "gemm-avx512")
    );
    let started = Instant::now();
    let mut rows = Vec::new();
    for &t in &opts.threads {
        let out = Command::new(&exe)
            .args(["--child", &t.to_string()])
            .args(["--shapes", &shapes.join(",")])
            .args(["--budget-ms", &opts.budget_ms.to_string()])
            .env("MATMUL_NUM_THREADS", t.to_string())
            .stderr(std::process::Stdio::inherit())
            .output();
        match out {
            Ok(o) if o.status.success() => rows.extend(
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter_map(Row::from_line),
            ),
            Ok(o) => {
                eprintln!("gemm-compare: child for {t} threads failed: {}", o.status);
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("gemm-compare: cannot start child: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    // Group each shape's thread counts together.
    let order = |r: &Row| {
        opts.shapes
            .iter()
            .position(|&s| s == (r.m, r.n, r.k))
            .unwrap_or(usize::MAX)
    };
    rows.sort_by_key(|r| (order(r), r.threads));
    let ok = print_table(&rows, false);
    print_table(&rows, true);
    println!("\ntotal wall time {:.1} s", started.elapsed().as_secs_f64());
    if ok {
        ExitCode::SUCCESS
    } else {
        eprintln!("gemm-compare: some library disagrees with the others (see WRONG rows)");
        ExitCode::FAILURE
    }
}
