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
    pub fn route(&self, x: &Tensor) -> Result<Routing, tch::TchError> {
        let (logits, scores) = self.scores(x)?;
        let experts = self.choose(&scores)?;
        let weights = self.weigh(&scores, &experts, x.kind())?;
        Ok(Routing {
            logits,
            experts,
            weights,
        })
    }

    /// Routes `x` `[n, hidden]` to `recorded` `[n, k]` (int64; a row of -1 routes as usual):
    /// the recorded experts weighed by this router's scores, as they would weigh had it chosen
    /// them (its gradient flows through them).
    pub fn route_recorded(&self, x: &Tensor, recorded: &Tensor) -> Result<Routing, tch::TchError> {
        let (logits, scores) = self.scores(x)?;
        let own = self.choose(&scores)?;
        let recorded = recorded.f_to_device(x.device())?;
        let valid = recorded.f_ge(0)?.f_all_dim(-1, true)?;
        let experts = recorded.f_where_self(&valid, &own)?;
        let weights = self.weigh(&scores, &experts, x.kind())?;
        Ok(Routing {
            logits,
            experts,
            weights,
        })
    }

    /// The logits `[n, experts]` and fp32 scores: Qwen3-MoE's logits in the model's dtype and
    /// their softmax over every expert; or sigmoid routing's logits from fp32 inputs and
    /// weights, scaled, and their sigmoid.
    fn scores(&self, x: &Tensor) -> Result<(Tensor, Tensor), tch::TchError> {
        Ok(match &self.sigmoid {
            None => {
                let logits = linear(x, &self.gate.weight, None);
                let probs = logits.f_softmax(-1, Kind::Float)?;
                (logits, probs)
            }
            Some(s) => {
                let weight = self.gate.weight.f_to_kind(Kind::Float)?;
                let logits = x.f_to_kind(Kind::Float)?.f_linear(&weight, None::<Tensor>)? * s.settings.logit_scale;
                let scores = logits.f_sigmoid()?;
                (logits, scores)
            }
        })
    }

    /// The top `k` experts `[n, k]` by score, most probable first (sigmoid routing: by score
    /// plus the correction bias).
    fn choose(&self, scores: &Tensor) -> Result<Tensor, tch::TchError> {
        let by = match &self.sigmoid {
            None => scores.shallow_clone(),
            Some(s) => scores.f_add(&s.bias.f_to_kind(Kind::Float)?)?,
        };
        Ok(by.f_topk(self.top_k, -1, true, true)?.1)
    }

    /// The weights `[n, k]` of `experts` from the scores: Qwen3-MoE's probabilities,
    /// renormalised without an epsilon where `norm_topk_prob`, in `kind`; sigmoid routing's
    /// scores renormalised with transformers' epsilon and scaled, kept in fp32.
    fn weigh(&self, scores: &Tensor, experts: &Tensor, kind: Kind) -> Result<Tensor, tch::TchError> {
        let top = scores.f_gather(1, experts, false)?;
        match &self.sigmoid {
            None if self.norm_topk_prob => (&top / top.f_sum_dim_intlist(-1, true, Kind::Float)?).f_to_kind(kind),
            None => top.f_to_kind(kind),
            Some(s) => {
                Ok((&top / (top.f_sum_dim_intlist(-1, true, Kind::Float)? + 1e-15)) * s.settings.routed_scaling_factor)
            }
        }
    }

    /// Experts each token is sent to.
    pub fn top_k(&self) -> i64 {
        self.top_k
    }
}
