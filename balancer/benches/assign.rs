//! Time of one step's assignment (1,024 LLaVA-like samples, one core) and the load
//! imbalance before (round-robin) and after (data-aware).
//!
//! `cargo bench -p braid-balancer --bench assign`

use std::time::Instant;

use braid_balancer::synthetic::llava_like;
use braid_balancer::{Assigner, Balanced, Replicas, RoundRobin, TokenCost};

fn median_us(mut f: impl FnMut(), runs: usize) -> f64 {
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

fn main() {
    let c = Balanced {
        llm: TokenCost::transformer(32, 4096, 11008, 3, 4096 * 32000, true),
        vision: TokenCost::transformer(24, 1024, 4096, 2, 0, false),
        audio: TokenCost::transformer(24, 1024, 4096, 2, 0, false),
    };
    println!(
        "batch                         rows  assign(us) rr(us)  llm before/after  mb before/after  vision before/after  audio before/after"
    );
    for (name, speech) in [("llava-like 1024", 0.0), ("llava-like + 30% speech", 0.3)] {
        let b = llava_like(1024, speech, 4096, 7);
        let r = Replicas {
            llm_dp: 8,
            microbatches: 4,
            vision_dp: 8,
            audio_dp: 4,
        };
        let t = median_us(
            || {
                std::hint::black_box(c.assign(&b, &r));
            },
            301,
        );
        let t_rr = median_us(
            || {
                std::hint::black_box(RoundRobin.assign(&b, &r));
            },
            301,
        );
        let (x, y) = c.report(&b, &r);
        println!(
            "{name:<29} {:>4}  {t:>9.0} {t_rr:>6.0}  {:.3} / {:.3}     {:.3} / {:.3}    {:.3} / {:.3}        {:.3} / {:.3}",
            b.row_tokens.len(),
            x.llm,
            y.llm,
            x.microbatch,
            y.microbatch,
            x.vision,
            y.vision,
            x.audio,
            y.audio
        );
    }
}
