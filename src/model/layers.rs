//! The small building blocks: linear maps and RMSNorm.

use tch::{Kind, Tensor, nn};

use super::cpu_kernels::{self, CpuOps};
use super::lora::LoraDelta;

/// What an adapter puts on a linear layer.
#[derive(Debug)]
pub enum LinearAdapter {
    /// LoRA: the layer's output plus `scale * B A x`.
    Lora(LoraDelta),
    /// `modules_to_save`: a trained copy used instead of the (frozen) base weights.
    Copy {
        /// `[out, in]`.
        weight: Tensor,
        /// `[out]`.
        bias: Option<Tensor>,
    },
}

/// Inputs of at most this many rows (decode steps: one token per sequence) are multiplied as
/// `W x^T` on the CPU: MKL streams the weight faster in that orientation than as `x W^T`
/// (the generation bench's decode steps over a real-size LM head show it).
pub(crate) const SKINNY_ROWS: i64 = 64;

/// `x W^T + b` for `x` `[..., in]`, `weight` `[out, in]` with libtorch's ops: on the CPU for
/// a few rows in the orientation that reads the weight fastest ([`SKINNY_ROWS`]);
/// differentiable either way.
pub(super) fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
    linear_with(x, weight, bias, CpuOps::Libtorch)
}

/// [`linear`] with `ops`: [`CpuOps::Kernels`] sends up to `KERNEL_ROWS` rows through the
/// decode kernel ([`super::cpu_kernels::product`]) where it applies.
pub(crate) fn linear_with(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, ops: CpuOps) -> Tensor {
    let size = x.size();
    let input = size.last().copied().unwrap_or(0);
    let rows = if input > 0 { x.numel() as i64 / input } else { 0 };
    let most_rows = match ops {
        CpuOps::Libtorch => SKINNY_ROWS,
        CpuOps::Kernels => SKINNY_ROWS.max(cpu_kernels::KERNEL_ROWS),
    };
    if x.device() != tch::Device::Cpu || rows == 0 || rows > most_rows || x.dim() < 2 {
        return x.linear(weight, bias);
    }
    let mut out_size = size.clone();
    *out_size.last_mut().expect("at least two dimensions") = weight.size()[0];
    if let Some(y) = ops.kernel(|| cpu_kernels::product(&x.reshape([rows, input]), weight, bias)) {
        return y.view(out_size.as_slice());
    }
    if rows > SKINNY_ROWS {
        return x.linear(weight, bias);
    }
    let y = weight.mm(&x.reshape([rows, input]).tr()).tr().contiguous();
    let y = match bias {
        Some(b) => y + b,
        None => y,
    };
    y.view(out_size.as_slice())
}

/// `y = x W^T + b`, with `weight` `[out, in]` and `bias` `[out]` named as in PyTorch, plus an
/// optional adapter.
#[derive(Debug)]
pub struct Linear {
    /// `[out_features, in_features]`.
    pub weight: Tensor,
    /// `[out_features]`.
    pub bias: Option<Tensor>,
    /// The adapter on this layer, if any.
    pub adapter: Option<LinearAdapter>,
}

impl Linear {
    /// Declares `{path}.weight` (and `{path}.bias`) in the var store.
    pub fn new(path: nn::Path, in_dim: i64, out_dim: i64, bias: bool) -> Self {
        let weight = path.var("weight", &[out_dim, in_dim], nn::Init::Const(0.0));
        let bias = bias.then(|| path.var("bias", &[out_dim], nn::Init::Const(0.0)));
        Linear {
            weight,
            bias,
            adapter: None,
        }
    }

    /// `x` `[..., in]` -> `[..., out]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_with(x, CpuOps::Libtorch)
    }

    /// [`Linear::forward`] with `ops` for the base product.
    pub fn forward_with(&self, x: &Tensor, ops: CpuOps) -> Tensor {
        match &self.adapter {
            None => linear_with(x, &self.weight, self.bias.as_ref(), ops),
            Some(LinearAdapter::Copy { weight, bias }) => linear_with(x, weight, bias.as_ref(), ops),
            Some(LinearAdapter::Lora(lora)) => {
                let y = linear_with(x, &self.weight, self.bias.as_ref(), ops);
                match lora.forward(x) {
                    Some(delta) => y + delta,
                    None => y,
                }
            }
        }
    }

    /// The weight the forward multiplies by (a `modules_to_save` copy when there is one).
    pub(crate) fn effective_weight(&self) -> &Tensor {
        match &self.adapter {
            Some(LinearAdapter::Copy { weight, .. }) => weight,
            _ => &self.weight,
        }
    }

    /// The same base tensors (shared, not copied) without the adapter.
    pub fn base_view(&self) -> Linear {
        Linear {
            weight: self.weight.shallow_clone(),
            bias: self.bias.as_ref().map(Tensor::shallow_clone),
            adapter: None,
        }
    }
}

/// RMSNorm computed in f32 and cast back, as the reference implementation does.
#[derive(Debug)]
pub struct RmsNorm {
    /// `[dim]`.
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Declares `{path}.weight`.
    pub fn new(path: nn::Path, dim: i64, eps: f64) -> Self {
        RmsNorm {
            weight: path.var("weight", &[dim], nn::Init::Const(1.0)),
            eps,
        }
    }

    /// A norm over an already declared `weight`.
    pub(crate) fn from_weight(weight: Tensor, eps: f64) -> Self {
        RmsNorm { weight, eps }
    }

    /// The same weight tensor (shared, not copied).
    pub fn base_view(&self) -> RmsNorm {
        RmsNorm {
            weight: self.weight.shallow_clone(),
            eps: self.eps,
        }
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Normalises the last dimension of `x` `[..., dim]`.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_with(x, CpuOps::Libtorch)
    }

    /// [`RmsNorm::forward`] with `ops`.
    pub fn forward_with(&self, x: &Tensor, ops: CpuOps) -> Tensor {
        if let Some(y) = ops.kernel(|| cpu_kernels::rms_norm(x, &self.weight, self.eps)) {
            return y;
        }
        let kind = x.kind();
        let x32 = x.to_kind(Kind::Float);
        let var = x32.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = x32 * (var + self.eps).rsqrt();
        &self.weight * normed.to_kind(kind)
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    #[test]
    fn the_skinny_orientation_gives_the_same_values_and_gradients() {
        tch::manual_seed(5);
        let w = Tensor::randn([7, 5], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let b = Tensor::randn([7], (Kind::Float, Device::Cpu));
        for shape in [vec![2i64, 3, 5], vec![1, 5], vec![70, 5]] {
            let x = Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let ours = super::linear(&x, &w, Some(&b));
            let reference = x.linear(&w, Some(&b));
            assert_eq!(ours.size(), reference.size());
            assert!(ours.allclose(&reference, 1e-6, 1e-6, false), "{shape:?}");
            let (gx, gw) = {
                let g = Tensor::run_backward(&[ours.sum(Kind::Float)], &[&x, &w], false, false);
                (g[0].shallow_clone(), g[1].shallow_clone())
            };
            let g = Tensor::run_backward(&[reference.sum(Kind::Float)], &[&x, &w], false, false);
            assert!(gx.allclose(&g[0], 1e-5, 1e-5, false) && gw.allclose(&g[1], 1e-5, 1e-5, false));
        }
    }
}
