//! A GRPO step's time split (generation, rewards, packing, forward/backward, optimizer) on the
//! shipped recipe, and tree vs flat packing of the update on the same real rollouts.
//!
//! cargo bench --bench grpo -- [--steps 20] [--prompts 16] [--config config.json | --model DIR]
//!     [--trl-pairs N [--python PATH]]
//!
//! The shipped SFT model (or a random model of a published config, with the shipped tokenizer)
//! and prompts, 16 prompts x 8 completions a step, completions of at most 16 tokens, sync
//! rollouts, fp32, CPU. After every trainer step (tree-packed), the step's
//! rollouts are packed both ways and one forward + backward of each is timed on the trainer's
//! policy (`GrpoTrainer::measure_update`, gradients cleared after), alternating which goes
//! first. Under `cargo test` a 2-step smoke run.
//!
//! `--trl-pairs N`: then N pairs of whole runs, treetrain's trainer and TRL 1.16's
//! `GRPOTrainer` (`scripts/bench/trl_grpo.py`: the same model, prompts, completions, rewards and
//! learning rate, generation by transformers' `generate`) one after the other, each timed per
//! step after 2 warm-up steps.

mod common;

use clap::Parser;

use treetrain::grpo::{BuiltinReward, GrpoConfig, GrpoTrainer, RewardSpec};
use treetrain::pack::Packing;
use treetrain::train::{DataSettings, OptimizerSettings, TrainConfig, Trainer};

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// The GRPO step bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Prompts per step.
    #[arg(long, default_value_t = 16)]
    prompts: usize,
    /// Pairs of whole runs against TRL's GRPOTrainer (0: none).
    #[arg(long, default_value_t = 0)]
    trl_pairs: usize,
}

/// Seconds per step of a fresh trainer of `cfg` over `steps` steps after 2 warm-up steps.
fn treetrain_step_s(cfg: &GrpoConfig, steps: u64) -> f64 {
    let mut c = cfg.clone();
    c.max_steps = steps + 2;
    let mut t = GrpoTrainer::new(c).expect("trainer");
    t.train_for(steps + 2).expect("train");
    mean(&t.state.history[2..].iter().map(|m| m.times.step_s).collect::<Vec<_>>())
}

/// Seconds per step of TRL's GRPOTrainer on the same recipe (`None`, said, when it fails).
fn trl_step_s(py: &str, model_dir: &std::path::Path, prompts: usize, steps: u64) -> Option<f64> {
    let data = common::root().join("datasets/grpo/train.parquet");
    let (prompts, steps) = (prompts.to_string(), steps.to_string());
    let args = [
        model_dir.as_os_str(),
        data.as_os_str(),
        prompts.as_ref(),
        steps.as_ref(),
    ];
    common::python_result(py, "scripts/bench/trl_grpo.py", &args).and_then(|v| v["step_s"].as_f64())
}

/// `pairs` pairs of whole runs, treetrain then TRL: each side's seconds per step and the ratio.
fn against_trl(
    cfg: &GrpoConfig,
    py: &str,
    (model_dir, prompts, steps): (&std::path::Path, usize, u64),
    pairs: usize,
) -> serde_json::Value {
    let mut runs = Vec::new();
    for pair in 0..pairs {
        let ours = treetrain_step_s(cfg, steps);
        let Some(theirs) = trl_step_s(py, model_dir, prompts, steps) else {
            break;
        };
        println!(
            "pair {pair}: treetrain {ours:.3} s/step, TRL {theirs:.3} s/step: {:.2}x",
            theirs / ours
        );
        runs.push(serde_json::json!({"treetrain_step_s": ours, "trl_step_s": theirs, "ratio": theirs / ours}));
    }
    serde_json::Value::Array(runs)
}

/// Tree and flat updates of every step's rollouts: seconds and tokens forwarded per step,
/// and the forward FLOPs each packing computes, summed.
#[derive(Default)]
struct Updates {
    tree_s: Vec<f64>,
    flat_s: Vec<f64>,
    tree_tokens: usize,
    flat_tokens: usize,
    tree_flops: f64,
    flat_flops: f64,
}

/// The shipped recipe at bench size: `prompts` prompts x 8 completions of at most 16 tokens.
fn recipe(model_dir: &std::path::Path, prompts: usize, steps: u64) -> GrpoConfig {
    let root = &common::root();
    let mut c = GrpoConfig {
        train: TrainConfig {
            model: model_dir.display().to_string(),
            seed: 7,
            data: DataSettings {
                dataset: root.join("datasets/grpo/train.parquet"),
                ..Default::default()
            },
            optimizer: OptimizerSettings {
                learning_rate: 1e-3,
                ..Default::default()
            },
            ..Default::default()
        },
        rewards: [BuiltinReward::ExactAnswer, BuiltinReward::AnswerFormat]
            .into_iter()
            .zip([1.0, 0.5])
            .map(|(name, weight)| RewardSpec { name, weight })
            .collect(),
        ..Default::default()
    };
    c.rollouts.prompts_per_step = prompts;
    c.rollouts.num_generations = 8;
    c.rollouts.max_completion_length = 16;
    c.update.token_budget = 2048;
    c.max_steps = steps;
    c
}

/// `steps` trainer steps, each followed by a tree and a flat update of its rollouts on the
/// trainer's own policy (gradients cleared after), alternating which goes first.
fn run(t: &mut GrpoTrainer, cfg: &GrpoConfig, steps: u64) -> Updates {
    let mut u = Updates::default();
    for step in 0..steps {
        t.step().expect("step");
        let batch = t.last_batch.clone().expect("batch");
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
            let rollouts = batch.rollouts_for_update(cfg.loss.mask_truncated_completions);
            let rows = treetrain::grpo::pack_rollouts(rollouts, packing, cfg.update.token_budget).expect("pack");
            rows.iter().map(|r| r.forward_flops(&t.model().lm.config)).sum()
        };
        u.tree_flops += flops(Packing::Tree);
        u.flat_flops += flops(Packing::Flat);
        u.tree_s.push(ts);
        u.flat_s.push(fs);
        u.tree_tokens += tt;
        u.flat_tokens += ft;
    }
    u
}

fn main() {
    let cli = Cli::parse();
    let args = &cli.common;
    let steps = args.steps(20, 2);
    let model_dir = args.model_dir(common::root().join("datasets/tiny-qwen3-sft"));
    let prompts = cli.prompts;
    let cfg = recipe(&model_dir, prompts, steps);
    let mut t = GrpoTrainer::new(cfg.clone()).expect("trainer");
    let u = run(&mut t, &cfg, steps);
    let h = &t.state.history;
    let col = |f: fn(&treetrain::grpo::GrpoStepMetrics) -> f64| mean(&h.iter().map(f).collect::<Vec<_>>());
    let split = [
        ("generation", col(|m| m.times.generation_s)),
        ("rewards", col(|m| m.times.reward_s)),
        ("packing", col(|m| m.times.pack_s)),
        ("forward + backward", col(|m| m.times.forward_backward_s)),
        ("optimizer", col(|m| m.times.optimizer_s)),
    ];
    let step_s = col(|m| m.times.step_s);
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
    let ratio = u.flat_tokens as f64 / u.tree_tokens.max(1) as f64;
    let work_ratio = u.flat_flops / u.tree_flops.max(1.0);
    let speedup = mean(&u.flat_s) / mean(&u.tree_s);
    println!(
        "update on the same rollouts: tree {:.3} s, flat {:.3} s per step: {speedup:.2}x faster; packing ratio {ratio:.2} ({} vs {} tokens forwarded), work ratio {work_ratio:.2} ({:.2} vs {:.2} GFLOP forward): {:.2} of it",
        mean(&u.tree_s),
        mean(&u.flat_s),
        u.tree_tokens,
        u.flat_tokens,
        u.tree_flops / 1e9,
        u.flat_flops / 1e9,
        speedup / work_ratio
    );
    let result = serde_json::json!({
        "steps": steps,
        "model": model_dir.display().to_string(),
        "prompts_per_step": prompts,
        "threads": tch::get_num_threads(),
        "split_s": split.iter().map(|(n, s)| (n.to_string(), serde_json::json!(s))).collect::<serde_json::Map<_, _>>(),
        "step_s": step_s,
        "tree_update_s": mean(&u.tree_s),
        "flat_update_s": mean(&u.flat_s),
        "tree_speedup": speedup,
        "packing_ratio": ratio,
        "work_ratio": work_ratio,
        "speedup_over_work_ratio": speedup / work_ratio,
        "tree_forward_gflop": u.tree_flops / 1e9,
        "flat_forward_gflop": u.flat_flops / 1e9,
        "reward_first": h.first().map(|m| m.rollouts.reward_mean),
        "reward_last": h.last().map(|m| m.rollouts.reward_mean),
    });
    let mut result = result;
    if cli.trl_pairs > 0 {
        match common::python(args.python.clone(), "trl, datasets") {
            Some(py) => result["against_trl"] = against_trl(&cfg, &py, (&model_dir, prompts, steps), cli.trl_pairs),
            None => println!("TRL: no Python with trl and datasets (scripts/fixtures/venv.sh makes one)"),
        }
    }
    args.write_result("grpo", &result);
}
