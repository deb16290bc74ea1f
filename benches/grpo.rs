//! A GRPO step's time split (generation, rewards, packing, forward/backward, optimizer) on the
//! shipped recipe, and tree vs flat packing of the update on the same real rollouts.
//!
//! cargo bench --bench grpo -- [--steps 20] [--prompts 16] [--config config.json | --model DIR]
//!
//! The shipped SFT model (or a random model of a published config, with the shipped tokenizer)
//! and prompts, 16 prompts x 8 completions a step, completions of at most 16 tokens, sync
//! rollouts, fp32, CPU. After every trainer step (tree-packed), the step's
//! rollouts are packed both ways and one forward + backward of each is timed on the trainer's
//! policy (`GrpoTrainer::measure_update`, gradients cleared after), alternating which goes first. Under `cargo test` a 2-step smoke run.

mod common;

use treetrain::grpo::{BuiltinReward, GrpoConfig, GrpoTrainer, RewardSpec};
use treetrain::pack::Packing;
use treetrain::train::TrainConfig;

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn main() {
    let args = common::Args::from_env();
    let steps = args.steps(20, 2);
    let root = &common::root();
    let model_dir = args.model_dir(root.join("datasets/tiny-qwen3-sft"));
    let prompts: usize = args.get("--prompts").map_or(16, |v| v.parse().expect("--prompts N"));
    let cfg = GrpoConfig {
        train: TrainConfig {
            model: model_dir.display().to_string(),
            dataset: root.join("datasets/grpo/train.parquet"),
            learning_rate: 1e-3,
            seed: 7,
            ..Default::default()
        },
        rewards: [BuiltinReward::ExactAnswer, BuiltinReward::AnswerFormat]
            .into_iter()
            .zip([1.0, 0.5])
            .map(|(name, weight)| RewardSpec { name, weight })
            .collect(),
        prompts_per_step: prompts,
        num_generations: 8,
        max_completion_length: 16,
        token_budget: 2048,
        max_steps: steps,
        ..Default::default()
    };
    let mut t = GrpoTrainer::new(cfg.clone()).expect("trainer");
    let (mut tree_s, mut flat_s, mut tree_tokens, mut flat_tokens) = (Vec::new(), Vec::new(), 0usize, 0usize);
    let (mut tree_flops, mut flat_flops) = (0.0, 0.0);
    for step in 0..steps {
        t.step().expect("step");
        let batch = t.last_batch.clone().expect("batch");
        // The trainer's own policy (after this step's update); gradients are cleared after.
        let time = |packing: Packing| {
            let (secs, stats) = t.measure_update(&batch, packing, 1).expect("update");
            (secs, stats.forwarded_tokens)
        };
        let ((ts, tt), (fs, ft)) = if step % 2 == 0 {
            let a = time(Packing::Tree);
            (a, time(Packing::Flat))
        } else {
            let b = time(Packing::Flat);
            (time(Packing::Tree), b)
        };
        // The work each packing does on these rollouts, counted from the config.
        let flops = |packing: Packing| -> f64 {
            let rollouts = batch.rollouts_for_update(cfg.mask_truncated_completions);
            let rows = treetrain::grpo::pack_rollouts(rollouts, packing, cfg.token_budget).expect("pack");
            rows.iter().map(|r| r.forward_flops(&t.model().lm.config)).sum()
        };
        tree_flops += flops(Packing::Tree);
        flat_flops += flops(Packing::Flat);
        tree_s.push(ts);
        flat_s.push(fs);
        tree_tokens += tt;
        flat_tokens += ft;
    }
    let h = &t.state.history;
    let col = |f: fn(&treetrain::grpo::GrpoStepMetrics) -> f64| mean(&h.iter().map(f).collect::<Vec<_>>());
    let split = [
        ("generation", col(|m| m.generation_s)),
        ("rewards", col(|m| m.reward_s)),
        ("packing", col(|m| m.pack_s)),
        ("forward + backward", col(|m| m.forward_backward_s)),
        ("optimizer", col(|m| m.optimizer_s)),
    ];
    let step_s = col(|m| m.step_s);
    println!(
        "GRPO, {} ({:.1} M parameters) fp32, {prompts} prompts x 8 completions (<= 16 tokens), sync, {} threads, {steps} steps",
        model_dir.display(),
        t.model().lm.config.num_parameters() as f64 / 1e6,
        tch::get_num_threads()
    );
    println!("{:<22}{:>10}{:>8}", "phase", "s/step", "share");
    for (name, s) in split {
        println!("{name:<22}{s:>10.3}{:>7.0}%", 100.0 * s / step_s);
    }
    println!("{:<22}{step_s:>10.3}", "whole step");
    let ratio = flat_tokens as f64 / tree_tokens.max(1) as f64;
    let work_ratio = flat_flops / tree_flops.max(1.0);
    let speedup = mean(&flat_s) / mean(&tree_s);
    println!(
        "update on the same rollouts: tree {:.3} s, flat {:.3} s per step: {speedup:.2}x faster; packing ratio {ratio:.2} ({tree_tokens} vs {flat_tokens} tokens forwarded), work ratio {work_ratio:.2} ({:.2} vs {:.2} GFLOP forward): {:.2} of it",
        mean(&tree_s),
        mean(&flat_s),
        tree_flops / 1e9,
        flat_flops / 1e9,
        speedup / work_ratio
    );
    let result = serde_json::json!({
        "steps": steps,
        "model": model_dir.display().to_string(),
        "prompts_per_step": prompts,
        "threads": tch::get_num_threads(),
        "split_s": split.iter().map(|(n, s)| (n.to_string(), serde_json::json!(s))).collect::<serde_json::Map<_, _>>(),
        "step_s": step_s,
        "tree_update_s": mean(&tree_s),
        "flat_update_s": mean(&flat_s),
        "tree_speedup": speedup,
        "packing_ratio": ratio,
        "work_ratio": work_ratio,
        "speedup_over_work_ratio": speedup / work_ratio,
        "tree_forward_gflop": tree_flops / 1e9,
        "flat_forward_gflop": flat_flops / 1e9,
        "reward_first": h.first().map(|m| m.reward_mean),
        "reward_last": h.last().map(|m| m.reward_mean),
    });
    args.write_result("grpo", &result);
}
