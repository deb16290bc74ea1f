use super::{PackError, PackKind, PackedRow, Rollout, Segment};

/// Sequence (flat) packing: rollouts laid end to end with position resets, each attending to
/// itself only. The baseline tree packing is measured against; it emits the same loss terms in
/// the same order as [`super::PrefixTree::pack`].
pub fn pack_flat(rollouts: &[Rollout]) -> Result<PackedRow, PackError> {
    let raw: usize = rollouts.iter().map(|r| r.input_ids.len()).sum();
    let mut row = PackedRow {
        kind: PackKind::Flat,
        input_ids: Vec::with_capacity(raw),
        position_ids: Vec::with_capacity(raw),
        shift_labels: vec![-100; raw],
        tree_kv_index: (0..raw as i64).collect(),
        tree_cu_seqlens_q: vec![0],
        tree_cu_seqlens_k: vec![0],
        tree_max_seqlens: [0, 0],
        token_index: Vec::new(),
        old_log_probs: Vec::new(),
        advantages: Vec::new(),
        segment_id: Vec::new(),
        segments: Vec::with_capacity(rollouts.len()),
        raw_tokens: raw,
        rollouts: rollouts.len(),
        rollout_positions: Vec::with_capacity(rollouts.len()),
    };
    for (i, r) in rollouts.iter().enumerate() {
        r.validate(i)?;
        let start = row.input_ids.len();
        row.input_ids.extend_from_slice(&r.input_ids);
        row.position_ids.extend(0..r.input_ids.len() as i64);
        for p in 1..r.input_ids.len() {
            if r.completion_mask[p] == 1 {
                let at = start + p - 1;
                row.shift_labels[at] = r.input_ids[p];
                row.token_index.push(at as i64);
                row.old_log_probs.push(r.old_log_probs[p]);
                row.advantages.push(r.advantage);
                row.segment_id.push(i as i64);
            }
        }
        row.rollout_positions
            .push((start as u32..(start + r.input_ids.len()) as u32).collect());
        let end = row.input_ids.len() as i32;
        row.tree_cu_seqlens_q.push(end);
        row.tree_cu_seqlens_k.push(end);
        let len = r.input_ids.len();
        row.segments.push(Segment {
            start,
            len,
            parent: None,
            path_len: len,
            rollouts: 1,
        });
        row.tree_max_seqlens = [
            row.tree_max_seqlens[0].max(len as i32),
            row.tree_max_seqlens[1].max(len as i32),
        ];
    }
    Ok(row)
}
