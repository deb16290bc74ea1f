//! The entropy bonus of a GRPO run ([`super::GrpoConfig::entropy_bonus`]): its coefficient,
//! Skywork-OR1's adaptive controller settings, and the controller's state carried from step to
//! step ([`EntropyControl`]).

use crate::train::TrainError;

/// The entropy bonus: the loss minus a coefficient times the policy's mean entropy, fixed or
/// steered toward a target entropy ([`GrpoConfig::entropy_bonus`](super::GrpoConfig::entropy_bonus)).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct EntropyBonus {
    /// Entropy bonus: the loss minus this times the mean policy entropy over the step's trained
    /// terms (those above the entropy floor with `top_entropy_quantile`), whatever the loss
    /// type's normalisation. 0: off (and the LM head's logits are not kept for it).
    pub entropy_coef: f64,
    /// Skywork-OR1's adaptive coefficient: after each step `entropy_coef` moves by
    /// `entropy_coef_delta` (up while the step's entropy is at or below `entropy_target`, down
    /// otherwise, within `[entropy_coef_min, entropy_coef_max]`), and the bonus applies only
    /// while the last step's entropy was at or below the target. Checkpointed
    /// ([`EntropyControl`]).
    pub use_adaptive_entropy: bool,
    /// Lowest adaptive coefficient.
    pub entropy_coef_min: f64,
    /// Highest adaptive coefficient.
    pub entropy_coef_max: f64,
    /// Step of the adaptive coefficient.
    pub entropy_coef_delta: f64,
    /// Entropy (nats per token) the adaptive coefficient steers toward.
    pub entropy_target: f64,
}

impl Default for EntropyBonus {
    fn default() -> Self {
        EntropyBonus {
            entropy_coef: 0.0,
            use_adaptive_entropy: false,
            entropy_coef_min: 0.0,
            entropy_coef_max: 1.0,
            entropy_coef_delta: 0.005,
            entropy_target: 0.2,
        }
    }
}

impl EntropyBonus {
    /// The coefficient and the target are finite; the adaptive bounds are ordered.
    pub fn validate(&self) -> Result<(), TrainError> {
        let finite = [
            ("entropy_coef", self.entropy_coef),
            ("entropy_target", self.entropy_target),
        ];
        if let Some((field, _)) = finite.iter().find(|(_, v)| !v.is_finite()) {
            return Err(TrainError::config(field, "must be finite"));
        }
        if self.use_adaptive_entropy
            && !(self.entropy_coef_min.is_finite()
                && self.entropy_coef_max.is_finite()
                && self.entropy_coef_min <= self.entropy_coef_max
                && self.entropy_coef_delta.is_finite()
                && self.entropy_coef_delta >= 0.0)
        {
            return Err(TrainError::config(
                "entropy_coef_min",
                "entropy_coef_min <= entropy_coef_max and entropy_coef_delta >= 0, all finite, for use_adaptive_entropy",
            ));
        }
        Ok(())
    }

    /// The coefficient a run starts with: `entropy_coef`, or 0 for the adaptive controller,
    /// which has no measured entropy yet.
    pub(crate) fn initial_coef(&self) -> f64 {
        if self.use_adaptive_entropy {
            0.0
        } else {
            self.entropy_coef
        }
    }
}

/// Skywork-OR1's adaptive entropy coefficient, carried from step to step (and checkpointed).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EntropyControl {
    /// The coefficient (`None` before the first step: `entropy_coef`).
    pub coef: Option<f64>,
    /// The last step's mean entropy over its trained terms (`None` before the first step: no
    /// bonus until one is measured).
    pub last_entropy: Option<f64>,
}

impl EntropyControl {
    /// The coefficient the next step applies: the controller's, while the last step's entropy
    /// was at or below the target; else 0.
    pub(crate) fn applied(&self, bonus: &EntropyBonus) -> f64 {
        match self.last_entropy {
            Some(e) if e <= bonus.entropy_target => self.coef.unwrap_or(bonus.entropy_coef),
            _ => 0.0,
        }
    }

    /// After a step whose trained terms' mean entropy was `entropy`: the coefficient steps up
    /// (entropy at or below the target) or down, within its bounds.
    pub(crate) fn update(&mut self, bonus: &EntropyBonus, entropy: f64) {
        let coef = self.coef.unwrap_or(bonus.entropy_coef);
        self.coef = Some(if entropy <= bonus.entropy_target {
            (coef + bonus.entropy_coef_delta).min(bonus.entropy_coef_max)
        } else {
            (coef - bonus.entropy_coef_delta).max(bonus.entropy_coef_min)
        });
        self.last_entropy = Some(entropy);
    }
}

impl crate::display::Rich for EntropyControl {
    fn html(&self) -> String {
        crate::display::rows_card("Adaptive entropy bonus", &self.rows())
    }
    fn text(&self) -> String {
        crate::display::rows_text(&self.rows())
    }
}

impl EntropyControl {
    fn rows(&self) -> Vec<(&'static str, String)> {
        let or_unset = |v: Option<f64>| v.map_or("not yet".to_string(), |v| format!("{v:.4}"));
        vec![
            ("coefficient", or_unset(self.coef)),
            ("last step's entropy", or_unset(self.last_entropy)),
        ]
    }
}

crate::display::rich_display!(EntropyControl);
