//! The data-aware assignment on LLaVA-like batches (with and without speech): max/mean
//! load over the replicas <= 1.05 for the LLM and both encoders, every row and item placed
//! once, and no worse than round-robin.

use braid_balancer::synthetic::llava_like;
use braid_balancer::{Assigner, Balanced, Replicas, TokenCost};

/// A 7B-class LLM (32 x 4096, SwiGLU 11008, vocab 32000), ViT-L/14, Whisper-medium.
fn costs() -> Balanced {
    Balanced {
        llm: TokenCost::transformer(32, 4096, 11008, 3, 4096 * 32000, true),
        vision: TokenCost::transformer(24, 1024, 4096, 2, 0, false),
        audio: TokenCost::transformer(24, 1024, 4096, 2, 0, false),
    }
}

#[test]
fn llava_like_batches_balance_to_within_five_percent() {
    for (speech, seed) in [(0.0, 1), (0.0, 2), (0.3, 3), (0.3, 4)] {
        let b = llava_like(1024, speech, 4096, seed);
        let r = Replicas {
            llm_dp: 8,
            microbatches: 4,
            vision_dp: 8,
            audio_dp: if speech > 0.0 { 4 } else { 1 },
        };
        let c = costs();
        let a = c.assign(&b, &r);
        a.validate(&b, &r).expect("a valid assignment");
        let (before, after) = c.report(&b, &r);
        for (what, x, y) in [
            ("llm", before.llm, after.llm),
            ("vision", before.vision, after.vision),
            ("audio", before.audio, after.audio),
        ] {
            assert!(
                y <= 1.05,
                "speech {speech} seed {seed}: {what} max/mean {y:.3}"
            );
            assert!(
                y <= x + 1e-9,
                "{what}: {y:.3} is worse than round-robin's {x:.3}"
            );
        }
        assert!(after.microbatch <= before.microbatch + 1e-9);
    }
}

#[test]
fn lpt_is_deterministic_and_fills_every_bin() {
    let costs = [5.0, 1.0, 4.0, 4.0, 2.0, 3.0, 3.0, 2.0];
    let a = braid_balancer::balance::lpt(&costs, 3);
    assert_eq!(a, braid_balancer::balance::lpt(&costs, 3));
    let mut load = [0.0; 3];
    for (c, &b) in costs.iter().zip(&a) {
        load[b] += c;
    }
    // Greedy's bound: no bin exceeds the mean by more than the largest item.
    assert!(
        load.iter().all(|&l| l > 0.0 && l <= 24.0 / 3.0 + 5.0),
        "{load:?}"
    );
    assert_eq!(load.iter().sum::<f64>(), 24.0);
    assert!(braid_balancer::balance::lpt(&[], 4).is_empty());
}

/// The overlapped schedule's assignment: rows where [`Balanced`] puts them, and every
/// microbatch's images balanced over the vision replicas on its own (within a microbatch
/// the per-step assignment can leave a replica idle while another has a long queue).
#[test]
fn per_microbatch_assignment_balances_each_chunk() {
    use braid_balancer::PerMicrobatch;
    for seed in [5, 6, 7] {
        let b = llava_like(512, 0.3, 4096, seed);
        let r = Replicas {
            llm_dp: 4,
            microbatches: 4,
            vision_dp: 8,
            audio_dp: 2,
        };
        let c = costs();
        let whole = c.assign(&b, &r);
        let chunked = PerMicrobatch(c).assign(&b, &r);
        chunked.validate(&b, &r).expect("a valid assignment");
        assert_eq!(chunked.rows, whole.rows, "rows are placed alike");
        let costs = c.costs(&b);
        let row_of: Vec<usize> = b
            .row_images
            .iter()
            .enumerate()
            .flat_map(|(row, &n)| std::iter::repeat_n(row, n))
            .collect();
        // The worst chunk's max/mean load over the replicas.
        let worst = |to: &[usize]| {
            (0..r.microbatches)
                .map(|k| {
                    let mut load = vec![0.0; r.vision_dp];
                    for (i, &rep) in to.iter().enumerate() {
                        if whole.rows[row_of[i]].1 == k {
                            load[rep] += costs.images[i];
                        }
                    }
                    let mean = load.iter().sum::<f64>() / load.len() as f64;
                    load.iter().copied().fold(0.0, f64::max) / mean
                })
                .fold(0.0, f64::max)
        };
        let (per_step, per_chunk) = (worst(&whole.images), worst(&chunked.images));
        assert!(
            per_chunk <= 1.1,
            "seed {seed}: worst chunk max/mean {per_chunk:.3}"
        );
        assert!(
            per_chunk < per_step,
            "seed {seed}: {per_chunk:.3} vs per step {per_step:.3}"
        );
    }
}

/// Microbatches with fewer items than replicas do not all go to the first replicas:
/// ties go to the replica with the least work so far.
#[test]
fn small_chunks_spread_over_the_replicas() {
    let mut before = vec![0.0; 4];
    let picked: Vec<usize> = (0..8)
        .map(|_| braid_balancer::balance::lpt_after(&[1.0], &mut before)[0])
        .collect();
    assert_eq!(picked, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    assert_eq!(before, vec![2.0; 4]);
    // Within a chunk it is still largest first to the least-loaded replica.
    let mut before = vec![0.0; 2];
    assert_eq!(
        braid_balancer::balance::lpt_after(&[3.0, 1.0, 2.0], &mut before),
        vec![0, 1, 1]
    );
}

/// The LLM-centric placement's assignment: every image and clip on an encoder replica of
/// its row's LLM replica (they run inside that replica's first stage), and each
/// (replica, microbatch)'s items spread so that no replica of the group carries more
/// than the mean plus the largest item.
#[test]
fn centric_assignment_keeps_items_in_their_row_s_replica() {
    use braid_balancer::Centric;
    for (seed, llm_dp, per_vision, per_audio) in
        [(8, 2, 4, 2), (9, 4, 2, 1), (10, 1, 8, 8), (11, 3, 2, 2)]
    {
        let b = llava_like(96, 0.3, 4096, seed);
        let r = Replicas {
            llm_dp,
            microbatches: 3,
            vision_dp: llm_dp * per_vision,
            audio_dp: llm_dp * per_audio,
        };
        let c = costs();
        let a = Centric(c, c).assign(&b, &r);
        a.validate(&b, &r).expect("a valid assignment");
        assert_eq!(
            a.rows,
            c.assign(&b, &r).rows,
            "rows are placed as the inner assigner does"
        );
        let costs = c.costs(&b);
        for (per_row, to, item_costs, per) in [
            (&b.row_images, &a.images, &costs.images, per_vision),
            (&b.row_clips, &a.clips, &costs.clips, per_audio),
        ] {
            let row_of: Vec<usize> = per_row
                .iter()
                .enumerate()
                .flat_map(|(row, &n)| std::iter::repeat_n(row, n))
                .collect();
            assert_eq!(row_of.len(), to.len());
            let mut load = vec![vec![vec![0.0; per]; r.microbatches]; llm_dp];
            let mut largest = vec![vec![0.0f64; r.microbatches]; llm_dp];
            for (i, &rep) in to.iter().enumerate() {
                let (d, mb) = a.rows[row_of[i]];
                assert_eq!(
                    rep / per,
                    d,
                    "item {i} of replica {d}'s row went to encoder replica {rep}"
                );
                load[d][mb][rep % per] += item_costs[i];
                largest[d][mb] = largest[d][mb].max(item_costs[i]);
            }
            for d in 0..llm_dp {
                for mb in 0..r.microbatches {
                    let l = &load[d][mb];
                    let mean = l.iter().sum::<f64>() / per as f64;
                    let max = l.iter().copied().fold(0.0, f64::max);
                    assert!(
                        max <= mean + largest[d][mb] + 1e-6,
                        "replica {d} mb {mb}: {l:?}"
                    );
                }
            }
        }
    }
}
