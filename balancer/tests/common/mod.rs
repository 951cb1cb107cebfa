//! Model, cluster and plan builders shared by the planner's tests.
#![allow(dead_code, clippy::unwrap_used)]

use braid_balancer::cluster::{Cluster, Link};
use braid_balancer::workload::{MediaTokens, Mix, RowShape, Workload, generate};
use braid_balancer::{Layout, ModelDims, ModuleDims, Placement, Plan, Problem, Schedule};

pub fn block(layers: usize, hidden: usize, heads: usize, causal: bool, vocab: usize) -> ModuleDims {
    ModuleDims {
        layers,
        hidden,
        heads,
        kv_heads: heads,
        head_dim: hidden / heads,
        ffn: 4 * hidden,
        mlp_mats: if causal { 3 } else { 2 },
        causal,
        vocab,
        tied: false,
        extra_params: 0,
        stem_flops_per_token: 0.0,
        projector_flops_per_token: 0.0,
    }
}

/// A cluster whose links are free: only compute takes time.
pub fn free_links() -> Cluster {
    let mut c = Cluster::preset("h100").unwrap();
    c.intra = Link {
        bandwidth_gbs: 1e12,
        latency_us: 0.0,
    };
    c.inter = c.intra;
    c.layer_overhead_us = 0.0;
    c
}

pub fn llm_only(layers: usize) -> ModelDims {
    ModelDims {
        llm: block(layers, 1024, 16, true, 0),
        vision: None,
        audio: None,
        vision_llm_ratio: 1.0,
        audio_llm_ratio: 0.125,
    }
}

/// A problem with no frozen modules, no loader time and the sync after the backward.
pub fn problem(model: ModelDims, cluster: Cluster) -> Problem {
    Problem {
        model,
        cluster,
        frozen: vec![],
        input_s: 0.0,
        overlap_sync: false,
        sequence_parallel: true,
    }
}

/// `n` rows of one 1,024-token text sample each: equal microbatches.
pub fn equal_rows(n: usize) -> Vec<RowShape> {
    (0..n)
        .map(|_| RowShape {
            samples: vec![1024],
            images: vec![],
            clips: vec![],
        })
        .collect()
}

/// An LLM layout of `pp` stages and nothing else.
pub fn pipeline(pp: usize) -> Layout {
    Layout {
        tp: 1,
        cp: 1,
        pp,
        dp: 1,
    }
}

pub fn plan(llm: Layout, m: usize) -> Plan {
    Plan {
        placement: Placement::Disjoint,
        schedule: Schedule::Phased,
        microbatches: m,
        recompute: false,
        recompute_encoders: false,
        recompute_audio: None,
        llm_first_stage_layers: None,
        llm_virtual_stages: 1,
        reverse_encoder_stages: false,
        llm_zero_bubble: false,
        zero1: true,
        llm,
        vision: None,
        audio: None,
    }
}

/// A small three-module model on 16 GPUs: brute force is feasible.
pub fn small() -> (Problem, Workload) {
    let model = ModelDims {
        llm: block(8, 2048, 16, true, 32000),
        vision: Some(block(12, 1024, 16, false, 0)),
        audio: Some(block(8, 512, 8, false, 0)),
        vision_llm_ratio: 0.25,
        audio_llm_ratio: 0.125,
    };
    let mix = Mix {
        text_median: 200.0,
        text_sigma: 1.0,
        image_prob: 0.7,
        images_max: 4,
        audio_prob: 0.3,
        clips_max: 2,
        clip_s: [5.0, 30.0],
    };
    let media = MediaTokens {
        image_encoder: 1024,
        image_llm: 256,
        llm_per_frame: 0.125,
    };
    let rows = generate(&mix, media, 600, 4096, 3);
    let mut cluster = Cluster::preset("h100").unwrap();
    cluster.gpus_per_node = 4;
    let w = Workload {
        rows,
        batch_rows: 32,
        seq_len: 4096,
    };
    (problem(model, cluster), w)
}
