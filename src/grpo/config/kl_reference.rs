//! The KL reference of a GRPO run ([`super::GrpoConfig::reference`]): the penalty's weight, its
//! bias correction, and TR-DPO's moving of the reference toward the policy.

use crate::train::TrainError;

/// The KL penalty to a reference policy and how that reference moves
/// ([`GrpoConfig::reference`](super::GrpoConfig::reference)).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct KlReference {
    /// KL penalty to the starting weights (0: off, no reference model is kept).
    pub beta: f64,
    /// Multiply each term's KL estimate by its importance ratio (token or sequence level, before
    /// any clipping; TRL's `use_bias_correction_kl`, from DeepSeek-V3.2): the tokens were sampled
    /// by the old weights, so the plain `k3` average is biased once the policy has moved. The
    /// corrected value is also what `ref_kl` reports. Used only with `beta > 0`; on by default,
    /// as in TRL 1.16.
    pub use_bias_correction_kl: bool,
    /// TR-DPO: move the KL reference toward the policy every `ref_model_sync_steps` steps,
    /// `reference = alpha * policy + (1 - alpha) * reference` (needs `beta > 0`; with LoRA the
    /// reference is the base weights themselves, so it is refused, as TRL refuses it).
    pub sync_ref_model: bool,
    /// TR-DPO's alpha, in [0, 1].
    pub ref_model_mixup_alpha: f64,
    /// Steps between reference syncs.
    pub ref_model_sync_steps: u64,
}

impl Default for KlReference {
    fn default() -> Self {
        KlReference {
            beta: 0.0,
            use_bias_correction_kl: true,
            sync_ref_model: false,
            ref_model_mixup_alpha: 0.6,
            ref_model_sync_steps: 512,
        }
    }
}

impl KlReference {
    /// The penalty's weight and the sync's settings.
    pub fn validate(&self) -> Result<(), TrainError> {
        if !(self.beta.is_finite() && self.beta >= 0.0) {
            return Err(TrainError::config("beta", "must be finite and >= 0"));
        }
        if self.sync_ref_model && self.beta == 0.0 {
            return Err(TrainError::config(
                "sync_ref_model",
                "needs beta > 0: without the KL term there is no reference to sync",
            ));
        }
        if !(0.0..=1.0).contains(&self.ref_model_mixup_alpha) || self.ref_model_sync_steps == 0 {
            return Err(TrainError::config(
                "ref_model_mixup_alpha",
                "must lie in [0, 1], with ref_model_sync_steps >= 1",
            ));
        }
        Ok(())
    }
}
