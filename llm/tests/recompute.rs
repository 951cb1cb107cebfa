//! Activation recomputation in an `LlmStage`: the same logits, input grad and parameter
//! grads bit for bit as keeping every activation, while the bytes held between the
//! forward and the backward shrink to the blocks' inputs. Memory is measured by a
//! counting global allocator (CPU tensors live on the heap), so this binary holds one
//! test: nothing else allocates while it measures.

#![allow(clippy::unwrap_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use braid_comm::SingleRank;
use braid_kernels::rng::Rng;
use braid_kernels::{Device, Tensor};
use braid_llm::{LlmConfig, LlmStage, StageInput};
use braid_nn::{Init, SeqInfo};
use common::{TestResult, grads, tiny_config};

/// The system allocator, counting live bytes and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let live = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call is forwarded unchanged to `System`, which upholds GlobalAlloc's
// contract; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout is passed on as given.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (i.e. System) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from System with `layout`; the caller guarantees new_size.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Live heap bytes now, and resets the high-water mark to it.
fn mark() -> usize {
    let live = LIVE.load(Ordering::Relaxed);
    PEAK.store(live, Ordering::Relaxed);
    live
}

/// What one forward + backward of a fresh stage gave, and the memory it took.
struct Run {
    logits: Vec<f32>,
    /// d hidden (T, C) of the stage's input
    dinput: Vec<f32>,
    grads: Vec<(String, Vec<f32>)>,
    /// bytes allocated by the forward and still live when it returns (the cache and the
    /// logits)
    held: usize,
    /// the most bytes live during the backward above what was live before the forward
    backward_peak: usize,
}

/// A last stage (layers 1..L, no embedding) over hidden states (T, C): its input is a
/// float the test owns, so the input grad is compared too.
fn run(cfg: &LlmConfig, t: usize, recompute: bool) -> TestResult<Run> {
    let dev = Device::Cpu;
    let mut stage = LlmStage::new(
        cfg,
        1..cfg.layers,
        &Init::new(11, dev).with_std(0.2),
        Arc::new(SingleRank),
    )?;
    stage.recompute = recompute;
    // Three packed samples: the recomputed forward must see the same packing.
    let seq = SeqInfo::packed(&[t / 2, t / 4, t - t / 2 - t / 4]);
    let x = Tensor::from_vec(
        Rng::new(3).normal_vec(t * cfg.hidden, 1.0),
        [t, cfg.hidden],
        dev,
    )?;
    let dlogits = Tensor::from_vec(
        Rng::new(4).normal_vec(t * cfg.vocab, 0.1),
        [t, cfg.vocab],
        dev,
    )?;
    let start = mark();
    let (logits, cache) = stage.forward(StageInput::Hidden(x), &seq)?;
    let held = LIVE.load(Ordering::Relaxed) - start;
    let logits_host = logits.to_vec_f32()?;
    drop(logits);
    mark();
    let dinput = stage.backward(cache, &dlogits)?.ok_or("no input grad")?;
    let backward_peak = PEAK.load(Ordering::Relaxed) - start;
    Ok(Run {
        logits: logits_host,
        dinput: dinput.to_vec_f32()?,
        grads: grads(&stage),
        held,
        backward_peak,
    })
}

#[test]
fn recomputation_gives_the_same_grads_and_holds_only_block_inputs() -> TestResult {
    // Wide enough that the blocks' activations dominate what a forward keeps.
    let cfg = LlmConfig {
        vocab: 32,
        hidden: 64,
        intermediate: 256,
        layers: 5,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        max_position_embeddings: 1024,
        ..tiny_config(false, true)
    };
    let t = 256;
    let full = run(&cfg, t, false)?;
    let rec = run(&cfg, t, true)?;

    // Same numbers: the recomputed forward is the forward.
    assert_eq!(rec.logits, full.logits, "logits");
    assert_eq!(rec.dinput, full.dinput, "input grad");
    assert_eq!(rec.grads.len(), full.grads.len());
    assert!(!full.grads.is_empty());
    for ((n, g), (m, h)) in rec.grads.iter().zip(&full.grads) {
        assert_eq!(n, m);
        assert_eq!(g, h, "grad of {n}");
    }

    // Held: 4 blocks' inputs (T, C) f32, the head's normed input and norm cache
    // (T, C) each, the logits (T, V) and small change (the packing).
    let blocks = cfg.layers - 1;
    let tc = t * cfg.hidden * 4;
    let floor = blocks * tc + t * cfg.vocab * 4;
    println!(
        "held after forward: {} B keeping everything, {} B recomputing ({:.1}x less); \
         backward peak {} B vs {} B; the blocks' inputs are {} B",
        full.held,
        rec.held,
        full.held as f64 / rec.held as f64,
        full.backward_peak,
        rec.backward_peak,
        blocks * tc
    );
    assert!(
        rec.held >= floor,
        "{} < {floor}: inputs not held?",
        rec.held
    );
    assert!(
        rec.held <= floor + 3 * tc,
        "recomputing still holds {} B, expected about {floor} B",
        rec.held
    );
    // Each block keeps about 5 (T, C) and 3 (T, MLP) tensors plus attention's own.
    assert!(
        full.held >= 4 * rec.held,
        "keeping everything holds {} B, recomputing {} B",
        full.held,
        rec.held
    );
    // The backward holds one block's activations at a time on top of the inputs.
    assert!(
        rec.backward_peak < full.backward_peak,
        "backward peak {} B recomputing vs {} B",
        rec.backward_peak,
        full.backward_peak
    );
    Ok(())
}
