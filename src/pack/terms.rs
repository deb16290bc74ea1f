//! The loss terms of a packed row, one contract for every packing: for each rollout (in the
//! row's order) and each of its trained tokens, the packed position whose hidden state predicts
//! it. Tree and flat rows differ only in where a rollout's tokens lie (`rollout_positions`).

use super::rollout::Rollout;

/// `shift_labels` `[N]` and the per-term fields `[M]` of [`super::PackedRow`].
pub(crate) struct LossTerms {
    pub shift_labels: Vec<i64>,
    pub token_index: Vec<i64>,
    pub old_log_probs: Vec<f32>,
    pub advantages: Vec<f32>,
    pub segment_id: Vec<i64>,
}

/// The loss terms of `rollouts` laid into a row of `n` positions, rollout `i`'s token `p` at
/// `positions[i][p]`. Token `p` is a term where its mask is 1 and `p > 0` (nothing predicts the
/// first token); its predictor is the position of token `p - 1`.
pub(crate) fn loss_terms(rollouts: &[Rollout], positions: &[Vec<u32>], n: usize) -> LossTerms {
    let trained: usize = rollouts.iter().map(Rollout::trained).sum();
    let mut t = LossTerms {
        shift_labels: vec![-100; n],
        token_index: Vec::with_capacity(trained),
        old_log_probs: Vec::with_capacity(trained),
        advantages: Vec::with_capacity(trained),
        segment_id: Vec::with_capacity(trained),
    };
    for (i, (r, pos)) in rollouts.iter().zip(positions).enumerate() {
        for p in 1..r.input_ids.len() {
            if r.completion_mask[p] == 1 {
                let at = pos[p - 1] as usize;
                t.shift_labels[at] = r.input_ids[p];
                t.token_index.push(at as i64);
                t.old_log_probs.push(r.old_log_probs[p]);
                t.advantages.push(r.advantage);
                t.segment_id.push(i as i64);
            }
        }
    }
    t
}
