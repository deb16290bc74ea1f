//! Qwen3-MoE's sparse block: route each token, run its experts, weight and sum them. No shared
//! experts; the output is not scaled further.

use tch::{Tensor, nn};

use super::config::MixtureConfig;
use super::experts::Experts;
use super::router::{Router, Routing};
use crate::model::error::ModelError;

/// A sparse layer's `mlp`: `gate` (the router) and `experts`.
#[derive(Debug)]
pub struct SparseMoe {
    /// `mlp.gate`.
    pub router: Router,
    /// `mlp.experts`.
    pub experts: Experts,
}

impl SparseMoe {
    /// Declares `{path}.gate.weight` and `{path}.experts.{gate_up,down}_proj`.
    pub fn new(path: nn::Path, hidden: i64, mixture: &MixtureConfig) -> Self {
        SparseMoe {
            router: Router::new(
                &path / "gate",
                hidden,
                mixture.num_experts,
                mixture.experts_per_token,
                mixture.norm_topk_prob,
            ),
            experts: Experts::new(&path / "experts", mixture.num_experts, hidden, mixture.expert_size),
        }
    }

    /// The same tensors without adapters.
    pub(crate) fn base_view(&self) -> SparseMoe {
        SparseMoe {
            router: self.router.base_view(),
            experts: self.experts.base_view(),
        }
    }

    /// `x` `[..., hidden]` -> `[..., hidden]`, with the routing it used.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Routing), ModelError> {
        let size = x.size();
        let hidden = *size.last().unwrap_or(&0);
        // 1. Tokens as rows `[n, hidden]`, routed.
        let flat = x.f_reshape([-1, hidden])?;
        let routing = self.router.route(&flat);
        // 2. The chosen experts, weighted and summed, back in `x`'s shape.
        let y = self.experts.forward(&flat, &routing.experts, &routing.weights)?;
        Ok((y.f_view(size.as_slice())?, routing))
    }
}
