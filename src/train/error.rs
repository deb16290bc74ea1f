//! What can stop a training run, for both trainers.

use std::path::PathBuf;

/// Errors from the trainers (SFT and GRPO) and the training core.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A setting is out of range or inconsistent.
    #[error("config `{field}`: {message}")]
    Config {
        /// The offending field (as in the TOML file).
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A config file could not be read, parsed or holds an unknown key.
    #[error("{path}: {message}")]
    ConfigFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A dataset row could not be used (the message names the row).
    #[error("{0}")]
    Data(String),
    /// Reading a dataset failed.
    #[error(transparent)]
    Dataset(#[from] crate::data::DataError),
    /// A model or hub folder could not be found.
    #[error(transparent)]
    Hub(#[from] crate::hub::HubError),
    /// The model failed (loading, a forward, an optimizer update).
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// The tokenizer failed.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// The device setting names a device this process cannot use.
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// Generation failed.
    #[error(transparent)]
    Generate(#[from] crate::generate::GenerateError),
    /// Packing failed (names the rollout).
    #[error(transparent)]
    Pack(#[from] crate::pack::PackError),
    /// The generation thread failed or stopped.
    #[error("async rollouts: {0}")]
    Worker(String),
    /// A step produced a non-finite loss or gradient under `on_nan = stop`.
    #[error("step {step}: non-finite {what} on dataset rows {rows:?} (0-based); weights left untouched")]
    NonFinite {
        /// Optimizer step.
        step: u64,
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// Training rows (SFT) or prompt rows (GRPO) of the step.
        rows: Vec<usize>,
    },
    /// Under `on_nan = skip`, every one of the last `count` steps was non-finite.
    #[error(
        "step {step}: non-finite {what} for {count} steps in a row (last on dataset rows {rows:?}, 0-based); stopped under on_nan = skip, as no step updates the weights. Check the model's settings and weights, or lower the learning rate"
    )]
    KeepsSkipping {
        /// Optimizer step of the last one.
        step: u64,
        /// Steps skipped in a row.
        count: u64,
        /// `loss` or `gradient norm` of the last one.
        what: &'static str,
        /// Training rows (SFT) or prompt rows (GRPO) of the last one.
        rows: Vec<usize>,
    },
    /// A multi-process rendezvous or collective failed (names the rank).
    #[error(transparent)]
    Distributed(#[from] crate::distributed::DistError),
    /// An update left a weight NaN or infinite (the run cannot go on from it).
    #[error(
        "step {step}: the update made `{name}` NaN or infinite (learning rate too high for the precision?); stopped, no checkpoint of it written"
    )]
    NonFiniteWeights {
        /// Optimizer step.
        step: u64,
        /// The first such parameter.
        name: String,
    },
    /// An allocation failed inside a step (host or device memory ran out, or a `ulimit -v` or
    /// cgroup limit was reached): the step's gradients are dropped and the weights untouched.
    #[error(
        "step {step}: out of memory ({detail}); lower {lower}, or turn on gradient_checkpointing; the weights are untouched"
    )]
    OutOfMemory {
        /// Optimizer step.
        step: u64,
        /// libtorch's account of the failed allocation.
        detail: String,
        /// The settings whose sizes the step grows with.
        lower: &'static str,
    },
    /// A checkpoint could not be written or read.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// The checkpoint folder.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// A run log (TensorBoard events, `metrics.csv`) could not be read.
    #[error("run log {path}: {message}")]
    Log {
        /// The file or folder.
        path: PathBuf,
        /// What failed.
        message: String,
    },
}

impl TrainError {
    /// A [`TrainError::Config`] error.
    pub fn config(field: &'static str, message: impl Into<String>) -> Self {
        TrainError::Config {
            field,
            message: message.into(),
        }
    }
}
