//! GRPO run configuration (TRL's `GRPOConfig`, single process), readable from TOML.

use std::path::{Path, PathBuf};

use super::{GrpoError, ScaleRewards};
use crate::train::{AdamWConfig, ScheduleKind};

/// How the policy update packs the step's rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpdatePacking {
    /// Prefix trees through the token-budget planner: each shared prompt forwarded once.
    #[default]
    Tree,
    /// Sequence packing (every rollout forwarded whole), for comparison.
    Flat,
}

/// Where rollouts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutMode {
    /// Generate, then train, with the same weights: on-policy, deterministic.
    #[default]
    Sync,
    /// A generation thread with its own copy of the weights fills a bounded queue of scored
    /// groups while the trainer updates; samples may be a few weight versions old.
    Async,
}

/// How the loss terms of a step are averaged (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// Over all loss terms of the step (token level; TRL's default).
    #[default]
    Dapo,
    /// Per rollout first, then over rollouts (the original GRPO; favours short completions).
    Grpo,
    /// Over rollouts x `max_completion_length` (Dr. GRPO: no length bias).
    DrGrpo,
}

/// A built-in reward by name, with its weight.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RewardSpec {
    /// `exact_answer` or `answer_format`.
    pub name: String,
    /// Weight in the total reward.
    #[serde(default = "one")]
    pub weight: f32,
}

fn one() -> f32 {
    1.0
}

/// Everything a GRPO run needs.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct GrpoConfig {
    /// Model folder or cached repo id (the policy's starting point).
    pub model: String,
    /// Prompt dataset file or folder (Parquet, Arrow, JSON lines) or a cached hub dataset.
    pub dataset: PathBuf,
    /// Split of a hub dataset.
    pub dataset_split: Option<String>,
    /// Column holding the prompt: a list of chat messages (rendered with the chat template and
    /// the generation prompt) or plain text (used as is).
    pub prompt_field: String,
    /// Where `log.jsonl` and checkpoints go (none: nothing written).
    pub output_dir: Option<PathBuf>,
    /// Built-in rewards (custom closures: [`super::GrpoTrainer::with_rewards`]).
    pub rewards: Vec<RewardSpec>,
    /// Completions per prompt (the group size G).
    pub num_generations: usize,
    /// Prompts per optimizer step; the step trains on `prompts_per_step * num_generations`
    /// rollouts.
    pub prompts_per_step: usize,
    /// Longest prompt in tokens; longer rows are an error naming them (or skipped).
    pub max_prompt_length: usize,
    /// Most tokens generated per completion.
    pub max_completion_length: usize,
    /// Sampling temperature (also applied to the policy's logits in the loss).
    pub temperature: f64,
    /// Nucleus sampling.
    pub top_p: Option<f64>,
    /// Top-k sampling.
    pub top_k: Option<usize>,
    /// Min-p sampling.
    pub min_p: Option<f64>,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Schedule after warmup.
    pub lr_scheduler: ScheduleKind,
    /// Warmup as a fraction of all steps.
    pub warmup_ratio: f64,
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
    /// Gradient-norm clipping (`None`: off).
    pub max_grad_norm: Option<f64>,
    /// Lower clip of the importance ratio.
    pub epsilon_low: f64,
    /// Upper clip of the importance ratio.
    pub epsilon_high: f64,
    /// KL penalty to the starting weights (0: off, no reference model is kept).
    pub beta: f64,
    /// Advantage scaling within a group.
    pub scale_rewards: ScaleRewards,
    /// How loss terms are averaged.
    pub loss_type: LossType,
    /// Leave completions cut at `max_completion_length` out of the loss (TRL's
    /// `mask_truncated_completions`).
    pub mask_truncated_completions: bool,
    /// Optimizer steps taken on each generated batch (TRL's `num_iterations`, μ); the clip
    /// bounds how far later iterations move from the generating weights.
    pub num_iterations: usize,
    /// Tree (default) or flat packing of the update.
    pub packing: UpdatePacking,
    /// Most tokens per packed row of the update (unique tokens for trees).
    pub token_budget: usize,
    /// Sync (default) or async rollouts.
    pub mode: RolloutMode,
    /// Async: finished groups that may wait for the trainer, in steps' worth
    /// (`queue_size x prompts_per_step` groups).
    pub queue_size: usize,
    /// Async: groups generated more than this many weight versions ago are dropped.
    pub max_staleness: u64,
    /// Async: the generator receives the trainer's weights every this many steps.
    pub weight_sync_steps: u64,
    /// Optimizer steps of the run.
    pub max_steps: u64,
    /// Seed of the prompt order and of sampling.
    pub seed: u64,
    /// Parameter dtype (`fp32` or `bf16`).
    pub dtype: String,
    /// Where the policy runs: `cpu`, `cuda`, `cuda:N`, `mps` or `auto` (CUDA when available).
    pub device: String,
    /// Prompts are prefilled this many tokens at a time (a static shape).
    pub prefill_chunk_size: i64,
    /// Skip prompts that cannot be used (counted) instead of failing on the first.
    pub skip_invalid_rows: bool,
    /// Completions kept for the state display's sample table.
    pub log_completions: usize,
    /// Write a checkpoint every this many steps (CLI).
    pub save_steps: Option<u64>,
    /// Held-out prompts to evaluate on (CLI: before training, every `eval_steps` and at the end).
    pub eval_dataset: Option<PathBuf>,
    /// Completions per held-out prompt (0: one greedy completion).
    pub eval_samples: usize,
    /// Evaluate every this many steps (CLI).
    pub eval_steps: Option<u64>,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            model: String::new(),
            dataset: PathBuf::new(),
            dataset_split: None,
            prompt_field: "prompt".into(),
            output_dir: None,
            rewards: vec![RewardSpec {
                name: "exact_answer".into(),
                weight: 1.0,
            }],
            num_generations: 8,
            prompts_per_step: 4,
            max_prompt_length: 512,
            max_completion_length: 64,
            temperature: 1.0,
            top_p: None,
            top_k: None,
            min_p: None,
            learning_rate: 1e-6,
            lr_scheduler: ScheduleKind::Linear,
            warmup_ratio: 0.0,
            adamw: AdamWConfig::default(),
            max_grad_norm: Some(1.0),
            epsilon_low: 0.2,
            epsilon_high: 0.2,
            beta: 0.0,
            scale_rewards: ScaleRewards::Group,
            loss_type: LossType::Dapo,
            mask_truncated_completions: false,
            num_iterations: 1,
            packing: UpdatePacking::Tree,
            token_budget: 4096,
            mode: RolloutMode::Sync,
            queue_size: 2,
            max_staleness: 1,
            weight_sync_steps: 1,
            max_steps: 100,
            seed: 42,
            dtype: "fp32".into(),
            device: "cpu".into(),
            prefill_chunk_size: 64,
            skip_invalid_rows: false,
            log_completions: 8,
            save_steps: None,
            eval_dataset: None,
            eval_samples: 4,
            eval_steps: None,
        }
    }
}

impl GrpoConfig {
    /// Parses a TOML file of [`GrpoConfig`] fields (unset fields keep their defaults; relative
    /// paths are taken relative to the file's folder).
    pub fn from_toml_file(path: &Path) -> Result<Self, GrpoError> {
        use crate::train::config_file::{anchor, anchor_model, read_toml};
        let (mut cfg, base): (GrpoConfig, _) = read_toml(path).map_err(GrpoError::Config)?;
        // A dataset that is not a file under the config's folder may be a hub repo id.
        if base.join(&cfg.dataset).exists() {
            anchor(base, &mut cfg.dataset);
        }
        for p in [cfg.eval_dataset.as_mut(), cfg.output_dir.as_mut()]
            .into_iter()
            .flatten()
        {
            anchor(base, p);
        }
        anchor_model(base, &mut cfg.model);
        Ok(cfg)
    }

    /// Checks the numbers that would make a run meaningless or hang.
    pub fn validate(&self) -> Result<(), GrpoError> {
        let bad = |m: &str| Err(GrpoError::Config(m.to_string()));
        if self.num_generations < 2 {
            return bad("num_generations must be at least 2 (advantages compare completions of one prompt)");
        }
        if self.prompts_per_step == 0
            || self.max_completion_length == 0
            || self.token_budget == 0
            || self.num_iterations == 0
        {
            return bad("prompts_per_step, max_completion_length, token_budget and num_iterations must be at least 1");
        }
        if self.mode == RolloutMode::Async && (self.queue_size == 0 || self.weight_sync_steps == 0) {
            return bad("queue_size and weight_sync_steps must be at least 1 in async mode");
        }
        if self.temperature.is_nan() || self.temperature <= 0.0 {
            return bad("temperature must be > 0");
        }
        if self.epsilon_low < 0.0 || self.epsilon_high < 0.0 || self.beta < 0.0 {
            return bad("epsilon_low, epsilon_high and beta must be >= 0");
        }
        Ok(())
    }
}
