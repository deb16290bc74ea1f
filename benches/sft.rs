//! SFT throughput: trained-on tokens per second of `SftTrainer`, and TRL's SFTTrainer on the
//! same model, data and settings when a Python with trl is available.
//!
//! cargo bench --bench sft -- [--steps 20] [--python PATH]
//!
//! The shipped SFT data, the shipped tiny model, bfd packing into 256-token rows, 8 rows a step,
//! assistant-only loss, AdamW lr 2e-3, fp32, CPU. Under `cargo test` a 2-step smoke run.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use treetrain::sft::{PackingStrategy, SftConfig, SftTrainer, TokenizeOptions};
use treetrain::train::{TrainConfig, Trainer};

fn main() {
    let args = common::Args::from_env();
    let (full, steps) = (args.full, args.steps(20, 2));
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let model_dir = root.join("datasets/tiny-qwen3-sft");
    let data = root.join("datasets/sft/train.parquet");
    let cfg = SftConfig {
        train: TrainConfig {
            model: model_dir.display().to_string(),
            dataset: data.clone(),
            learning_rate: 2e-3,
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
    t.train_for(2).expect("warm-up");
    let start = Instant::now();
    t.train_for(steps).expect("train");
    let secs = start.elapsed().as_secs_f64();
    // Mean of the per-step rates (each step counts its non-padding tokens over its own time).
    let real: f64 = t.state.history[2..].iter().map(|m| m.tokens_per_s).sum::<f64>() / steps as f64;
    println!(
        "SFT, tiny Qwen3 fp32, bfd rows of 256, 8 rows a step, {} threads, {steps} steps after 2 warm-ups",
        tch::get_num_threads()
    );
    println!("{:<28}{:>14}", "trainer", "tokens/s");
    println!("{:<28}{:>14.0}   ({secs:.1} s)", "treetrain SftTrainer", real);
    let mut result =
        serde_json::json!({"steps": steps, "treetrain_tokens_per_s": real, "threads": tch::get_num_threads()});
    if full {
        match common::python(args.get("--python"), "trl, datasets") {
            None => println!("TRL: skipped (no Python with trl + datasets; see scripts/fixtures/venv.sh)"),
            Some(py) => {
                let out = Command::new(py)
                    .arg(root.join("scripts/bench/trl_sft.py"))
                    .arg(&model_dir)
                    .arg(&data)
                    .arg(steps.to_string())
                    .output()
                    .expect("run python");
                let stdout = String::from_utf8_lossy(&out.stdout);
                match stdout
                    .lines()
                    .last()
                    .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                {
                    Some(v) => {
                        let trl = v["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
                        println!(
                            "{:<28}{:>14.0}   treetrain is {:.2}x",
                            "TRL 1.16 SFTTrainer",
                            trl,
                            real / trl
                        );
                        result["trl_tokens_per_s"] = trl.into();
                        result["speedup_vs_trl"] = (real / trl).into();
                    }
                    None => println!(
                        "TRL: failed: {}",
                        String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
                    ),
                }
            }
        }
    }
    args.write_result("sft", &result);
}
