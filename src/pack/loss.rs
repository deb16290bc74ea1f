use tch::{Kind, Tensor};

use super::PackedRow;
use crate::model::{CausalLm, LogprobChunks, ModelError, target_logprobs};

/// Clipping of the GRPO surrogate (DAPO-style asymmetric bounds allowed).
#[derive(Debug, Clone, Copy)]
pub struct GrpoLossConfig {
    /// Lower clip: ratios below `1 - epsilon_low` stop improving the objective.
    pub epsilon_low: f64,
    /// Upper clip: ratios above `1 + epsilon_high` stop improving the objective.
    pub epsilon_high: f64,
    /// LM-head chunking for the per-term log-probs.
    pub chunks: LogprobChunks,
}

impl Default for GrpoLossConfig {
    fn default() -> Self {
        GrpoLossConfig {
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            chunks: LogprobChunks::default(),
        }
    }
}

/// The loss of one packed row and what it was made of.
#[derive(Debug)]
pub struct GrpoLoss {
    /// Scalar: sum of per-term losses / normalizer.
    pub loss: Tensor,
    /// Policy log-prob of every loss term `[M]` (f32, differentiable).
    pub logprobs: Tensor,
    /// Loss terms `M`.
    pub num_terms: usize,
    /// Share of terms where clipping is active: ratio above `1 + eps_high` with a positive
    /// advantage, or below `1 - eps_low` with a negative one (TRL's clip-region metric).
    pub clip_fraction: f64,
}

/// Log-prob under `model` of every loss term of `row` `[M]`: one forward of the packed row,
/// then the LM head only at the predicting positions.
pub fn row_logprobs(model: &CausalLm, row: &PackedRow, chunks: LogprobChunks) -> Result<Tensor, ModelError> {
    let device = model.device();
    let (ids, pos, layout) = row.layout(device);
    let hidden = model.forward_hidden(&ids, &pos, &layout)?.squeeze_dim(0);
    let index = Tensor::from_slice(&row.token_index).to_device(device);
    let h = hidden.index_select(0, &index);
    target_logprobs(&h, model.lm_head_weight(), &Tensor::from_slice(&row.targets()), chunks)
}

/// The clipped GRPO surrogate over a packed row:
/// `ratio = exp(logp - old_logp)`, per term `-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`,
/// summed and divided by `normalizer` (the number of loss terms of the whole accumulation window;
/// defaults to this row's). Identical for tree and flat packing of the same rollouts.
pub fn grpo_loss(
    model: &CausalLm,
    row: &PackedRow,
    cfg: &GrpoLossConfig,
    normalizer: Option<f64>,
) -> Result<GrpoLoss, ModelError> {
    let device = model.device();
    let logprobs = row_logprobs(model, row, cfg.chunks)?;
    let old = Tensor::from_slice(&row.old_log_probs).to_device(device);
    let adv = Tensor::from_slice(&row.advantages).to_device(device);
    let ratio = (&logprobs - old).exp();
    let clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high);
    let per_term = -(&ratio * &adv).minimum(&(&clipped * &adv));
    let m = row.token_index.len();
    let norm = normalizer.unwrap_or(m.max(1) as f64);
    let loss = per_term.sum(Kind::Float) / norm;
    let clip_fraction = if m == 0 {
        0.0
    } else {
        tch::no_grad(|| {
            let high = ratio.gt(1.0 + cfg.epsilon_high).logical_and(&adv.gt(0.0));
            let low = ratio.lt(1.0 - cfg.epsilon_low).logical_and(&adv.lt(0.0));
            high.logical_or(&low)
                .to_kind(Kind::Float)
                .mean(Kind::Float)
                .double_value(&[])
        })
    };
    Ok(GrpoLoss {
        loss,
        logprobs,
        num_terms: m,
        clip_fraction,
    })
}
