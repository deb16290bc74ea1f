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
//! use treetrain::train::Trainer;
//! let mut config = GrpoConfig::from_toml_file(&treetrain::shipped::datasets_dir().join("grpo.toml")).unwrap();
//! config.train.output_dir = None;
//! config.prompts_per_step = 2;
//! let rewards = vec![
//!     RewardFn::exact_answer(),
//!     RewardFn::answer_format().with_weight(0.5),
//!     // Our own: a bonus for answers of at most 6 tokens.
//!     RewardFn::new("short", |x| Some(if x.completion_ids.len() <= 6 { 1.0 } else { 0.0 })).with_weight(0.1),
//! ];
//! let mut trainer = GrpoTrainer::builder(config).rewards(rewards).build().unwrap();
//! let m = trainer.step().unwrap(); // 2 prompts x 8 completions, one tree-packed update
//! assert_eq!(m.rewards.len(), 3);
//! assert!(m.packing_ratio > 1.0); // each prompt forwarded once for its 8 completions
//! ```

mod advantage;
mod answer;
mod builder;
mod config;
mod environment;
mod eval;
mod metrics;
mod multiturn;
mod objective;
mod producer;
mod reward;
mod rollouts;
mod trainer;
mod update;
mod view;
pub use view::GrpoSettings;
mod worker;

pub use advantage::{ScaleRewards, group_advantages};
pub use answer::extract_answer;
pub use builder::GrpoTrainerBuilder;
pub use config::{GrpoConfig, ImportanceSampling, LossType, RewardSpec, RolloutMode, SamplingCorrectionMode};
pub use environment::{Conversation, EnvReply, EnvRole, Environment, FnEnvironment, environment};
pub use eval::{EvalBreakdown, EvalResult};
pub use metrics::{GrpoStepMetrics, RewardStat, SampleCompletion};
pub use multiturn::MultiTurn;
pub use objective::{
    GrpoLoss, GrpoObjective, SamplingCorrection, TermLogprobs, TermWeights, grpo_loss, grpo_loss_backward,
    grpo_loss_with_reference,
};
pub use reward::{BuiltinReward, GroupRewards, RewardClosure, RewardFailure, RewardFn, RewardInput, score_group};
pub use producer::{BatchShape, RolloutProducer, Shard};
pub use rollouts::{PromptRow, PromptSampler, PromptSet, QueuedGroup, RolloutBatch, ScoredGroup};
pub use trainer::{GrpoState, GrpoTrainer};
pub use update::{
    RankUpdate, StepTotals, UpdateStats, accumulate_gradients, accumulate_share, entropy_floor, pack_rollouts,
    plan_rank_update, with_entropy_floor,
};
pub use worker::AsyncRollouts;

/// The message of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}
