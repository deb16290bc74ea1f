//! A sparse layer's router: a linear map to one logit per expert, then Qwen3-MoE's softmax in
//! fp32 over all of them, the top `k`, optionally renormalised; or Muse Spark's sigmoid scores
//! chosen with a correction bias (see [`SigmoidRouting`]).

use tch::{Kind, Tensor, nn};

use super::config::{MixtureConfig, SigmoidRouting};
use crate::model::layers::{Linear, linear};

/// What the router decided for `n` tokens.
#[derive(Debug)]
pub struct Routing {
    /// `[n, experts]` in the model's dtype: what the load-balancing loss reads.
    pub logits: Tensor,
    /// `[n, k]` int64: the chosen experts, most probable first.
    pub experts: Tensor,
    /// `[n, k]`: each chosen expert's weight, in the model's dtype (fp32 for sigmoid routing,
    /// as transformers keeps them).
    pub weights: Tensor,
}

/// Sigmoid routing's settings and its `e_score_correction_bias` `[experts]` (a buffer: it
/// chooses experts, never weights them, and is not trained).
#[derive(Debug)]
struct Sigmoid {
    settings: SigmoidRouting,
    bias: Tensor,
}

/// `mlp.gate`: `weight` `[experts, hidden]`.
#[derive(Debug)]
pub struct Router {
    /// `mlp.gate.weight` `[experts, hidden]`.
    pub gate: Linear,
    top_k: i64,
    norm_topk_prob: bool,
    sigmoid: Option<Sigmoid>,
}

impl Router {
    /// Declares `{path}.weight` (and, for sigmoid routing, `{path}.e_score_correction_bias`).
    pub(crate) fn new(path: nn::Path, hidden: i64, mixture: &MixtureConfig) -> Self {
        let experts = mixture.num_experts;
        let sigmoid = mixture.sigmoid.map(|settings| Sigmoid {
            settings,
            bias: path.zeros_no_train("e_score_correction_bias", &[experts]),
        });
        Router {
            gate: Linear::new(path, hidden, experts, false),
            top_k: mixture.experts_per_token,
            norm_topk_prob: mixture.norm_topk_prob,
            sigmoid,
        }
    }

    /// The same weight without adapters.
    pub(crate) fn base_view(&self) -> Router {
        Router {
            gate: self.gate.base_view(),
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
            sigmoid: self.sigmoid.as_ref().map(|s| Sigmoid {
                settings: s.settings,
                bias: s.bias.shallow_clone(),
            }),
        }
    }

    /// Routes `x` `[n, hidden]`.
    pub fn route(&self, x: &Tensor) -> Routing {
        if let Some(s) = &self.sigmoid {
            return self.route_sigmoid(x, s);
        }
        // 1. Logits `[n, experts]` in the model's dtype; probabilities in fp32 over all experts.
        let logits = linear(x, &self.gate.weight, None);
        let probs = logits.softmax(-1, Kind::Float);
        // 2. The top k, sorted; renormalised without an epsilon, as transformers does.
        let (mut top, experts) = probs.topk(self.top_k, -1, true, true);
        if self.norm_topk_prob {
            top = &top / top.sum_dim_intlist(-1, true, Kind::Float);
        }
        // 3. Weights back in the model's dtype.
        let weights = top.to_kind(x.kind());
        Routing {
            logits,
            experts,
            weights,
        }
    }

    /// Sigmoid routing of `x` `[n, hidden]`.
    fn route_sigmoid(&self, x: &Tensor, s: &Sigmoid) -> Routing {
        // 1. Logits `[n, experts]` from fp32 inputs and weights, scaled; sigmoid scores.
        let logits = x
            .to_kind(Kind::Float)
            .linear(&self.gate.weight.to_kind(Kind::Float), None::<Tensor>)
            * s.settings.logit_scale;
        let scores = logits.sigmoid();
        // 2. The top k by score plus the correction bias; their own scores, renormalised
        //    (the epsilon as transformers adds it) and scaled, kept in fp32.
        let (_, experts) = (&scores + s.bias.to_kind(Kind::Float)).topk(self.top_k, -1, true, true);
        let top = scores.gather(1, &experts, false);
        let weights = &top / (top.sum_dim_intlist(-1, true, Kind::Float) + 1e-15) * s.settings.routed_scaling_factor;
        Routing {
            logits,
            experts,
            weights,
        }
    }

    /// Routes `x` `[n, hidden]` to `recorded` `[n, k]` (int64; a row of -1 routes as usual):
    /// the recorded experts with weights recomputed from this router's scores, as they would
    /// weigh had it chosen them (its gradient flows through them).
    pub fn route_recorded(&self, x: &Tensor, recorded: &Tensor) -> Result<Routing, tch::TchError> {
        let own = self.route(x);
        let recorded = recorded.f_to_device(x.device())?;
        let valid = recorded.f_ge(0)?.f_all_dim(-1, true)?;
        let experts = recorded.f_where_self(&valid, &own.experts)?;
        let weights = match &self.sigmoid {
            Some(s) => {
                let top = own.logits.f_sigmoid()?.f_gather(1, &experts, false)?;
                (&top / (top.f_sum_dim_intlist(-1, true, Kind::Float)? + 1e-15)) * s.settings.routed_scaling_factor
            }
            None => {
                let mut top = own.logits.f_softmax(-1, Kind::Float)?.f_gather(1, &experts, false)?;
                if self.norm_topk_prob {
                    top = &top / top.f_sum_dim_intlist(-1, true, Kind::Float)?;
                }
                top.f_to_kind(x.kind())?
            }
        };
        Ok(Routing {
            logits: own.logits,
            experts,
            weights,
        })
    }

    /// Experts each token is sent to.
    pub fn top_k(&self) -> i64 {
        self.top_k
    }
}
