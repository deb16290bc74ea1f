//! How a sub-layer's output joins the residual stream: a plain sum, or Muse Spark's gate
//! `alpha * residual + beta * h` with `beta = sigmoid(g / T)` and
//! `alpha = sqrt(max(sigmoid(-g / T) * (1 + beta), 1e-3))` per channel.

use tch::{Tensor, nn};

/// The smallest `alpha^2` the gate allows (transformers' `residual_gate_eps`).
const ALPHA_SQUARED_MIN: f64 = 1e-3;

/// One residual join of a layer.
#[derive(Debug)]
pub enum Residual {
    /// `residual + h`.
    Add,
    /// `alpha * residual + beta * h`, from the gate's `gate` `[hidden]`.
    Gated {
        /// `{...}_residual_gate.gate` `[hidden]`.
        gate: Tensor,
        /// `residual_gate_temperature`.
        temperature: f64,
    },
}

impl Residual {
    /// Declares `{path}.gate` `[hidden]` when `temperature` is given (a gated join).
    pub(crate) fn new(path: nn::Path, hidden: i64, temperature: Option<f64>) -> Self {
        match temperature {
            None => Residual::Add,
            Some(temperature) => Residual::Gated {
                gate: path.var("gate", &[hidden], nn::Init::Const(0.0)),
                temperature,
            },
        }
    }

    /// The same gate (shared, not copied).
    pub(crate) fn base_view(&self) -> Residual {
        match self {
            Residual::Add => Residual::Add,
            Residual::Gated { gate, temperature } => Residual::Gated {
                gate: gate.shallow_clone(),
                temperature: *temperature,
            },
        }
    }

    /// `residual` joined by `h` (both `[..., hidden]`), in `residual`'s dtype.
    pub fn join(&self, residual: &Tensor, h: &Tensor) -> Tensor {
        match self {
            Residual::Add => residual + h,
            Residual::Gated { gate, temperature } => {
                let w = gate / *temperature;
                let beta = w.sigmoid();
                let alpha = ((-&w).sigmoid() * (&beta + 1.0)).clamp_min(ALPHA_SQUARED_MIN).sqrt();
                (alpha * residual + beta * h).to_kind(residual.kind())
            }
        }
    }
}
