//! Tree packing against TRL v1.16.0: the worked example of its tree-packing contract (three
//! rollouts of the prompt `101 102 103`, as `PackedRow`'s doc states it) field by field, and
//! TRL's own packer on 70 seeded rollout sets (tests/fixtures/trl_tree_packing.json, made by
//! scripts/fixtures/make_tree_fixtures.py).

use serde_json::Value;
use treetrain::pack::{PackError, PrefixTree, Rollout, pack_flat, plan};

fn rollout(prompt: &[i64], completion: &[i64], advantage: f32) -> Rollout {
    let n = prompt.len() + completion.len();
    let mut mask = vec![0u8; prompt.len()];
    mask.extend(std::iter::repeat_n(1, completion.len()));
    let mut lp = vec![0.0; prompt.len()];
    lp.extend(std::iter::repeat_n(-0.5, completion.len()));
    assert_eq!(lp.len(), n);
    Rollout {
        input_ids: [prompt, completion].concat(),
        completion_mask: mask,
        old_log_probs: lp,
        advantage,
        group_id: "0".into(),
    }
}

fn trl_fixture_rows() -> Vec<Rollout> {
    let p = [101, 102, 103];
    vec![
        rollout(&p, &[201, 202], 1.0),
        rollout(&p, &[301, 302], -1.0),
        rollout(&p, &[201, 202, 401], 0.5),
    ]
}

#[test]
fn reference_fixture_field_by_field() {
    let mut tree = PrefixTree::new();
    for (i, r) in trl_fixture_rows().into_iter().enumerate() {
        tree.add(r, i).unwrap();
    }
    let row = tree.pack();
    assert_eq!(row.input_ids, [101, 102, 103, 201, 202, 202, 401, 103, 301, 302]);
    assert_eq!(row.position_ids, [0, 1, 2, 3, 4, 4, 5, 2, 3, 4]);
    assert_eq!(
        row.shift_labels,
        [-100, -100, 201, 202, -100, 401, -100, 301, 302, -100]
    );
    assert_eq!(row.token_index, [2, 3, 7, 8, 2, 3, 5]);
    assert_eq!(row.advantages, [1.0, 1.0, -1.0, -1.0, 0.5, 0.5, 0.5]);
    assert_eq!(row.segment_id, [0, 0, 1, 1, 2, 2, 2]);
    assert_eq!(row.old_log_probs, [-0.5; 7]);
    assert_eq!(
        row.tree_kv_index,
        [
            0, 1, /**/ 0, 1, 2, 3, /**/ 0, 1, 2, 3, 4, /**/ 0, 1, 2, 3, 5, 6, /**/ 0, 1, 7, 8, 9
        ]
    );
    assert_eq!(row.tree_cu_seqlens_q, [0, 2, 4, 5, 7, 10]);
    assert_eq!(row.tree_cu_seqlens_k, [0, 2, 6, 11, 17, 22]);
    assert_eq!(row.tree_max_seqlens, [3, 6]);
    let (enter, leave) = row.intervals();
    assert_eq!(enter, (0..10).collect::<Vec<i64>>());
    assert_eq!(leave, [10, 10, 7, 7, 5, 7, 7, 10, 10, 10]);
    let flat = pack_flat(&trl_fixture_rows()).unwrap();
    assert_eq!((flat.len(), row.len()), (16, 10));
    assert!((row.packing_ratio() - 1.6).abs() < 1e-12);
    assert_eq!(flat.targets(), row.targets());
    assert_eq!(flat.advantages, row.advantages);
    assert_eq!(flat.segment_id, row.segment_id);
}

fn rollout_from(v: &Value) -> Rollout {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn matches_trl_packer_on_seeded_rollout_sets() {
    let fixture: Value = serde_json::from_str(include_str!("fixtures/trl_tree_packing.json")).unwrap();
    let budgets: Vec<usize> = serde_json::from_value(fixture["budgets"].clone()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 70);
    for (c, case) in cases.iter().enumerate() {
        let mut tree = PrefixTree::new();
        for (i, (r, fits)) in case["rollouts"]
            .as_array()
            .unwrap()
            .iter()
            .zip(case["fits_before_add"].as_array().unwrap())
            .enumerate()
        {
            let r = rollout_from(r);
            for (b, want) in budgets.iter().zip(fits.as_array().unwrap()) {
                assert_eq!(
                    tree.fits(&r, *b),
                    want.as_bool().unwrap(),
                    "case {c} rollout {i} budget {b}"
                );
            }
            tree.add(r, i).unwrap();
        }
        let got = tree.pack().to_json();
        let want = &case["packed"];
        for field in [
            "input_ids",
            "position_ids",
            "shift_labels",
            "tree_kv_index",
            "tree_cu_seqlens_q",
            "tree_cu_seqlens_k",
            "tree_max_seqlens",
            "token_index",
            "segment_id",
        ] {
            assert_eq!(got[field], want[field], "case {c} ({}) field {field}", case["kind"]);
        }
        for field in ["old_log_probs", "advantages"] {
            let g: Vec<f64> = serde_json::from_value(got[field].clone()).unwrap();
            let w: Vec<f64> = serde_json::from_value(want[field].clone()).unwrap();
            assert_eq!(g.len(), w.len());
            assert!(
                g.iter().zip(&w).all(|(a, b)| (a - b).abs() < 1e-6),
                "case {c} field {field}"
            );
        }
    }
}

#[test]
fn bad_rollouts_are_typed_errors_naming_the_row() {
    let mut tree = PrefixTree::new();
    let good = trl_fixture_rows().remove(0);
    let mut short_mask = good.clone();
    short_mask.completion_mask.pop();
    assert_eq!(
        tree.add(short_mask, 4).unwrap_err().to_string(),
        "rollout 4: field `completion_mask` has 4 entries, input_ids 5"
    );
    let mut short_lp = good.clone();
    short_lp.old_log_probs.push(0.0);
    assert!(matches!(
        tree.add(short_lp, 1),
        Err(PackError::InvalidRollout {
            row: 1,
            field: "old_log_probs",
            ..
        })
    ));
    let empty = Rollout {
        input_ids: vec![],
        completion_mask: vec![],
        old_log_probs: vec![],
        ..good.clone()
    };
    assert!(matches!(
        pack_flat(&[good.clone(), empty]),
        Err(PackError::InvalidRollout {
            row: 1,
            field: "input_ids",
            ..
        })
    ));
    let mut nan = good.clone();
    nan.old_log_probs[4] = f32::NAN;
    assert!(tree.add(nan, 0).unwrap_err().to_string().contains("position 4"));
    let mut bad_mask = good.clone();
    bad_mask.completion_mask[3] = 2;
    assert!(tree.add(bad_mask, 0).is_err());
    assert!(tree.is_empty(), "failed adds leave the tree untouched");
    let err = plan(vec![good.clone(), good.clone()], 4, 1).unwrap_err();
    assert_eq!(
        err,
        PackError::OverBudget {
            row: 0,
            tokens: 5,
            trained: 2,
            budget: 4
        }
    );
    assert_eq!(plan(vec![good.clone()], 0, 1).unwrap_err(), PackError::Zero("budget"));
    assert_eq!(plan(vec![good], 8, 0).unwrap_err(), PackError::Zero("ranks"));
}

#[test]
fn planner_bounds_unique_tokens_keeps_groups_and_balances_ranks() {
    let mut rollouts = Vec::new();
    for g in 0..6 {
        let prompt: Vec<i64> = (0..20).map(|t| 1000 * g + t).collect();
        for k in 0..4 {
            let mut r = rollout(&prompt, &[g * 10 + k + 500, 7, 8], 1.0);
            r.group_id = format!("g{g}");
            rollouts.push(r);
        }
    }
    // Each group is 20 + 4 * 4 = 36 unique tokens (one duplicated fork token per extra branch).
    let p = plan(rollouts.clone(), 40, 3).unwrap();
    let rows: Vec<_> = p.rows().collect();
    assert_eq!(rows.len(), 6, "one group per row");
    for t in &rows {
        assert!(t.unique_tokens() <= 40);
        assert_eq!(t.groups().len(), 1);
        assert_eq!(t.len(), 4);
    }
    assert!(p.ranks.iter().all(|r| r.len() == 2), "6 equal rows over 3 ranks");
    // Identical rollouts add no unique token: the trained-token bound still closes rows.
    let same = vec![rollouts[0].clone(); 10];
    let p = plan(same, 23, 1).unwrap();
    assert!(p.rows().all(|t| t.trained_tokens() <= 23));
    assert_eq!(p.rows().map(|t| t.len()).sum::<usize>(), 10);
    assert!(p.rows().count() >= 2);
}
