//! A decoder layer's feed-forward block, chosen once from the config: the dense SwiGLU or a
//! sparse mixture of experts. The next kind (a mixture with shared experts, say) is a variant
//! here and a match arm in each method.

use tch::{Tensor, nn};

use super::config::ModelConfig;
use super::cpu_kernels::CpuOps;
use super::error::ModelError;
use super::layers::Linear;
use super::mlp::Mlp;
use super::moe::{Routing, SparseMoe};

/// `model.layers.{i}.mlp`.
#[derive(Debug)]
pub enum FeedForward {
    /// `down(silu(gate(x)) * up(x))`.
    Dense(Mlp),
    /// Routed experts (Qwen3-MoE).
    Sparse(SparseMoe),
}

impl FeedForward {
    /// Declares layer `layer`'s block under `path`: sparse where the config's mixture says so.
    pub(crate) fn new(path: nn::Path, cfg: &ModelConfig, layer: usize) -> Self {
        match &cfg.mixture {
            Some(m) if m.is_sparse(layer) => FeedForward::Sparse(SparseMoe::new(path, cfg.hidden_size, m)),
            _ => FeedForward::Dense(Mlp::new(path, cfg)),
        }
    }

    /// The same base tensors without adapters.
    pub(crate) fn base_view(&self) -> FeedForward {
        match self {
            FeedForward::Dense(m) => FeedForward::Dense(m.base_view()),
            FeedForward::Sparse(m) => FeedForward::Sparse(m.base_view()),
        }
    }

    /// The dense MLP, when this block is one.
    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            FeedForward::Dense(m) => Some(m),
            FeedForward::Sparse(_) => None,
        }
    }

    /// The mixture, when this block is one.
    pub fn sparse(&self) -> Option<&SparseMoe> {
        match self {
            FeedForward::Sparse(m) => Some(m),
            FeedForward::Dense(_) => None,
        }
    }

    /// The linear layers an adapter may wrap, by name within the block (a mixture's experts
    /// are 3-d tensors, not linear layers; its router is not one in transformers either; Muse
    /// Spark's projections around the experts are).
    pub(crate) fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        match self {
            FeedForward::Dense(m) => m.linears_mut().into(),
            FeedForward::Sparse(m) => m.linears_mut(),
        }
    }

    /// The linear layers, in `state_dict` order.
    pub(crate) fn linears(&self) -> Vec<&Linear> {
        match self {
            FeedForward::Dense(m) => m.linears().into(),
            FeedForward::Sparse(m) => m.linears(),
        }
    }

    /// Ties the dense block's gate and up weights into one buffer (see `model::projection`).
    pub(crate) fn tie(&mut self) -> Result<(), ModelError> {
        match self {
            FeedForward::Dense(m) => m.gate_up.tie(),
            FeedForward::Sparse(_) => Ok(()),
        }
    }

    /// The fused gate/up buffers of a dense block (weight, bias).
    pub(crate) fn buffers(&self) -> Option<(&Tensor, Option<&Tensor>)> {
        match self {
            FeedForward::Dense(m) => m.gate_up.buffers(),
            FeedForward::Sparse(_) => None,
        }
    }

    /// `x` `[..., hidden]` -> `[..., hidden]`, with the routing when the block is sparse
    /// (routed to `replayed` experts where given: [`SparseMoe::forward_routed_by`]).
    pub fn forward_with(
        &self,
        x: &Tensor,
        ops: CpuOps,
        replayed: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Routing>), ModelError> {
        match self {
            FeedForward::Dense(m) => Ok((m.forward_with(x, ops), None)),
            FeedForward::Sparse(m) => m.forward_routed_by(x, replayed).map(|(y, r)| (y, Some(r))),
        }
    }
}
