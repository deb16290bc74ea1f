//! The GRPO trainer: `step()` from a notebook cell, or `train_for(n)`.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::advantage::mean_std;
use super::reward::RewardFailure;
use super::worker::AsyncRollouts;
use super::{Environment, MultiTurn};
use super::{
    GrpoConfig, GrpoObjective, PromptSampler, PromptSet, RewardFn, RolloutBatch, RolloutMode, RolloutProducer, Shard,
    UpdateStats, accumulate_gradients, accumulate_share, pack_rollouts, plan_rank_update, with_entropy_floor,
};
use crate::data::Dataset;
use crate::generate::GenerationConfig;
use crate::model::{CausalLm, Model, SpecialTokens};
use crate::pack::{PackedRow, Packing};
use crate::tokenizer::Tokenizer;
use crate::train::distributed::World;
use crate::train::{TrainConfig, TrainCore, TrainError, Trainer};
use serde_json::Value;

/// Mean and spread of one reward function over a step's rollouts.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RewardStat {
    /// Function name.
    pub name: String,
    /// Mean over scored rollouts.
    pub mean: f64,
    /// Standard deviation over scored rollouts.
    pub std: f64,
}

impl RewardStat {
    /// The mean of the function called `name` among `stats` (a step's or an evaluation's).
    pub fn mean_in(stats: &[RewardStat], name: &str) -> Option<f64> {
        stats.iter().find(|r| r.name == name).map(|r| r.mean)
    }
}

/// Metrics of one GRPO step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GrpoStepMetrics {
    /// Step number (1-based).
    pub step: u64,
    /// Weight version that generated the batch (its oldest group).
    pub generated_by: u64,
    /// Steps between generation and this update (of the oldest group).
    pub staleness: u64,
    /// Groups dropped as too stale while this step's batch was assembled.
    pub dropped_stale: usize,
    /// Mean total (weighted) reward.
    pub reward_mean: f64,
    /// Spread of the total reward.
    pub reward_std: f64,
    /// Per reward function.
    pub rewards: Vec<RewardStat>,
    /// Rollouts some reward function failed on (advantage 0).
    pub reward_failures: usize,
    /// Mean completion length: tokens the model generated (multi-turn: over all its turns,
    /// the environment's messages not counted).
    pub completion_length: f64,
    /// Longest completion.
    pub completion_length_max: usize,
    /// Shortest completion.
    #[serde(default)]
    pub completion_length_min: usize,
    /// Share of groups whose rewards were all equal: zero advantages, no gradient (TRL's
    /// `frac_reward_zero_std`).
    #[serde(default)]
    pub frac_reward_zero_std: f64,
    /// Share of completions cut at `max_completion_length`.
    pub truncated_ratio: f64,
    /// The loss.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Share of loss terms in the clip region (`clip_ratio/region_mean`).
    pub clip_ratio: f64,
    /// Share clipped below: ratio under `1 - epsilon_low` with a negative advantage.
    #[serde(default)]
    pub clip_ratio_low: f64,
    /// Share clipped above: ratio over `1 + epsilon_high` with a positive advantage.
    #[serde(default)]
    pub clip_ratio_high: f64,
    /// Mean `k3(generator, policy)` per term.
    pub approx_kl: f64,
    /// Mean `k3(reference, policy)` per term (0 when `beta = 0`).
    pub kl: f64,
    /// Mean policy entropy per term.
    pub entropy: f64,
    /// Mean sampling-correction weight per term (1 without `importance_sampling_correction`).
    #[serde(default)]
    pub sampling_correction: f64,
    /// Raw tokens / forwarded tokens of the update.
    pub packing_ratio: f64,
    /// Tokens forwarded by the update (unique tokens for trees).
    pub forwarded_tokens: usize,
    /// Prompt + completion tokens of every rollout.
    pub raw_tokens: usize,
    /// Packed rows.
    pub rows: usize,
    /// Seconds generating this batch (on the generation thread in async mode).
    pub generation_s: f64,
    /// Seconds the trainer waited for a batch (async).
    pub wait_s: f64,
    /// Seconds scoring.
    pub reward_s: f64,
    /// Seconds packing.
    pub pack_s: f64,
    /// Seconds in forward + backward.
    pub forward_backward_s: f64,
    /// Seconds in clipping and the optimizer step.
    pub optimizer_s: f64,
    /// Wall seconds of the whole step (as the trainer saw it).
    pub step_s: f64,
    /// Generated tokens per second of generation.
    pub generation_tokens_per_s: f64,
    /// Raw (rollout) tokens per second of forward + backward.
    pub training_tokens_per_s: f64,
    /// Whether the update was skipped (non-finite loss or gradient norm: the weights are left
    /// untouched, the step counts in `skipped_steps`).
    pub skipped: bool,
}

/// One completion kept for the display.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SampleCompletion {
    /// Step that trained on it.
    pub step: u64,
    /// Dataset row of the prompt.
    pub dataset_row: usize,
    /// The prompt: the last message of a conversation, else the prompt text.
    pub prompt: String,
    /// The completion text.
    pub completion: String,
    /// Per reward function (None: failed).
    pub rewards: Vec<Option<f32>>,
    /// Weighted total.
    pub total: Option<f32>,
    /// Its advantage.
    pub advantage: f32,
}

/// Where the run is.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct GrpoState {
    /// Optimizer steps done (= the policy's weight version).
    pub global_step: u64,
    /// Steps of the run.
    pub total_steps: u64,
    /// Reward function names, in metric order.
    pub reward_names: Vec<String>,
    /// Every step's metrics.
    pub history: Vec<GrpoStepMetrics>,
    /// Groups dropped as older than `max_staleness`.
    pub dropped_stale: usize,
    /// Weight syncs forced because every queued batch would have been too stale.
    pub forced_syncs: usize,
    /// Reward failures of the latest step.
    pub recent_failures: Vec<RewardFailure>,
    /// Reward failures of the run.
    pub total_failures: usize,
    /// Completions of the latest step, for the display.
    pub samples: Vec<SampleCompletion>,
    /// Prompt rows skipped as unusable.
    pub skipped_prompts: usize,
    /// Steps skipped as non-finite.
    pub skipped_steps: usize,
    /// Batches taken from the rollout source (trained on or dropped): where a resumed run's
    /// prompt order continues.
    pub batches_consumed: u64,
}

enum Source {
    Sync(Box<RolloutProducer>),
    Async(AsyncRollouts),
}

/// The reference of the KL term: with LoRA the policy's base, sharing its tensors; else the
/// starting weights loaded again.
fn reference_of(core: &TrainCore) -> Result<CausalLm, TrainError> {
    Ok(match core.model.adapter {
        Some(_) => core.model.base_view()?,
        None => Model::load(&core.model_dir, core.load_options)?.lm,
    })
}

/// GRPO on one process: policy, optional frozen reference, rewards, optimizer and rollouts.
///
/// The configuration is fixed once built ([`GrpoTrainer::config`] reads it): in async mode a
/// generation thread already works from it, so a change could not reach both sides alike.
pub struct GrpoTrainer {
    /// Progress and metrics.
    pub state: GrpoState,
    /// The prompts.
    pub prompts: Arc<PromptSet>,
    /// The latest update's packed rows' last row (its prefix tree is displayed).
    pub last_row: Option<PackedRow>,
    /// The latest batch trained on.
    pub last_batch: Option<RolloutBatch>,
    config: GrpoConfig,
    core: TrainCore,
    generation: GenerationConfig,
    /// The frozen reference of the KL term: a loaded copy of the starting weights, or with
    /// LoRA the policy's own base tensors with the adapter off (no copy).
    reference: Option<CausalLm>,
    rewards: Arc<Vec<RewardFn>>,
    held_out: Option<PromptSet>,
    /// A batch with optimizer steps left (`num_iterations > 1`).
    pending: Option<(RolloutBatch, usize)>,
    source: Source,
    /// Multi-turn rollouts (a trainer built with an environment).
    multi_turn: Option<MultiTurn>,
}

impl std::fmt::Debug for GrpoTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpoTrainer")
            .field("global_step", &self.state.global_step)
            .field("rewards", &self.rewards)
            .finish_non_exhaustive()
    }
}

impl GrpoTrainer {
    /// A trainer with the built-in rewards named in `config.rewards`.
    pub fn new(config: GrpoConfig) -> Result<Self, TrainError> {
        let rewards = builtin_rewards(&config);
        Self::with_rewards(config, rewards)
    }

    /// A trainer with the given reward functions (closures; `config.rewards` is ignored).
    pub fn with_rewards(config: GrpoConfig, rewards: Vec<RewardFn>) -> Result<Self, TrainError> {
        Self::build(config, rewards, None, None)
    }

    /// A trainer of multi-turn rollouts: `environment` answers every assistant turn (the
    /// contract: [`super::environment`]); its reward ([`RewardFn::environment`]) comes first,
    /// then `rewards`, which see each whole conversation as the completion. `max_turns`,
    /// `turn_generations` and `max_conversation_length` of `config` bound the conversations.
    pub fn with_environment(
        config: GrpoConfig,
        environment: impl Environment + 'static,
        rewards: Vec<RewardFn>,
    ) -> Result<Self, TrainError> {
        Self::build_with_environment(config, Arc::new(environment), rewards, None)
    }

    /// [`GrpoTrainer::with_environment`], continuing from a checkpoint.
    pub fn resume_with_environment(
        config: GrpoConfig,
        environment: impl Environment + 'static,
        rewards: Vec<RewardFn>,
        checkpoint: &Path,
    ) -> Result<Self, TrainError> {
        Self::build_with_environment(config, Arc::new(environment), rewards, Some(checkpoint))
    }

    /// The environment's reward first, then `rewards`.
    fn build_with_environment(
        config: GrpoConfig,
        environment: Arc<dyn Environment>,
        rewards: Vec<RewardFn>,
        checkpoint: Option<&Path>,
    ) -> Result<Self, TrainError> {
        let all = std::iter::once(RewardFn::environment(environment.name()))
            .chain(rewards)
            .collect();
        Self::build(config, all, checkpoint, Some(environment))
    }

    /// Continues a run from a folder written by [`Trainer::save_checkpoint`] with the
    /// built-in rewards of `config`: policy weights, optimizer, state and the prompt order.
    /// Sync runs continue exactly as if never stopped (on CPU); async runs continue from the
    /// next unseen batch of prompts.
    pub fn resume_from(config: GrpoConfig, checkpoint: &Path) -> Result<Self, TrainError> {
        let rewards = builtin_rewards(&config);
        Self::build(config, rewards, Some(checkpoint), None)
    }

    /// [`GrpoTrainer::resume_from`] with the given reward functions.
    pub fn resume_with_rewards(
        config: GrpoConfig,
        rewards: Vec<RewardFn>,
        checkpoint: &Path,
    ) -> Result<Self, TrainError> {
        Self::build(config, rewards, Some(checkpoint), None)
    }

    fn build(
        config: GrpoConfig,
        rewards: Vec<RewardFn>,
        checkpoint: Option<&Path>,
        environment: Option<Arc<dyn Environment>>,
    ) -> Result<Self, TrainError> {
        config.validate()?;
        check_rewards(&rewards)?;
        let mut core = TrainCore::load(&config.train, checkpoint)?;
        core.set_schedule(&config.train, config.max_steps);
        let tools = environment.as_ref().and_then(|e| e.tools());
        let multi_turn = environment.map(|environment| MultiTurn {
            environment,
            max_turns: config.max_turns,
            turn_generations: config.turn_generations,
            max_conversation_length: config.max_conversation_length,
            prompt_field: config.prompt_field.clone(),
        });
        let prompts = Arc::new(load_prompt_set(
            &config,
            &core.tokenizer,
            &TrainCore::open_dataset(&config.train)?,
            tools.clone(),
        )?);
        check_columns(&rewards, &prompts, "dataset")?;
        if multi_turn.is_some() {
            check_conversation_room(&config, &prompts)?;
            core.model
                .lm
                .config
                .check_positions(config.max_conversation_length, "max_conversation_length")
                .map_err(|e| TrainError::config("max_conversation_length", e))?;
        }
        let generation = generation_config(&config, &core.special);
        let rewards = Arc::new(rewards);
        let mut producer = RolloutProducer {
            prompts: prompts.clone(),
            rewards: rewards.clone(),
            tokenizer: core.tokenizer.clone(),
            generation: generation.clone(),
            group: config.num_generations,
            // `prompts_per_step` is per process (TRL's per-device batch): the world's batch is
            // that many times the processes, each generating its share.
            per_batch: config.prompts_per_step * core.world.size,
            shard: Shard::from(&core.world),
            scale: config.scale_rewards,
            sampler: PromptSampler::new(prompts.prompts.len(), config.train.seed),
            produced: 0,
            generator: Default::default(),
            multi_turn: multi_turn.clone(),
        };
        let mut state = GrpoState {
            total_steps: config.max_steps,
            reward_names: rewards.iter().map(|r| r.name.clone()).collect(),
            skipped_prompts: prompts.skipped,
            ..Default::default()
        };
        if let Some(ckpt) = checkpoint {
            state = core.resume(ckpt, config.max_steps)?;
            state.total_steps = config.max_steps;
            // The prompt order and sampling seeds pick up after the last batch the run consumed.
            for _ in 0..state.batches_consumed {
                producer.sampler.take(producer.per_batch);
            }
            producer.produced = state.batches_consumed;
        }
        let source = match config.mode {
            RolloutMode::Sync => Source::Sync(Box::new(producer)),
            RolloutMode::Async => {
                let copy = core.copy_of_policy()?;
                let capacity = config.queue_size * config.prompts_per_step;
                Source::Async(AsyncRollouts::spawn(producer, copy, state.global_step, capacity))
            }
        };
        let reference = (config.beta > 0.0).then(|| reference_of(&core)).transpose()?;
        let held_out = match &config.eval_dataset {
            Some(path) => Some(load_prompt_set(&config, &core.tokenizer, &Dataset::open(path)?, tools)?),
            None => None,
        };
        if let Some(h) = &held_out {
            check_columns(&rewards, h, "eval_dataset")?;
        }
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
            pending: None,
            source,
            multi_turn,
        })
    }

    /// The configuration (fixed once built).
    pub fn config(&self) -> &GrpoConfig {
        &self.config
    }

    /// The policy.
    pub fn model(&self) -> &Model {
        &self.core.model
    }

    /// Its tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.core.tokenizer
    }

    /// The frozen reference of the KL term (`beta > 0`): with LoRA the policy's base tensors
    /// with the adapter off.
    pub fn reference(&self) -> Option<&CausalLm> {
        self.reference.as_ref()
    }

    /// The loss of the run.
    pub fn objective(&self) -> GrpoObjective {
        GrpoObjective::from(&self.config)
    }

    /// Async mode: the generation thread and its queue.
    pub fn async_rollouts(&self) -> Option<&AsyncRollouts> {
        match &self.source {
            Source::Async(a) => Some(a),
            Source::Sync(_) => None,
        }
    }

    /// Sync mode: the generator's shape ledger (prefill and decode shapes so far).
    pub fn generation_shapes(&self) -> Option<&crate::shapes::ShapeLedger> {
        match &self.source {
            Source::Sync(p) => Some(&p.generator.ledger),
            Source::Async(_) => None,
        }
    }

    /// The next batch to train on: generated now (sync), or assembled from the oldest queued
    /// groups that are at most `max_staleness` versions old (async; older ones are dropped and
    /// counted).
    fn next_batch(&mut self) -> Result<(RolloutBatch, f64, usize), TrainError> {
        let version = self.state.global_step;
        match &mut self.source {
            Source::Sync(p) => {
                let mut batch = p.produce(&self.core.model.lm, version)?.gather(&self.core.world)?;
                batch.scale_advantages(self.config.scale_rewards);
                self.state.batches_consumed += 1;
                Ok((batch, 0.0, 0))
            }
            Source::Async(a) => {
                let (mut wait, mut dropped) = (0.0, 0);
                let mut groups = Vec::with_capacity(self.config.prompts_per_step);
                while groups.len() < self.config.prompts_per_step {
                    let t = Instant::now();
                    let queued = a.next()?;
                    wait += t.elapsed().as_secs_f64();
                    if version - queued.group.version.min(version) <= self.config.max_staleness {
                        groups.push(queued);
                        continue;
                    }
                    dropped += 1;
                    self.state.dropped_stale += 1;
                    // Until the generator has weights recent enough, all it makes is dropped.
                    if version - a.published() > self.config.max_staleness {
                        a.publish(version, self.core.model.trainable());
                        self.state.forced_syncs += 1;
                    }
                }
                let mut batch =
                    RolloutBatch::from_groups(self.state.batches_consumed, groups, self.state.reward_names.clone())
                        .gather(&self.core.world)?;
                batch.scale_advantages(self.config.scale_rewards);
                self.state.batches_consumed += 1;
                Ok((batch, wait, dropped))
            }
        }
    }

    /// The batch of this step: the pending one again (`num_iterations > 1`), else the next.
    fn take_batch(&mut self) -> Result<(RolloutBatch, f64, usize), TrainError> {
        if let Some((batch, left)) = self.pending.take() {
            if left > 1 {
                self.pending = Some((batch.clone(), left - 1));
            }
            return Ok((batch, 0.0, 0));
        }
        let next = self.next_batch()?;
        if self.config.num_iterations > 1 {
            self.pending = Some((next.0.clone(), self.config.num_iterations - 1));
        }
        Ok(next)
    }

    /// One GRPO step: a batch of `prompts_per_step x num_generations` scored rollouts, one
    /// packed update, one optimizer step.
    pub fn step(&mut self) -> Result<GrpoStepMetrics, TrainError> {
        crate::device::privateuse1::checked(self.core.model.device(), || self.step_here())
    }

    fn step_here(&mut self) -> Result<GrpoStepMetrics, TrainError> {
        let start = Instant::now();
        let (batch, wait_s, dropped) = self.take_batch()?;
        let version = self.state.global_step;
        let t = Instant::now();
        let rollouts = batch.rollouts_for_update(self.config.mask_truncated_completions);
        let world = &self.core.world;
        let update = plan_rank_update(
            rollouts,
            self.config.packing,
            self.config.token_budget,
            world.rank,
            world.size,
        )?;
        let pack_s = t.elapsed().as_secs_f64();
        let training = self.core.model.training();
        let accumulated =
            with_entropy_floor(&self.core.model.lm, &update.rows, self.objective(), world).and_then(|objective| {
                accumulate_share(
                    &self.core.model.lm,
                    self.reference.as_ref(),
                    &update.rows,
                    update.totals,
                    &objective,
                )
            });
        drop(training);
        // Rows before the failure left gradients behind: the next step must not see them.
        let mut stats = accumulated.inspect_err(|_| self.core.optim.discard_gradients())?;
        sum_over_ranks(&mut stats, world)?;
        let rows = update.rows;
        let t = Instant::now();
        let prompt_rows = || batch.groups.iter().map(|g| g.dataset_row).collect();
        let outcome =
            self.core
                .optim
                .finish_step(&self.core.world, &self.config.train, version, stats.loss, prompt_rows)?;
        self.state.skipped_steps += usize::from(outcome.skipped);
        let optimizer_s = t.elapsed().as_secs_f64();
        self.state.global_step = version + 1;
        if let Source::Async(a) = &mut self.source
            && self.state.global_step.is_multiple_of(self.config.weight_sync_steps)
        {
            a.publish(self.state.global_step, self.core.model.trainable());
        }
        let m = GrpoStepMetrics {
            staleness: version - batch.version.min(version),
            dropped_stale: dropped,
            wait_s,
            pack_s,
            optimizer_s,
            step_s: start.elapsed().as_secs_f64(),
            ..self.metrics(&batch, &stats, update.step_rows, outcome)
        };
        self.record(&batch, &m);
        self.last_row = rows.into_iter().last();
        self.last_batch = Some(batch);
        Ok(m)
    }

    /// The update of `batch` under `packing`, timed `repeats` times (best forward + backward in
    /// seconds, and the last run's statistics); the gradients are cleared afterwards, so the
    /// weights and the next step are untouched. What the demo and the benches compare.
    pub fn measure_update(
        &self,
        batch: &RolloutBatch,
        packing: Packing,
        repeats: usize,
    ) -> Result<(f64, UpdateStats), TrainError> {
        let rollouts = batch.rollouts_for_update(self.config.mask_truncated_completions);
        let rows = pack_rollouts(rollouts, packing, self.config.token_budget)?;
        let (mut best, mut last) = (f64::INFINITY, UpdateStats::default());
        for _ in 0..repeats.max(1) {
            let run = accumulate_gradients(&self.core.model.lm, None, &rows, &self.objective());
            self.core.optim.discard_gradients();
            last = run?;
            best = best.min(last.forward_backward_s);
        }
        Ok((best, last))
    }

    fn metrics(
        &self,
        batch: &RolloutBatch,
        stats: &UpdateStats,
        rows: usize,
        outcome: crate::train::StepOutcome,
    ) -> GrpoStepMetrics {
        let totals: Vec<f64> = batch.totals().flatten().map(f64::from).collect();
        let (reward_mean, reward_std) = mean_std(&totals);
        let rewards = reward_stats(batch, &self.rewards);
        let lengths: Vec<usize> = batch
            .groups
            .iter()
            .flat_map(|g| (0..g.completions.len()).map(|i| g.generated_tokens(i)))
            .collect();
        let n = lengths.len().max(1) as f64;
        let truncated = batch
            .groups
            .iter()
            .flat_map(|g| &g.completions)
            .filter(|c| c.finish_reason == crate::generate::FinishReason::Length)
            .count();
        GrpoStepMetrics {
            step: self.state.global_step,
            generated_by: batch.version,
            staleness: 0,
            dropped_stale: 0,
            reward_mean,
            reward_std,
            rewards,
            reward_failures: batch.totals().filter(Option::is_none).count(),
            completion_length: lengths.iter().sum::<usize>() as f64 / n,
            completion_length_max: lengths.iter().copied().max().unwrap_or(0),
            completion_length_min: lengths.iter().copied().min().unwrap_or(0),
            frac_reward_zero_std: batch.frac_reward_zero_std(),
            truncated_ratio: truncated as f64 / n,
            loss: stats.loss,
            grad_norm: outcome.grad_norm,
            lr: outcome.lr,
            clip_ratio: stats.clip_ratio,
            clip_ratio_low: stats.clip_ratio_low,
            clip_ratio_high: stats.clip_ratio_high,
            approx_kl: stats.approx_kl,
            kl: stats.ref_kl,
            entropy: stats.entropy,
            sampling_correction: stats.sampling_correction,
            packing_ratio: stats.packing_ratio(),
            forwarded_tokens: stats.forwarded_tokens,
            raw_tokens: stats.raw_tokens,
            rows,
            generation_s: batch.generation_s,
            wait_s: 0.0,
            reward_s: batch.reward_s,
            pack_s: 0.0,
            forward_backward_s: stats.forward_backward_s,
            optimizer_s: 0.0,
            step_s: 0.0,
            generation_tokens_per_s: batch.generated_tokens as f64 / batch.generation_s.max(1e-9),
            training_tokens_per_s: stats.raw_tokens as f64 / stats.forward_backward_s.max(1e-9),
            skipped: outcome.skipped,
        }
    }

    fn record(&mut self, batch: &RolloutBatch, m: &GrpoStepMetrics) {
        self.state.recent_failures = batch.groups.iter().flat_map(|g| g.rewards.failures.clone()).collect();
        self.state.total_failures += m.reward_failures;
        // The samples: completions taken round-robin across groups.
        let mut samples = Vec::new();
        let most = batch.groups.iter().map(|g| g.completions.len()).max().unwrap_or(0);
        'fill: for i in 0..most {
            for g in &batch.groups {
                if samples.len() >= self.config.log_completions {
                    break 'fill;
                }
                if i < g.completions.len() {
                    samples.push(SampleCompletion {
                        step: m.step,
                        dataset_row: g.dataset_row,
                        prompt: prompt_summary(&self.prompts.prompts[g.prompt], &self.config.prompt_field),
                        completion: g.texts[i].clone(),
                        rewards: g.rewards.per_function.iter().map(|f| f[i]).collect(),
                        total: g.rewards.total[i],
                        advantage: g.advantages[i],
                    });
                }
            }
        }
        self.state.samples = samples;
        self.state.history.push(m.clone());
        self.core.log(&self.config.train, m);
    }

    /// Reward functions of the run.
    pub fn rewards(&self) -> &[RewardFn] {
        &self.rewards
    }

    /// Prompts of another file or folder (a held-out split), read like the training prompts.
    pub fn load_prompts(&self, path: &Path) -> Result<PromptSet, TrainError> {
        let tools = self.multi_turn.as_ref().and_then(|m| m.environment.tools());
        load_prompt_set(&self.config, &self.core.tokenizer, &Dataset::open(path)?, tools)
    }

    /// Mean rewards of the current policy on `prompts`: `samples` completions per prompt at the
    /// run's sampling settings with a fixed `seed` (so two calls differ only by the weights),
    /// or one greedy completion when `samples` is 0. Multi-turn: one conversation per sample
    /// (no forks after a turn).
    pub fn evaluate(&self, prompts: &PromptSet, samples: usize, seed: u64) -> Result<EvalResult, TrainError> {
        let mut generation = self.generation.clone();
        generation.sampling.seed = seed;
        generation.sampling.do_sample = samples > 0;
        let mut producer = RolloutProducer {
            prompts: Arc::new(prompts.clone()),
            rewards: self.rewards.clone(),
            tokenizer: self.core.tokenizer.clone(),
            generation,
            group: samples.max(1),
            per_batch: prompts.prompts.len(),
            shard: Shard::from(&self.core.world),
            scale: self.config.scale_rewards,
            sampler: PromptSampler::new(prompts.prompts.len(), seed),
            produced: 0,
            generator: Default::default(),
            // One conversation per sample: forks would weigh conversations that go on more.
            multi_turn: self.multi_turn.clone().map(|m| MultiTurn {
                turn_generations: 1,
                ..m
            }),
        };
        let batch = producer
            .produce(&self.core.model.lm, self.state.global_step)?
            .gather(&self.core.world)?;
        Ok(EvalResult::from_batch(&batch, &self.rewards, self.state.global_step))
    }

    /// [`evaluate`](Self::evaluate) on each part of `prompts` that shares a value of `column`, a
    /// string column of the prompt rows (the shipped prompts' `task`): which kinds of prompt a
    /// run has learnt, not only how many. Parts in order of first appearance; every part is
    /// sampled with the same `seed`. A row without a string `column` is an error naming it.
    pub fn evaluate_by(
        &self,
        prompts: &PromptSet,
        column: &str,
        samples: usize,
        seed: u64,
    ) -> Result<EvalBreakdown, TrainError> {
        let mut parts: Vec<(String, PromptSet)> = Vec::new();
        for p in &prompts.prompts {
            let Some(value) = p.row.get(column).and_then(|v| v.as_str()) else {
                return Err(TrainError::Data(format!(
                    "prompt row {} has no string column `{column}` to group the evaluation by",
                    p.dataset_row
                )));
            };
            match parts.iter_mut().find(|(v, _)| v == value) {
                Some((_, part)) => part.prompts.push(p.clone()),
                None => parts.push((
                    value.to_string(),
                    PromptSet {
                        prompts: vec![p.clone()],
                        skipped: 0,
                    },
                )),
            }
        }
        let parts = parts
            .into_iter()
            .map(|(value, part)| Ok((value, self.evaluate(&part, samples, seed)?)))
            .collect::<Result<Vec<_>, TrainError>>()?;
        Ok(EvalBreakdown {
            column: column.to_string(),
            parts,
        })
    }
}

/// Held-out results per value of a prompt column ([`GrpoTrainer::evaluate_by`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EvalBreakdown {
    /// The column the prompts were grouped by.
    pub column: String,
    /// Each value with the evaluation of its prompts.
    pub parts: Vec<(String, EvalResult)>,
}

impl EvalBreakdown {
    /// The mean of reward function `name` for each value (0 where the run has no such function).
    pub fn means(&self, name: &str) -> Vec<(String, f64)> {
        self.parts
            .iter()
            .map(|(v, e)| (v.clone(), RewardStat::mean_in(&e.per_function, name).unwrap_or(0.0)))
            .collect()
    }
}

/// Every rank's update statistics summed (each rank's are its share of the step's means, as
/// [`accumulate_share`] divides by the step's totals); timings stay this rank's.
fn sum_over_ranks(stats: &mut UpdateStats, world: &World) -> Result<(), TrainError> {
    if !world.is_distributed() {
        return Ok(());
    }
    let mut v = [
        stats.loss,
        stats.clip_ratio,
        stats.clip_ratio_low,
        stats.clip_ratio_high,
        stats.approx_kl,
        stats.ref_kl,
        stats.entropy,
        stats.sampling_correction,
        stats.forwarded_tokens as f64,
        stats.raw_tokens as f64,
        stats.rows as f64,
    ];
    world.sum(&mut v)?;
    let [
        loss,
        clip,
        clip_low,
        clip_high,
        approx_kl,
        ref_kl,
        entropy,
        correction,
        forwarded,
        raw,
        rows,
    ] = v;
    *stats = UpdateStats {
        loss,
        clip_ratio: clip,
        clip_ratio_low: clip_low,
        clip_ratio_high: clip_high,
        approx_kl,
        ref_kl,
        entropy,
        sampling_correction: correction,
        forwarded_tokens: forwarded as usize,
        raw_tokens: raw as usize,
        rows: rows as usize,
        ..stats.clone()
    };
    Ok(())
}

impl Trainer for GrpoTrainer {
    type Config = GrpoConfig;
    type Metrics = GrpoStepMetrics;
    type Eval = EvalResult;
    type State = GrpoState;

    fn from_config(config: GrpoConfig, resume_from: Option<&Path>) -> Result<Self, TrainError> {
        let rewards = builtin_rewards(&config);
        Self::build(config, rewards, resume_from, None)
    }
    fn step(&mut self) -> Result<GrpoStepMetrics, TrainError> {
        GrpoTrainer::step(self)
    }
    fn core(&self) -> &TrainCore {
        &self.core
    }
    fn train_config(&self) -> &TrainConfig {
        &self.config.train
    }
    fn state(&self) -> &GrpoState {
        &self.state
    }
    /// `eval_samples` completions per prompt of `eval_dataset`, seeded so that evaluations
    /// differ only by the weights.
    fn evaluate_held_out(&mut self) -> Result<Option<EvalResult>, TrainError> {
        match &self.held_out {
            Some(prompts) => self
                .evaluate(prompts, self.config.eval_samples, self.config.train.seed ^ 0xe7a1)
                .map(Some),
            None => Ok(None),
        }
    }
    /// Aligned step numbers and every reward function, for a terminal scrolling through a run.
    fn log_line(&self, m: &GrpoStepMetrics) -> String {
        let per_fn: Vec<String> = m.rewards.iter().map(|r| format!("{} {:.2}", r.name, r.mean)).collect();
        format!(
            "step {:>4}: reward {:.3} ({}) flat {:.2} len {:.1} loss {:+.4} clip {:.3} kl~ {:.1e} ent {:.2} pack {:.2}x stale {} | gen {:.2}s fwd/bwd {:.2}s\n",
            m.step,
            m.reward_mean,
            per_fn.join(", "),
            m.frac_reward_zero_std,
            m.completion_length,
            m.loss,
            m.clip_ratio,
            m.approx_kl,
            m.entropy,
            m.packing_ratio,
            m.staleness,
            m.generation_s,
            m.forward_backward_s
        )
    }
    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "{} prompts ({} skipped), {} steps of {} prompts x {} completions, {} rollouts, {} packing",
            self.prompts.prompts.len(),
            self.state.skipped_prompts,
            self.state.total_steps,
            c.prompts_per_step,
            c.num_generations,
            crate::display::serde_name(&c.mode),
            crate::display::serde_name(&c.packing)
        )
    }
}

/// Mean rewards of the policy on held-out prompts.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EvalResult {
    /// Policy version evaluated.
    pub step: u64,
    /// Completions scored.
    pub completions: usize,
    /// Mean weighted total.
    pub reward_mean: f64,
    /// Its spread.
    pub reward_std: f64,
    /// Per function.
    pub per_function: Vec<RewardStat>,
}

/// Mean and spread of every reward function over a batch.
fn reward_stats(batch: &RolloutBatch, rewards: &[RewardFn]) -> Vec<RewardStat> {
    rewards
        .iter()
        .enumerate()
        .map(|(f, r)| {
            let v: Vec<f64> = batch
                .groups
                .iter()
                .flat_map(|g| g.rewards.per_function[f].iter().flatten().map(|&x| f64::from(x)))
                .collect();
            let (mean, std) = mean_std(&v);
            RewardStat {
                name: r.name.clone(),
                mean,
                std,
            }
        })
        .collect()
}

impl EvalResult {
    fn from_batch(batch: &RolloutBatch, rewards: &[RewardFn], step: u64) -> Self {
        let totals: Vec<f64> = batch.totals().flatten().map(f64::from).collect();
        let (reward_mean, reward_std) = mean_std(&totals);
        EvalResult {
            step,
            completions: totals.len(),
            reward_mean,
            reward_std,
            per_function: reward_stats(batch, rewards),
        }
    }
}

/// Sampling settings of the run: EOS and padding from the tokenizer and `config.json`, the
/// run's temperature and truncation.
fn generation_config(config: &GrpoConfig, special: &SpecialTokens) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens: config.max_completion_length,
        eos_token_ids: special.eos.clone(),
        pad_token_id: special.pad,
        prefill_chunk_size: config.prefill_chunk_size,
        sampling: config.sampling(),
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
fn check_columns(rewards: &[RewardFn], prompts: &PromptSet, which: &str) -> Result<(), TrainError> {
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
    }
    Ok(())
}

/// The prompts of `ds`, read as the run's config says.
/// Refuses a multi-turn run whose conversation cache cannot hold its longest prompt (padded to
/// the prefill chunk) and a first turn.
fn check_conversation_room(config: &GrpoConfig, prompts: &PromptSet) -> Result<(), TrainError> {
    let chunk = config.prefill_chunk_size.max(1) as usize;
    let longest = prompts.prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let need = longest.div_ceil(chunk) * chunk + config.max_completion_length;
    if config.max_conversation_length < need {
        return Err(TrainError::config(
            "max_conversation_length",
            format!(
                "is {}: the longest prompt ({longest} tokens, padded to {chunk}) and a {}-token turn need {need}",
                config.max_conversation_length, config.max_completion_length
            ),
        ));
    }
    Ok(())
}

fn load_prompt_set(
    config: &GrpoConfig,
    tokenizer: &Tokenizer,
    ds: &Dataset,
    tools: Option<Value>,
) -> Result<PromptSet, TrainError> {
    PromptSet::load_with_tools(
        ds,
        tokenizer,
        &config.prompt_field,
        config.max_prompt_length,
        config.train.skip_invalid_rows,
        tools,
    )
}

/// What a person asked: the last message's content of a conversational prompt, else the text.
fn prompt_summary(prompt: &super::PromptRow, field: &str) -> String {
    prompt
        .row
        .get(field)
        .and_then(|v| v.as_array()?.last()?.get("content")?.as_str().map(str::to_string))
        .unwrap_or_else(|| prompt.text.clone())
}

crate::train::run_state!(GrpoState);
