//! Properties of tree packing on random rollout sets (proptest): every packed token sees
//! exactly its rollout's prefix, tree and flat packing emit the same loss terms, and malformed
//! input never panics.

use proptest::prelude::*;
use treetrain::pack::{PackedRow, PrefixTree, Rollout, pack_flat, plan};

/// Rollout sets with heavy sharing: small alphabets make shared prompts across groups, nested
/// forks, rollouts that are prefixes of others and exact duplicates common.
fn rollout_sets() -> impl Strategy<Value = Vec<Rollout>> {
    let group = (
        prop::collection::vec(0i64..4, 1..6),
        prop::collection::vec(
            (prop::collection::vec(0i64..3, 0..6), any::<bool>(), -2.0f32..2.0),
            1..5,
        ),
    );
    prop::collection::vec(group, 1..4).prop_map(|groups| {
        let mut out = Vec::new();
        for (g, (prompt, completions)) in groups.into_iter().enumerate() {
            for (completion, empty_mask, advantage) in completions {
                let n = prompt.len() + completion.len();
                let mut mask = vec![0u8; prompt.len()];
                mask.extend(std::iter::repeat_n(u8::from(!empty_mask), completion.len()));
                let old_log_probs = (0..n).map(|i| -((i % 7) as f32) / 4.0).collect();
                out.push(Rollout {
                    input_ids: [prompt.as_slice(), completion.as_slice()].concat(),
                    completion_mask: mask,
                    old_log_probs,
                    advantage,
                    group_id: format!("g{g}"),
                });
            }
        }
        out
    })
}

/// Rollout sets with wide nodes: many groups side by side at the root and, inside a group,
/// completions forking into up to 30 branches at one position (the trie then indexes a node's
/// children in its edge map instead of walking their list).
fn wide_rollout_sets() -> impl Strategy<Value = Vec<Rollout>> {
    let group = (
        prop::collection::vec(0i64..40, 1..4),
        prop::collection::vec(prop::collection::vec(0i64..40, 1..4), 1..30),
    );
    prop::collection::vec(group, 1..14).prop_map(|groups| {
        let mut out = Vec::new();
        for (g, (prompt, completions)) in groups.into_iter().enumerate() {
            for completion in completions {
                let n = prompt.len() + completion.len();
                let mut mask = vec![0u8; prompt.len()];
                mask.extend(std::iter::repeat_n(1u8, completion.len()));
                out.push(Rollout {
                    input_ids: [prompt.as_slice(), completion.as_slice()].concat(),
                    completion_mask: mask,
                    old_log_probs: vec![-1.0; n],
                    advantage: 0.5,
                    group_id: format!("g{g}"),
                });
            }
        }
        out
    })
}

/// The tokens a tree must forward, counted without a trie: one per distinct (prefix, next
/// token) over every rollout's positions (a rollout's last token is keyed on its end).
fn distinct_keys(rollouts: &[Rollout]) -> usize {
    let mut keys = std::collections::HashSet::new();
    for r in rollouts {
        for p in 0..r.input_ids.len() {
            keys.insert((r.input_ids[..=p].to_vec(), r.input_ids.get(p + 1).copied()));
        }
    }
    keys.len()
}

fn pack_tree(rollouts: &[Rollout]) -> PackedRow {
    let mut t = PrefixTree::new();
    for (i, r) in rollouts.iter().enumerate() {
        t.add(r.clone(), i).unwrap();
    }
    t.pack()
}

fn check_visibility(row: &PackedRow, rollouts: &[Rollout]) {
    let (_, leave) = row.intervals();
    let seg_of = |pos: usize| {
        row.segments
            .iter()
            .position(|s| s.start <= pos && pos < s.start + s.len)
            .unwrap()
    };
    for (r, positions) in rollouts.iter().zip(&row.rollout_positions) {
        for (p, &q) in positions.iter().enumerate() {
            let q = q as usize;
            assert_eq!(row.input_ids[q], r.input_ids[p]);
            assert_eq!(row.position_ids[q], p as i64);
            let want: Vec<usize> = positions[..=p].iter().map(|&x| x as usize).collect();
            // Interval form.
            let seen: Vec<usize> = (0..row.len()).filter(|&k| k <= q && (q as i64) < leave[k]).collect();
            assert_eq!(seen, want, "interval mask");
            // Segment form: bottom-right causal over the segment's path.
            let s = seg_of(q);
            let seg = &row.segments[s];
            let path = &row.tree_kv_index[row.tree_cu_seqlens_k[s] as usize..row.tree_cu_seqlens_k[s + 1] as usize];
            let visible = path.len() - seg.len + (q - seg.start) + 1;
            let path_seen: Vec<usize> = path[..visible].iter().map(|&x| x as usize).collect();
            assert_eq!(path_seen, want, "segment path");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_token_sees_exactly_its_prefix(rollouts in rollout_sets()) {
        let tree = pack_tree(&rollouts);
        check_visibility(&tree, &rollouts);
        let flat = pack_flat(&rollouts).unwrap();
        check_visibility(&flat, &rollouts);
        prop_assert_eq!(tree.check(), Ok(()));
        prop_assert_eq!(flat.check(), Ok(()));
        prop_assert!(tree.len() <= flat.len());
        prop_assert_eq!(flat.len(), rollouts.iter().map(|r| r.input_ids.len()).sum::<usize>());
        prop_assert_eq!(tree.tree_cu_seqlens_q.last().copied(), Some(tree.len() as i32));
        prop_assert_eq!(tree.len(), distinct_keys(&rollouts));
    }

    #[test]
    fn wide_forks_share_exactly_what_they_have_in_common(rollouts in wide_rollout_sets()) {
        let tree = pack_tree(&rollouts);
        check_visibility(&tree, &rollouts);
        prop_assert_eq!(tree.check(), Ok(()));
        prop_assert_eq!(tree.len(), distinct_keys(&rollouts));
        let flat = pack_flat(&rollouts).unwrap();
        prop_assert_eq!(tree.targets(), flat.targets());
    }

    #[test]
    fn tree_and_flat_emit_the_same_loss_terms(rollouts in rollout_sets()) {
        let tree = pack_tree(&rollouts);
        let flat = pack_flat(&rollouts).unwrap();
        prop_assert_eq!(tree.targets(), flat.targets());
        prop_assert_eq!(&tree.advantages, &flat.advantages);
        prop_assert_eq!(&tree.old_log_probs, &flat.old_log_probs);
        prop_assert_eq!(&tree.segment_id, &flat.segment_id);
        let terms: usize = rollouts.iter().map(Rollout::trained).sum();
        prop_assert_eq!(tree.token_index.len(), terms);
    }

    #[test]
    fn planned_rows_cover_every_rollout_once(rollouts in rollout_sets(), budget in 8usize..40, ranks in 1usize..4) {
        let total = rollouts.len();
        match plan(rollouts, budget, ranks) {
            Ok(p) => {
                prop_assert_eq!(p.ranks.len(), ranks);
                prop_assert_eq!(p.rows().map(|t| t.len()).sum::<usize>(), total);
                for t in p.rows() {
                    prop_assert!(t.unique_tokens() <= budget && t.trained_tokens() <= budget);
                }
            }
            Err(e) => prop_assert!(e.to_string().contains("exceed the row budget")),
        }
    }

    #[test]
    fn malformed_input_is_an_error_never_a_panic(
        ids in prop::collection::vec(-3i64..50, 0..8),
        mask in prop::collection::vec(0u8..3, 0..8),
        lps in prop::collection::vec(prop_oneof![Just(f32::NAN), -5.0f32..0.0], 0..8),
        advantage in prop_oneof![Just(f32::INFINITY), -1.0f32..1.0],
    ) {
        let r = Rollout { input_ids: ids, completion_mask: mask, old_log_probs: lps, advantage, group_id: String::new() };
        let valid = r.validate(0).is_ok();
        let mut t = PrefixTree::new();
        prop_assert_eq!(t.add(r.clone(), 0).is_ok(), valid);
        prop_assert_eq!(pack_flat(std::slice::from_ref(&r)).is_ok(), valid);
        let _ = plan(vec![r], 4, 2);
        let _ = t.pack();
    }
}
