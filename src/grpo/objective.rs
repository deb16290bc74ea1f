//! The GRPO objective's settings: clipping, the KL penalty to a frozen reference, the loss type
//! that normalises loss terms over a whole step (TRL's `loss_type`), the sampling correction and
//! how the LM head is back-propagated. What they compute over a packed row is in `row_terms`.

use super::config::{GrpoConfig, ImportanceSampling, LossType, SamplingCorrectionMode};
use crate::model::Truncation;
use crate::model::{Activations, LogprobChunks};

/// How the loss's LM head is back-propagated (`row_loss`'s module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LmHead {
    /// Chunk by chunk, recomputed in backward.
    #[default]
    Fused,
    /// Every chunk's graph kept until backward.
    Kept,
}

/// The GRPO objective: clipping (DAPO-style asymmetric bounds allowed), sampling temperature,
/// the KL penalty and how the loss terms of a step are averaged. Built from a run's
/// [`GrpoConfig`] by `From`.
#[derive(Debug, Clone, Copy)]
pub struct GrpoObjective {
    /// Lower clip: ratios below `1 - epsilon_low` stop improving the objective.
    pub epsilon_low: f64,
    /// Upper clip: ratios above `1 + epsilon_high` stop improving the objective.
    pub epsilon_high: f64,
    /// Two-sided clipping: the unclipped ratio capped at `delta` (`None`: off).
    pub delta: Option<f64>,
    /// Token- or sequence-level (GSPO) importance ratios.
    pub importance_sampling: ImportanceSampling,
    /// Correction for rollouts sampled by other weights than the policy at update start
    /// (`None`: the ratio is taken against the sampling log-probs, uncorrected).
    pub sampling_correction: Option<SamplingCorrection>,
    /// Share of the step's loss terms, by entropy from the top, that are trained (1: all).
    pub top_entropy_quantile: f64,
    /// The step's entropy at quantile `1 - top_entropy_quantile`: terms below it are left out
    /// of the policy loss. Set per step by the update (`update::entropy_floor`); `None`: all
    /// terms train.
    pub entropy_floor: Option<f64>,
    /// LM-head chunking for the per-term log-probs.
    pub chunks: LogprobChunks,
    /// The LM head's backward fused chunk by chunk (default) or kept whole until backward.
    pub lm_head: LmHead,
    /// Policy log-probs are taken under `softmax(logits / temperature)` with the sampler's
    /// `truncation` replayed: the distribution the generator's log-probs (the old log-probs)
    /// were drawn from.
    pub temperature: f64,
    /// The sampler's top-k / top-p / min-p and token limit (the limit is the tokenizer's,
    /// set by the trainer): the policy, the reference and the policy at update start are
    /// scored under the same truncation, each from its own logits.
    pub truncation: Truncation,
    /// Weight of the per-term KL estimate to a frozen reference (`k3`, Schulman): 0 = off.
    pub beta: f64,
    /// The KL estimate times the importance ratio (TRL's `use_bias_correction_kl`).
    pub bias_corrected_kl: bool,
    /// How loss terms are averaged over the step.
    pub loss_type: LossType,
    /// Dr. GRPO's constant (the run's `max_completion_length`).
    pub max_completion_length: usize,
    /// Rollouts per micro-batch of `Bnpo` (TRL's `per_device_train_batch_size`).
    pub per_device_train_batch_size: usize,
    /// Layer activations kept for backward or recomputed (`gradient_checkpointing`).
    pub activations: Activations,
    /// `sapo`'s gate temperatures: for a positive advantage, otherwise.
    pub sapo_temperatures: [f64; 2],
    /// `vespo`'s Gamma `(k, lambda)`: for an advantage >= 0, otherwise.
    pub vespo_shape: [(f64, f64); 2],
    /// Off-policy sequence masking: a rollout with a negative advantage whose mean KL from the
    /// sampling weights exceeds this leaves the policy loss (`None`: off).
    pub off_policy_mask_threshold: Option<f64>,
    /// The entropy bonus's coefficient this step (0: off; the adaptive controller's value, or
    /// 0 while it holds the bonus back).
    pub entropy_coef: f64,
    /// Trained terms of the whole step the bonus's mean divides by (those at or above the
    /// entropy floor); `None`: the row's own (a row scored on its own).
    pub entropy_terms: Option<usize>,
    /// Weight of a mixture model's load-balancing loss (`router_aux_loss_coef`; 0: off). Each
    /// packed row adds it over its tokens, weighted by the row's share of the step's rollouts.
    pub router_aux_loss_coef: f64,
}

impl From<&GrpoConfig> for GrpoObjective {
    fn from(c: &GrpoConfig) -> Self {
        GrpoObjective {
            epsilon_low: c.loss.epsilon_low,
            epsilon_high: c.loss.epsilon_high,
            delta: c.loss.delta,
            importance_sampling: c.loss.importance_sampling_level,
            top_entropy_quantile: c.loss.top_entropy_quantile,
            entropy_floor: None,
            sampling_correction: c.sampling_correction.objective(),
            chunks: LogprobChunks::default(),
            lm_head: LmHead::Fused,
            temperature: c.sampling.temperature,
            truncation: c.sampling_config().truncation(),
            beta: c.reference.beta,
            bias_corrected_kl: c.reference.use_bias_correction_kl,
            loss_type: c.loss.loss_type,
            max_completion_length: c.rollouts.max_completion_length,
            per_device_train_batch_size: c.loss.per_device_train_batch_size,
            activations: Activations::from_checkpointing(c.train.precision.gradient_checkpointing),
            sapo_temperatures: [c.loss.sapo_temperature_pos, c.loss.sapo_temperature_neg],
            vespo_shape: [
                (c.loss.vespo_k_pos, c.loss.vespo_lambda_pos),
                (c.loss.vespo_k_neg, c.loss.vespo_lambda_neg),
            ],
            off_policy_mask_threshold: c.loss.off_policy_mask_threshold,
            entropy_coef: c.entropy_bonus.initial_coef(),
            entropy_terms: None,
            router_aux_loss_coef: c.train.router_aux_loss_coef,
        }
    }
}

impl Default for GrpoObjective {
    fn default() -> Self {
        GrpoObjective {
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            delta: None,
            importance_sampling: ImportanceSampling::Token,
            top_entropy_quantile: 1.0,
            entropy_floor: None,
            sampling_correction: None,
            chunks: LogprobChunks::default(),
            lm_head: LmHead::Fused,
            temperature: 1.0,
            truncation: Truncation::default(),
            beta: 0.0,
            bias_corrected_kl: false,
            loss_type: LossType::Dapo,
            activations: Activations::Kept,
            max_completion_length: 0,
            per_device_train_batch_size: 8,
            sapo_temperatures: [1.0, 1.05],
            vespo_shape: [(2.0, 3.0), (3.0, 2.0)],
            off_policy_mask_threshold: None,
            entropy_coef: 0.0,
            entropy_terms: None,
            router_aux_loss_coef: 0.0,
        }
    }
}

/// TRL's importance-sampling correction of the sampling mismatch: a mode and its bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingCorrection {
    /// Per token or per rollout, clipped or masked.
    pub mode: SamplingCorrectionMode,
    /// Lower bound of the ratio.
    pub clip_min: Option<f64>,
    /// Upper bound of the ratio.
    pub clip_max: Option<f64>,
}

impl GrpoObjective {
    /// The settings every objective has, then those of its loss type and the options it uses.
    fn rows(&self) -> Vec<(&'static str, String)> {
        let mut rows = vec![
            ("epsilon_low", self.epsilon_low.to_string()),
            ("epsilon_high", self.epsilon_high.to_string()),
            ("temperature", self.temperature.to_string()),
            ("beta", self.beta.to_string()),
            ("use_bias_correction_kl", self.bias_corrected_kl.to_string()),
            ("loss_type", crate::display::serde_name(&self.loss_type)),
            ("max_completion_length", self.max_completion_length.to_string()),
        ];
        let [(k_pos, l_pos), (k_neg, l_neg)] = self.vespo_shape;
        match self.loss_type {
            LossType::Sapo => rows.push(("sapo temperatures (pos, neg)", format!("{:?}", self.sapo_temperatures))),
            LossType::Vespo => rows.push((
                "vespo k, lambda (pos; neg)",
                format!("{k_pos}, {l_pos}; {k_neg}, {l_neg}"),
            )),
            _ => {}
        }
        if let Some(t) = self.off_policy_mask_threshold {
            rows.push(("off_policy_mask_threshold", t.to_string()));
        }
        if self.entropy_coef != 0.0 {
            rows.push(("entropy_coef (this step)", format!("{:.4}", self.entropy_coef)));
        }
        if self.truncation != Truncation::default() {
            rows.push(("truncation (replayed)", self.truncation.to_string()));
        }
        rows
    }
}

impl crate::display::Rich for GrpoObjective {
    fn html(&self) -> String {
        crate::display::rows_card("GRPO objective", &self.rows())
    }
    fn text(&self) -> String {
        self.rows().iter().map(|(k, v)| format!("{k} = {v}\n")).collect()
    }
}

crate::display::rich_display!(GrpoObjective);
