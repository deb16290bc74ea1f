//! Muse Spark Open's text decoder (`model.language_model` and `lm_head` of transformers 5.23's
//! `MuseSparkForConditionalGeneration`): its settings read from a checkpoint's `text_config`.
//!
//! A Muse Spark `config.json` nests the decoder's settings under `text_config`, and
//! transformers writes there only what differs from `MuseSparkTextConfig`'s defaults (the
//! released checkpoint's sizes). [`text_config`] fills them in, so the decoder reads as any
//! other `config.json`; the vision and audio towers are not loaded (their tensors are skipped,
//! and a row holding their placeholder tokens is refused).

use serde_json::{Map, Value, json};

use super::error::ModelError;

/// `model_type` of a Muse Spark checkpoint.
pub(crate) const MODEL_TYPE: &str = "muse_spark";

/// `model_type` of its text decoder.
pub(crate) const TEXT_MODEL_TYPE: &str = "muse_spark_text";

/// `MuseSparkTextConfig`'s defaults (transformers 5.23), those a saved `text_config` may omit.
fn defaults() -> Value {
    json!({
        "vocab_size": 202048, "hidden_size": 8192, "intermediate_size": 16384,
        "num_hidden_layers": 62, "num_attention_heads": 128, "num_key_value_heads": 16,
        "head_dim": 64, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
        "eos_token_id": 200001, "bos_token_id": 200000, "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "attention_bias": false, "sliding_window": 2048, "final_logit_softcapping": 20.0,
        "qk_scale_factor": 5.4730064863875, "output_multiplier": 0.1767766952966369,
        "post_norm_eps": 1e-8, "hidden_act": "silu", "moe_intermediate_size": 4096,
        "num_local_experts": 256, "num_experts_per_tok": 8, "routed_scaling_factor": 1.0,
        "moe_hidden_size": 4096, "residual_gate_temperature": 0.3, "output_router_logits": false,
    })
}

/// The decoder's `config.json` fields of a Muse Spark config `outer`: its `text_config` over
/// the defaults, with the per-layer lists transformers derives when they are absent (every
/// fourth layer counted back from the last full attention without RoPE, the others sliding;
/// every MLP sparse).
pub(crate) fn text_config(outer: &Value) -> Result<Value, ModelError> {
    let Some(text) = outer.get("text_config").and_then(Value::as_object) else {
        return Err(ModelError::unsupported(
            "text_config",
            "missing",
            "a muse_spark config.json holds its decoder's settings there",
        ));
    };
    let mut merged: Map<String, Value> = defaults().as_object().cloned().unwrap_or_default();
    // An explicit null stays (transformers reads it as None), except for the per-layer lists
    // derived below.
    merged.extend(text.iter().map(|(k, v)| (k.clone(), v.clone())));
    merged
        .retain(|k, v| !(v.is_null() && matches!(k.as_str(), "layer_types" | "mlp_layer_types" | "layer_rope_theta")));
    merged.insert("model_type".into(), TEXT_MODEL_TYPE.into());
    let layers = merged
        .get("num_hidden_layers")
        .and_then(Value::as_i64)
        .unwrap_or(0)
        .max(0);
    let every_fourth = |i: i64| (layers - 1 - i) % 4 == 0;
    merged.entry("layer_types").or_insert_with(|| {
        (0..layers)
            .map(|i| {
                if every_fourth(i) {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect()
    });
    merged
        .entry("mlp_layer_types")
        .or_insert_with(|| (0..layers).map(|_| "sparse").collect());
    let theta = merged
        .get("rope_parameters")
        .and_then(|p| p.get("rope_theta"))
        .cloned()
        .unwrap_or(json!(500000.0));
    merged.entry("layer_rope_theta").or_insert_with(|| {
        (0..layers)
            .map(|i| if every_fourth(i) { json!(0) } else { theta.clone() })
            .collect()
    });
    Ok(Value::Object(merged))
}

/// The placeholder ids of the towers treetrain does not run, with their names: the outer
/// config's `image_token_id`, `video_token_id` and `audio_token_id` (`MuseSparkConfig`'s
/// defaults where absent).
pub(crate) fn tower_tokens(outer: &Value) -> Vec<(String, i64)> {
    [
        ("image_token_id", 200092),
        ("video_token_id", 200091),
        ("audio_token_id", 200038),
    ]
    .into_iter()
    .map(|(name, default)| {
        (
            name.to_string(),
            outer.get(name).and_then(Value::as_i64).unwrap_or(default),
        )
    })
    .collect()
}
