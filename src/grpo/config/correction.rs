//! The importance-sampling correction of a GRPO run ([`super::GrpoConfig::sampling_correction`]):
//! TRL's `vllm_importance_sampling_*` settings, for rollouts whose sampling weights lag the
//! policy.

use super::loss::LossType;
use crate::train::TrainError;

/// How the mismatch between the weights that sampled a rollout and the policy at update start
/// is corrected (TRL's `vllm_importance_sampling_mode`; here for async rollouts and repeated
/// iterations, whose generating weights lag). The ratio is `exp(before - sampled)` of the
/// log-probs, per token or summed per rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum SamplingCorrectionMode {
    /// Per-token ratios clipped to `[clip_min, clip_max]`.
    TokenTruncate,
    /// Per-token ratios outside `[clip_min, clip_max]` set to 0.
    TokenMask,
    /// One ratio per rollout, clipped, applied to all its tokens.
    SequenceTruncate,
    /// Rollouts whose ratio is outside `[clip_min, clip_max]` left out (TRL 1.16's default).
    #[default]
    SequenceMask,
}

/// The correction for the weights that sampled the rollouts lagging the policy
/// ([`GrpoConfig::sampling_correction`](super::GrpoConfig::sampling_correction)).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ImportanceCorrection {
    /// Correct for the weights that sampled the rollouts lagging the policy (TRL's
    /// `vllm_importance_sampling_correction`, accepted as an alias, as are its `_mode`,
    /// `_clip_max` (and `_cap`) and `_clip_min`): the clipped ratio is then taken against the
    /// policy's own log-probs at the start of the update (one more forward per row, without
    /// gradient), and each term's policy loss is weighted by the capped ratio of those to the
    /// sampling log-probs. Off by default (it costs that forward).
    pub importance_sampling_correction: bool,
    /// How the correction ratio is capped.
    pub importance_sampling_mode: SamplingCorrectionMode,
    /// Upper bound of the correction ratio (TRL's default 3.0; `None`: none).
    pub importance_sampling_clip_max: Option<f64>,
    /// Lower bound of the correction ratio (`None`: none).
    pub importance_sampling_clip_min: Option<f64>,
}

impl Default for ImportanceCorrection {
    fn default() -> Self {
        ImportanceCorrection {
            importance_sampling_correction: false,
            importance_sampling_mode: SamplingCorrectionMode::SequenceMask,
            importance_sampling_clip_max: Some(3.0),
            importance_sampling_clip_min: None,
        }
    }
}

impl ImportanceCorrection {
    /// The bounds, and the modes `loss_type` takes.
    pub fn validate(&self, loss_type: LossType) -> Result<(), TrainError> {
        let (lo, hi) = (self.importance_sampling_clip_min, self.importance_sampling_clip_max);
        if lo.is_some_and(|l| !(l.is_finite() && l >= 0.0))
            || hi.is_some_and(|h| !(h.is_finite() && h > lo.unwrap_or(0.0)))
        {
            return Err(TrainError::config(
                "importance_sampling_clip_max",
                "and importance_sampling_clip_min must be finite, >= 0, with min below max",
            ));
        }
        // VESPO folds the correction into its sequence weight token by token (as TRL does).
        let per_sequence = matches!(
            self.importance_sampling_mode,
            SamplingCorrectionMode::SequenceMask | SamplingCorrectionMode::SequenceTruncate
        );
        if loss_type == LossType::Vespo && self.importance_sampling_correction && per_sequence {
            return Err(TrainError::config(
                "importance_sampling_mode",
                "must be token_truncate or token_mask with loss_type = \"vespo\" and importance_sampling_correction (TRL refuses the sequence modes)",
            ));
        }
        Ok(())
    }

    /// The correction the objective applies (`None`: off).
    pub fn objective(&self) -> Option<super::super::SamplingCorrection> {
        self.importance_sampling_correction
            .then_some(super::super::SamplingCorrection {
                mode: self.importance_sampling_mode,
                clip_min: self.importance_sampling_clip_min,
                clip_max: self.importance_sampling_clip_max,
            })
    }
}
