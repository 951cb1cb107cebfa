//! Model, cluster and plan builders shared by the planner's tests.
#![allow(dead_code, clippy::unwrap_used)]

use braid_balancer::cluster::{Cluster, Link};
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

pub fn plan(llm: Layout, m: usize) -> Plan {
    Plan {
        placement: Placement::Disjoint,
        schedule: Schedule::Phased,
        microbatches: m,
        recompute: false,
        recompute_encoders: false,
        llm_first_stage_layers: None,
        llm_virtual_stages: 1,
        zero1: true,
        llm,
        vision: None,
        audio: None,
    }
}
