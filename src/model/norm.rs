//! The RMS norms a decoder uses, one kind each: Llama's scaled norm (`w * x / rms(x)`), Muse
//! Spark's centered (`(1 + w) * x / rms(x)`), input-scaled (scale by `1 + w`, then normalise)
//! and weightless norms. Every kind computes in fp32 and casts back, as transformers does,
//! each at the point its reference casts.

use tch::{Kind, Tensor, nn};

use super::cpu_kernels::CpuOps;
use super::layers::RmsNorm;

/// One RMS norm of a decoder, by kind.
#[derive(Debug)]
pub enum Norm {
    /// `w * (x / rms(x))`, the product in the input's dtype (Llama, Qwen).
    Scaled(RmsNorm),
    /// `(1 + w) * x / rms(x)` in fp32, then cast (Muse Spark's `CenteredRMSNorm`; `w` starts at 0).
    Centered(RmsNorm),
    /// `y = (1 + w) * x` cast to the input's dtype, then `y / rms(y)` in fp32 (Muse Spark's
    /// `InputScaledRMSNorm`).
    InputScaled(RmsNorm),
    /// `x / rms(x)`, no weight; `x * (mean(x^2) + eps)^-0.5` with a power, as the reference
    /// writes it.
    Weightless {
        /// Added to the mean square.
        eps: f64,
    },
}

/// Which [`Norm`] to declare.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum NormKind {
    /// [`Norm::Scaled`].
    Scaled,
    /// [`Norm::Centered`].
    Centered,
    /// [`Norm::InputScaled`].
    InputScaled,
    /// [`Norm::Weightless`].
    Weightless,
}

impl Norm {
    /// Declares `{path}.weight` `[dim]` (none for a weightless norm): ones for a scaled norm,
    /// zeros for the `(1 + w)` kinds, which is each kind's identity.
    pub(crate) fn new(kind: NormKind, path: nn::Path, dim: i64, eps: f64) -> Self {
        let zeros = |path: nn::Path| RmsNorm::from_weight(path.var("weight", &[dim], nn::Init::Const(0.0)), eps);
        match kind {
            NormKind::Scaled => Norm::Scaled(RmsNorm::new(path, dim, eps)),
            NormKind::Centered => Norm::Centered(zeros(path)),
            NormKind::InputScaled => Norm::InputScaled(zeros(path)),
            NormKind::Weightless => Norm::Weightless { eps },
        }
    }

    /// The same weight (shared, not copied).
    pub(crate) fn base_view(&self) -> Norm {
        match self {
            Norm::Scaled(n) => Norm::Scaled(n.base_view()),
            Norm::Centered(n) => Norm::Centered(n.base_view()),
            Norm::InputScaled(n) => Norm::InputScaled(n.base_view()),
            Norm::Weightless { eps } => Norm::Weightless { eps: *eps },
        }
    }

    /// The scaled norm, when this is one (what the CPU kernels take).
    pub fn scaled(&self) -> Option<&RmsNorm> {
        match self {
            Norm::Scaled(n) => Some(n),
            _ => None,
        }
    }

    /// Normalises the last dimension of `x` `[..., dim]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_with(x, CpuOps::Libtorch)
    }

    /// [`Norm::forward`] with `ops` (the decode kernels serve the scaled kind only).
    pub fn forward_with(&self, x: &Tensor, ops: CpuOps) -> Tensor {
        let kind = x.kind();
        match self {
            Norm::Scaled(n) => n.forward_with(x, ops),
            Norm::Centered(n) => {
                let x32 = x.to_kind(Kind::Float);
                (inverse_rms(&x32, n.eps()) * x32 * one_plus(&n.weight)).to_kind(kind)
            }
            Norm::InputScaled(n) => {
                let scaled = (x.to_kind(Kind::Float) * one_plus(&n.weight))
                    .to_kind(kind)
                    .to_kind(Kind::Float);
                (inverse_rms(&scaled, n.eps()) * scaled).to_kind(kind)
            }
            Norm::Weightless { eps } => {
                let x32 = x.to_kind(Kind::Float);
                let mean = x32.square().mean_dim(-1, true, Kind::Float) + *eps;
                (x32 * mean.pow_tensor_scalar(-0.5)).to_kind(kind)
            }
        }
    }
}

/// `1 + w` in `w`'s dtype, then in fp32, as the reference rounds it.
fn one_plus(w: &Tensor) -> Tensor {
    (w + 1.0).to_kind(Kind::Float)
}

/// `rsqrt(mean(x^2) + eps)` over the last dimension of an fp32 `x`, kept for broadcasting.
fn inverse_rms(x: &Tensor, eps: f64) -> Tensor {
    (x.square().mean_dim(-1, true, Kind::Float) + eps).rsqrt()
}
