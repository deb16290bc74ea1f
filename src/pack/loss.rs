use tch::{Kind, Tensor};

use super::PackedRow;
use crate::model::{CausalLm, LogprobChunks, ModelError, target_logprobs};

/// The GRPO objective's knobs: clipping (DAPO-style asymmetric bounds allowed), sampling
/// temperature and the KL penalty.
#[derive(Debug, Clone, Copy)]
pub struct GrpoLossConfig {
    /// Lower clip: ratios below `1 - epsilon_low` stop improving the objective.
    pub epsilon_low: f64,
    /// Upper clip: ratios above `1 + epsilon_high` stop improving the objective.
    pub epsilon_high: f64,
    /// LM-head chunking for the per-term log-probs.
    pub chunks: LogprobChunks,
    /// Policy log-probs are taken under `softmax(logits / temperature)`: the distribution the
    /// generator's untruncated log-probs (the old log-probs) were measured under.
    pub temperature: f64,
    /// Weight of the per-term KL estimate to a frozen reference (`k3`, Schulman): 0 = off.
    pub beta: f64,
}

impl Default for GrpoLossConfig {
    fn default() -> Self {
        GrpoLossConfig {
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            chunks: LogprobChunks::default(),
            temperature: 1.0,
            beta: 0.0,
        }
    }
}

/// How each loss term is weighted in the sum that becomes a row's loss.
#[derive(Debug, Clone, Copy)]
pub enum TermWeights<'a> {
    /// Every term times this (1 / the loss terms of the window: token-level normalisation).
    Uniform(f64),
    /// One weight per loss term `[M]` (e.g. 1 / (the term's rollout length x rollouts):
    /// sequence-level normalisation).
    PerTerm(&'a [f32]),
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
    /// Sum over terms of the `k3` estimate of `KL(old || policy)` (the tokens were sampled from
    /// the old weights): how far the policy has moved since generation (0 for the same weights).
    pub approx_kl_sum: f64,
    /// Sum over terms of the `k3` estimate of `KL(policy || reference)`, as TRL penalises it (0
    /// without a reference).
    pub ref_kl_sum: f64,
    /// Sum over terms of the policy's entropy (nats) at the predicting position.
    pub entropy_sum: f64,
}

/// `k3 = exp(q - p) - (q - p) - 1` per term: an unbiased, non-negative estimate of
/// `KL(P || Q)` from samples of `P` (log-probs `p` under `P`, `q` under `Q`).
fn k3(sampled: &Tensor, other: &Tensor) -> Tensor {
    let d = other - sampled;
    d.exp() - &d - 1.0
}

/// The distinct `(position, target)` pairs of a row's loss terms. A token trained in several
/// rollouts that share it in the tree is several terms with one hidden state and one target, so
/// its log-prob (and the LM head's work for it) is computed once and fanned out.
struct DistinctTerms {
    /// `[U]` hidden states at the pairs' positions, divided by the temperature (so that
    /// `h W^T = logits / temperature`).
    hidden: Tensor,
    /// `[U]` targets.
    targets: Tensor,
    /// `[M]` the pair of each loss term.
    of_term: Tensor,
    /// `[U]` terms per pair (f64, for weighting per-pair statistics).
    counts: Vec<f64>,
}

fn distinct_terms(model: &CausalLm, row: &PackedRow, temperature: f64) -> Result<DistinctTerms, ModelError> {
    let device = model.device();
    // Rows are public data: a hand-made one must fail with a message, not an index panic.
    row.check().map_err(|e| ModelError::Input(format!("packed row: {e}")))?;
    let targets = row.targets();
    let mut seen: std::collections::HashMap<(i64, i64), i64> = std::collections::HashMap::new();
    let (mut positions, mut pair_targets, mut counts) = (Vec::new(), Vec::new(), Vec::new());
    let of_term: Vec<i64> = row
        .token_index
        .iter()
        .zip(&targets)
        .map(|(&p, &t)| {
            let id = *seen.entry((p, t)).or_insert_with(|| {
                positions.push(p);
                pair_targets.push(t);
                counts.push(0.0);
                positions.len() as i64 - 1
            });
            counts[id as usize] += 1.0;
            id
        })
        .collect();
    let (ids, pos, layout) = row.layout(device);
    let hidden = model.forward_hidden(&ids, &pos, &layout)?.squeeze_dim(0);
    let h = hidden.index_select(0, &Tensor::from_slice(&positions).to_device(device));
    Ok(DistinctTerms {
        hidden: if temperature == 1.0 { h } else { h / temperature },
        targets: Tensor::from_slice(&pair_targets),
        of_term: Tensor::from_slice(&of_term).to_device(device),
        counts,
    })
}

impl DistinctTerms {
    /// Log-prob of every loss term `[M]`.
    fn logprobs(&self, lm_head: &Tensor, chunks: LogprobChunks) -> Result<Tensor, ModelError> {
        Ok(target_logprobs(&self.hidden, lm_head, &self.targets, chunks)?.index_select(0, &self.of_term))
    }
}

/// Log-prob under `model` of every loss term of `row` `[M]`: one forward of the packed row,
/// then the LM head only at the predicting positions.
pub fn row_logprobs(model: &CausalLm, row: &PackedRow, chunks: LogprobChunks) -> Result<Tensor, ModelError> {
    row_logprobs_at(model, row, chunks, 1.0)
}

/// [`row_logprobs`] under `softmax(logits / temperature)`.
pub fn row_logprobs_at(
    model: &CausalLm,
    row: &PackedRow,
    chunks: LogprobChunks,
    temperature: f64,
) -> Result<Tensor, ModelError> {
    distinct_terms(model, row, temperature)?.logprobs(model.lm_head_weight(), chunks)
}

/// `sum_i weights[i] * entropy(softmax(h_i W^T))` over rows of `h` `[U, hidden]`, without
/// gradient, `chunk` rows at a time (full-vocabulary logits only for one chunk).
fn entropy_sum(h: &Tensor, lm_head: &Tensor, weights: &[f64], chunk: i64) -> f64 {
    tch::no_grad(|| {
        let n = h.size()[0];
        let w = lm_head.to_kind(Kind::Float);
        let weights = Tensor::from_slice(weights).to_kind(Kind::Float).to_device(h.device());
        let mut total = 0.0;
        let mut start = 0;
        while start < n {
            let len = chunk.max(1).min(n - start);
            let logits = h.narrow(0, start, len).to_kind(Kind::Float).matmul(&w.transpose(0, 1));
            let logp = logits.log_softmax(-1, Kind::Float);
            let entropy = -(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Float);
            total += (entropy * weights.narrow(0, start, len))
                .sum(Kind::Float)
                .double_value(&[]);
            start += len;
        }
        total
    })
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
    let norm = normalizer.unwrap_or(row.token_index.len().max(1) as f64);
    grpo_loss_with_reference(model, row, cfg, TermWeights::Uniform(1.0 / norm), None)
}

/// The clipped surrogate with per-term `weights`, plus `beta * k3(policy, reference)` per term
/// when `reference` holds the frozen reference model's log-probs of the row's terms `[M]` and
/// `cfg.beta > 0`: `loss = sum_t weight_t * term_t`.
pub fn grpo_loss_with_reference(
    model: &CausalLm,
    row: &PackedRow,
    cfg: &GrpoLossConfig,
    weights: TermWeights<'_>,
    reference: Option<&Tensor>,
) -> Result<GrpoLoss, ModelError> {
    let device = model.device();
    let m = row.token_index.len();
    let terms = distinct_terms(model, row, cfg.temperature)?;
    let logprobs = terms.logprobs(model.lm_head_weight(), cfg.chunks)?;
    let old = Tensor::from_slice(&row.old_log_probs).to_device(device);
    let adv = Tensor::from_slice(&row.advantages).to_device(device);
    let ratio = (&logprobs - &old).exp();
    let clipped = ratio.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high);
    let mut per_term = -(&ratio * &adv).minimum(&(&clipped * &adv));
    let mut ref_kl_sum = 0.0;
    if let Some(reference) = reference.filter(|_| cfg.beta > 0.0) {
        if reference.size() != [m as i64] {
            return Err(ModelError::Input(format!(
                "reference log-probs have shape {:?}, the row has {m} loss terms",
                reference.size()
            )));
        }
        let kl = k3(&logprobs, &reference.to_device(device).to_kind(Kind::Float));
        ref_kl_sum = tch::no_grad(|| kl.sum(Kind::Float).double_value(&[]));
        per_term += kl * cfg.beta;
    }
    let loss = match weights {
        TermWeights::Uniform(w) => per_term.sum(Kind::Float) * w,
        TermWeights::PerTerm(w) => {
            if w.len() != m {
                return Err(ModelError::Input(format!(
                    "{} term weights for a row of {m} loss terms",
                    w.len()
                )));
            }
            (per_term * Tensor::from_slice(w).to_device(device)).sum(Kind::Float)
        }
    };
    let (clip_fraction, approx_kl_sum) = if m == 0 {
        (0.0, 0.0)
    } else {
        tch::no_grad(|| {
            let high = ratio.gt(1.0 + cfg.epsilon_high).logical_and(&adv.gt(0.0));
            let low = ratio.lt(1.0 - cfg.epsilon_low).logical_and(&adv.lt(0.0));
            let clip = high
                .logical_or(&low)
                .to_kind(Kind::Float)
                .mean(Kind::Float)
                .double_value(&[]);
            // Sampled from the old weights: k3 of KL(old || policy) uses ratio policy/old.
            (clip, k3(&old, &logprobs).sum(Kind::Float).double_value(&[]))
        })
    };
    let entropy_sum = entropy_sum(
        &terms.hidden,
        model.lm_head_weight(),
        &terms.counts,
        cfg.chunks.tokens.min(256),
    );
    Ok(GrpoLoss {
        loss,
        logprobs,
        num_terms: m,
        clip_fraction,
        approx_kl_sum,
        ref_kl_sum,
        entropy_sum,
    })
}
