//! GRPO: G sampled completions per prompt, scored by reward functions, group-normalised
//! advantages, and a clipped-surrogate update over tree-packed rollouts; rollouts generated
//! in line (sync) or by a generation thread with a bounded, staleness-checked queue (async).
//!
//! Old log-probs are the generator's log-probs under the distribution each token was drawn
//! from: `softmax(logits / T)` of the weights that sampled it, with the LM head's padding rows
//! (past the tokenizer) and top-k / top-p / min-p left out and renormalised. The loss scores
//! the policy (and the reference, and the policy at update start) under the same truncation,
//! replayed from that model's own logits with the sampled token always kept
//! ([`Truncation`](crate::model::Truncation)): the ratio `q_θ(x) / q_old(x)` is then an
//! unbiased importance weight for the expected reward of the policy as it samples, where the
//! ratio of untruncated log-probs would weight every kept token by the dropped mass
//! (`tests/truncated_sampling.rs`). In sync mode the ratio starts at 1 (up to floating-point
//! differences between the static-cache decode and the packed forward); in async mode it
//! measures how far the weights moved since generation, which the clip bounds. The repetition
//! penalty is not replayed: with it, the ratio also carries the penalty's reweighting from the
//! first update, and `importance_sampling_correction` moves that into its capped weight.
//! Entropies (metrics, `top_entropy_quantile`, the entropy bonus) are the untruncated
//! distribution's, as TRL's.
//!
//! ```
//! use treetrain::grpo::{GrpoConfig, GrpoTrainer, RewardFn};
//! use treetrain::train::Trainer;
//! let mut config = GrpoConfig::from_toml_file(&treetrain::shipped::datasets_dir().join("grpo.toml")).unwrap();
//! config.train.output.output_dir = None;
//! config.rollouts.prompts_per_step = 2;
//! let rewards = vec![
//!     RewardFn::exact_answer(),
//!     RewardFn::answer_format().with_weight(0.5),
//!     // Our own: a bonus for answers of at most 6 tokens.
//!     RewardFn::new("short", |x| Some(if x.completion_ids.len() <= 6 { 1.0 } else { 0.0 })).with_weight(0.1),
//! ];
//! let mut trainer = GrpoTrainer::builder(config).rewards(rewards).build().unwrap();
//! let m = trainer.step().unwrap(); // 2 prompts x 8 completions, one tree-packed update
//! assert_eq!(m.rollouts.rewards.len(), 3);
//! assert!(m.update.packing_ratio > 1.0); // each prompt forwarded once for its 8 completions
//! ```
//!
//! # Reference
//!
//! - **Rewards**: [`RewardFn::new`]`(name, |x: &RewardInput| -> Option<f32>)` closures over the
//!   prompt, the completion's text and ids, whether it was truncated, and the whole dataset row,
//!   weighted with `.with_weight(w)`. Built-ins for the shipped prompts: `exact_answer` (the text
//!   after the last `Answer:` equals the row's `answer`) and `answer_format`. A function that
//!   returns `None`, NaN or an infinity, or panics, for a rollout is reported
//!   (`state.recent_failures`, metric `reward_failures`) and that rollout gets advantage 0; the
//!   step goes on.
//! - **Advantages** (`scale_rewards`, TRL's meaning): `"group"` (default) `(r - group mean) /
//!   (group std + 1e-4)` (Bessel-corrected, as `torch.std`), `"batch"` the group-centred rewards
//!   over the std of the whole step's rewards, `"none"` centred only (Dr. GRPO); over the
//!   rollouts that were scored. Groups whose rewards are all equal get zero advantages and are
//!   counted (`frac_reward_zero_std`).
//! - **Loss** (TRL's `_compute_loss`, term by term; [`GrpoObjective`]): the clipped surrogate
//!   (`epsilon_low`, `epsilon_high`; `delta` caps the unclipped ratio too: two-sided clipping),
//!   with the ratio per token or, `importance_sampling_level = "sequence"` (GSPO), the exponent of
//!   each rollout's mean log-ratio. `top_entropy_quantile` (ρ) trains only the terms in the top ρ
//!   of the step's policy entropies (the quantile is over the whole step, the same in either
//!   packing and on any number of ranks; TRL takes it per local batch). Optional `beta` × k3 KL
//!   to a frozen reference (off by default; `use_bias_correction_kl`, on by default as in TRL
//!   1.16, multiplies each term's k3 by its importance ratio).
//! - **Averaging** as TRL's `loss_type`: `dapo` (default: over all loss terms of the step), `grpo`
//!   (per rollout, then over rollouts), `dr_grpo` (over rollouts × `max_completion_length`) or
//!   `bnpo` (over micro-batches of `per_device_train_batch_size` consecutive rollouts, each its
//!   token mean).
//! - **Other policy losses** of TRL 1.16's `loss_type`: `cispo` (the ratio capped at
//!   `epsilon_high`, detached, times advantage × log-prob; averaged as `dapo`), `sapo` (a soft
//!   gate `sigmoid(τ (ratio − 1)) × 4 / τ` for the clip, τ = `sapo_temperature_pos/neg`;
//!   averaged as `grpo`), `luspo` (the clipped surrogate summed per rollout, then the mean over
//!   rollouts) and `vespo` (a detached Gamma weight of each rollout's importance weight,
//!   `vespo_k_pos/neg`, `vespo_lambda_pos/neg`; averaged as `dapo`).
//!   `off_policy_mask_threshold` drops the policy loss of rollouts with a negative advantage whose
//!   mean KL from the sampling weights exceeds it (DeepSeek-V3.2, eq. 9). Loss and gradient equal
//!   TRL 1.16's own `_compute_loss` in both packings (`tests/trl_losses.rs`).
//! - **Sampling correction** (`importance_sampling_correction`, TRL's vLLM IS correction, here for
//!   async rollouts and `num_iterations > 1`, whose sampling weights lag): the ratio is taken
//!   against the policy at the start of the update and each term's policy loss is weighted by
//!   `exp(before - sampled)` per token or summed per rollout, truncated or masked to
//!   `[importance_sampling_clip_min, importance_sampling_clip_max]` (`importance_sampling_mode`:
//!   `token_truncate`, `token_mask`, `sequence_truncate`, `sequence_mask` = TRL 1.16's default).
//!   Every option is checked against a reference computed from each rollout's own forward
//!   (`tests/grpo.rs`), in both packings. `num_iterations` (μ) optimizer steps per generated
//!   batch; `mask_truncated_completions`.
//! - **Updates**: the step's rollouts go through the token-budget planner into prefix-tree rows
//!   (`packing = "tree"`, default) or are laid end to end (`"flat"`): the same loss and gradients
//!   (tested to 1e-5 on real rollouts).
//! - **Rollouts**: `mode = "sync"` (generate, then train; default) or `"async"`: a generation
//!   thread with its own copy of the weights fills a bounded queue (`queue_size` steps' worth)
//!   with scored groups, each tagged with the weight version that generated it; the trainer
//!   assembles each step from the oldest queued groups, drops groups more than `max_staleness`
//!   versions old (counted), publishes weights every `weight_sync_steps`, and forces a sync when
//!   everything it could receive would be too stale.
//! - **Multi-turn rollouts** ([`GrpoTrainerBuilder::environment`]): an [`Environment`] (a trait,
//!   or a closure through [`environment()`], with optional `tools` schemas rendered into the
//!   prompt as transformers' `tools=`) answers each assistant turn with [`EnvReply::Done`] or the
//!   next message ([`EnvRole::User`] or [`EnvRole::Tool`]). The generator continues each
//!   conversation from its static KV cache, prefilling only what the cache lacks, and forks each
//!   conversation that goes on `turn_generations` ways; `max_turns` and `max_conversation_length`
//!   bound it. Only generated tokens are trained. An environment that fails, panics, returns a
//!   non-finite reward or a message the template cannot render as an extension of the
//!   conversation fails that conversation like a failing reward (advantage 0); the step goes on.
//!   Shipped environments: [`crate::shipped`] (`treetrain grpo --environment
//!   calculator|retry-game`).
//! - **The trainer**: [`GrpoTrainer::step`] / `train_for(n)` / [`GrpoTrainer::evaluate`] /
//!   [`GrpoTrainer::evaluate_by`] (each part of the prompts sharing a value of a string column,
//!   evaluated alone) / `state` (HTML: reward curves per function, entropy and KL, the time split,
//!   sample completions with rewards and advantages, the latest micro-batch's prefix tree), a
//!   log per step ([`GrpoStepMetrics`]'s fields in `log.jsonl`; TensorBoard and `metrics.csv` under
//!   TRL's tag names, with the completions table: `report_to`), and checkpoints that resume (sync
//!   runs exactly, on CPU; `--resume-from latest`).
//! - CLI: `treetrain grpo --config datasets/grpo.toml` (the recipe the demo runs).

mod advantage;
mod answer;
mod builder;
mod config;
mod environment;
mod eval;
mod metrics;
mod multiturn;
mod objective;
mod pending;
mod policy_terms;
mod producer;
mod reference;
mod reward;
mod rollouts;
mod routing_replay;
mod row_loss;
mod row_terms;
mod talk;
mod tools;
mod trainer;
mod update;
mod view;
pub use view::GrpoSettings;
mod worker;

pub use advantage::{MultiObjective, ScaleRewards};
pub use answer::extract_answer;
pub use builder::GrpoTrainerBuilder;
pub use config::{
    EntropyBonus, EntropyControl, Eval, GrpoConfig, ImportanceCorrection, ImportanceSampling, KlReference, Loss,
    LossType, MultiTurnLimits, RewardSpec, RolloutMode, Rollouts, Sampling, SamplingCorrectionMode, Update,
};
pub use environment::{Conversation, EnvReply, EnvRole, Environment, FnEnvironment, ToolMessage, environment};
pub use eval::EvalBreakdown;
pub use metrics::EvalResult;
pub use metrics::{
    BatchOrigin, GrpoStepMetrics, RewardStat, RolloutMetrics, SampleCompletion, StepTimes, TurnDrift, UpdateMetrics,
};
pub use multiturn::MultiTurn;
pub use objective::{GrpoObjective, LmHead, SamplingCorrection};
pub use producer::{BatchShape, RolloutProducer, Shard};
pub use reference::REFERENCE_FILE;
pub use reward::{BuiltinReward, GroupRewards, RewardFailure, RewardFn, RewardInput};
pub use rollouts::{
    DriftTally, ForkedRow, PromptRow, PromptSampler, PromptSet, QueuedGroup, RolloutBatch, ScoredGroup,
};
pub use row_loss::{grpo_loss, grpo_loss_backward};
pub use row_terms::{GrpoLoss, TermEntropies, TermLogprobs, TermWeights, grpo_loss_of_logprobs};
pub use tools::{CallFormat, Tool, ToolCall, ToolEnvironment, ToolError, ToolTally, TypedTool, tool};
pub use trainer::{GrpoState, GrpoTrainer};
pub(crate) use update::StepTotals;
pub use update::{UpdateStats, accumulate_gradients, pack_rollouts};
pub use worker::AsyncRollouts;

/// The message of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}
