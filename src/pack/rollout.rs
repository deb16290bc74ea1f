use super::error::PackError;

/// One GRPO rollout: prompt and completion tokens, which of them are trained, the generator's
/// log-probability of each token, the rollout's advantage and its group (prompt).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rollout {
    /// Prompt + completion token ids `[len]`.
    pub input_ids: Vec<i64>,
    /// 1 on trained (completion) tokens `[len]`; the first token is never trained (nothing
    /// predicts it).
    pub completion_mask: Vec<u8>,
    /// Generator log-probability of each token `[len]` (ignored where the mask is 0).
    pub old_log_probs: Vec<f32>,
    /// Group-normalised advantage of the whole rollout.
    pub advantage: f32,
    /// Rollouts of one prompt share a group id.
    #[serde(default, deserialize_with = "group_from_any")]
    pub group_id: String,
}

fn group_from_any<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    use serde::Deserialize;
    Ok(match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => s,
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    })
}

impl Rollout {
    /// Checks lengths and values; `row` names the rollout in errors.
    pub fn validate(&self, row: usize) -> Result<(), PackError> {
        let n = self.input_ids.len();
        let bad = |field: &'static str, message: String| PackError::InvalidRollout { row, field, message };
        if n == 0 {
            return Err(bad("input_ids", "empty".into()));
        }
        if self.completion_mask.len() != n {
            return Err(bad(
                "completion_mask",
                format!("has {} entries, input_ids {n}", self.completion_mask.len()),
            ));
        }
        if self.old_log_probs.len() != n {
            return Err(bad(
                "old_log_probs",
                format!("has {} entries, input_ids {n}", self.old_log_probs.len()),
            ));
        }
        if let Some(v) = self.completion_mask.iter().find(|&&m| m > 1) {
            return Err(bad("completion_mask", format!("holds {v}; only 0 and 1 are allowed")));
        }
        if let Some(t) = self.input_ids.iter().find(|&&t| t < 0) {
            return Err(bad("input_ids", format!("holds negative id {t}")));
        }
        if !self.advantage.is_finite() {
            return Err(bad("advantage", format!("is {}", self.advantage)));
        }
        if let Some((i, lp)) = self
            .old_log_probs
            .iter()
            .enumerate()
            .find(|(i, lp)| self.completion_mask[*i] == 1 && !lp.is_finite())
        {
            return Err(bad("old_log_probs", format!("position {i} is {lp} on a trained token")));
        }
        Ok(())
    }

    /// Trained tokens (loss terms) of this rollout: mask positions 1.. (position 0 has no
    /// predecessor).
    pub fn trained(&self) -> usize {
        self.completion_mask.iter().skip(1).filter(|&&m| m == 1).count()
    }
}
