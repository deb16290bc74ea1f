//! The dense feed-forward block of a decoder layer: SwiGLU, `down(silu(gate(x)) * up(x))`, its
//! gate and up projections run as one product where no graph is built.

use tch::{Tensor, nn};

use super::config::ModelConfig;
use super::cpu_kernels::{self, CpuOps};
use super::layers::Linear;
use super::projection::Projections;

/// `down(silu(gate(x)) * up(x))`.
#[derive(Debug)]
pub struct Mlp {
    /// `gate_proj` and `up_proj`, each `[intermediate, hidden]`: one product where no graph is
    /// built.
    pub gate_up: Projections<2>,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear,
}

impl Mlp {
    /// Declares `{path}.{gate,up,down}_proj`.
    pub fn new(path: nn::Path, cfg: &ModelConfig) -> Self {
        let (h, i, b) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Mlp {
            gate_up: Projections::new(
                ["gate_proj", "up_proj"],
                [
                    Linear::new(&path / "gate_proj", h, i, b),
                    Linear::new(&path / "up_proj", h, i, b),
                ],
            ),
            down_proj: Linear::new(&path / "down_proj", i, h, b),
        }
    }

    /// The same base tensors without adapters.
    pub fn base_view(&self) -> Mlp {
        Mlp {
            gate_up: self.gate_up.base_view(),
            down_proj: self.down_proj.base_view(),
        }
    }

    /// `gate_proj`.
    pub fn gate_proj(&self) -> &Linear {
        &self.gate_up.maps()[0]
    }

    /// `up_proj`.
    pub fn up_proj(&self) -> &Linear {
        &self.gate_up.maps()[1]
    }

    /// The linear layers by name within the MLP.
    pub(crate) fn linears_mut(&mut self) -> [(&'static str, &mut Linear); 3] {
        let [gate, up] = self.gate_up.named_mut();
        [gate, up, ("down_proj", &mut self.down_proj)]
    }

    /// The linear layers, in `state_dict` order.
    pub fn linears(&self) -> [&Linear; 3] {
        let [gate, up] = self.gate_up.maps();
        [gate, up, &self.down_proj]
    }

    /// `x` `[..., hidden]` -> `[..., hidden]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_with(x, CpuOps::Libtorch)
    }

    /// [`Mlp::forward`] with `ops`.
    pub fn forward_with(&self, x: &Tensor, ops: CpuOps) -> Tensor {
        // 1. gate and up, `[..., intermediate]` each (one product where no graph is built).
        let projected = self.gate_up.forward(x, ops);
        // 2. silu(gate) * up: one pass over that product where the decode kernel applies.
        let act = match projected.fused().and_then(|y| ops.kernel(|| cpu_kernels::swiglu(y))) {
            Some(act) => act,
            None => {
                let [gate, up] = projected.split();
                gate.silu() * up
            }
        };
        // 3. down, `[..., hidden]`.
        self.down_proj.forward_with(&act, ops)
    }
}
