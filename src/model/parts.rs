//! The parts of a decoder, chosen once from the config: how q and k are normed, whether the
//! attention output is gated, where the norms sit and of which kind, how a sub-layer joins the
//! residual stream, each layer's attention span and rotary embedding, what wraps the
//! embedding and the logits. The layers read these; nothing else branches on the family.
//! A new family is a match arm in [`DecoderParts::of`] (and a file for any new part).

use serde_json::Value;

use super::config::{Architecture, HfConfig};
use super::error::ModelError;
use super::muse_spark;
use super::norm::NormKind;

/// How a layer norms its queries and keys, per head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QkNorm {
    /// None (Llama, Qwen2).
    None,
    /// A scaled RMS norm each, `q_norm` and `k_norm` (Qwen3).
    PerHead,
    /// A weightless RMS norm, the queries then multiplied by `query_scale` (Muse Spark's
    /// `qk_norm` and `qk_scale_factor`).
    Weightless {
        /// `qk_scale_factor`.
        query_scale: f64,
    },
}

/// Where a layer's norms sit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LayerNorms {
    /// A scaled norm before attention (`input_layernorm`) and before the MLP
    /// (`post_attention_layernorm`).
    PreNorm,
    /// Muse Spark's: a centered norm before each sub-layer (`input_layernorm`,
    /// `pre_feedforward_layernorm`), a weightless one after attention
    /// (`post_attention_layernorm`) and an input-scaled one after the MLP
    /// (`post_feedforward_layernorm`), both with `post_norm_eps`.
    Sandwich {
        /// `post_norm_eps`.
        post_norm_eps: f64,
    },
}

impl LayerNorms {
    /// The norm kind before a sub-layer and, if any, after it (`attention` or the MLP).
    pub(crate) fn kinds(self, attention: bool) -> (NormKind, Option<NormKind>) {
        match self {
            LayerNorms::PreNorm => (NormKind::Scaled, None),
            LayerNorms::Sandwich { .. } if attention => (NormKind::Centered, Some(NormKind::Weightless)),
            LayerNorms::Sandwich { .. } => (NormKind::Centered, Some(NormKind::InputScaled)),
        }
    }
}

/// One layer's attention span and rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerAttention {
    /// A query sees the last `window` positions of its path, itself included (`None`: all).
    pub window: Option<i64>,
    /// Whether RoPE rotates q and k (`false`: a NoPE layer).
    pub rope: bool,
}

/// `cap * tanh(logits * multiplier / cap)` (Muse Spark's `output_multiplier` and
/// `final_logit_softcapping`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitSoftcap {
    /// `output_multiplier`.
    pub multiplier: f64,
    /// `final_logit_softcapping`.
    pub cap: f64,
}

/// Everything about a decoder's layers that differs between families.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderParts {
    /// q/k norms.
    pub qk_norm: QkNorm,
    /// The attention output normed per head (weightless) and gated by
    /// `sigmoid(gate_proj(x))` before `o_proj` (Muse Spark).
    pub attention_gate: bool,
    /// The norms of a layer.
    pub norms: LayerNorms,
    /// Residual gates' `residual_gate_temperature` (`None`: plain sums).
    pub residual_gate: Option<f64>,
    /// A weightless RMS norm after the embedding (Muse Spark).
    pub embedding_norm: bool,
    /// What wraps the logits (`None`: nothing).
    pub logit_softcap: Option<LogitSoftcap>,
    /// Per layer.
    pub layers: Vec<LayerAttention>,
    /// Token ids that stand for inputs of towers treetrain does not load, by setting name.
    pub tower_tokens: Vec<(String, i64)>,
    /// The decoder sits under `model.language_model` (a multimodal checkpoint).
    pub language_model: bool,
}

impl DecoderParts {
    /// The parts of `arch` as `hf` configures them.
    pub(crate) fn of(arch: Architecture, hf: &HfConfig) -> Result<Self, ModelError> {
        let layers = hf.num_hidden_layers.max(0) as usize;
        let plain = LayerAttention {
            window: None,
            rope: true,
        };
        let mut parts = DecoderParts {
            qk_norm: QkNorm::None,
            attention_gate: false,
            norms: LayerNorms::PreNorm,
            residual_gate: None,
            embedding_norm: false,
            logit_softcap: None,
            layers: vec![plain; layers],
            tower_tokens: Vec::new(),
            language_model: false,
        };
        match arch {
            Architecture::Llama | Architecture::Qwen2 => {}
            Architecture::Qwen3 | Architecture::Qwen3Moe => parts.qk_norm = QkNorm::PerHead,
            Architecture::MuseSparkText => parts.muse_spark(hf)?,
        }
        Ok(parts)
    }

    /// Muse Spark's text decoder.
    fn muse_spark(&mut self, hf: &HfConfig) -> Result<(), ModelError> {
        let x = &hf.extra;
        self.qk_norm = QkNorm::Weightless {
            query_scale: finite(x, "qk_scale_factor", false)?,
        };
        self.attention_gate = true;
        self.norms = LayerNorms::Sandwich {
            post_norm_eps: finite(x, "post_norm_eps", true)?,
        };
        self.residual_gate = Some(finite(x, "residual_gate_temperature", true)?);
        self.embedding_norm = true;
        self.logit_softcap = Some(LogitSoftcap {
            multiplier: finite(x, "output_multiplier", false)?,
            cap: finite(x, "final_logit_softcapping", true)?,
        });
        let window = match x.get("sliding_window").and_then(Value::as_i64) {
            Some(w) if w > 0 => Some(w),
            _ => None,
        };
        let kinds = hf.layer_types.clone().unwrap_or_default();
        let thetas: Vec<f64> = list(x, "layer_rope_theta")?;
        for (field, n) in [("layer_types", kinds.len()), ("layer_rope_theta", thetas.len())] {
            if n != self.layers.len() {
                return Err(ModelError::unsupported(
                    field,
                    format!("{n} entries"),
                    &format!("needs one per layer, {}", self.layers.len()),
                ));
            }
        }
        for ((layer, kind), theta) in self.layers.iter_mut().zip(&kinds).zip(&thetas) {
            layer.window = match kind.as_str() {
                "full_attention" => None,
                "sliding_attention" => Some(window.ok_or_else(|| {
                    ModelError::unsupported("sliding_window", "absent", "a sliding_attention layer needs it > 0")
                })?),
                other => {
                    return Err(ModelError::unsupported(
                        "layer_types",
                        format!("{other:?}"),
                        "Muse Spark's layers are full_attention or sliding_attention",
                    ));
                }
            };
            // transformers rotates every layer whose theta is non-zero by the global
            // `rope_parameters`: only zero (NoPE) is read from the list.
            layer.rope = *theta != 0.0;
        }
        self.tower_tokens = hf.wrapper.as_ref().map(muse_spark::tower_tokens).unwrap_or_default();
        self.language_model = true;
        Ok(())
    }

    /// The sliding window of the model's sliding layers (one `sliding_window` for all).
    pub fn window(&self) -> Option<i64> {
        self.layers.iter().find_map(|l| l.window)
    }
}

/// `extra[name]` as a finite number (and `> 0` when `positive`), named when it is not.
fn finite(x: &std::collections::BTreeMap<String, Value>, name: &str, positive: bool) -> Result<f64, ModelError> {
    match x.get(name).and_then(Value::as_f64) {
        Some(v) if v.is_finite() && (!positive || v > 0.0) => Ok(v),
        Some(v) => Err(ModelError::unsupported(
            name,
            v,
            if positive {
                "must be finite and > 0"
            } else {
                "must be finite"
            },
        )),
        None => Err(ModelError::unsupported(
            name,
            "missing",
            "Muse Spark's decoder needs it",
        )),
    }
}

/// `extra[name]` as a list of `T`, named when it is absent or of another type.
fn list<T: serde::de::DeserializeOwned>(
    x: &std::collections::BTreeMap<String, Value>,
    name: &str,
) -> Result<Vec<T>, ModelError> {
    let v = x
        .get(name)
        .ok_or_else(|| ModelError::unsupported(name, "missing", "Muse Spark's decoder needs it"))?;
    serde_json::from_value(v.clone()).map_err(|e| ModelError::unsupported(name, v, &format!("has the wrong type: {e}")))
}
