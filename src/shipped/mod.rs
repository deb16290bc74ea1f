//! What treetrain ships so every demo and notebook runs offline: small verifiable task
//! datasets and a tiny Qwen3 with its own tokenizer (folder `datasets/` of the repository).
//!
//! Everything here is generated from fixed seeds by `treetrain make-shipped-data`; a test checks
//! the committed files equal what the generator makes.

pub mod calculator;
pub mod datasets;
pub mod retry;
pub mod tasks;
pub mod tiny_model;

use std::path::{Path, PathBuf};

use crate::grpo::{Environment, GrpoConfig, GrpoTrainer};
use crate::train::TrainError;

/// The shipped multi-turn environments, by name (`treetrain grpo --environment`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ShippedEnvironment {
    /// [`calculator::Calculator`]: a tool call, its result, an answer.
    Calculator,
    /// [`retry::RetryGame`]: the selection questions with three tries.
    RetryGame,
}

impl ShippedEnvironment {
    /// A trainer of `config` with this environment (its reward only), from `checkpoint` when
    /// given.
    pub fn trainer(self, config: GrpoConfig, checkpoint: Option<&Path>) -> Result<GrpoTrainer, TrainError> {
        match self {
            ShippedEnvironment::Calculator => trainer_with(calculator::Calculator::default(), config, checkpoint),
            ShippedEnvironment::RetryGame => trainer_with(retry::RetryGame::default(), config, checkpoint),
        }
    }
}

/// A trainer of `config` with `environment`, fresh or from `checkpoint`.
fn trainer_with(
    environment: impl Environment + 'static,
    config: GrpoConfig,
    checkpoint: Option<&Path>,
) -> Result<GrpoTrainer, TrainError> {
    let builder = GrpoTrainer::builder(config).environment(environment);
    match checkpoint {
        None => builder.build(),
        Some(c) => builder.resume(c).build(),
    }
}

/// The repository's `datasets/` folder (where this crate was built from), or
/// `TREETRAIN_DATASETS` when set.
pub fn datasets_dir() -> PathBuf {
    std::env::var_os("TREETRAIN_DATASETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets"))
}

/// The shipped tiny model's folder, with weights made on first use.
pub fn tiny_model_dir() -> Result<PathBuf, crate::model::ModelError> {
    tiny_model::ensure_weights(&datasets_dir().join("tiny-qwen3"))
}

/// The shipped tiny mixture-of-experts model's folder (`tiny_model::mixture_config`), with
/// weights made on first use.
pub fn tiny_mixture_dir() -> Result<PathBuf, crate::model::ModelError> {
    tiny_model::ensure_weights(&datasets_dir().join("tiny-qwen3-moe"))
}

/// The shipped tiny Muse Spark's folder (`tiny_model::muse_spark_config`), with weights made on
/// first use.
pub fn tiny_muse_spark_dir() -> Result<PathBuf, crate::model::ModelError> {
    tiny_model::ensure_weights(&datasets_dir().join("tiny-muse-spark"))
}
