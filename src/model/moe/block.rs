//! A sparse layer's block: route each token, run its experts, weight and sum them. Qwen3-MoE's
//! runs the experts at the model's width; Muse Spark's projects down to `moe_hidden_size` and
//! norms first, and projects back after. No shared experts; the output is not scaled further.

use tch::{Tensor, nn};

use super::config::MixtureConfig;
use super::experts::Experts;
use super::router::{Router, Routing};
use crate::model::error::ModelError;
use crate::model::layers::Linear;
use crate::model::norm::{Norm, NormKind};

/// Muse Spark's projections around the experts.
#[derive(Debug)]
pub struct ExpertProjections {
    /// `pre_expert_proj` `[width, hidden]`.
    pub pre: Linear,
    /// `pre_expert_norm`, centered.
    pub norm: Norm,
    /// `post_expert_proj` `[hidden, width]`.
    pub post: Linear,
}

/// A sparse layer's `mlp`: `gate` (the router) and `experts`.
#[derive(Debug)]
pub struct SparseMoe {
    /// `mlp.gate`.
    pub router: Router,
    /// `mlp.experts`.
    pub experts: Experts,
    /// The projections around the experts (Muse Spark).
    pub projections: Option<ExpertProjections>,
}

impl SparseMoe {
    /// Declares `{path}.gate.weight`, `{path}.experts.{gate_up,down}_proj` and what the mixture
    /// adds around them.
    pub fn new(path: nn::Path, hidden: i64, mixture: &MixtureConfig) -> Self {
        let width = mixture.expert_width(hidden);
        let projections = mixture.projection.map(|p| ExpertProjections {
            pre: Linear::new(&path / "pre_expert_proj", hidden, width, false),
            norm: Norm::new(NormKind::Centered, &path / "pre_expert_norm", width, p.norm_eps),
            post: Linear::new(&path / "post_expert_proj", width, hidden, false),
        });
        SparseMoe {
            router: Router::new(&path / "gate", hidden, mixture),
            experts: Experts::new(
                &path / "experts",
                mixture.num_experts,
                width,
                mixture.expert_size,
                mixture.projection.map(|p| p.expert_norm_eps),
            ),
            projections,
        }
    }

    /// The same tensors without adapters.
    pub(crate) fn base_view(&self) -> SparseMoe {
        SparseMoe {
            router: self.router.base_view(),
            experts: self.experts.base_view(),
            projections: self.projections.as_ref().map(|p| ExpertProjections {
                pre: p.pre.base_view(),
                norm: p.norm.base_view(),
                post: p.post.base_view(),
            }),
        }
    }

    /// The projections' linear layers by name within the block (none without projections).
    pub(crate) fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        match &mut self.projections {
            Some(p) => vec![("pre_expert_proj", &mut p.pre), ("post_expert_proj", &mut p.post)],
            None => Vec::new(),
        }
    }

    /// The same, in `state_dict` order.
    pub(crate) fn linears(&self) -> Vec<&Linear> {
        match &self.projections {
            Some(p) => vec![&p.pre, &p.post],
            None => Vec::new(),
        }
    }

    /// `x` `[..., hidden]` -> `[..., hidden]`, with the routing it used.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Routing), ModelError> {
        self.forward_routed_by(x, None)
    }

    /// [`SparseMoe::forward`], each token routed to `replayed` `[tokens, k]` where that has a
    /// row for it (see [`Router::route_recorded`]).
    pub fn forward_routed_by(&self, x: &Tensor, replayed: Option<&Tensor>) -> Result<(Tensor, Routing), ModelError> {
        let size = x.size();
        let hidden = *size.last().unwrap_or(&0);
        // 1. Tokens as rows `[n, hidden]`, routed at the model's width (or to the replayed
        //    experts).
        let flat = x.f_reshape([-1, hidden])?;
        let routing = match replayed {
            Some(r) => self.router.route_recorded(&flat, r)?,
            None => self.router.route(&flat)?,
        };
        // 2. Down to the experts' width and normed, where the block projects (`[n, width]`).
        let rows = match &self.projections {
            Some(p) => p.norm.forward(&p.pre.forward(&flat)),
            None => flat,
        };
        // 3. The chosen experts, weighted and summed; back to the model's width.
        let y = self.experts.forward(&rows, &routing.experts, &routing.weights)?;
        let y = match &self.projections {
            Some(p) => p.post.forward(&y),
            None => y,
        };
        Ok((y.f_view(size.as_slice())?, routing))
    }
}
