use std::collections::HashSet;

use super::error::PackError;
use super::planner::RowBuilder;
use super::rollout::Rollout;
use super::row::{PackKind, PackedRow, Segment};
use super::terms::loss_terms;

/// Sequence (flat) packing: rollouts laid end to end with position resets, each attending to
/// itself only. The baseline tree packing is measured against; it emits the same loss terms in
/// the same order as [`super::PrefixTree::pack`].
pub fn pack_flat(rollouts: &[Rollout]) -> Result<PackedRow, PackError> {
    for (i, r) in rollouts.iter().enumerate() {
        r.validate(i)?;
    }
    Ok(lay_out(rollouts))
}

/// A flat row being filled: every rollout forwarded whole.
#[derive(Debug, Clone, Default)]
pub struct FlatRow {
    rollouts: Vec<Rollout>,
    sources: Vec<usize>,
    groups: HashSet<String>,
    tokens: usize,
    trained: usize,
    load: u64,
}

impl RowBuilder for FlatRow {
    const SHARES_TOKENS: bool = false;
    fn empty() -> Self {
        FlatRow::default()
    }
    fn fits(&self, rollout: &Rollout, budget: usize) -> bool {
        self.tokens + rollout.input_ids.len() <= budget && self.trained + rollout.trained() <= budget
    }
    fn novel_tokens(&self, rollout: &Rollout) -> usize {
        rollout.input_ids.len()
    }
    fn holds_group(&self, group: &str) -> bool {
        self.groups.contains(group)
    }
    fn add(&mut self, rollout: Rollout, row: usize) -> Result<(), PackError> {
        rollout.validate(row)?;
        let n = rollout.input_ids.len();
        self.tokens += n;
        self.trained += rollout.trained();
        // Every token attends over its own prefix: 1 + 2 + ... + n keys.
        self.load += (n * (n + 1) / 2) as u64;
        self.groups.insert(rollout.group_id.clone());
        self.rollouts.push(rollout);
        self.sources.push(row);
        Ok(())
    }
    fn load(&self) -> u64 {
        self.load
    }
    fn pack(&self) -> PackedRow {
        PackedRow {
            sources: self.sources.clone(),
            ..lay_out(&self.rollouts)
        }
    }
    fn rollouts(&self) -> &[Rollout] {
        &self.rollouts
    }
    fn sources(&self) -> &[usize] {
        &self.sources
    }
}

/// The flat layout of validated rollouts.
fn lay_out(rollouts: &[Rollout]) -> PackedRow {
    let raw: usize = rollouts.iter().map(|r| r.input_ids.len()).sum();
    let (mut input_ids, mut position_ids) = (Vec::with_capacity(raw), Vec::with_capacity(raw));
    let (mut cu, mut segments, mut rollout_positions) = (vec![0i32], Vec::new(), Vec::new());
    let mut longest = 0;
    for r in rollouts {
        let (start, len) = (input_ids.len(), r.input_ids.len());
        input_ids.extend_from_slice(&r.input_ids);
        position_ids.extend(0..len as i64);
        rollout_positions.push((start as u32..(start + len) as u32).collect());
        cu.push((start + len) as i32);
        segments.push(Segment {
            start,
            len,
            parent: None,
            path_len: len,
            rollouts: 1,
        });
        longest = longest.max(len as i32);
    }
    let terms = loss_terms(rollouts, &rollout_positions, raw);
    PackedRow {
        kind: PackKind::Flat,
        input_ids,
        position_ids,
        shift_labels: terms.shift_labels,
        tree_kv_index: (0..raw as i64).collect(),
        tree_cu_seqlens_q: cu.clone(),
        tree_cu_seqlens_k: cu,
        tree_max_seqlens: [longest, longest],
        token_index: terms.token_index,
        old_log_probs: terms.old_log_probs,
        advantages: terms.advantages,
        segment_id: terms.segment_id,
        segments,
        raw_tokens: raw,
        rollouts: rollouts.len(),
        rollout_positions,
        sources: (0..rollouts.len()).collect(),
    }
}
