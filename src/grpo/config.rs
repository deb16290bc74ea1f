//! GRPO run configuration (TRL's `GRPOConfig`, single process), readable from TOML.

use std::path::{Path, PathBuf};

use super::{BuiltinReward, MultiObjective, ScaleRewards};
use crate::pack::Packing;
use crate::train::config_file::{Alias, same};
use crate::train::{TrainConfig, TrainError};

/// Where rollouts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum RolloutMode {
    /// Generate, then train, with the same weights: on-policy, deterministic.
    #[default]
    Sync,
    /// A generation thread with its own copy of the weights fills a bounded queue of scored
    /// groups while the trainer updates; samples may be a few weight versions old.
    Async,
}

/// How the loss terms of a step are averaged (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum LossType {
    /// Over all loss terms of the step (token level; TRL's default).
    #[default]
    Dapo,
    /// Per rollout first, then over rollouts (the original GRPO; favours short completions).
    Grpo,
    /// Over rollouts x `max_completion_length` (Dr. GRPO: no length bias).
    DrGrpo,
    /// Over each micro-batch's terms (`per_device_train_batch_size` consecutive rollouts),
    /// then over micro-batches (TRL's `bnpo`; equal to `grpo` at one rollout per batch).
    Bnpo,
    /// CISPO (MiniMax-M1): `-min(ratio, epsilon_high)` (detached) x advantage x log-prob, so
    /// every token keeps a gradient; `epsilon_high` is the cap itself (ScaleRL recommends 5).
    /// Averaged as `dapo`.
    Cispo,
    /// SAPO: a soft gate `sigmoid(tau (ratio - 1)) x 4 / tau` instead of the hard clip, `tau`
    /// by the advantage's sign (`sapo_temperature_pos/neg`). Averaged as `grpo`.
    Sapo,
    /// LUSPO: the clipped surrogate summed over each rollout's tokens, then the mean over
    /// rollouts (length-unbiased with `importance_sampling_level = "sequence"`, as its paper).
    Luspo,
    /// VESPO: each rollout's importance weight `w` (the product over its tokens) shapes a
    /// detached Gamma weight `exp(lambda + k ln w - lambda w)` (1 at `w = 1`; `k`, `lambda`
    /// by the advantage's sign) times advantage x log-prob. Averaged as `dapo`.
    Vespo,
}

/// Where the importance ratio is taken (TRL's `importance_sampling_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ImportanceSampling {
    /// One ratio per token: `exp(logp - old_logp)` (GRPO; TRL's default).
    #[default]
    Token,
    /// One ratio per rollout, the exponent of its tokens' mean log-ratio, shared by all its
    /// tokens (GSPO: clipping then acts on whole sequences).
    Sequence,
}

/// How the mismatch between the weights that sampled a rollout and the policy at update start
/// is corrected (TRL's `vllm_importance_sampling_mode`; here for async rollouts and repeated
/// iterations, whose generating weights lag). The ratio is `exp(before - sampled)` of the
/// log-probs, per token or summed per rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum SamplingCorrectionMode {
    /// Per-token ratios clipped to `[clip_min, clip_max]`.
    TokenTruncate,
    /// Per-token ratios outside `[clip_min, clip_max]` set to 0.
    TokenMask,
    /// One ratio per rollout, clipped, applied to all its tokens.
    SequenceTruncate,
    /// Rollouts whose ratio is outside `[clip_min, clip_max]` left out (TRL 1.16's default).
    #[default]
    SequenceMask,
}

/// A built-in reward by name, with its weight.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RewardSpec {
    /// Which built-in.
    pub name: BuiltinReward,
    /// Weight in the total reward.
    #[serde(default = "one")]
    pub weight: f32,
}

fn one() -> f32 {
    1.0
}

/// Everything a GRPO run needs (TRL's `GRPOConfig`). Grouped here by concern; a TOML file
/// (and [`GrpoConfig::save_toml`]) writes every field at the top level under TRL's names
/// (`num_generations = 8`, not `rollouts.num_generations`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct GrpoConfig {
    /// Model (the policy's starting point), prompt dataset, optimizer, schedule, dtype, device,
    /// bookkeeping.
    #[serde(flatten)]
    pub train: TrainConfig,
    /// Built-in rewards (custom closures: [`super::GrpoTrainerBuilder::rewards`]).
    pub rewards: Vec<RewardSpec>,
    /// Optimizer steps of the run.
    pub max_steps: u64,
    /// What each step generates: prompts, group size, lengths, sync or async.
    #[serde(flatten)]
    pub rollouts: Rollouts,
    /// How completions are sampled.
    #[serde(flatten)]
    pub sampling: Sampling,
    /// The clipped-surrogate loss and its options.
    #[serde(flatten)]
    pub loss: Loss,
    /// How the update packs its rollouts.
    #[serde(flatten)]
    pub update: Update,
    /// Conversations with an environment (a trainer built with one).
    #[serde(flatten)]
    pub multi_turn: MultiTurnLimits,
    /// Held-out evaluation and logged samples.
    #[serde(flatten)]
    pub eval: Eval,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            train: TrainConfig {
                learning_rate: 1e-6,
                ..TrainConfig::default()
            },
            rewards: vec![RewardSpec {
                name: BuiltinReward::ExactAnswer,
                weight: 1.0,
            }],
            max_steps: 100,
            rollouts: Rollouts::default(),
            sampling: Sampling::default(),
            loss: Loss::default(),
            update: Update::default(),
            multi_turn: MultiTurnLimits::default(),
            eval: Eval::default(),
        }
    }
}

/// What each GRPO step generates ([`GrpoConfig::rollouts`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Rollouts {
    /// Column holding the prompt: a list of chat messages (rendered with the chat template and
    /// the generation prompt) or plain text (used as is).
    pub prompt_field: String,
    /// Completions per prompt (the group size G).
    pub num_generations: usize,
    /// Prompts per optimizer step; the step trains on `prompts_per_step * num_generations`
    /// rollouts.
    pub prompts_per_step: usize,
    /// Longest prompt in tokens; longer rows are an error naming them (or skipped).
    pub max_prompt_length: usize,
    /// Most tokens generated per completion.
    pub max_completion_length: usize,
    /// Prompts are prefilled this many tokens at a time (a static shape).
    pub prefill_chunk_size: i64,
    /// Sync (default) or async rollouts.
    pub mode: RolloutMode,
    /// Async: finished groups that may wait for the trainer, in steps' worth
    /// (`queue_size x prompts_per_step` groups).
    pub queue_size: usize,
    /// Async: groups generated more than this many weight versions ago are dropped.
    pub max_staleness: u64,
    /// Async: the generator receives the trainer's weights every this many steps.
    pub weight_sync_steps: u64,
    /// Sync: one generation makes the rollouts of this many optimizer steps, each trained on
    /// its own slice of `prompts_per_step` prompts (TRL's `steps_per_generation`; later slices
    /// are off-policy by the steps before them, as in TRL). Distinct from `num_iterations`,
    /// which trains every slice again.
    pub steps_per_generation: usize,
    /// TRL's other spelling of `steps_per_generation`: the rollouts of one generation
    /// (`prompts_per_step x num_generations x steps_per_generation`, per process).
    pub generation_batch_size: Option<usize>,
    /// Variables every chat template rendering of the run sees (prompts and multi-turn
    /// messages), as transformers' `apply_chat_template(**kwargs)`: e.g. `enable_thinking =
    /// false` for Qwen3 (a `[chat_template_kwargs]` table in TOML).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
}

impl Rollouts {
    /// Optimizer steps per generation: `steps_per_generation`, or `generation_batch_size` in
    /// rollouts (a whole number of steps' rollouts; both set, they must agree).
    pub fn generation_steps(&self) -> Result<usize, TrainError> {
        let per_step = self.prompts_per_step * self.num_generations;
        let steps = match self.generation_batch_size {
            None => self.steps_per_generation,
            Some(n) if per_step > 0 && n > 0 && n.is_multiple_of(per_step) => n / per_step,
            Some(n) => {
                return Err(TrainError::config(
                    "generation_batch_size",
                    format!(
                        "is {n}: it must be a whole number (>= 1) of steps' rollouts, prompts_per_step x num_generations = {per_step}"
                    ),
                ));
            }
        };
        if steps == 0 {
            return Err(TrainError::config("steps_per_generation", "must be at least 1"));
        }
        if self.generation_batch_size.is_some() && self.steps_per_generation != 1 && self.steps_per_generation != steps
        {
            return Err(TrainError::config(
                "generation_batch_size",
                format!(
                    "makes {steps} steps per generation, but steps_per_generation is {}",
                    self.steps_per_generation
                ),
            ));
        }
        Ok(steps)
    }
}

impl Default for Rollouts {
    fn default() -> Self {
        Rollouts {
            prompt_field: "prompt".into(),
            num_generations: 8,
            prompts_per_step: 4,
            max_prompt_length: 512,
            max_completion_length: 64,
            prefill_chunk_size: 64,
            mode: RolloutMode::Sync,
            queue_size: 2,
            max_staleness: 1,
            weight_sync_steps: 1,
            steps_per_generation: 1,
            generation_batch_size: None,
            chat_template_kwargs: Default::default(),
        }
    }
}

/// How completions are sampled ([`GrpoConfig::sampling`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Sampling {
    /// Sampling temperature (also applied to the policy's logits in the loss).
    pub temperature: f64,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// Top-k sampling.
    pub top_k: Option<usize>,
    /// Min-p sampling.
    pub min_p: Option<f64>,
    /// Rollouts penalise tokens already in the prompt or completion (transformers' rule; 1:
    /// off). Like truncation, it shapes only what is sampled: the old log-probs and the loss
    /// stay under the policy's own distribution.
    pub repetition_penalty: f64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            repetition_penalty: 1.0,
            temperature: 1.0,
            top_p: None,
            top_k: None,
            min_p: None,
        }
    }
}

/// The loss ([`GrpoConfig::loss`]): TRL's `_compute_loss` options.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Loss {
    /// Lower clip of the importance ratio (TRL's `epsilon`, accepted as an alias).
    #[serde(alias = "epsilon")]
    pub epsilon_low: f64,
    /// Upper clip of the importance ratio.
    pub epsilon_high: f64,
    /// Two-sided clipping: the unclipped branch's ratio is capped at `delta` too, so a large
    /// ratio with a negative advantage cannot blow the loss up (TRL's `delta`; above
    /// `1 + epsilon_high`; `None`: off).
    pub delta: Option<f64>,
    /// Token- or sequence-level importance ratios (GSPO).
    pub importance_sampling_level: ImportanceSampling,
    /// Correct for the weights that sampled the rollouts lagging the policy (TRL's
    /// `vllm_importance_sampling_correction`, accepted as an alias, as are its `_mode`,
    /// `_clip_max` (and `_cap`) and `_clip_min`): the clipped ratio is then taken against the
    /// policy's own log-probs at the start of the update (one more forward per row, without
    /// gradient), and each term's policy loss is weighted by the capped ratio of those to the
    /// sampling log-probs. Off by default (it costs that forward).
    #[serde(alias = "vllm_importance_sampling_correction")]
    pub importance_sampling_correction: bool,
    /// How the correction ratio is capped.
    #[serde(alias = "vllm_importance_sampling_mode")]
    pub importance_sampling_mode: SamplingCorrectionMode,
    /// Upper bound of the correction ratio (TRL's default 3.0; `None`: none).
    #[serde(alias = "vllm_importance_sampling_clip_max", alias = "vllm_importance_sampling_cap")]
    pub importance_sampling_clip_max: Option<f64>,
    /// Lower bound of the correction ratio (`None`: none).
    #[serde(alias = "vllm_importance_sampling_clip_min")]
    pub importance_sampling_clip_min: Option<f64>,
    /// Train only the loss terms whose policy entropy is in the top `top_entropy_quantile` of
    /// the step's (TRL's ρ, "Beyond the 80/20 Rule"; 0.2 recommended, 1.0 keeps all). The other
    /// terms still count in the normaliser, as in TRL.
    pub top_entropy_quantile: f64,
    /// KL penalty to the starting weights (0: off, no reference model is kept).
    pub beta: f64,
    /// Multiply each term's KL estimate by its importance ratio (token or sequence level, before
    /// any clipping; TRL's `use_bias_correction_kl`, from DeepSeek-V3.2): the tokens were sampled
    /// by the old weights, so the plain `k3` average is biased once the policy has moved. The
    /// corrected value is also what `ref_kl` reports. Used only with `beta > 0`; on by default,
    /// as in TRL 1.16.
    pub use_bias_correction_kl: bool,
    /// Advantage scaling within a group.
    pub scale_rewards: ScaleRewards,
    /// How several reward functions combine into one advantage (GDPO: `normalize_then_sum`).
    pub multi_objective_aggregation: MultiObjective,
    /// How loss terms are averaged.
    pub loss_type: LossType,
    /// Rollouts per micro-batch for `loss_type = "bnpo"` (TRL's `per_device_train_batch_size`,
    /// whose batches `bnpo` normalises over; packing itself is set by `token_budget`).
    pub per_device_train_batch_size: usize,
    /// Leave completions cut at `max_completion_length` out of the loss (TRL's
    /// `mask_truncated_completions`).
    pub mask_truncated_completions: bool,
    /// Optimizer steps taken on each generated batch (TRL's `num_iterations`, μ); the clip
    /// bounds how far later iterations move from the generating weights.
    pub num_iterations: usize,
    /// `sapo`'s gate temperature for terms with a positive advantage.
    pub sapo_temperature_pos: f64,
    /// `sapo`'s gate temperature for terms with a negative (or zero) advantage.
    pub sapo_temperature_neg: f64,
    /// `vespo`'s Gamma shape `k` for rollouts with an advantage >= 0.
    pub vespo_k_pos: f64,
    /// `vespo`'s Gamma rate `lambda` for rollouts with an advantage >= 0.
    pub vespo_lambda_pos: f64,
    /// `vespo`'s `k` for rollouts with a negative advantage.
    pub vespo_k_neg: f64,
    /// `vespo`'s `lambda` for rollouts with a negative advantage.
    pub vespo_lambda_neg: f64,
    /// Turn dropout off for the run (TRL's `disable_dropout`): the decoder applies none, so this
    /// sets LoRA's `lora_dropout` to 0, and the log-probs of a rollout no longer depend on the
    /// dropout draws.
    pub disable_dropout: bool,
    /// TR-DPO: move the KL reference toward the policy every `ref_model_sync_steps` steps,
    /// `reference = alpha * policy + (1 - alpha) * reference` (needs `beta > 0`; with LoRA the
    /// reference is the base weights themselves, so it is refused, as TRL refuses it).
    pub sync_ref_model: bool,
    /// TR-DPO's alpha, in [0, 1].
    pub ref_model_mixup_alpha: f64,
    /// Steps between reference syncs.
    pub ref_model_sync_steps: u64,
    /// Entropy bonus: the loss minus this times the mean policy entropy over the step's trained
    /// terms (those above the entropy floor with `top_entropy_quantile`), whatever the loss
    /// type's normalisation. 0: off (and the LM head's logits are not kept for it).
    pub entropy_coef: f64,
    /// Skywork-OR1's adaptive coefficient: after each step `entropy_coef` moves by
    /// `entropy_coef_delta` (up while the step's entropy is at or below `entropy_target`, down
    /// otherwise, within `[entropy_coef_min, entropy_coef_max]`), and the bonus applies only
    /// while the last step's entropy was at or below the target. Checkpointed.
    pub use_adaptive_entropy: bool,
    /// Lowest adaptive coefficient.
    pub entropy_coef_min: f64,
    /// Highest adaptive coefficient.
    pub entropy_coef_max: f64,
    /// Step of the adaptive coefficient.
    pub entropy_coef_delta: f64,
    /// Entropy (nats per token) the adaptive coefficient steers toward.
    pub entropy_target: f64,
    /// Off-policy sequence masking (DeepSeek-V3.2, eq. 9): a rollout with a negative advantage
    /// whose mean per-token KL from the sampling weights to the policy (`sampled - policy`
    /// log-prob) exceeds this leaves the policy loss (`None`: off; e.g. 0.5).
    pub off_policy_mask_threshold: Option<f64>,
}

impl Default for Loss {
    fn default() -> Self {
        Loss {
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            delta: None,
            importance_sampling_level: ImportanceSampling::Token,
            importance_sampling_correction: false,
            importance_sampling_mode: SamplingCorrectionMode::SequenceMask,
            importance_sampling_clip_max: Some(3.0),
            importance_sampling_clip_min: None,
            top_entropy_quantile: 1.0,
            beta: 0.0,
            use_bias_correction_kl: true,
            scale_rewards: ScaleRewards::Group,
            multi_objective_aggregation: MultiObjective::SumThenNormalize,
            loss_type: LossType::Dapo,
            per_device_train_batch_size: 8,
            mask_truncated_completions: false,
            num_iterations: 1,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            vespo_k_pos: 2.0,
            vespo_lambda_pos: 3.0,
            vespo_k_neg: 3.0,
            vespo_lambda_neg: 2.0,
            off_policy_mask_threshold: None,
            disable_dropout: false,
            sync_ref_model: false,
            ref_model_mixup_alpha: 0.6,
            ref_model_sync_steps: 512,
            entropy_coef: 0.0,
            use_adaptive_entropy: false,
            entropy_coef_min: 0.0,
            entropy_coef_max: 1.0,
            entropy_coef_delta: 0.005,
            entropy_target: 0.2,
        }
    }
}

impl Loss {
    /// Ranges and the combinations TRL refuses, naming the field.
    fn validate(&self) -> Result<(), TrainError> {
        let l = self;
        let non_negative = [
            ("epsilon_low", l.epsilon_low),
            ("epsilon_high", l.epsilon_high),
            ("beta", l.beta),
            ("vespo_k_pos", l.vespo_k_pos),
            ("vespo_lambda_pos", l.vespo_lambda_pos),
            ("vespo_k_neg", l.vespo_k_neg),
            ("vespo_lambda_neg", l.vespo_lambda_neg),
            ("off_policy_mask_threshold", l.off_policy_mask_threshold.unwrap_or(0.0)),
        ];
        if let Some((field, _)) = non_negative.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            return Err(TrainError::config(field, "must be finite and >= 0"));
        }
        let finite = [("entropy_coef", l.entropy_coef), ("entropy_target", l.entropy_target)];
        if let Some((field, _)) = finite.iter().find(|(_, v)| !v.is_finite()) {
            return Err(TrainError::config(field, "must be finite"));
        }
        if l.use_adaptive_entropy
            && !(l.entropy_coef_min.is_finite()
                && l.entropy_coef_max.is_finite()
                && l.entropy_coef_min <= l.entropy_coef_max
                && l.entropy_coef_delta.is_finite()
                && l.entropy_coef_delta >= 0.0)
        {
            return Err(TrainError::config(
                "entropy_coef_min",
                "entropy_coef_min <= entropy_coef_max and entropy_coef_delta >= 0, all finite, for use_adaptive_entropy",
            ));
        }
        let positive = [
            ("sapo_temperature_pos", l.sapo_temperature_pos),
            ("sapo_temperature_neg", l.sapo_temperature_neg),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
            return Err(TrainError::config(field, "must be finite and > 0"));
        }
        if !(0.0..=1.0).contains(&l.top_entropy_quantile) {
            return Err(TrainError::config("top_entropy_quantile", "must lie in [0, 1]"));
        }
        if l.sync_ref_model && l.beta == 0.0 {
            return Err(TrainError::config(
                "sync_ref_model",
                "needs beta > 0: without the KL term there is no reference to sync",
            ));
        }
        if !(0.0..=1.0).contains(&l.ref_model_mixup_alpha) || l.ref_model_sync_steps == 0 {
            return Err(TrainError::config(
                "ref_model_mixup_alpha",
                "must lie in [0, 1], with ref_model_sync_steps >= 1",
            ));
        }
        // VESPO folds the correction into its sequence weight token by token (as TRL does).
        let per_sequence = matches!(
            l.importance_sampling_mode,
            SamplingCorrectionMode::SequenceMask | SamplingCorrectionMode::SequenceTruncate
        );
        if l.loss_type == LossType::Vespo && l.importance_sampling_correction && per_sequence {
            return Err(TrainError::config(
                "importance_sampling_mode",
                "must be token_truncate or token_mask with loss_type = \"vespo\" and importance_sampling_correction (TRL refuses the sequence modes)",
            ));
        }
        Ok(())
    }
}

/// How the update packs a step's rollouts ([`GrpoConfig::update`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Update {
    /// Tree (default) or flat packing of the update.
    pub packing: Packing,
    /// Most tokens per packed row of the update (unique tokens for trees).
    pub token_budget: usize,
}

impl Default for Update {
    fn default() -> Self {
        Update {
            packing: Packing::Tree,
            token_budget: 4096,
        }
    }
}

/// Bounds of multi-turn conversations ([`GrpoConfig::multi_turn`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct MultiTurnLimits {
    /// Most assistant turns per conversation; after the last the environment must answer
    /// `Done` (TRL's `max_tool_calling_iterations = n` in a config file means `n + 1`).
    pub max_turns: usize,
    /// Continuations forked from each conversation that goes on after a turn (1: no fork; a
    /// prompt then has at most `num_generations x turn_generations^(max_turns - 1)`
    /// conversations).
    pub turn_generations: usize,
    /// Most tokens of a whole conversation (prompt, turns, messages); its KV cache holds this
    /// many slots. A conversation that would grow past it fails (advantage 0).
    pub max_conversation_length: usize,
}

impl Default for MultiTurnLimits {
    fn default() -> Self {
        MultiTurnLimits {
            max_turns: 4,
            turn_generations: 1,
            max_conversation_length: 1024,
        }
    }
}

/// Held-out evaluation and the samples a run keeps ([`GrpoConfig::eval`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Eval {
    /// Held-out prompts to evaluate on (CLI: before training, every `eval_steps` and at the end).
    pub eval_dataset: Option<PathBuf>,
    /// Completions per held-out prompt (0: one greedy completion; TRL's
    /// `num_generations_eval`, accepted as an alias).
    #[serde(alias = "num_generations_eval")]
    pub eval_samples: usize,
    /// Completions kept for the state display's sample table (TRL's boolean spelling is read
    /// too: `true` keeps 8, `false` none).
    #[serde(deserialize_with = "count_or_bool")]
    pub log_completions: usize,
    /// Of those, printed under each logged step's line (`None`: none printed).
    pub num_completions_to_print: Option<usize>,
    /// Keep one completion per prompt in the samples (the display, the printout and
    /// TensorBoard's completions table).
    pub log_unique_prompts: bool,
}

/// A count, or TRL's `true` (8) / `false` (0).
fn count_or_bool<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum CountOrBool {
        Count(usize),
        Flag(bool),
    }
    Ok(match <CountOrBool as serde::Deserialize>::deserialize(d)? {
        CountOrBool::Count(n) => n,
        CountOrBool::Flag(on) => {
            if on {
                8
            } else {
                0
            }
        }
    })
}

impl Default for Eval {
    fn default() -> Self {
        Eval {
            eval_dataset: None,
            eval_samples: 4,
            log_completions: 8,
            num_completions_to_print: None,
            log_unique_prompts: false,
        }
    }
}

/// TRL's spellings of treetrain's GRPO settings.
const TRL_ALIASES: &[Alias] = &[
    ("epsilon", "epsilon_low", same),
    (
        "vllm_importance_sampling_correction",
        "importance_sampling_correction",
        same,
    ),
    ("vllm_importance_sampling_mode", "importance_sampling_mode", same),
    (
        "vllm_importance_sampling_clip_max",
        "importance_sampling_clip_max",
        same,
    ),
    ("vllm_importance_sampling_cap", "importance_sampling_clip_max", same),
    (
        "vllm_importance_sampling_clip_min",
        "importance_sampling_clip_min",
        same,
    ),
    ("num_generations_eval", "eval_samples", same),
    // TRL's async trainer allows `n + 1` assistant turns for `n` tool-calling iterations.
    ("max_tool_calling_iterations", "max_turns", one_more),
];

/// `n + 1` of a non-negative integer.
fn one_more(v: &toml::Value) -> Option<toml::Value> {
    Some(toml::Value::Integer(
        v.as_integer().filter(|n| *n >= 0)?.checked_add(1)?,
    ))
}

impl GrpoConfig {
    /// Writes the config as a TOML file [`GrpoConfig::from_toml_file`] reads back unchanged: how a
    /// notebook's run is scaled out (`treetrain launch --nproc-per-node N -- grpo --config FILE`).
    pub fn save_toml(&self, path: &Path) -> Result<(), TrainError> {
        crate::train::config_file::write_toml(self, path)
    }

    /// Parses a TOML file of [`GrpoConfig`] fields (unset fields keep their defaults, unknown
    /// keys are refused; relative paths are taken relative to the file's folder).
    pub fn from_toml_file(path: &Path) -> Result<Self, TrainError> {
        let (mut cfg, base): (GrpoConfig, _) = crate::train::config_file::read_toml_with_aliases(path, TRL_ALIASES)?;
        cfg.train.anchor_paths(base);
        if let Some(p) = cfg.eval.eval_dataset.as_mut() {
            crate::train::config_file::anchor(base, p);
        }
        Ok(cfg)
    }

    /// How rollouts are sampled: temperature, top-k, top-p and min-p of this config, seeded
    /// by the run's seed (what the generator uses and what validation checks).
    pub fn sampling_config(&self) -> crate::generate::SamplingConfig {
        let s = &self.sampling;
        crate::generate::SamplingConfig {
            do_sample: true,
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            seed: self.train.seed,
            ..Default::default()
        }
    }

    /// Checks the numbers that would make a run meaningless or hang.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.train.validate()?;
        if self.train.eval_steps.is_some() && self.eval.eval_dataset.is_none() {
            return Err(TrainError::config(
                "eval_steps",
                "is set, but eval_dataset is not: there is nothing to evaluate on",
            ));
        }
        if self.rollouts.num_generations < 2 {
            return Err(TrainError::config(
                "num_generations",
                "must be at least 2 (advantages compare completions of one prompt)",
            ));
        }
        let mut positive = vec![
            ("prompts_per_step", self.rollouts.prompts_per_step),
            ("max_completion_length", self.rollouts.max_completion_length),
            ("token_budget", self.update.token_budget),
            ("num_iterations", self.loss.num_iterations),
            ("per_device_train_batch_size", self.loss.per_device_train_batch_size),
            ("max_turns", self.multi_turn.max_turns),
            ("turn_generations", self.multi_turn.turn_generations),
        ];
        if self.rollouts.mode == RolloutMode::Async {
            positive.extend([
                ("queue_size", self.rollouts.queue_size),
                ("weight_sync_steps", self.rollouts.weight_sync_steps as usize),
            ]);
        }
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(TrainError::config(field, "must be at least 1"));
        }
        self.rollouts.generation_steps()?;
        if self.rollouts.steps_per_generation > 1 && self.rollouts.mode == RolloutMode::Async {
            return Err(TrainError::config(
                "steps_per_generation",
                "applies to mode = \"sync\": async rollouts stream groups, step by step",
            ));
        }
        self.sampling_config()
            .check()
            .map_err(|(field, message)| TrainError::config(field, message))?;
        self.loss.validate()?;
        if self.loss.sync_ref_model && self.train.lora.is_some() {
            return Err(TrainError::config(
                "sync_ref_model",
                "does not apply with lora: the reference is the base weights themselves (no copy), and moving them would move the policy's base too (TRL refuses it with PEFT)",
            ));
        }
        let (lo, hi) = (
            self.loss.importance_sampling_clip_min,
            self.loss.importance_sampling_clip_max,
        );
        if lo.is_some_and(|l| !(l.is_finite() && l >= 0.0))
            || hi.is_some_and(|h| !(h.is_finite() && h > lo.unwrap_or(0.0)))
        {
            return Err(TrainError::config(
                "importance_sampling_clip_max",
                "and importance_sampling_clip_min must be finite, >= 0, with min below max",
            ));
        }
        if self.multi_turn.max_conversation_length <= self.rollouts.max_completion_length {
            return Err(TrainError::config(
                "max_conversation_length",
                "must exceed max_completion_length (a prompt and one whole turn)",
            ));
        }
        if let Some(d) = self
            .loss
            .delta
            .filter(|d| !(d.is_finite() && *d > 1.0 + self.loss.epsilon_high))
        {
            return Err(TrainError::config(
                "delta",
                format!("is {d}: it caps the unclipped ratio, so it must be finite and above 1 + epsilon_high"),
            ));
        }
        Ok(())
    }
}
