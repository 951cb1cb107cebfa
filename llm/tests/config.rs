//! Config: Hugging Face `config.json` parsing (5.x and 4.x rope styles), validation
//! errors that name the key, unknown architectures, and RoPE inverse frequencies of
//! every scaling type against values printed by transformers 5.24's
//! `ROPE_INIT_FUNCTIONS` (head_dim 16).

#![allow(clippy::unwrap_used, clippy::excessive_precision)]

mod common;

use braid_kernels::testing::assert_close;
use braid_llm::rope::inv_freq_and_factor;
use braid_llm::{Family, LlmConfig, RopeScaling, RopeSpec};
use braid_nn::Error;
use common::{TestResult, fixture, tiny_config};
use serde_json::json;

fn hf_base() -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 11, "hidden_size": 32, "intermediate_size": 12,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
    })
}

fn with_rope(rope: serde_json::Value) -> LlmConfig {
    let mut j = hf_base();
    j["rope_parameters"] = rope;
    LlmConfig::from_hf_json(&j).unwrap()
}

fn check_rope(what: &str, config: &LlmConfig, want: &[f32], want_factor: f64) {
    let (inv, a) = inv_freq_and_factor(config);
    assert_close(what, &inv, want, 0.0, 3e-7);
    assert!(
        (f64::from(a) - want_factor).abs() < 1e-6,
        "{what}: attention factor {a} vs {want_factor}"
    );
}

#[test]
fn rope_llama3_matches_transformers() {
    let c = with_rope(
        json!({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    );
    let want = [
        1.0,
        0.0958399772644043,
        0.012500000186264515,
        0.0039528473280370235,
        0.0012499999720603228,
        0.00039528473280370235,
        0.0001250000059371814,
        3.9528473280370235e-05,
    ];
    check_rope("llama3", &c, &want, 1.0);
}

#[test]
fn rope_yarn_matches_transformers() {
    let c = with_rope(
        json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}),
    );
    let want = [
        1.0,
        0.07905694097280502,
        0.02500000037252903,
        0.007905694656074047,
        0.0024999999441206455,
        0.0007905694656074047,
        0.0002500000118743628,
        7.905694656074047e-05,
    ];
    check_rope("yarn", &c, &want, 1.138629436111989);
    // Every optional key: betas, mscale / mscale_all_dim, no truncation.
    let c = with_rope(
        json!({"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
        "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
        "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": false}),
    );
    let want = [
        1.0,
        0.024240344762802124,
        0.004700753837823868,
        0.0009115831344388425,
        0.00017677668074611574,
        3.428102354519069e-05,
        6.647869668086059e-06,
        1.289173155782919e-06,
    ];
    check_rope("yarn with options", &c, &want, 1.0565079928608092);
}

#[test]
fn rope_dynamic_ntk_beyond_max_positions_matches_transformers() -> TestResult {
    let mut j = hf_base();
    j["max_position_embeddings"] = json!(16);
    j["rope_parameters"] = json!({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0});
    let c = LlmConfig::from_hf_json(&j)?;
    let rope = braid_llm::rope::build_rope(&c)?;
    // Up to max_position_embeddings: the unscaled frequencies.
    let plain = braid_llm::rope::default_inv_freq(10000.0, 16);
    assert_eq!(*rope.inv_freq_for(16), plain[..]);
    // A batch whose positions reach 39 (seq_len 40 > 16): the NTK-scaled base.
    let want = [
        1.0,
        0.25941282510757446,
        0.06729500740766525,
        0.01745718903839588,
        0.0045286184176802635,
        0.0011747815879061818,
        0.0003047533973585814,
        7.905694656074047e-05,
    ];
    assert_close("dynamic", &rope.inv_freq_for(40), &want, 0.0, 3e-7);
    Ok(())
}

#[test]
fn hf_4x_style_config_reads_like_5x() -> TestResult {
    // unseen/llama is written 4.x style: top-level rope_theta, rope_scaling, torch_dtype.
    let c = LlmConfig::from_hf_config(&fixture("unseen/llama"))?;
    assert_eq!(c.family, Family::Llama);
    assert_eq!(
        c.rope,
        RopeSpec {
            theta: 10000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 32
            }
        }
    );
    assert_eq!((c.heads, c.kv_heads, c.head_dim, c.layers), (3, 1, 16, 3));
    // 4.x `type` key instead of `rope_type`; original_max_position_embeddings defaults
    // to max_position_embeddings as in standardize_rope_params.
    let mut j = hf_base();
    j["rope_theta"] = json!(5e5);
    j["rope_scaling"] = json!({"type": "yarn", "factor": 4.0});
    let c = LlmConfig::from_hf_json(&j)?;
    assert_eq!(c.rope.theta, 5e5);
    assert!(matches!(
        c.rope.scaling,
        RopeScaling::Yarn {
            original_max_position_embeddings: 64,
            ..
        }
    ));
    // Qwen2: biases on q/k/v only; head_dim defaults to hidden / heads.
    let q = LlmConfig::from_hf_config(&fixture("qwen2_bias"))?;
    assert_eq!(q.family, Family::Qwen2);
    assert!(q.qkv_bias && !q.o_bias && q.tie_embeddings);
    assert_eq!(q.head_dim, 12);
    Ok(())
}

#[test]
fn unknown_architecture_lists_supported_ones() {
    let mut j = hf_base();
    j["architectures"] = json!(["GPT2LMHeadModel"]);
    let e = LlmConfig::from_hf_json(&j).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Config { .. }), "{e:?}");
    assert!(msg.contains("GPT2LMHeadModel"), "{msg}");
    assert!(
        msg.contains("LlamaForCausalLM") && msg.contains("Qwen2ForCausalLM"),
        "{msg}"
    );
    j.as_object_mut().unwrap().remove("architectures");
    assert!(LlmConfig::from_hf_json(&j).is_err());
}

#[test]
fn unsupported_hf_settings_are_errors_naming_the_key() {
    let cases = [
        ("hidden_act", json!("gelu"), "hidden_act"),
        ("partial_rotary_factor", json!(0.5), "partial_rotary_factor"),
        (
            "rope_parameters",
            json!({"rope_type": "longrope", "factor": 2.0}),
            "longrope",
        ),
        (
            "rope_parameters",
            json!({"rope_type": "linear", "factor": 2.0, "mrope_section": [1, 2]}),
            "mrope_section",
        ),
        ("rope_parameters", json!({"rope_type": "linear"}), "factor"),
        ("num_attention_heads", json!("two"), "num_attention_heads"),
    ];
    for (key, value, needle) in cases {
        let mut j = hf_base();
        j[key] = value;
        let msg = LlmConfig::from_hf_json(&j).unwrap_err().to_string();
        assert!(msg.contains(needle), "{key}: {msg}");
    }
    let mut j = hf_base();
    j["architectures"] = json!(["Qwen2ForCausalLM"]);
    j["use_sliding_window"] = json!(true);
    let msg = LlmConfig::from_hf_json(&j).unwrap_err().to_string();
    assert!(msg.contains("use_sliding_window"), "{msg}");
    j.as_object_mut().unwrap().remove("vocab_size");
    j["use_sliding_window"] = json!(false);
    let msg = LlmConfig::from_hf_json(&j).unwrap_err().to_string();
    assert!(
        msg.contains("vocab_size") && msg.contains("missing"),
        "{msg}"
    );
}

#[test]
fn validate_names_the_key() {
    type Edit = fn(&mut LlmConfig);
    let cases: [(Edit, &str); 14] = [
        (|c| c.o_bias = true, "`o_bias` = true differ"),
        (
            |c| c.family = Family::Qwen2,
            "family qwen2 has biases on q/k/v only",
        ),
        (|c| c.vocab = 0, "`vocab` = 0"),
        (|c| c.kv_heads = 3, "`kv_heads` = 3 must divide `heads` = 4"),
        (|c| c.head_dim = 5, "`head_dim` = 5 must be even"),
        (|c| c.rms_norm_eps = 0.0, "`rms_norm_eps`"),
        (|c| c.rope.theta = -1.0, "`rope.theta`"),
        (
            |c| c.rope.scaling = RopeScaling::Linear { factor: 0.5 },
            "`rope.scaling.factor` = 0.5",
        ),
        (
            |c| {
                c.rope.scaling = RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 4.0,
                    high_freq_factor: 1.0,
                    original_max_position_embeddings: 8,
                }
            },
            "low_freq_factor",
        ),
        (|c| c.layers = 0, "`layers` = 0"),
        // Sizes no model has: named before anything is allocated or wrapped.
        (
            |c| c.layers = 1_000_000,
            "`layers` = 1000000 is larger than any model's",
        ),
        (
            |c| c.intermediate = 1 << 62,
            "`intermediate` = 4611686018427387904",
        ),
        (
            |c| c.vocab = 4_000_000_000,
            "`vocab` = 4000000000 is larger",
        ),
        (
            |c| c.max_position_embeddings = usize::MAX,
            "`max_position_embeddings`",
        ),
    ];
    for (edit, needle) in cases {
        let mut c = tiny_config(false, false);
        c.validate().unwrap();
        edit(&mut c);
        let e = c.validate().unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e:?}");
        assert!(e.to_string().contains(needle), "{e} lacks {needle}");
    }
}

#[test]
fn braid_config_is_strict_and_round_trips() -> TestResult {
    let c = tiny_config(true, false);
    let text = serde_json::to_string(&c)?;
    assert_eq!(serde_json::from_str::<LlmConfig>(&text)?, c);
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    v["num_layers"] = json!(2);
    let e = serde_json::from_value::<LlmConfig>(v).unwrap_err();
    assert!(e.to_string().contains("num_layers"), "{e}");
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    v["rope"]["scaling"] = json!({"type": "linear", "factor": 2.0, "fator": 1.0});
    assert!(serde_json::from_value::<LlmConfig>(v).is_err());
    // to_hf_json -> from_hf_json is the identity, every rope type.
    let scalings = [
        RopeScaling::Default,
        RopeScaling::Linear { factor: 2.0 },
        RopeScaling::Dynamic { factor: 3.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        },
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 8,
            attention_factor: Some(1.5),
            beta_fast: Some(16.0),
            beta_slow: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: Some(false),
        },
    ];
    for s in scalings {
        let mut c = tiny_config(false, true);
        c.o_bias = true;
        c.mlp_bias = true;
        c.rope.scaling = s;
        assert_eq!(LlmConfig::from_hf_json(&c.to_hf_json())?, c);
    }
    let mut q = tiny_config(true, true);
    q.family = Family::Qwen2;
    q.o_bias = false;
    assert_eq!(LlmConfig::from_hf_json(&q.to_hf_json())?, q);
    Ok(())
}
