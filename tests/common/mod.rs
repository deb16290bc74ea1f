//! Shared by the integration tests that train on the shipped data.

use std::path::{Path, PathBuf};

use treetrain::sft::{PackingStrategy, SftConfig, TokenizeOptions};
use treetrain::train::TrainConfig;

/// The repository root.
#[allow(dead_code)]
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// SFT of the shipped tiny model on the shipped conversations at test size: bfd rows of 128
/// tokens, 4 a step, lr 3e-3 with 10% warmup, `steps` steps, writing to `out` when given.
#[allow(dead_code)]
pub fn shipped_sft(out: Option<PathBuf>, steps: u64) -> SftConfig {
    SftConfig {
        train: TrainConfig {
            model: treetrain::shipped::tiny_model_dir().unwrap().display().to_string(),
            dataset: root().join("datasets/sft/train.parquet"),
            output_dir: out,
            learning_rate: 3e-3,
            warmup_ratio: 0.1,
            ..Default::default()
        },
        tokenize: TokenizeOptions {
            max_length: 128,
            ..Default::default()
        },
        packing: Some(PackingStrategy::Bfd),
        batch_size: 4,
        max_steps: Some(steps),
        ..Default::default()
    }
}
