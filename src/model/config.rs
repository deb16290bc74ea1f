//! `config.json` as Hugging Face writes it, and the validated runtime config.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::ModelError;
use super::moe::MixtureConfig;
use super::muse_spark;
use super::parts::{DecoderParts, LayerNorms, QkNorm};

/// An int-or-list field (`eos_token_id` is written both ways).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// A single id.
    One(i64),
    /// Several ids.
    Many(Vec<i64>),
}

impl OneOrMany {
    /// The ids as a list.
    pub fn to_vec(&self) -> Vec<i64> {
        match self {
            OneOrMany::One(x) => vec![*x],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// `config.json` of a Qwen3, Qwen2/2.5, Llama or Qwen3-MoE checkpoint, field for field (a mixture's
/// fields are read from `extra`, see [`super::moe::MixtureConfig`]). Fields treetrain
/// does not interpret are kept in `extra`, so saving writes them back unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HfConfig {
    /// `qwen3`, `qwen2`, `llama` or `qwen3_moe`.
    pub model_type: String,
    /// e.g. `["Qwen3ForCausalLM"]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architectures: Option<Vec<String>>,
    /// Vocabulary rows of the embedding.
    pub vocab_size: i64,
    /// Model width.
    pub hidden_size: i64,
    /// MLP width.
    pub intermediate_size: i64,
    /// Decoder layers.
    pub num_hidden_layers: i64,
    /// Query heads.
    pub num_attention_heads: i64,
    /// Key/value heads (GQA); absent means equal to query heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<i64>,
    /// Per-head width; absent means hidden_size / heads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<i64>,
    /// Must be `silu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    /// RMSNorm epsilon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rms_norm_eps: Option<f64>,
    /// RoPE base (transformers < 5 writes it here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// RoPE scaling (transformers < 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Value>,
    /// RoPE base and scaling together (transformers >= 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_parameters: Option<Value>,
    /// Bias on q/k/v/o projections (Llama, Qwen3); Qwen2 always has q/k/v bias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bias: Option<bool>,
    /// Bias on the MLP projections (Llama).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlp_bias: Option<bool>,
    /// LM head shares the embedding matrix; absent means false for these architectures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_word_embeddings: Option<bool>,
    /// Longest position the model was trained for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_position_embeddings: Option<i64>,
    /// Sliding-window attention switch (Qwen2/3); only `false` is supported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_sliding_window: Option<bool>,
    /// Per-layer attention kinds (transformers >= 4.5x).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<String>>,
    /// Beginning-of-sequence id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos_token_id: Option<i64>,
    /// End-of-sequence id(s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eos_token_id: Option<OneOrMany>,
    /// Padding id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_token_id: Option<i64>,
    /// Checkpoint dtype (transformers < 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub torch_dtype: Option<String>,
    /// Checkpoint dtype (transformers >= 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Everything else, written back unchanged on save.
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
    /// The whole `config.json` of a checkpoint whose decoder is configured in `text_config`
    /// (Muse Spark): what a save writes back.
    #[serde(skip)]
    pub(crate) wrapper: Option<Value>,
}

/// What an unknown `model_type` is told.
const IMPLEMENTED: &str = "treetrain implements qwen3, qwen2, llama, qwen3_moe and muse_spark (its text decoder)";

/// The decoder families treetrain implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen3: RMSNorm on q and k per head, no bias by default.
    Qwen3,
    /// Qwen2 / Qwen2.5: bias on q, k, v.
    Qwen2,
    /// Llama 2/3/3.x and look-alikes.
    Llama,
    /// Qwen3-MoE: Qwen3's attention, routed experts in the sparse layers.
    Qwen3Moe,
    /// Muse Spark Open's text decoder: sandwich norms, gated residuals and attention, sliding
    /// and NoPE layers, sigmoid-routed experts at a narrower width.
    MuseSparkText,
}

impl Architecture {
    /// The family's name as its model cards write it.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "Qwen3",
            Architecture::Qwen2 => "Qwen2",
            Architecture::Llama => "Llama",
            Architecture::Qwen3Moe => "Qwen3-MoE",
            Architecture::MuseSparkText => "Muse Spark",
        }
    }
}

impl RopeScaling {
    /// The scaling in words, for displays.
    pub fn describe(&self) -> String {
        match self {
            RopeScaling::None => "no scaling".into(),
            RopeScaling::Linear { factor } => format!("linear scaling x{factor}"),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => format!(
                "Llama 3.1 scaling x{factor} (low/high frequency factors {low_freq_factor}/{high_freq_factor}, trained on {original_max_position_embeddings} positions)"
            ),
        }
    }
}

/// How RoPE frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Divisor.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Divisor for low frequencies.
        factor: f64,
        /// Wavelength threshold factor below which frequencies are scaled.
        low_freq_factor: f64,
        /// Wavelength threshold factor above which frequencies are kept.
        high_freq_factor: f64,
        /// Context length the base model was trained with.
        original_max_position_embeddings: f64,
    },
}

/// A validated config: everything the model code reads, nothing it must re-check.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Family.
    pub arch: Architecture,
    /// Vocabulary size.
    pub vocab_size: i64,
    /// Width.
    pub hidden_size: i64,
    /// MLP width.
    pub intermediate_size: i64,
    /// Layers.
    pub num_layers: i64,
    /// Query heads.
    pub num_heads: i64,
    /// Key/value heads.
    pub num_kv_heads: i64,
    /// Per-head width.
    pub head_dim: i64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope_scaling: RopeScaling,
    /// The layers' parts, chosen once from the config (q/k norms, norm and residual kinds,
    /// windows, NoPE layers, what wraps the embedding and the logits).
    pub parts: DecoderParts,
    /// Bias on q, k, v.
    pub qkv_bias: bool,
    /// Bias on o.
    pub o_bias: bool,
    /// Bias on the MLP.
    pub mlp_bias: bool,
    /// LM head = embedding.
    pub tie_word_embeddings: bool,
    /// End-of-sequence ids.
    pub eos_token_ids: Vec<i64>,
    /// BOS id.
    pub bos_token_id: Option<i64>,
    /// Padding id.
    pub pad_token_id: Option<i64>,
    /// Longest sequence the model was made for (`max_position_embeddings`), when the config
    /// says.
    pub max_positions: Option<i64>,
    /// The experts of a mixture model (None for a dense one).
    pub mixture: Option<MixtureConfig>,
}

impl HfConfig {
    /// Reads and parses a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let json = |e: serde_json::Error| ModelError::Json {
            path: path.into(),
            message: e.to_string(),
        };
        let value: Value = serde_json::from_str(&text).map_err(json)?;
        // A multimodal checkpoint keeps its decoder's settings under `text_config`: name what it
        // is rather than a top-level field it never had.
        if value.get("model_type").and_then(Value::as_str) == Some(muse_spark::MODEL_TYPE) {
            let mut config: HfConfig = serde_json::from_value(muse_spark::text_config(&value)?).map_err(json)?;
            config.wrapper = Some(value);
            return Ok(config);
        }
        if value.get("text_config").is_some_and(Value::is_object) && value.get("vocab_size").is_none() {
            let kind = value.get("model_type").and_then(Value::as_str).unwrap_or("absent");
            return Err(ModelError::unsupported(
                "model_type",
                format!("{kind:?}"),
                &format!("a multimodal checkpoint whose text decoder is configured in `text_config`; {IMPLEMENTED}"),
            ));
        }
        serde_json::from_value(value).map_err(json)
    }

    /// The checkpoint's dtype as written (`dtype` or `torch_dtype`).
    pub(crate) fn checkpoint_dtype(&self) -> Option<&str> {
        self.dtype.as_deref().or(self.torch_dtype.as_deref())
    }

    /// Validates into a [`ModelConfig`]; anything unsupported is an error naming its field.
    pub fn validate(&self) -> Result<ModelConfig, ModelError> {
        let arch = self.architecture()?;
        let (num_heads, num_kv_heads, head_dim) = self.attention_shape()?;
        self.check_features()?;
        let (rope_theta, rope_scaling) = self.rope()?;
        let rms_norm_eps = self.rms_norm_eps.unwrap_or(1e-6);
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
            return Err(ModelError::unsupported(
                "rms_norm_eps",
                rms_norm_eps,
                "must be finite and > 0 (RMSNorm divides by sqrt(mean + eps))",
            ));
        }
        let attention_bias = self.attention_bias.unwrap_or(false);
        Ok(ModelConfig {
            arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            parts: DecoderParts::of(arch, self)?,
            qkv_bias: arch == Architecture::Qwen2 || attention_bias,
            o_bias: arch != Architecture::Qwen2 && attention_bias,
            mlp_bias: arch == Architecture::Llama && self.mlp_bias.unwrap_or(false),
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            eos_token_ids: self.eos_token_id.as_ref().map(OneOrMany::to_vec).unwrap_or_default(),
            bos_token_id: self.bos_token_id,
            pad_token_id: self.pad_token_id,
            max_positions: self.max_position_embeddings,
            mixture: match arch {
                Architecture::Qwen3Moe => Some(MixtureConfig::qwen3_moe(&self.extra, self.num_hidden_layers)?),
                Architecture::MuseSparkText => Some(MixtureConfig::muse_spark(
                    &self.extra,
                    self.num_hidden_layers,
                    rms_norm_eps,
                )?),
                _ => None,
            },
        })
    }

    /// `model_type` as one of the implemented architectures.
    fn architecture(&self) -> Result<Architecture, ModelError> {
        match self.model_type.as_str() {
            "qwen3" => Ok(Architecture::Qwen3),
            "qwen2" => Ok(Architecture::Qwen2),
            "llama" => Ok(Architecture::Llama),
            "qwen3_moe" => Ok(Architecture::Qwen3Moe),
            muse_spark::TEXT_MODEL_TYPE => Ok(Architecture::MuseSparkText),
            other => Err(ModelError::unsupported("model_type", format!("{other:?}"), IMPLEMENTED)),
        }
    }

    /// Positive sizes, and `(heads, kv_heads, head_dim)` consistent with them and with RoPE.
    fn attention_shape(&self) -> Result<(i64, i64, i64), ModelError> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
        ] {
            if v <= 0 {
                return Err(ModelError::unsupported(field, v, "must be positive"));
            }
        }
        let num_heads = self.num_attention_heads;
        let num_kv_heads = self.num_key_value_heads.unwrap_or(num_heads);
        if num_kv_heads <= 0 || num_heads % num_kv_heads != 0 {
            return Err(ModelError::unsupported(
                "num_key_value_heads",
                num_kv_heads,
                "must be positive and divide num_attention_heads",
            ));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if self.hidden_size % num_heads == 0 => self.hidden_size / num_heads,
            None => {
                return Err(ModelError::unsupported(
                    "head_dim",
                    "absent",
                    "hidden_size is not divisible by num_attention_heads; set head_dim",
                ));
            }
        };
        if head_dim <= 0 || head_dim % 2 != 0 {
            return Err(ModelError::unsupported(
                "head_dim",
                head_dim,
                "RoPE needs a positive even head_dim",
            ));
        }
        Ok((num_heads, num_kv_heads, head_dim))
    }

    /// Features treetrain does not implement are refused by name.
    fn check_features(&self) -> Result<(), ModelError> {
        let act = self.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(ModelError::unsupported(
                "hidden_act",
                format!("{act:?}"),
                "only silu (SwiGLU) is implemented",
            ));
        }
        if self.use_sliding_window == Some(true) {
            return Err(ModelError::unsupported(
                "use_sliding_window",
                true,
                "sliding-window attention is not implemented",
            ));
        }
        // Muse Spark's layer kinds are read with its parts (`DecoderParts::of`).
        if let Some(kinds) = self
            .layer_types
            .as_ref()
            .filter(|_| self.model_type != muse_spark::TEXT_MODEL_TYPE)
            && let Some(k) = kinds.iter().find(|k| k.as_str() != "full_attention")
        {
            return Err(ModelError::unsupported(
                "layer_types",
                format!("{k:?}"),
                "only full_attention layers are implemented",
            ));
        }
        Ok(())
    }

    /// RoPE base and scaling from `rope_parameters` (v5) or `rope_theta` + `rope_scaling` (v4).
    fn rope(&self) -> Result<(f64, RopeScaling), ModelError> {
        let (params, field) = match (&self.rope_parameters, &self.rope_scaling) {
            (Some(p), _) if !p.is_null() => (Some(p), "rope_parameters"),
            (_, Some(s)) if !s.is_null() => (Some(s), "rope_scaling"),
            _ => (None, "rope_scaling"),
        };
        let theta = params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(self.rope_theta)
            .unwrap_or(10_000.0);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(ModelError::unsupported(
                "rope_theta",
                theta,
                "must be finite and > 0 (the RoPE frequencies are its powers)",
            ));
        }
        let Some(p) = params else {
            return Ok((theta, RopeScaling::None));
        };
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let num = |key: &str| -> Result<f64, ModelError> {
            let x = p.get(key).and_then(Value::as_f64).ok_or_else(|| {
                ModelError::unsupported(
                    &format!("{field}.{key}"),
                    "missing",
                    &format!("rope type {kind:?} needs it"),
                )
            })?;
            match x.is_finite() && x > 0.0 {
                true => Ok(x),
                false => Err(ModelError::unsupported(
                    &format!("{field}.{key}"),
                    x,
                    "must be finite and > 0",
                )),
            }
        };
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: num("factor")? },
            "llama3" => RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            },
            other => {
                return Err(ModelError::unsupported(
                    &format!("{field}.rope_type"),
                    format!("{other:?}"),
                    "treetrain implements default, linear and llama3 RoPE",
                ));
            }
        };
        Ok((theta, scaling))
    }
}

impl ModelConfig {
    /// Whether training adds a load-balancing loss for this model: a mixture whose reference
    /// computes one (Qwen3-MoE; not Muse Spark).
    pub fn load_balancing(&self) -> bool {
        self.mixture.as_ref().is_some_and(|m| m.load_balancing)
    }

    /// What is wrong with the first token of `ids` that stands for a tower the model does not
    /// load (Muse Spark's image, video and audio placeholders): a row holding one needs inputs
    /// treetrain cannot give it.
    pub fn tower_token(&self, ids: &[i64]) -> Option<String> {
        ids.iter().find_map(|t| {
            let (name, _) = self.parts.tower_tokens.iter().find(|(_, id)| id == t)?;
            Some(format!(
                "token {t} is the checkpoint's {name}: its tower is not loaded (treetrain runs the text decoder only; give text-only rows)"
            ))
        })
    }

    /// An error naming what is too long when `positions` tokens (prompt and completion, or a
    /// scored row) exceed `max_position_embeddings`.
    pub fn check_positions(&self, positions: usize, what: &str) -> Result<(), String> {
        match self.max_positions {
            Some(max) if positions as i64 > max => Err(format!(
                "{what} needs {positions} positions; the model's max_position_embeddings is {max}"
            )),
            _ => Ok(()),
        }
    }

    /// Bytes of a static KV cache of `rows` x `slots` in `kind`.
    pub(crate) fn kv_cache_bytes(&self, rows: usize, slots: usize, kind: tch::Kind) -> u128 {
        let per_slot = 2 * self.num_layers as u128 * self.num_kv_heads as u128 * self.head_dim as u128;
        per_slot * rows as u128 * slots as u128 * kind.elt_size_in_bytes() as u128
    }

    /// Parameters in the model (tied embeddings counted once; a router's score-correction
    /// bias counted as transformers' state dict holds it).
    pub fn num_parameters(&self) -> i64 {
        // In i128: a config's sizes are user input, and their products must not overflow.
        let w = |x: i64| i128::from(x);
        let (h, i, v) = (w(self.hidden_size), w(self.intermediate_size), w(self.vocab_size));
        let (q, kv) = (
            w(self.num_heads) * w(self.head_dim),
            w(self.num_kv_heads) * w(self.head_dim),
        );
        let mut attn = h * q + 2 * h * kv + q * h;
        if self.qkv_bias {
            attn += q + 2 * kv;
        }
        if self.o_bias {
            attn += h;
        }
        match self.parts.qk_norm {
            QkNorm::PerHead => attn += 2 * w(self.head_dim),
            QkNorm::None | QkNorm::Weightless { .. } => {}
        }
        if self.parts.attention_gate {
            attn += h * q;
        }
        let norms = match self.parts.norms {
            LayerNorms::PreNorm => 2 * h,
            LayerNorms::Sandwich { .. } => 3 * h,
        };
        let gates = if self.parts.residual_gate.is_some() { 2 * h } else { 0 };
        let dense = 3 * h * i + if self.mlp_bias { 2 * i + h } else { 0 };
        let (sparse_layers, sparse) = match &self.mixture {
            Some(m) => (w(m.num_sparse_layers()), m.block_parameters(self.hidden_size)),
            None => (0, 0),
        };
        let layers = w(self.num_layers) * (attn + norms + gates)
            + (w(self.num_layers) - sparse_layers) * dense
            + sparse_layers * sparse;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        i64::try_from(v * h + layers + h + head).unwrap_or(i64::MAX)
    }

    /// Parameters a token runs through: [`ModelConfig::num_parameters`] with only the
    /// `num_experts_per_tok` chosen experts of each sparse layer (routers counted whole). Equal
    /// to it for a dense model.
    pub fn active_parameters(&self) -> i64 {
        let Some(m) = &self.mixture else {
            return self.num_parameters();
        };
        let idle = i128::from(m.num_experts - m.experts_per_token)
            * 3
            * i128::from(m.expert_width(self.hidden_size))
            * i128::from(m.expert_size)
            * i128::from(m.num_sparse_layers());
        i64::try_from(i128::from(self.num_parameters()) - idle).unwrap_or(i64::MAX)
    }

    /// Feed-forward weights a token multiplies by, averaged over the layers (the dense MLP's,
    /// or the router's and `num_experts_per_tok` experts'): what a forward's work counts.
    pub(crate) fn feed_forward_weights_per_token(&self) -> f64 {
        let (h, layers) = (self.hidden_size as f64, self.num_layers.max(1) as f64);
        let dense = 3.0 * h * self.intermediate_size as f64;
        match &self.mixture {
            None => dense,
            Some(m) => {
                let sparse = m.num_sparse_layers() as f64;
                let width = m.expert_width(self.hidden_size) as f64;
                let projections = if m.projection.is_some() { 2.0 * h * width } else { 0.0 };
                let routed =
                    h * m.num_experts as f64 + projections + 3.0 * width * (m.experts_per_token * m.expert_size) as f64;
                ((layers - sparse) * dense + sparse * routed) / layers
            }
        }
    }
}
