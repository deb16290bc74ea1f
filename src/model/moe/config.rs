//! The mixture settings of a `config.json`, read from the fields transformers names them by and
//! checked into a [`MixtureConfig`].

use std::collections::BTreeMap;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::model::error::ModelError;

/// A validated mixture-of-experts configuration (Qwen3-MoE's fields).
#[derive(Debug, Clone, PartialEq)]
pub struct MixtureConfig {
    /// Routed experts in a sparse layer (`num_experts`, written `num_local_experts` by
    /// transformers 5).
    pub num_experts: i64,
    /// Experts each token is sent to (`num_experts_per_tok`).
    pub experts_per_token: i64,
    /// Width of one expert's SwiGLU (`moe_intermediate_size`).
    pub expert_size: i64,
    /// Whether the chosen experts' probabilities are renormalised to sum to 1
    /// (`norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Per layer, whether it is sparse: not in `mlp_only_layers` and `(layer + 1)` a multiple
    /// of `decoder_sparse_step`. The others run the dense MLP of `intermediate_size`.
    pub sparse_layers: Vec<bool>,
    /// The checkpoint's `router_aux_loss_coef`, kept as read. Training uses
    /// `TrainConfig::router_aux_loss_coef` instead, as TRL's trainers use their own setting.
    pub router_aux_loss_coef: f64,
    /// The checkpoint's `output_router_logits`, kept as read; treetrain's forwards always
    /// return the routing, and the trainers add the loss by `router_aux_loss_coef` alone.
    pub output_router_logits: bool,
    /// Sigmoid routing (Muse Spark) instead of the softmax over all experts.
    pub sigmoid: Option<SigmoidRouting>,
    /// The experts run at a narrower width between two projections (Muse Spark).
    pub projection: Option<ExpertProjection>,
    /// Whether transformers computes its load-balancing loss for this family (Qwen3-MoE
    /// does; Muse Spark's code has none, so the trainers add none).
    pub load_balancing: bool,
}

/// Muse Spark's router: `sigmoid(logits * logit_scale)` in fp32, the top k chosen by those
/// scores plus `e_score_correction_bias`, their unbiased scores renormalised (plus 1e-15) and
/// times `routed_scaling_factor`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SigmoidRouting {
    /// `output_multiplier`.
    pub logit_scale: f64,
    /// `routed_scaling_factor`.
    pub routed_scaling_factor: f64,
}

/// Muse Spark's projections around the experts: `pre_expert_proj` down to `width`, a centered
/// norm (`pre_expert_norm`), the experts at `width` each followed by one shared input-scaled
/// norm (`experts.post_expert_norm`), `post_expert_proj` back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertProjection {
    /// `moe_hidden_size`.
    pub width: i64,
    /// `rms_norm_eps`, of `pre_expert_norm`.
    pub norm_eps: f64,
    /// `post_norm_eps`, of `post_expert_norm`.
    pub expert_norm_eps: f64,
}

/// Fields of other mixture families that Qwen3-MoE's code does not have: a config carrying one
/// asks for something treetrain would silently leave out.
const NOT_IMPLEMENTED: [(&str, &str); 6] = [
    ("shared_expert_intermediate_size", "shared experts are not implemented"),
    ("n_shared_experts", "shared experts are not implemented"),
    ("num_shared_experts", "shared experts are not implemented"),
    ("n_group", "grouped routing is not implemented"),
    ("topk_group", "grouped routing is not implemented"),
    ("router_jitter_noise", "router jitter is not implemented"),
];

/// `extra[name]` as a `T`, or `None` when absent or null; a value of the wrong type is an
/// error naming the field.
fn field<T: DeserializeOwned>(extra: &BTreeMap<String, Value>, name: &str) -> Result<Option<T>, ModelError> {
    match extra.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| ModelError::unsupported(name, v, &format!("has the wrong type: {e}"))),
    }
}

/// A field that must be present and positive.
fn positive(extra: &BTreeMap<String, Value>, name: &str) -> Result<i64, ModelError> {
    match field::<i64>(extra, name)? {
        Some(v) if v > 0 => Ok(v),
        Some(v) => Err(ModelError::unsupported(name, v, "must be positive")),
        None => Err(ModelError::unsupported(name, "missing", "a qwen3_moe config needs it")),
    }
}

/// `num_experts_per_tok`: positive and at most `num_experts`.
fn top_k(extra: &BTreeMap<String, Value>, num_experts: i64) -> Result<i64, ModelError> {
    let k = positive(extra, "num_experts_per_tok")?;
    if k > num_experts {
        return Err(ModelError::unsupported(
            "num_experts_per_tok",
            k,
            &format!("exceeds the {num_experts} experts"),
        ));
    }
    Ok(k)
}

impl MixtureConfig {
    /// Reads Qwen3-MoE's mixture fields from a config's `extra` fields, for a stack of
    /// `num_layers` layers.
    pub(crate) fn qwen3_moe(extra: &BTreeMap<String, Value>, num_layers: i64) -> Result<Self, ModelError> {
        for (name, reason) in NOT_IMPLEMENTED {
            let set = match extra.get(name) {
                None | Some(Value::Null) => false,
                Some(v) => v.as_f64() != Some(0.0),
            };
            if set {
                return Err(ModelError::unsupported(name, &extra[name], reason));
            }
        }
        let num_experts = match extra.contains_key("num_local_experts") {
            true => positive(extra, "num_local_experts")?,
            false => positive(extra, "num_experts")?,
        };
        let experts_per_token = top_k(extra, num_experts)?;
        let step = field::<i64>(extra, "decoder_sparse_step")?.unwrap_or(1);
        if step <= 0 {
            return Err(ModelError::unsupported("decoder_sparse_step", step, "must be positive"));
        }
        let dense: Vec<i64> = field(extra, "mlp_only_layers")?.unwrap_or_default();
        if let Some(l) = dense.iter().find(|&&l| l < 0 || l >= num_layers) {
            return Err(ModelError::unsupported(
                "mlp_only_layers",
                l,
                &format!("names no layer of the {num_layers}"),
            ));
        }
        let coef = field::<f64>(extra, "router_aux_loss_coef")?.unwrap_or(0.001);
        if !coef.is_finite() || coef < 0.0 {
            return Err(ModelError::unsupported(
                "router_aux_loss_coef",
                coef,
                "must be finite and >= 0",
            ));
        }
        Ok(MixtureConfig {
            num_experts,
            experts_per_token,
            expert_size: positive(extra, "moe_intermediate_size")?,
            norm_topk_prob: field(extra, "norm_topk_prob")?.unwrap_or(false),
            sparse_layers: (0..num_layers)
                .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
                .collect(),
            router_aux_loss_coef: coef,
            output_router_logits: field(extra, "output_router_logits")?.unwrap_or(false),
            sigmoid: None,
            projection: None,
            load_balancing: true,
        })
    }

    /// Reads Muse Spark's mixture fields (`extra`: its text config, defaults filled in) for a
    /// stack of `num_layers` layers normed with `rms_norm_eps`.
    pub(crate) fn muse_spark(
        extra: &BTreeMap<String, Value>,
        num_layers: i64,
        rms_norm_eps: f64,
    ) -> Result<Self, ModelError> {
        let num_experts = positive(extra, "num_local_experts")?;
        let experts_per_token = top_k(extra, num_experts)?;
        let kinds: Vec<String> = field(extra, "mlp_layer_types")?.unwrap_or_default();
        if kinds.len() as i64 != num_layers {
            return Err(ModelError::unsupported(
                "mlp_layer_types",
                format!("{} entries", kinds.len()),
                &format!("needs one per layer, {num_layers}"),
            ));
        }
        if let Some(k) = kinds.iter().find(|k| !matches!(k.as_str(), "dense" | "sparse")) {
            return Err(ModelError::unsupported(
                "mlp_layer_types",
                format!("{k:?}"),
                "layers are dense or sparse",
            ));
        }
        let number = |name: &str| -> Result<f64, ModelError> {
            match field::<f64>(extra, name)? {
                Some(v) if v.is_finite() && v > 0.0 => Ok(v),
                Some(v) => Err(ModelError::unsupported(name, v, "must be finite and > 0")),
                None => Err(ModelError::unsupported(
                    name,
                    "missing",
                    "Muse Spark's mixture needs it",
                )),
            }
        };
        Ok(MixtureConfig {
            num_experts,
            experts_per_token,
            expert_size: positive(extra, "moe_intermediate_size")?,
            norm_topk_prob: true,
            sparse_layers: kinds.iter().map(|k| k == "sparse").collect(),
            router_aux_loss_coef: 0.0,
            output_router_logits: field(extra, "output_router_logits")?.unwrap_or(false),
            sigmoid: Some(SigmoidRouting {
                logit_scale: number("output_multiplier")?,
                routed_scaling_factor: number("routed_scaling_factor")?,
            }),
            projection: Some(ExpertProjection {
                width: positive(extra, "moe_hidden_size")?,
                norm_eps: rms_norm_eps,
                expert_norm_eps: number("post_norm_eps")?,
            }),
            load_balancing: false,
        })
    }

    /// The width the experts run at.
    pub fn expert_width(&self, hidden: i64) -> i64 {
        self.projection.map_or(hidden, |p| p.width)
    }

    /// Parameters of one sparse block in a model of width `hidden` (the router, any
    /// projections and norms, every expert).
    pub(crate) fn block_parameters(&self, hidden: i64) -> i128 {
        let (h, e) = (i128::from(hidden), i128::from(self.num_experts));
        let width = i128::from(self.expert_width(hidden));
        let router = e * h + if self.sigmoid.is_some() { e } else { 0 };
        let projections = if self.projection.is_some() {
            2 * h * width + 2 * width
        } else {
            0
        };
        router + projections + e * 3 * width * i128::from(self.expert_size)
    }

    /// Whether layer `layer` routes through experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }

    /// `8 experts (top 2, width 32) in 2 of 3 layers`.
    pub fn describe(&self) -> String {
        format!(
            "{} experts (top {}, width {}) in {} of {} layers",
            self.num_experts,
            self.experts_per_token,
            self.expert_size,
            self.num_sparse_layers(),
            self.sparse_layers.len()
        )
    }

    /// Sparse layers in the stack.
    pub fn num_sparse_layers(&self) -> i64 {
        self.sparse_layers.iter().filter(|&&s| s).count() as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extra(v: serde_json::Value) -> BTreeMap<String, Value> {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn sparse_layers_follow_the_step_and_the_dense_list() {
        let m = MixtureConfig::qwen3_moe(
            &extra(serde_json::json!({"num_local_experts": 8, "num_experts_per_tok": 2,
                "moe_intermediate_size": 16, "decoder_sparse_step": 2, "mlp_only_layers": [3]})),
            6,
        )
        .unwrap();
        assert_eq!(m.sparse_layers, [false, true, false, false, false, true]);
        assert_eq!(
            (m.num_experts, m.router_aux_loss_coef, m.norm_topk_prob),
            (8, 0.001, false)
        );
    }

    #[test]
    fn features_of_other_families_are_refused_by_name() {
        let base = serde_json::json!({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16});
        for (key, value) in [
            ("shared_expert_intermediate_size", 64),
            ("n_group", 4),
            ("topk_group", 2),
        ] {
            let mut v = base.clone();
            v[key] = value.into();
            let e = MixtureConfig::qwen3_moe(&extra(v), 2).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
        let mut v = base.clone();
        v["num_experts_per_tok"] = 9.into();
        assert!(
            MixtureConfig::qwen3_moe(&extra(v), 2)
                .unwrap_err()
                .to_string()
                .contains("num_experts_per_tok")
        );
        let mut v = base;
        v.as_object_mut().unwrap().remove("moe_intermediate_size");
        assert!(
            MixtureConfig::qwen3_moe(&extra(v), 2)
                .unwrap_err()
                .to_string()
                .contains("moe_intermediate_size")
        );
    }
}
