//! GRPO run configuration (TRL's `GRPOConfig`, single process), readable from TOML.

use std::path::{Path, PathBuf};

mod correction;
mod entropy;
mod kl_reference;
mod loss;

pub use correction::{ImportanceCorrection, SamplingCorrectionMode};
pub use entropy::{EntropyBonus, EntropyControl};
pub use kl_reference::KlReference;
pub use loss::{ImportanceSampling, Loss, LossType};

use super::BuiltinReward;
use crate::pack::Packing;
use crate::train::config_file::{Alias, same};
use crate::train::{OptimizerSettings, TrainConfig, TrainError};

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
    /// The clipped-surrogate loss proper: clipping, normalisation, advantages.
    #[serde(flatten)]
    pub loss: Loss,
    /// The KL penalty's reference and TR-DPO's sync of it.
    #[serde(flatten)]
    pub reference: KlReference,
    /// The entropy bonus, fixed or adaptive.
    #[serde(flatten)]
    pub entropy_bonus: EntropyBonus,
    /// The importance-sampling correction of lagging sampling weights.
    #[serde(flatten)]
    pub sampling_correction: ImportanceCorrection,
    /// How the update packs its rollouts, and its dropout.
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
                optimizer: OptimizerSettings {
                    learning_rate: 1e-6,
                    ..OptimizerSettings::default()
                },
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
            reference: KlReference::default(),
            entropy_bonus: EntropyBonus::default(),
            sampling_correction: ImportanceCorrection::default(),
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
    /// The group size, the counts that must be at least 1, and how generations are cut into
    /// steps.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.num_generations < 2 {
            return Err(TrainError::config(
                "num_generations",
                "must be at least 2 (advantages compare completions of one prompt)",
            ));
        }
        let mut positive = vec![
            ("prompts_per_step", self.prompts_per_step),
            ("max_completion_length", self.max_completion_length),
        ];
        if self.mode == RolloutMode::Async {
            positive.extend([
                ("queue_size", self.queue_size),
                ("weight_sync_steps", self.weight_sync_steps as usize),
            ]);
        }
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(TrainError::config(field, "must be at least 1"));
        }
        self.generation_steps()?;
        if self.steps_per_generation > 1 && self.mode == RolloutMode::Async {
            return Err(TrainError::config(
                "steps_per_generation",
                "applies to mode = \"sync\": async rollouts stream groups, step by step",
            ));
        }
        Ok(())
    }

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

/// How the update packs a step's rollouts, and whether it drops out ([`GrpoConfig::update`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Update {
    /// Tree (default) or flat packing of the update.
    pub packing: Packing,
    /// Most tokens per packed row of the update (unique tokens for trees).
    pub token_budget: usize,
    /// Turn dropout off for the run (TRL's `disable_dropout`): the decoder applies none, so this
    /// sets LoRA's `lora_dropout` to 0, and the log-probs of a rollout no longer depend on the
    /// dropout draws.
    pub disable_dropout: bool,
    /// A mixture model's update routes each generated token to the experts the generator chose
    /// for it, with the routing weights recomputed from the current router (routing replay,
    /// the R3 method). Off by default; `routing_mismatch` is logged either way.
    pub routing_replay: bool,
}

impl Default for Update {
    fn default() -> Self {
        Update {
            packing: Packing::Tree,
            token_budget: 4096,
            disable_dropout: false,
            routing_replay: false,
        }
    }
}

impl Update {
    /// The token budget is at least 1.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.token_budget == 0 {
            return Err(TrainError::config("token_budget", "must be at least 1"));
        }
        Ok(())
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
    /// A chat template that renders the history otherwise than the model saw it (Qwen3 drops
    /// earlier turns' reasoning): a departure inside the latest assistant turn that moves fewer
    /// held tokens than this is realigned as context; an earlier or larger one forks a new
    /// training row (TRL's async `fork_threshold_tokens`; `grpo::talk`).
    pub fork_threshold_tokens: usize,
}

impl MultiTurnLimits {
    /// The turn counts are at least 1, and a conversation holds more than one completion of
    /// `max_completion_length` tokens.
    pub fn validate(&self, max_completion_length: usize) -> Result<(), TrainError> {
        let positive = [
            ("max_turns", self.max_turns),
            ("turn_generations", self.turn_generations),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(TrainError::config(field, "must be at least 1"));
        }
        if self.max_conversation_length <= max_completion_length {
            return Err(TrainError::config(
                "max_conversation_length",
                "must exceed max_completion_length (a prompt and one whole turn)",
            ));
        }
        Ok(())
    }
}

impl Default for MultiTurnLimits {
    fn default() -> Self {
        MultiTurnLimits {
            max_turns: 4,
            turn_generations: 1,
            max_conversation_length: 1024,
            fork_threshold_tokens: 1024,
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

    /// Checks the numbers that would make a run meaningless or hang: each group its own, then
    /// the settings that only make sense together.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.train.validate()?;
        if self.train.output.eval_steps.is_some() && self.eval.eval_dataset.is_none() {
            return Err(TrainError::config(
                "eval_steps",
                "is set, but eval_dataset is not: there is nothing to evaluate on",
            ));
        }
        self.rollouts.validate()?;
        self.update.validate()?;
        self.loss.validate()?;
        self.multi_turn.validate(self.rollouts.max_completion_length)?;
        self.sampling_config()
            .check()
            .map_err(|(field, message)| TrainError::config(field, message))?;
        self.reference.validate()?;
        self.entropy_bonus.validate()?;
        self.sampling_correction.validate(self.loss.loss_type)?;
        if self.reference.sync_ref_model && self.train.lora.is_some() {
            return Err(TrainError::config(
                "sync_ref_model",
                "does not apply with lora: the reference is the base weights themselves (no copy), and moving them would move the policy's base too (TRL refuses it with PEFT)",
            ));
        }
        Ok(())
    }
}
