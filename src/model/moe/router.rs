//! Qwen3-MoE's router: a linear map to one logit per expert, a softmax in fp32 over all of them,
//! the top `k`, optionally renormalised.

use tch::{Kind, Tensor, nn};

use crate::model::layers::{Linear, linear};

/// What the router decided for `n` tokens.
#[derive(Debug)]
pub struct Routing {
    /// `[n, experts]` in the model's dtype: what the load-balancing loss reads.
    pub logits: Tensor,
    /// `[n, k]` int64: the chosen experts, most probable first.
    pub experts: Tensor,
    /// `[n, k]` in the model's dtype: each chosen expert's weight.
    pub weights: Tensor,
}

/// `mlp.gate`: `weight` `[experts, hidden]`.
#[derive(Debug)]
pub struct Router {
    /// `mlp.gate.weight` `[experts, hidden]`.
    pub gate: Linear,
    top_k: i64,
    norm_topk_prob: bool,
}

impl Router {
    /// Declares `{path}.weight`.
    pub(crate) fn new(path: nn::Path, hidden: i64, experts: i64, top_k: i64, norm_topk_prob: bool) -> Self {
        Router {
            gate: Linear::new(path, hidden, experts, false),
            top_k,
            norm_topk_prob,
        }
    }

    /// The same weight without adapters.
    pub(crate) fn base_view(&self) -> Router {
        Router {
            gate: self.gate.base_view(),
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
        }
    }

    /// Routes `x` `[n, hidden]`.
    pub fn route(&self, x: &Tensor) -> Routing {
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

    /// Experts each token is sent to.
    pub fn top_k(&self) -> i64 {
        self.top_k
    }
}
