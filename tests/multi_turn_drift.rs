//! Multi-turn rollouts under a chat template that renders the history otherwise than the model
//! saw it (as Qwen3 drops earlier turns' reasoning): here every earlier assistant turn renders
//! as `[earlier answer]`. Under `fork_threshold_tokens` the departure is realigned as context
//! (a high threshold) or forks a new training row (threshold 0), as TRL's async GRPO reconciles
//! it; either way the row's tokens are the template's rendering, and the update trains.

mod common;

use std::path::PathBuf;

use treetrain::grpo::{GrpoConfig, GrpoTrainer, ScoredGroup};
use treetrain::shipped::retry::RetryGame;
use treetrain::tokenizer::Tokenizer;

const EARLIER: &str = "[earlier answer]";

/// The shipped SFT model with a template that hides every assistant turn but the last.
fn rewriting_model() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("treetrain-drift-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let from = common::root().join("datasets/tiny-qwen3-sft");
    for f in std::fs::read_dir(&from).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let path = dir.join("tokenizer_config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let template = cfg["chat_template"].as_str().unwrap();
    let shown = "{{- message.content or '' }}";
    assert!(template.contains(shown));
    let hidden = format!("{{%- if loop.last %}}{shown}{{%- else %}}{{{{- '{EARLIER}' }}}}{{%- endif %}}");
    cfg["chat_template"] = template.replace(shown, &hidden).into();
    std::fs::write(&path, serde_json::to_string(&cfg).unwrap()).unwrap();
    dir
}

/// The retry game (3 tries, a wrong answer forked in two) on the rewriting template.
fn config(model: &std::path::Path, fork_threshold_tokens: usize) -> GrpoConfig {
    let mut c = common::shipped_grpo();
    c.train.model = model.display().to_string();
    c.rollouts.prompts_per_step = 4;
    c.rollouts.num_generations = 4;
    c.rollouts.prefill_chunk_size = 16;
    c.multi_turn.max_turns = 3;
    c.multi_turn.turn_generations = 2;
    c.multi_turn.max_conversation_length = 256;
    c.multi_turn.fork_threshold_tokens = fork_threshold_tokens;
    c
}

fn decode(tok: &Tokenizer, ids: &[i64], mask: &[u8], trained: u8) -> String {
    let ids: Vec<u32> = ids
        .iter()
        .zip(mask)
        .filter(|(_, m)| **m == trained)
        .map(|(&t, _)| t as u32)
        .collect();
    tok.decode(&ids, false).unwrap()
}

/// Every conversation's row holds the template's rendering of it, token for token: its text
/// after the prompt (what the rewards saw) and the last reply's end-of-turn token.
fn rows_hold_the_rendering(g: &ScoredGroup, tok: &Tokenizer) {
    for (c, text) in g.completions.iter().zip(&g.texts) {
        let ids: Vec<u32> = c.output_ids.iter().map(|&t| t as u32).collect();
        let held = tok.decode(&ids, false).unwrap();
        assert_eq!(held.trim_end_matches("<|im_end|>"), text, "row vs rendering");
    }
}

#[test]
fn a_rewritten_history_is_realigned_or_forked_by_the_threshold() {
    let model = rewriting_model();
    for threshold in [1024, 0] {
        let mut t = GrpoTrainer::builder(config(&model, threshold))
            .environment(RetryGame::default())
            .build()
            .unwrap();
        let m = t.step().unwrap();
        let batch = t.last_batch.clone().unwrap();
        let tok = t.tokenizer();
        let transitions: usize = batch.groups.iter().map(|g| g.drift.transitions).sum();
        assert!(transitions > 0, "no conversation went past its first turn");
        // Every transition departs: the answer the model gave is no longer rendered.
        let (realigned, forked) = if threshold > 0 { (1.0, 0.0) } else { (0.0, 1.0) };
        assert_eq!((m.turns.realign_frac, m.turns.fork_frac), (realigned, forked), "{m:?}");
        assert!(m.turns.drift_tokens_max >= 1 && m.turns.drift_tokens_max <= 16, "{m:?}");
        let mut rows = 0;
        for g in &batch.groups {
            rows_hold_the_rendering(g, tok);
            rows += g.completions.len() + g.forked_rows.len();
            for (c, mask) in g.completions.iter().zip(&g.trained_masks) {
                let context = decode(tok, &c.output_ids, mask, 0);
                let went_on = context.contains("is wrong. Try again.");
                assert_eq!(went_on, context.contains(EARLIER), "{context:?}");
                if went_on {
                    // Only the latest turn trains in the row: realigned or forked, the
                    // earlier answers are context.
                    let trained = decode(tok, &c.output_ids, mask, 1);
                    assert!(!trained.contains("<|im_start|>"), "{trained:?}");
                }
            }
            // The forked rows keep each earlier turn's answer, trained, as it was generated
            // (a row a conversation closed before it was itself forked goes with each of its
            // continuations, as their shared turns do).
            assert_eq!(g.forked_rows.is_empty(), g.drift.forked == 0);
            assert_eq!(g.drift.forked, if threshold > 0 { 0 } else { g.drift.transitions });
            for f in &g.forked_rows {
                assert!(f.trained_mask.contains(&1));
                let trained = decode(tok, &f.completion.output_ids, &f.trained_mask, 1);
                assert!(
                    !trained.contains(EARLIER) && !trained.contains("<|im_start|>"),
                    "{trained:?}"
                );
                // Its last turn is the one the template then hid: not shown as hidden in it.
                let ids: Vec<u32> = f.completion.output_ids.iter().map(|&t| t as u32).collect();
                let all = tok.decode(&ids, false).unwrap();
                assert!(!all.ends_with(&format!("{EARLIER}<|im_end|>")), "{all:?}");
                assert!(f.conversation < g.completions.len());
            }
        }
        // Each row trains, forked ones with their conversation's advantage.
        let rollouts = batch.rollouts();
        assert_eq!(rollouts.len(), rows);
        for g in &batch.groups {
            for f in &g.forked_rows {
                let a = g.advantages[f.conversation];
                assert!(
                    rollouts
                        .iter()
                        .any(|r| r.advantage == a && r.input_ids.ends_with(&f.completion.output_ids))
                );
            }
        }
        assert!(m.update.loss.is_finite() && m.update.packing_ratio > 1.0, "{m:?}");
    }
    std::fs::remove_dir_all(&model).unwrap();
}
