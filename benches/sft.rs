//! SFT throughput: trained-on tokens per second of `SftTrainer`, and TRL's SFTTrainer on the
//! same model, data and settings when a Python with trl is available, run interleaved
//! (treetrain, TRL, treetrain, TRL, ...: the median of the pairwise ratios is reported), with
//! the achieved GFLOP/s against this machine's matmul rate measured in the same run.
//!
//! cargo bench --bench sft -- [--steps 20] [--pairs 2] [--config config.json | --model DIR] [--python PATH]
//!     [--checkpointing]
//!
//! The shipped SFT data, the shipped SFT model (or with `--config` a random model of a
//! published config, e.g. `benches/configs/smollm2-135m.json`, with the shipped tokenizer), bfd
//! packing into 256-token rows, 8 rows a step, assistant-only loss, AdamW lr 2e-3, fp32, CPU;
//! `--checkpointing`: gradient checkpointing on both sides (for models whose step does not fit
//! in memory with activations kept: benches/README.md says which).
//! Under `cargo test` a 2-step smoke run.

mod common;

use clap::Parser;

use std::path::Path;

use treetrain::model::ModelConfig;
use treetrain::sft::{PackingStrategy, SftConfig, SftTrainer, TokenizeOptions};
use treetrain::train::{DataSettings, OptimizerSettings, PrecisionSettings, TrainConfig, Trainer};

/// The SFT bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Interleaved treetrain / TRL pairs.
    #[arg(long, default_value_t = 2)]
    pairs: usize,
    /// Gradient checkpointing on both sides.
    #[arg(long)]
    checkpointing: bool,
}

fn main() {
    let cli = Cli::parse();
    let args = &cli.common;
    let (full, steps) = (args.full, args.steps(20, 2));
    let root = &common::root();
    let model_dir = args.model_dir(root.join("datasets/tiny-qwen3-sft"));
    let data = root.join("datasets/sft/train.parquet");
    let pairs = cli.pairs;
    let python = full
        .then(|| common::python(args.python.clone(), "trl, datasets"))
        .flatten();
    let checkpointing = full && cli.checkpointing;
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut config = None;
    for _ in 0..if python.is_some() { pairs } else { 1 } {
        let (rate, model_config) = treetrain_rate(&model_dir, &data, steps, checkpointing);
        config = Some(model_config);
        ours.push(rate);
        if let Some(trl) = python
            .as_deref()
            .and_then(|py| trl_rate(py, &model_dir, &data, steps, checkpointing))
        {
            theirs.push(trl);
            ratios.push(rate / trl);
        }
    }
    let config = config.expect("one run");
    let real = common::median(&ours);
    let peak = common::matmul_gflops();
    // Body FLOPs only: 6 x the decoder layers' linear parameters per token (forward + backward);
    // attention scores and the LM head (run on trained positions only) are left out, so this
    // is a lower bound on the work done.
    let achieved = real * 6.0 * linear_parameters(&config) as f64 / 1e9;
    println!(
        "SFT, {} ({:.1} M parameters) fp32, bfd rows of 256, 8 rows a step, gradient checkpointing {checkpointing}, {} threads, {steps} steps after 2 warm-ups",
        model_dir
            .file_name()
            .map_or("?".into(), |f| f.to_string_lossy().into_owned()),
        config.num_parameters() as f64 / 1e6,
        tch::get_num_threads()
    );
    println!("{:<28}{:>14}", "trainer", "tokens/s");
    println!(
        "{:<28}{real:>14.0}   ({achieved:.1} GFLOP/s of the decoder body, {:.2} of the {peak:.1} GFLOP/s f32 matmul rate)",
        "treetrain SftTrainer",
        achieved / peak
    );
    let mut result = serde_json::json!({"model": model_dir.display().to_string(), "steps": steps,
        "gradient_checkpointing": checkpointing,
        "treetrain_tokens_per_s": real, "threads": tch::get_num_threads(), "body_gflops": achieved,
        "matmul_gflops": peak, "fraction_of_matmul_rate": achieved / peak});
    match (&python, ratios.is_empty()) {
        (None, _) if full => println!("TRL: skipped (no Python with trl + datasets; see scripts/fixtures/venv.sh)"),
        (Some(_), false) => {
            let (trl, ratio) = (common::median(&theirs), common::median(&ratios));
            println!(
                "{:<28}{trl:>14.0}   treetrain is {ratio:.2}x (median of {} interleaved pairs)",
                "TRL 1.16 SFTTrainer",
                ratios.len()
            );
            result["trl_tokens_per_s"] = trl.into();
            result["speedup_vs_trl"] = ratio.into();
            result["pairwise_ratios"] = serde_json::json!(ratios);
        }
        _ => {}
    }
    args.write_result("sft", &result);
}

/// Tokens/s of one treetrain run (mean of the per-step rates after 2 warm-up steps; each step
/// counts its non-padding tokens over its own time), and the model's config.
fn treetrain_rate(model_dir: &Path, data: &Path, steps: u64, checkpointing: bool) -> (f64, ModelConfig) {
    let cfg = SftConfig {
        train: TrainConfig {
            model: model_dir.display().to_string(),
            data: DataSettings {
                dataset: data.into(),
                ..Default::default()
            },
            optimizer: OptimizerSettings {
                learning_rate: 2e-3,
                ..Default::default()
            },
            precision: PrecisionSettings {
                gradient_checkpointing: checkpointing,
                ..Default::default()
            },
            ..Default::default()
        },
        tokenize: TokenizeOptions {
            max_length: 256,
            ..Default::default()
        },
        packing: Some(PackingStrategy::Bfd),
        batch_size: 8,
        max_steps: Some(steps + 2),
        eval_fraction: 0.0,
        ..Default::default()
    };
    let mut t = SftTrainer::new(cfg).expect("trainer");
    t.train_for(steps + 2).expect("train");
    let rate = t.state.history[2..].iter().map(|m| m.tokens_per_s).sum::<f64>() / steps as f64;
    (rate, t.model().lm.config.clone())
}

/// Tokens/s of TRL's SFTTrainer on the same model, data and settings (`None`, said, when it
/// fails).
fn trl_rate(py: &str, model_dir: &Path, data: &Path, steps: u64, checkpointing: bool) -> Option<f64> {
    let steps = steps.to_string();
    let mode = if checkpointing { "checkpointing" } else { "kept" };
    let args = [model_dir.as_os_str(), data.as_os_str(), steps.as_ref(), mode.as_ref()];
    common::python_result(py, "scripts/bench/trl_sft.py", &args).and_then(|v| v["tokens_per_s"].as_f64())
}

/// Parameters of the decoder layers' linear maps (q, k, v, o, gate, up, down).
fn linear_parameters(c: &ModelConfig) -> i64 {
    let (h, q, kv) = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
    c.num_layers * (2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size)
}
