//! Building a [`GrpoTrainer`]: `GrpoTrainer::builder(config)`, then what the run adds to its
//! config (reward closures, an environment, a checkpoint to continue), then `build()`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::config::{GrpoConfig, RolloutMode};
use super::environment::Environment;
use super::multiturn::MultiTurn;
use super::producer::{BatchShape, RolloutProducer, Shard};
use super::reference::Reference;
use super::reward::RewardFn;
use super::rollouts::PromptSet;
use super::trainer::GrpoTrainer;
use super::trainer::{GrpoState, Source};
use super::worker::AsyncRollouts;
use crate::data::Dataset;
use crate::generate::{GenerationConfig, SamplingConfig};
use crate::model::SpecialTokens;
use crate::train::{TrainCore, TrainError};
use serde_json::Value;

/// Builds a [`GrpoTrainer`] from a [`GrpoConfig`] ([`GrpoTrainer::builder`]).
///
/// ```no_run
/// use treetrain::grpo::{GrpoConfig, GrpoTrainer, RewardFn};
/// let config = GrpoConfig::from_toml_file("datasets/grpo.toml".as_ref())?;
/// let trainer = GrpoTrainer::builder(config)
///     .rewards(vec![RewardFn::exact_answer(), RewardFn::answer_format().with_weight(0.5)])
///     .resume("grpo-out/checkpoint-50")
///     .build()?;
/// # Ok::<(), treetrain::train::TrainError>(())
/// ```
pub struct GrpoTrainerBuilder {
    config: GrpoConfig,
    rewards: Option<Vec<RewardFn>>,
    environment: Option<Arc<dyn Environment>>,
    resume: Option<PathBuf>,
}

impl std::fmt::Debug for GrpoTrainerBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpoTrainerBuilder")
            .field("rewards", &self.rewards)
            .field("environment", &self.environment.as_ref().map(|e| e.name()))
            .field("resume", &self.resume)
            .finish_non_exhaustive()
    }
}

impl GrpoTrainer {
    /// A trainer with the built-in rewards named in `config.rewards`; [`GrpoTrainer::builder`]
    /// adds reward closures, an environment or a checkpoint to continue.
    pub fn new(config: GrpoConfig) -> Result<Self, TrainError> {
        Self::builder(config).build()
    }

    /// A builder of a trainer of `config`.
    pub fn builder(config: GrpoConfig) -> GrpoTrainerBuilder {
        GrpoTrainerBuilder::new(config)
    }
}

impl GrpoTrainerBuilder {
    pub(super) fn new(config: GrpoConfig) -> Self {
        GrpoTrainerBuilder {
            config,
            rewards: None,
            environment: None,
            resume: None,
        }
    }

    /// The reward functions (closures or built-ins), in place of the built-in rewards named
    /// in `config.rewards`. With an environment they come after its reward and see each whole
    /// conversation as the completion.
    pub fn rewards(mut self, rewards: Vec<RewardFn>) -> Self {
        self.rewards = Some(rewards);
        self
    }

    /// Multi-turn rollouts: `environment` answers every assistant turn (the contract:
    /// [`super::environment`]) and its reward ([`RewardFn::environment`]) comes first. Without
    /// [`rewards`](Self::rewards) it is the only reward (`config.rewards` is for single-turn
    /// runs). `max_turns`, `turn_generations` and `max_conversation_length` bound the
    /// conversations.
    pub fn environment(mut self, environment: impl Environment + 'static) -> Self {
        self.environment = Some(Arc::new(environment));
        self
    }

    /// Continues a run from a folder written by [`crate::train::Trainer::save_checkpoint`]:
    /// policy weights, optimizer, state and the prompt order. Sync runs continue exactly as if
    /// never stopped (on CPU); async runs continue from the next unseen batch of prompts.
    pub fn resume(mut self, checkpoint: impl AsRef<Path>) -> Self {
        self.resume = Some(checkpoint.as_ref().to_path_buf());
        self
    }

    /// The config the trainer will run.
    pub fn config(&self) -> &GrpoConfig {
        &self.config
    }

    /// What is set beside the config: the rewards (given, or the config's built-ins), the
    /// environment and the checkpoint to continue.
    pub(crate) fn summary(&self) -> [(&'static str, String); 3] {
        let rewards = match &self.rewards {
            Some(r) => r.iter().map(|f| f.name.clone()).collect::<Vec<_>>().join(", "),
            None if self.environment.is_some() => "the environment's alone".into(),
            None => "the config's built-ins".into(),
        };
        let environment = self
            .environment
            .as_ref()
            .map_or("none (single-turn)".into(), |e| e.name().to_string());
        let resume = self
            .resume
            .as_ref()
            .map_or("no (a fresh run)".into(), |p| p.display().to_string());
        [
            ("rewards", rewards),
            ("environment", environment),
            ("resume from", resume),
        ]
    }

    /// Validates the config and the rewards, loads the policy (and the KL reference when
    /// `beta > 0`), the prompts and the held-out prompts, and starts the generation thread
    /// in async mode.
    pub fn build(self) -> Result<GrpoTrainer, TrainError> {
        let GrpoTrainerBuilder {
            config,
            rewards,
            environment,
            resume,
        } = self;
        config.validate()?;
        let resume = config.train.checkpoint_to_resume(resume.as_deref())?;
        let rewards = run_rewards(&config, rewards, environment.as_deref());
        check_rewards(&rewards)?;
        let mut core = TrainCore::load(&training_settings(&config), resume.as_deref(), &config)?;
        core.set_schedule(&config.train, config.max_steps);
        core.logs.set_settings(&config);
        let tools = environment.as_ref().and_then(|e| e.tools());
        let multi_turn = environment.map(|environment| MultiTurn {
            environment,
            max_turns: config.multi_turn.max_turns,
            turn_generations: config.multi_turn.turn_generations,
            max_conversation_length: config.multi_turn.max_conversation_length,
            fork_threshold_tokens: config.multi_turn.fork_threshold_tokens,
            prompt_field: config.rollouts.prompt_field.clone(),
            chat_template_kwargs: config.rollouts.chat_template_kwargs.clone(),
        });
        let dataset = TrainCore::open_dataset(&config.train)?;
        let prompts = Arc::new(super::eval::load_prompt_set(
            &config,
            &core.tokenizer,
            &dataset,
            tools.clone(),
        )?);
        check_columns(&rewards, &prompts, "dataset")?;
        if multi_turn.is_some() {
            check_conversation_room(&config, &prompts)?;
            let lm = &core.model.lm.config;
            lm.check_positions(config.multi_turn.max_conversation_length, "max_conversation_length")
                .map_err(|e| TrainError::config("max_conversation_length", e))?;
        }
        let generation = generation_config(&config, &core.special);
        let rewards = Arc::new(rewards);
        let producer = RolloutProducer::new(
            prompts.clone(),
            rewards.clone(),
            core.tokenizer.clone(),
            generation.clone(),
            BatchShape {
                group: config.rollouts.num_generations,
                // `prompts_per_step` is per process (TRL's per-device batch): the world's
                // batch is that many times the processes, each generating its share.
                per_batch: config.rollouts.prompts_per_step * core.world.size * config.rollouts.generation_steps()?,
                shard: Shard::from(&*core.world),
                scale: config.loss.scale_rewards,
                aggregation: config.loss.multi_objective_aggregation,
                seed: config.train.seed,
            },
        )
        .with_multi_turn(multi_turn.clone());
        let state = starting_state(&config, &mut core, &rewards, &prompts, resume.as_deref())?;
        let source = rollout_source(&config, &core, producer, &state)?;
        let (reference, pending) = carried_state(&config, &core, resume.as_deref(), state.global_step)?;
        let held_out = held_out_prompts(&config, &core, tools, &rewards)?;
        Ok(GrpoTrainer {
            state,
            prompts,
            last_row: None,
            last_batch: None,
            config,
            core,
            generation,
            reference,
            rewards,
            held_out,
            pending,
            source,
            multi_turn,
        })
    }
}

/// The shared settings the run loads its model with: `disable_dropout` zeroes LoRA's dropout.
fn training_settings(config: &GrpoConfig) -> std::borrow::Cow<'_, crate::train::TrainConfig> {
    match &config.train.lora {
        Some(lora) if config.update.disable_dropout && lora.lora_dropout != 0.0 => {
            let mut train = config.train.clone();
            train.lora = Some(crate::model::lora::LoraConfig {
                lora_dropout: 0.0,
                ..lora.clone()
            });
            std::borrow::Cow::Owned(train)
        }
        _ => std::borrow::Cow::Borrowed(&config.train),
    }
}

/// The KL reference (`beta > 0`) and the batches generated for later steps, as the checkpoint
/// being resumed (at `step`) left them.
fn carried_state(
    config: &GrpoConfig,
    core: &TrainCore,
    resume: Option<&Path>,
    step: u64,
) -> Result<(Option<Reference>, std::collections::VecDeque<super::RolloutBatch>), TrainError> {
    let reference = (config.reference.beta > 0.0).then(|| Reference::of(core)).transpose()?;
    if let (Some(r), Some(ckpt)) = (&reference, resume) {
        r.restore(ckpt, step, &config.reference)?;
    }
    let pending = match resume {
        Some(ckpt) => super::pending::read(ckpt)?,
        None => Default::default(),
    };
    Ok((reference, pending))
}

/// The `eval_dataset` prompts (none without one), their reward columns checked.
fn held_out_prompts(
    config: &GrpoConfig,
    core: &TrainCore,
    tools: Option<Value>,
    rewards: &[RewardFn],
) -> Result<Option<PromptSet>, TrainError> {
    let Some(path) = &config.eval.eval_dataset else {
        return Ok(None);
    };
    let held_out = super::eval::load_prompt_set(config, &core.tokenizer, &Dataset::open_held_out(path)?, tools)?;
    check_columns(rewards, &held_out, "eval_dataset")?;
    Ok(Some(held_out))
}

/// The run's rewards: the environment's first, then the given ones, else the built-ins named
/// in `config.rewards` (single-turn runs only).
fn run_rewards(
    config: &GrpoConfig,
    given: Option<Vec<RewardFn>>,
    environment: Option<&dyn Environment>,
) -> Vec<RewardFn> {
    match environment {
        Some(e) => std::iter::once(RewardFn::environment(e.name()))
            .chain(given.unwrap_or_default())
            .collect(),
        None => given.unwrap_or_else(|| builtin_rewards(config)),
    }
}

/// A fresh run's state, or the checkpoint's (the producer then skips the batches it consumed).
fn starting_state(
    config: &GrpoConfig,
    core: &mut TrainCore,
    rewards: &[RewardFn],
    prompts: &PromptSet,
    checkpoint: Option<&Path>,
) -> Result<GrpoState, TrainError> {
    let Some(ckpt) = checkpoint else {
        return Ok(GrpoState {
            total_steps: config.max_steps,
            reward_names: rewards.iter().map(|r| r.name.clone()).collect(),
            skipped_prompts: prompts.skipped,
            ..Default::default()
        });
    };
    let mut state: GrpoState = core.resume(ckpt, config.max_steps)?;
    // One batch a step at most (fewer with num_iterations): the prompt order is replayed up to
    // it, so a larger count is a corrupt file, not a position.
    if state.batches_consumed > state.global_step {
        return Err(TrainError::Checkpoint {
            path: ckpt.into(),
            message: format!(
                "trainer_state.json: `batches_consumed` is {}, more than the {} steps taken",
                state.batches_consumed, state.global_step
            ),
        });
    }
    state.total_steps = config.max_steps;
    Ok(state)
}

/// The producer in line (sync) or on a generation thread with a copy of the policy (async),
/// its prompt order and sampling seeds picking up after the batches the run consumed.
fn rollout_source(
    config: &GrpoConfig,
    core: &TrainCore,
    mut producer: RolloutProducer,
    state: &GrpoState,
) -> Result<Source, TrainError> {
    producer.skip_batches(state.batches_consumed);
    Ok(match config.rollouts.mode {
        RolloutMode::Sync => Source::Sync(Box::new(producer)),
        RolloutMode::Async => {
            let copy = core.copy_of_policy()?;
            let capacity = config.rollouts.queue_size * config.rollouts.prompts_per_step;
            Source::Async(AsyncRollouts::spawn(producer, copy, state.global_step, capacity))
        }
    })
}

/// Sampling settings of the run: EOS and padding from the tokenizer and `config.json`, the
/// run's temperature and truncation.
fn generation_config(config: &GrpoConfig, special: &SpecialTokens) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens: config.rollouts.max_completion_length,
        eos_token_ids: special.eos.clone(),
        pad_token_id: special.pad,
        prefill_chunk_size: config.rollouts.prefill_chunk_size,
        sampling: SamplingConfig {
            token_limit: special.token_limit,
            ..config.sampling_config()
        },
        ..Default::default()
    }
}

/// The built-in rewards named in `config.rewards`, weighted.
fn builtin_rewards(config: &GrpoConfig) -> Vec<RewardFn> {
    config
        .rewards
        .iter()
        .map(|spec| RewardFn::builtin(spec.name).with_weight(spec.weight))
        .collect()
}

/// At least one reward, every weight finite.
fn check_rewards(rewards: &[RewardFn]) -> Result<(), TrainError> {
    if rewards.is_empty() {
        return Err(TrainError::config("rewards", "no reward function"));
    }
    match rewards.iter().find(|r| !r.weight.is_finite()) {
        Some(r) => Err(TrainError::config(
            "rewards",
            format!("reward `{}` has weight {}", r.name, r.weight),
        )),
        None => Ok(()),
    }
}

/// Every reward's declared column is in every prompt row (else the run would score failures
/// or 0 on every rollout of those rows).
pub(super) fn check_columns(rewards: &[RewardFn], prompts: &PromptSet, which: &str) -> Result<(), TrainError> {
    for r in rewards {
        let Some(column) = r.needs_column() else { continue };
        if let Some(p) = prompts.prompts.iter().find(|p| !p.row.contains_key(column)) {
            return Err(TrainError::config(
                "rewards",
                format!(
                    "reward `{}` reads the `{column}` column, which {which} row {} (0-based) lacks",
                    r.name, p.dataset_row
                ),
            ));
        }
        // A list, an object or null would be compared as its JSON text: 0 on every rollout.
        let not_scalar = |v: &serde_json::Value| v.is_array() || v.is_object() || v.is_null();
        if let Some(p) = prompts
            .prompts
            .iter()
            .find(|p| p.row.get(column).is_some_and(not_scalar))
        {
            return Err(TrainError::config(
                "rewards",
                format!(
                    "reward `{}` reads the `{column}` column as one value, but {which} row {} (0-based) holds {}",
                    r.name, p.dataset_row, p.row[column]
                ),
            ));
        }
    }
    Ok(())
}

/// Refuses a multi-turn run whose conversation cache cannot hold its longest prompt (padded to
/// the prefill chunk) and a first turn.
fn check_conversation_room(config: &GrpoConfig, prompts: &PromptSet) -> Result<(), TrainError> {
    let chunk = config.rollouts.prefill_chunk_size.max(1) as usize;
    let longest = prompts.prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let need = longest.div_ceil(chunk) * chunk + config.rollouts.max_completion_length;
    if config.multi_turn.max_conversation_length < need {
        return Err(TrainError::config(
            "max_conversation_length",
            format!(
                "is {}: the longest prompt ({longest} tokens, padded to {chunk}) and a {}-token turn need {need}",
                config.multi_turn.max_conversation_length, config.rollouts.max_completion_length
            ),
        ));
    }
    Ok(())
}
