//! The GRPO loss's fused LM head (`LmHead::Fused`: log-probs and entropies without a graph,
//! then each chunk recomputed and back-propagated with the objective's gradient) gives the
//! loss and the gradients of the plain autograd path (`LmHead::Kept`) to 1e-5 relative (fp32),
//! on random tree-shaped rollouts in tree and flat packing, with the entropy bonus, the KL term,
//! truncated sampling, the top-entropy mask, sequence-level ratios and gradient checkpointing.

mod common;

use common::take_grads;
use tch::Kind;
use treetrain::generate::Truncation;
use treetrain::grpo::{GrpoObjective, ImportanceSampling, LmHead, accumulate_gradients, pack_rollouts};
use treetrain::model::{Activations, LoadOptions, LogprobChunks, Model};
use treetrain::pack::{Packing, Rollout};
use treetrain::util::SplitMix64;

/// Groups of 4 rollouts of one prompt each, completions branching after a shared first token
/// or two (a tree), random old log-probs (ratios away from 1, some clipped) and advantages.
fn rollouts() -> Vec<Rollout> {
    let mut rng = SplitMix64::new(17);
    let id = |rng: &mut SplitMix64| (rng.next_u64() % 1700) as i64 + 10;
    let mut out = Vec::new();
    for g in 0..3 {
        let prompt: Vec<i64> = (0..6 + 3 * g).map(|_| id(&mut rng)).collect();
        let shared: Vec<i64> = (0..2).map(|_| id(&mut rng)).collect();
        for k in 0..4 {
            let mut ids = prompt.clone();
            ids.extend(&shared[..k % 3]);
            ids.extend((0..3 + (rng.next_u64() % 8) as usize).map(|_| id(&mut rng)));
            let mask: Vec<u8> = (0..ids.len()).map(|i| u8::from(i >= prompt.len())).collect();
            let old = ids.iter().map(|_| -(0.5 + 6.0 * rng.next_f64()) as f32).collect();
            out.push(Rollout {
                input_ids: ids,
                completion_mask: mask,
                old_log_probs: old,
                advantage: (rng.next_f64() * 2.0 - 1.0) as f32,
                group_id: format!("g{g}"),
            });
        }
    }
    out
}

#[test]
fn the_fused_head_gives_the_kept_heads_loss_and_gradients() {
    let dir = treetrain::shipped::datasets_dir();
    let policy = Model::load(&dir.join("tiny-qwen3"), LoadOptions::default()).unwrap();
    let reference = Model::load(&dir.join("tiny-qwen3-sft"), LoadOptions::default()).unwrap();
    let small = LogprobChunks { tokens: 7, vocab: 300 };
    let base = GrpoObjective {
        temperature: 0.9,
        ..GrpoObjective::default()
    };
    let cases = [
        ("plain", base),
        ("small chunks", GrpoObjective { chunks: small, ..base }),
        (
            "entropy bonus",
            GrpoObjective {
                entropy_coef: 0.05,
                chunks: small,
                ..base
            },
        ),
        (
            "KL term",
            GrpoObjective {
                beta: 0.04,
                bias_corrected_kl: true,
                ..base
            },
        ),
        (
            "truncated sampling",
            GrpoObjective {
                truncation: Truncation {
                    top_k: Some(40),
                    top_p: Some(0.9),
                    token_limit: Some(1760),
                    min_p: None,
                },
                chunks: small,
                ..base
            },
        ),
        (
            "top entropy, GSPO",
            GrpoObjective {
                top_entropy_quantile: 0.5,
                importance_sampling: ImportanceSampling::Sequence,
                ..base
            },
        ),
        (
            "checkpointing",
            GrpoObjective {
                activations: Activations::Recomputed,
                entropy_coef: 0.05,
                beta: 0.04,
                ..base
            },
        ),
    ];
    for (name, objective) in cases {
        for packing in [Packing::Tree, Packing::Flat] {
            let rows = pack_rollouts(rollouts(), packing, 256).unwrap();
            let run = |lm_head| {
                let o = GrpoObjective { lm_head, ..objective };
                let stats = accumulate_gradients(&policy.lm, Some(&reference.lm), &rows, &o).unwrap();
                (stats, take_grads(&policy))
            };
            let (kept, want) = run(LmHead::Kept);
            let (fused, got) = run(LmHead::Fused);
            let rel = (fused.loss - kept.loss).abs() / kept.loss.abs().max(1e-12);
            assert!(rel < 1e-5, "{name} {packing:?}: loss {} vs {}", fused.loss, kept.loss);
            assert!(kept.clip_ratio > 0.0, "{name}: nothing clipped, the case tests little");
            for ((k, g), (_, w)) in got.iter().zip(&want) {
                let scale = w.norm().double_value(&[]);
                if scale == 0.0 {
                    assert_eq!(g.norm().double_value(&[]), 0.0, "{name} {packing:?} {k}");
                    continue;
                }
                let err = (g - w).norm().double_value(&[]) / scale;
                assert!(err < 1e-5, "{name} {packing:?} {k}: relative error {err:e}");
            }
            assert!(
                want.iter()
                    .any(|(_, w)| w.abs().sum(Kind::Float).double_value(&[]) > 0.0)
            );
        }
    }
}
