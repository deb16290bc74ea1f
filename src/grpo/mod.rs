//! GRPO: G sampled completions per prompt, scored by reward functions, group-normalised
//! advantages, and a clipped-surrogate update over tree-packed rollouts; rollouts generated
//! in line (sync) or by a generation thread with a bounded, staleness-checked queue (async).
//!
//! Old log-probs are the generator's *untruncated* log-probs: `log softmax(logits / T)` of the
//! weights that sampled the token, before top-k / top-p / min-p truncation and repetition
//! penalty. The loss recomputes the policy's log-probs at the same temperature, so in sync
//! mode the importance ratio starts at 1 (up to floating-point differences between the
//! static-cache decode and the packed forward) and in async mode it measures how far the
//! weights moved since generation, which the clip bounds.
//!
//! ```
//! use treetrain::grpo::{GrpoConfig, GrpoTrainer, RewardFn};
//! let mut config = GrpoConfig::from_toml_file(&treetrain::shipped::datasets_dir().join("grpo.toml")).unwrap();
//! config.output_dir = None;
//! config.prompts_per_step = 2;
//! let rewards = vec![
//!     RewardFn::exact_answer(),
//!     RewardFn::answer_format().with_weight(0.5),
//!     // Our own: a bonus for answers of at most 6 tokens.
//!     RewardFn::new("short", |x| Some(if x.completion_ids.len() <= 6 { 1.0 } else { 0.0 })).with_weight(0.1),
//! ];
//! let mut trainer = GrpoTrainer::with_rewards(config, rewards).unwrap();
//! let m = trainer.step().unwrap(); // 2 prompts x 8 completions, one tree-packed update
//! assert_eq!(m.rewards.len(), 3);
//! assert!(m.packing_ratio > 1.0); // each prompt forwarded once for its 8 completions
//! ```

mod advantage;
mod config;
mod reward;
mod rollouts;
mod trainer;
mod update;
mod view;
mod worker;

pub use advantage::{ScaleRewards, group_advantages};
pub use config::{GrpoConfig, LossType, RewardSpec, RolloutMode, UpdatePacking};
pub use reward::{GroupRewards, RewardClosure, RewardFailure, RewardFn, RewardInput, score_group};
pub use rollouts::{PromptRow, PromptSampler, PromptSet, QueuedGroup, RolloutBatch, RolloutProducer, ScoredGroup};
pub use trainer::{EvalResult, GrpoState, GrpoStepMetrics, GrpoTrainer, RewardStat, SampleCompletion};
pub use update::{UpdateStats, accumulate_gradients, accumulate_gradients_with, pack_rollouts};
pub use worker::AsyncRollouts;

/// Errors from GRPO.
#[derive(Debug, thiserror::Error)]
pub enum GrpoError {
    /// Configuration problem.
    #[error("grpo config: {0}")]
    Config(String),
    /// A dataset row could not be used.
    #[error("{0}")]
    Data(String),
    /// Generation failed.
    #[error(transparent)]
    Generate(#[from] crate::generate::GenerateError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    /// Packing failed (names the rollout).
    #[error(transparent)]
    Pack(#[from] crate::pack::PackError),
    /// The generation thread failed or stopped.
    #[error("async rollouts: {0}")]
    Worker(String),
    /// Tokenizer, hub, optimizer or file failure.
    #[error("{0}")]
    Other(String),
}

/// The message of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

pub(crate) fn other<E: std::fmt::Display>(e: E) -> GrpoError {
    GrpoError::Other(e.to_string())
}
