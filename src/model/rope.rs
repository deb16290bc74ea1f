//! Rotary position embeddings from explicit position ids.

use tch::{Kind, Tensor};

use super::config::{ModelConfig, RopeScaling};

/// Inverse frequencies `[head_dim / 2]` (f32), scaled as the config says; computed with the
/// same f32 operations transformers uses so angles match bit for bit.
pub(super) fn inv_freq(cfg: &ModelConfig, device: tch::Device) -> Tensor {
    let dim = cfg.head_dim;
    let exponents = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device)).to_kind(Kind::Float) / dim as f64;
    let base = Tensor::pow_scalar(cfg.rope_theta, &exponents);
    let inv = base.reciprocal();
    match cfg.rope_scaling {
        RopeScaling::None => inv,
        RopeScaling::Linear { factor } => inv / factor,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } => {
            let low_freq_wavelen = old / low_freq_factor;
            let high_freq_wavelen = old / high_freq_factor;
            let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
            let long = wavelen.gt(low_freq_wavelen);
            let scaled = (&inv / factor).where_self(&long, &inv);
            let smooth = ((wavelen.reciprocal() * old) - low_freq_factor) / (high_freq_factor - low_freq_factor);
            let smoothed = (smooth.ones_like() - &smooth) * &scaled / factor + &smooth * &scaled;
            let medium = wavelen
                .lt(high_freq_wavelen)
                .logical_not()
                .logical_and(&long.logical_not());
            smoothed.where_self(&medium, &scaled)
        }
    }
}

/// `(cos, sin)`, each `[batch, seq, head_dim]` in `kind`, for `position_ids` `[batch, seq]`.
pub(crate) fn cos_sin(inv_freq: &Tensor, position_ids: &Tensor, kind: Kind) -> (Tensor, Tensor) {
    let freqs = position_ids.to_kind(Kind::Float).unsqueeze(-1) * inv_freq.view([1, 1, -1]);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
}

/// Rotates `x` `[batch, heads, seq, head_dim]` by `cos`/`sin` `[batch, seq, head_dim]`
/// (the rotate-half convention of the Hugging Face checkpoints).
pub(super) fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let x1 = x.narrow(3, 0, half);
    let x2 = x.narrow(3, half, half);
    let rotated = Tensor::cat(&[&x2.neg(), &x1], 3);
    x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
}
