//! The GRPO trainer: `step()` from a notebook cell, or `train_for(n)`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::advantage::mean_std;
use super::reward::RewardFailure;
use super::worker::AsyncRollouts;
use super::{
    GrpoConfig, GrpoError, PromptSampler, PromptSet, RewardFn, RolloutBatch, RolloutMode, RolloutProducer,
    accumulate_gradients_with, other, pack_rollouts,
};
use crate::data::Dataset;
use crate::generate::{GenerationConfig, SamplingConfig};
use crate::model::{LoadOptions, LogprobChunks, Model};
use crate::pack::{GrpoLossConfig, PackedRow};
use crate::tokenizer::Tokenizer;
use crate::train::{AdamW, LrSchedule};

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
    /// Mean completion length (tokens).
    pub completion_length: f64,
    /// Longest completion.
    pub completion_length_max: usize,
    /// Share of completions cut at `max_completion_length`.
    pub truncated_ratio: f64,
    /// The loss.
    pub loss: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Share of loss terms in the clip region.
    pub clip_ratio: f64,
    /// Mean `k3(generator, policy)` per term.
    pub approx_kl: f64,
    /// Mean `k3(reference, policy)` per term (0 when `beta = 0`).
    pub kl: f64,
    /// Mean policy entropy per term.
    pub entropy: f64,
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

/// GRPO on one process: policy, optional frozen reference, rewards, optimizer and rollouts.
pub struct GrpoTrainer {
    /// The configuration.
    pub config: GrpoConfig,
    /// The policy.
    pub model: Model,
    /// Its tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Progress and metrics.
    pub state: GrpoState,
    /// The prompts.
    pub prompts: Arc<PromptSet>,
    /// The latest update's packed rows' last row (its prefix tree is displayed).
    pub last_row: Option<PackedRow>,
    /// The latest batch trained on.
    pub last_batch: Option<RolloutBatch>,
    generation: GenerationConfig,
    reference: Option<Model>,
    rewards: Arc<Vec<RewardFn>>,
    /// A batch with optimizer steps left (`num_iterations > 1`).
    pending: Option<(RolloutBatch, usize)>,
    optimizer: AdamW,
    schedule: LrSchedule,
    source: Source,
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
    pub fn new(config: GrpoConfig) -> Result<Self, GrpoError> {
        let rewards = builtin_rewards(&config)?;
        Self::with_rewards(config, rewards)
    }

    /// A trainer with the given reward functions (closures; `config.rewards` is ignored).
    pub fn with_rewards(config: GrpoConfig, rewards: Vec<RewardFn>) -> Result<Self, GrpoError> {
        Self::build(config, rewards, None)
    }

    /// Continues a run from a folder written by [`GrpoTrainer::save_checkpoint`] with the
    /// built-in rewards of `config`: policy weights, optimizer, state and the prompt order.
    /// Sync runs continue exactly as if never stopped (on CPU); async runs continue from the
    /// next unseen batch of prompts.
    pub fn resume_from(config: GrpoConfig, checkpoint: &std::path::Path) -> Result<Self, GrpoError> {
        let rewards = builtin_rewards(&config)?;
        Self::build(config, rewards, Some(checkpoint))
    }

    /// [`GrpoTrainer::resume_from`] with the given reward functions.
    pub fn resume_with_rewards(
        config: GrpoConfig,
        rewards: Vec<RewardFn>,
        checkpoint: &std::path::Path,
    ) -> Result<Self, GrpoError> {
        Self::build(config, rewards, Some(checkpoint))
    }

    fn build(
        config: GrpoConfig,
        rewards: Vec<RewardFn>,
        checkpoint: Option<&std::path::Path>,
    ) -> Result<Self, GrpoError> {
        config.validate()?;
        if rewards.is_empty() {
            return Err(GrpoError::Config("no reward function".into()));
        }
        if let Some(r) = rewards.iter().find(|r| !r.weight.is_finite()) {
            return Err(GrpoError::Config(format!(
                "reward `{}` has weight {}",
                r.name, r.weight
            )));
        }
        let hub = crate::hub::HubCache::from_env();
        let dir = hub.model_dir(&config.model).map_err(other)?;
        let opts = LoadOptions {
            dtype: Some(crate::model::parse_kind(&config.dtype)?),
            device: crate::device::parse_device(&config.device).map_err(|e| GrpoError::Config(e.to_string()))?,
        };
        let weights = checkpoint.unwrap_or(&dir);
        let model = Model::load(weights, opts)?;
        let tokenizer = Arc::new(Tokenizer::from_dir(&dir).map_err(other)?);
        let ds = if config.dataset.exists() {
            Dataset::open(&config.dataset)
        } else {
            Dataset::from_hub(&hub, &config.dataset.to_string_lossy(), config.dataset_split.as_deref())
        }
        .map_err(other)?;
        let prompts = Arc::new(PromptSet::load(
            &ds,
            &tokenizer,
            &config.prompt_field,
            config.max_prompt_length,
            config.skip_invalid_rows,
        )?);
        let generation = generation_config(&config, &tokenizer, &model.lm.config);
        let rewards = Arc::new(rewards);
        let mut producer = RolloutProducer {
            prompts: prompts.clone(),
            rewards: rewards.clone(),
            tokenizer: tokenizer.clone(),
            generation: generation.clone(),
            group: config.num_generations,
            per_batch: config.prompts_per_step,
            scale: config.scale_rewards,
            sampler: PromptSampler::new(prompts.prompts.len(), config.seed),
            produced: 0,
            generator: Default::default(),
        };
        let mut state = GrpoState {
            total_steps: config.max_steps,
            reward_names: rewards.iter().map(|r| r.name.clone()).collect(),
            skipped_prompts: prompts.skipped,
            ..Default::default()
        };
        let mut optimizer = AdamW::new(&model.vs, config.adamw);
        if let Some(ckpt) = checkpoint {
            state = crate::train::load_checkpoint(ckpt, &mut optimizer).map_err(GrpoError::Other)?;
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
                let copy = Model::load(weights, opts)?;
                let capacity = config.queue_size * config.prompts_per_step;
                Source::Async(AsyncRollouts::spawn(producer, copy, state.global_step, capacity))
            }
        };
        let reference = if config.beta > 0.0 {
            Some(Model::load(&dir, opts)?)
        } else {
            None
        };
        Ok(GrpoTrainer {
            optimizer,
            schedule: LrSchedule::with_warmup_ratio(
                config.learning_rate,
                config.lr_scheduler,
                config.warmup_ratio,
                config.max_steps,
            ),
            state,
            model,
            tokenizer,
            prompts,
            last_row: None,
            last_batch: None,
            generation,
            reference,
            rewards,
            pending: None,
            source,
            config,
        })
    }

    /// The loss settings of the run.
    pub fn loss_config(&self) -> GrpoLossConfig {
        GrpoLossConfig {
            epsilon_low: self.config.epsilon_low,
            epsilon_high: self.config.epsilon_high,
            chunks: LogprobChunks::default(),
            temperature: self.config.temperature,
            beta: self.config.beta,
        }
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
    fn next_batch(&mut self) -> Result<(RolloutBatch, f64, usize), GrpoError> {
        let version = self.state.global_step;
        match &mut self.source {
            Source::Sync(p) => {
                let batch = p.produce(&self.model.lm, version)?;
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
                        a.publish(version, &self.model.vs);
                        self.state.forced_syncs += 1;
                    }
                }
                let batch =
                    RolloutBatch::from_groups(self.state.batches_consumed, groups, self.state.reward_names.clone());
                self.state.batches_consumed += 1;
                Ok((batch, wait, dropped))
            }
        }
    }

    /// One GRPO step: a batch of `prompts_per_step x num_generations` scored rollouts, one
    /// packed update, one optimizer step.
    pub fn step(&mut self) -> Result<GrpoStepMetrics, GrpoError> {
        let start = Instant::now();
        let (batch, wait_s, dropped) = match self.pending.take() {
            Some((batch, left)) => {
                if left > 1 {
                    self.pending = Some((batch.clone(), left - 1));
                }
                (batch, 0.0, 0)
            }
            None => {
                let (batch, wait_s, dropped) = self.next_batch()?;
                if self.config.num_iterations > 1 {
                    self.pending = Some((batch.clone(), self.config.num_iterations - 1));
                }
                (batch, wait_s, dropped)
            }
        };
        let version = self.state.global_step;
        let t = Instant::now();
        let rollouts = batch.rollouts_for_update(self.config.mask_truncated_completions);
        let rows = pack_rollouts(rollouts, self.config.packing, self.config.token_budget)?;
        let pack_s = t.elapsed().as_secs_f64();
        let stats = match accumulate_gradients_with(
            &self.model.lm,
            self.reference.as_ref().map(|m| &m.lm),
            &rows,
            &self.loss_config(),
            self.config.loss_type,
            self.config.max_completion_length,
        ) {
            Ok(stats) => stats,
            Err(e) => {
                // Rows before the failure left gradients behind: the next step must not see them.
                self.optimizer.zero_grad();
                return Err(e);
            }
        };
        let t = Instant::now();
        let grad_norm = self.optimizer.clip_grad_norm(self.config.max_grad_norm);
        let lr = self.schedule.lr_at(version);
        let skipped = !stats.loss.is_finite() || !grad_norm.is_finite();
        if skipped {
            self.state.skipped_steps += 1;
        } else {
            self.optimizer.step(lr)?;
        }
        self.optimizer.zero_grad();
        let optimizer_s = t.elapsed().as_secs_f64();
        self.state.global_step = version + 1;
        if let Source::Async(a) = &mut self.source
            && self.state.global_step.is_multiple_of(self.config.weight_sync_steps)
        {
            a.publish(self.state.global_step, &self.model.vs);
        }
        let m = self.metrics(&batch, &stats, rows.len(), grad_norm, lr, skipped);
        let m = GrpoStepMetrics {
            staleness: version - batch.version.min(version),
            dropped_stale: dropped,
            wait_s,
            pack_s,
            optimizer_s,
            step_s: start.elapsed().as_secs_f64(),
            ..m
        };
        self.record(&batch, &m);
        self.last_row = rows.into_iter().last();
        self.last_batch = Some(batch);
        Ok(m)
    }

    fn metrics(
        &self,
        batch: &RolloutBatch,
        stats: &super::UpdateStats,
        rows: usize,
        grad_norm: f64,
        lr: f64,
        skipped: bool,
    ) -> GrpoStepMetrics {
        let totals: Vec<f64> = batch.totals().flatten().map(f64::from).collect();
        let (reward_mean, reward_std) = mean_std(&totals);
        let rewards = reward_stats(batch, &self.rewards);
        let lengths: Vec<usize> = batch
            .groups
            .iter()
            .flat_map(|g| g.completions.iter().map(|c| c.output_ids.len()))
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
            truncated_ratio: truncated as f64 / n,
            loss: stats.loss,
            grad_norm,
            lr,
            clip_ratio: stats.clip_ratio,
            approx_kl: stats.approx_kl,
            kl: stats.ref_kl,
            entropy: stats.entropy,
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
            skipped,
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
        if let Some(dir) = &self.config.output_dir {
            crate::train::append_log(dir, m);
        }
    }

    /// Runs `n` steps (or until the run's last step); returns the last step's metrics.
    pub fn train_for(&mut self, n: u64) -> Result<Option<GrpoStepMetrics>, GrpoError> {
        let mut last = None;
        for _ in 0..n {
            if self.state.global_step >= self.state.total_steps {
                break;
            }
            last = Some(self.step()?);
        }
        Ok(last)
    }

    /// Writes `output_dir/checkpoint-<step>/`: the policy as a Hugging Face folder, the
    /// optimizer and the state, atomically.
    pub fn save_checkpoint(&self) -> Result<PathBuf, GrpoError> {
        let out = self
            .config
            .output_dir
            .clone()
            .ok_or_else(|| GrpoError::Config("output_dir is not set".into()))?;
        crate::train::save_checkpoint(
            &out,
            self.state.global_step,
            &self.model,
            &self.tokenizer.dir,
            &self.optimizer,
            &self.state,
        )
        .map_err(GrpoError::Other)
    }

    /// Reward functions of the run.
    pub fn rewards(&self) -> &[RewardFn] {
        &self.rewards
    }

    /// Prompts of another file or folder (a held-out split), read like the training prompts.
    pub fn load_prompts(&self, path: &std::path::Path) -> Result<PromptSet, GrpoError> {
        let ds = Dataset::open(path).map_err(other)?;
        PromptSet::load(
            &ds,
            &self.tokenizer,
            &self.config.prompt_field,
            self.config.max_prompt_length,
            self.config.skip_invalid_rows,
        )
    }

    /// Mean rewards of the current policy on `prompts`: `samples` completions per prompt at the
    /// run's sampling settings with a fixed `seed` (so two calls differ only by the weights),
    /// or one greedy completion when `samples` is 0.
    pub fn evaluate(&self, prompts: &PromptSet, samples: usize, seed: u64) -> Result<EvalResult, GrpoError> {
        let mut generation = self.generation.clone();
        generation.sampling.seed = seed;
        generation.sampling.do_sample = samples > 0;
        let mut producer = RolloutProducer {
            prompts: Arc::new(prompts.clone()),
            rewards: self.rewards.clone(),
            tokenizer: self.tokenizer.clone(),
            generation,
            group: samples.max(1),
            per_batch: prompts.prompts.len(),
            scale: self.config.scale_rewards,
            sampler: PromptSampler::new(prompts.prompts.len(), seed),
            produced: 0,
            generator: Default::default(),
        };
        let batch = producer.produce(&self.model.lm, self.state.global_step)?;
        Ok(EvalResult::from_batch(&batch, &self.rewards, self.state.global_step))
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

/// Sampling settings of the run: EOS from the tokenizer and `config.json`, the run's
/// temperature and truncation.
fn generation_config(
    config: &GrpoConfig,
    tokenizer: &Tokenizer,
    model: &crate::model::ModelConfig,
) -> GenerationConfig {
    let mut eos: Vec<i64> = tokenizer.eos_token_id().map(i64::from).into_iter().collect();
    for &e in &model.eos_token_ids {
        if !eos.contains(&e) {
            eos.push(e);
        }
    }
    GenerationConfig {
        max_new_tokens: config.max_completion_length,
        eos_token_ids: eos,
        pad_token_id: tokenizer
            .pad_token_id()
            .map(i64::from)
            .or(model.pad_token_id)
            .unwrap_or(0),
        prefill_chunk_size: config.prefill_chunk_size,
        sampling: SamplingConfig {
            do_sample: true,
            temperature: config.temperature,
            top_k: config.top_k,
            top_p: config.top_p,
            min_p: config.min_p,
            seed: config.seed,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The built-in rewards named in `config.rewards`, weighted.
fn builtin_rewards(config: &GrpoConfig) -> Result<Vec<RewardFn>, GrpoError> {
    config
        .rewards
        .iter()
        .map(|spec| {
            RewardFn::builtin(&spec.name)
                .map(|f| f.with_weight(spec.weight))
                .ok_or_else(|| {
                    GrpoError::Config(format!(
                        "unknown reward `{}` (built-ins: exact_answer, answer_format)",
                        spec.name
                    ))
                })
        })
        .collect()
}

/// What a person asked: the last message's content of a conversational prompt, else the text.
fn prompt_summary(prompt: &super::PromptRow, field: &str) -> String {
    prompt
        .row
        .get(field)
        .and_then(|v| v.as_array()?.last()?.get("content")?.as_str().map(str::to_string))
        .unwrap_or_else(|| prompt.text.clone())
}
