//! The GRPO trainer: `step()` from a notebook cell, or `train_for(n)`.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use super::config::{EntropyControl, GrpoConfig};
use super::metrics::EvalResult;
use super::metrics::{GrpoStepMetrics, SampleCompletion};
use super::metrics::{StepClock, UpdateMetrics, UpdatePart};
use super::multiturn::MultiTurn;
use super::objective::GrpoObjective;
use super::producer::RolloutProducer;
use super::reward::RewardFailure;
use super::reward::RewardFn;
use super::rollouts::{PromptSet, RolloutBatch};
use super::routing_replay::StepRouting;
use super::update::{
    UpdateStats, accumulate_gradients, accumulate_share, idle_rows, idle_share, pack_rollouts, plan_rank_update,
    with_entropy_floor,
};
use super::worker::AsyncRollouts;
use crate::generate::GenerationConfig;
use crate::model::{CausalLm, Model};
use crate::pack::{PackedRow, Packing};
use crate::tokenizer::Tokenizer;
use crate::train::{TrainConfig, TrainCore, TrainError, Trainer};

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
    /// The adaptive entropy bonus's controller (`use_adaptive_entropy`).
    #[serde(default)]
    pub entropy_control: EntropyControl,
}

pub(super) enum Source {
    Sync(Box<RolloutProducer>),
    Async(AsyncRollouts),
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
    pub(super) config: GrpoConfig,
    pub(super) core: TrainCore,
    pub(super) generation: GenerationConfig,
    /// The frozen reference of the KL term: a loaded copy of the starting weights, or with
    /// LoRA the policy's own base tensors with the adapter off (no copy).
    pub(super) reference: Option<super::reference::Reference>,
    pub(super) rewards: Arc<Vec<RewardFn>>,
    pub(super) held_out: Option<PromptSet>,
    /// Batches generated for later steps: the other slices of a generation
    /// (`steps_per_generation`) and the repeats of `num_iterations`. Checkpointed.
    pub(super) pending: std::collections::VecDeque<RolloutBatch>,
    pub(super) source: Source,
    /// Multi-turn rollouts (a trainer built with an environment).
    pub(super) multi_turn: Option<MultiTurn>,
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
        self.reference.as_ref().map(|r| &r.lm)
    }

    /// Whether the update adds a load-balancing loss: a mixture model whose family has one,
    /// with `router_aux_loss_coef > 0`.
    fn routed(&self) -> bool {
        self.config.train.router_aux_loss_coef > 0.0 && self.core.model.lm.config.load_balancing()
    }

    /// The loss of the run.
    pub fn objective(&self) -> GrpoObjective {
        let mut objective = GrpoObjective::from(&self.config);
        // The sampler never draws the LM head's padding rows: the loss leaves them out too.
        objective.truncation.token_limit = self.core.special.token_limit;
        if !self.core.model.lm.config.load_balancing() {
            objective.router_aux_loss_coef = 0.0;
        }
        if self.config.entropy_bonus.use_adaptive_entropy {
            objective.entropy_coef = self.state.entropy_control.applied(&self.config.entropy_bonus);
        }
        objective
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

    /// The next batch from the source, gathered over ranks: generated now (sync), or assembled
    /// from the oldest queued groups that are at most `max_staleness` versions old (async; older
    /// ones are dropped and counted).
    fn next_batch(&mut self) -> Result<(RolloutBatch, f64, usize), TrainError> {
        let version = self.state.global_step;
        if let Source::Async(a) = &self.source
            && self.core.model.lm.is_sharded()
            && a.behind(version, self.config.rollouts.max_staleness)
        {
            self.publish_weights(version)?;
            self.state.forced_syncs += 1;
        }
        match &mut self.source {
            Source::Sync(p) => {
                // Generation reads whole weights: under `full_shard` gathered for it.
                let lm = &self.core.model.lm;
                let produced = lm.with_whole_weights(|| p.produce(lm, version))?;
                let batch = produced.gather(&self.core.world)?;
                self.state.batches_consumed += 1;
                Ok((batch, 0.0, 0))
            }
            Source::Async(a) => {
                let (mut wait, mut dropped) = (0.0, 0);
                let mut groups = Vec::with_capacity(self.config.rollouts.prompts_per_step);
                while groups.len() < self.config.rollouts.prompts_per_step {
                    let t = Instant::now();
                    let queued = a.next()?;
                    wait += t.elapsed().as_secs_f64();
                    if version - queued.group.version.min(version) <= self.config.rollouts.max_staleness {
                        groups.push(queued);
                        continue;
                    }
                    dropped += 1;
                    self.state.dropped_stale += 1;
                    // Until the generator has weights recent enough, all it makes is dropped.
                    // (Sharded parameters are gathered for a publish by every rank at once, so
                    // there the step publishes before it waits: see `publish_weights`.)
                    if a.behind(version, self.config.rollouts.max_staleness) && !self.core.model.lm.is_sharded() {
                        a.publish(version, self.core.model.trainable());
                        self.state.forced_syncs += 1;
                    }
                }
                let batch =
                    RolloutBatch::from_groups(self.state.batches_consumed, groups, self.state.reward_names.clone())
                        .gather(&self.core.world)?;
                self.state.batches_consumed += 1;
                Ok((batch, wait, dropped))
            }
        }
    }

    /// Async mode: hands the generator the weights of `version` (under `full_shard` gathered
    /// for the copy, by every rank at once).
    fn publish_weights(&mut self, version: u64) -> Result<(), TrainError> {
        let Source::Async(a) = &mut self.source else {
            return Ok(());
        };
        let model = &self.core.model;
        model.lm.with_whole_weights(|| {
            a.publish(version, model.trainable());
            Ok::<_, TrainError>(())
        })
    }

    /// The batch of this step: the next pending one, else a new generation cut into
    /// `steps_per_generation` slices of `prompts_per_step` prompts (per process), queued
    /// `num_iterations` times over in TRL's order (every slice, then every slice again).
    fn take_batch(&mut self) -> Result<(RolloutBatch, f64, usize), TrainError> {
        if let Some(batch) = self.pending.pop_front() {
            return Ok((batch, 0.0, 0));
        }
        let (mut batch, wait, dropped) = self.next_batch()?;
        // The step-wide stage of the advantages, over the whole generation before it is cut.
        let loss = &self.config.loss;
        batch.scale_advantages(loss.scale_rewards, loss.multi_objective_aggregation);
        let slices = batch.split(self.config.rollouts.generation_steps()?);
        for _ in 0..self.config.loss.num_iterations {
            self.pending.extend(slices.iter().cloned());
        }
        let first = self
            .pending
            .pop_front()
            .ok_or_else(|| TrainError::Data("the rollout source made an empty batch".into()))?;
        Ok((first, wait, dropped))
    }

    /// One GRPO step: a batch of `prompts_per_step x num_generations` scored rollouts, one
    /// packed update, one optimizer step.
    pub fn step(&mut self) -> Result<GrpoStepMetrics, TrainError> {
        let step = self.state.global_step;
        crate::train::out_of_memory::guard(
            step,
            "prompts_per_step, num_generations or max_completion_length",
            || self.step_unguarded(),
        )
        .inspect_err(|e| {
            if matches!(e, TrainError::OutOfMemory { .. }) {
                self.core.optim.discard_gradients();
            }
        })
    }

    fn step_unguarded(&mut self) -> Result<GrpoStepMetrics, TrainError> {
        let device = self.core.model.device();
        crate::device::privateuse1::checked(device, || {
            let start = Instant::now();
            let (batch, wait_s, dropped_stale) = self.take_batch()?;
            let version = self.state.global_step;
            let (update, rows) = self.update_on(&batch, version)?;
            self.state.global_step = version + 1;
            if self
                .state
                .global_step
                .is_multiple_of(self.config.rollouts.weight_sync_steps)
            {
                self.publish_weights(self.state.global_step)?;
            }
            let clock = StepClock {
                staleness: version - batch.version.min(version),
                dropped_stale,
                wait_s,
                step_s: start.elapsed().as_secs_f64(),
            };
            let mut m = GrpoStepMetrics::compose(version + 1, (&batch, &self.rewards), update, clock);
            m.tools = self.tool_metrics()?;
            self.record(&batch, &m);
            self.last_row = rows.into_iter().last();
            self.last_batch = Some(batch);
            Ok(m)
        })
    }

    /// Plans, forwards and back-propagates this rank's share of `batch`, sums the statistics
    /// over ranks and ends optimizer step `version`: the update's part of the step's metrics
    /// (with its packing, forward + backward and optimizer times) and this rank's packed rows.
    fn update_on(&mut self, batch: &RolloutBatch, version: u64) -> Result<(UpdatePart, Vec<PackedRow>), TrainError> {
        let t = Instant::now();
        let rollouts = batch.rollouts_for_update(self.config.loss.mask_truncated_completions);
        let world = &self.core.world;
        let update = plan_rank_update(
            rollouts,
            self.config.update.packing,
            self.config.update.token_budget,
            world.rank,
            world.size,
        )?;
        let pack_s = t.elapsed().as_secs_f64();
        let lm = &self.core.model.lm;
        let training = self.core.model.training();
        let objective = self.objective();
        let entropy_coef = objective.entropy_coef;
        let accumulated = idle_rows(lm, update.rows.len(), world).and_then(|idle| {
            // One backward pass a row, idle ones included: the same count on every rank.
            lm.expect_backward_passes(update.rows.len() + idle);
            let objective = with_entropy_floor(lm, (&update.rows, idle), objective, world)?;
            let routing = StepRouting::new(
                batch.routing_for_update(self.config.loss.mask_truncated_completions),
                self.config.update.routing_replay,
            );
            let stats = accumulate_share(
                lm,
                self.reference(),
                &update.rows,
                update.totals,
                (&objective, &routing),
            )?;
            idle_share(lm, idle, &objective)?;
            Ok(stats)
        });
        drop(training);
        // Rows before the failure left gradients behind: the next step must not see them.
        let mut stats = accumulated.inspect_err(|_| self.core.optim.discard_gradients())?;
        stats.sum_over_ranks(world)?;
        let t = Instant::now();
        let prompt_rows = || batch.groups.iter().map(|g| g.dataset_row).collect();
        let outcome = self
            .core
            .optim
            .finish_step(&self.config.train, version, stats.loss, prompt_rows)?;
        self.state.skipped_steps += usize::from(outcome.skipped);
        if let Some(r) = self
            .reference
            .as_ref()
            .filter(|r| r.due(version + 1, &self.config.reference))
        {
            let lm = &self.core.model.lm;
            lm.with_whole_weights(|| r.sync(&self.core.model.vs, version + 1, &self.config.reference))?;
        }
        if self.config.entropy_bonus.use_adaptive_entropy {
            self.state
                .entropy_control
                .update(&self.config.entropy_bonus, stats.entropy_trained);
        }
        let part = UpdatePart {
            metrics: UpdateMetrics::of(&stats, &outcome, entropy_coef, update.step_rows, self.routed()),
            skipped: outcome.skipped,
            pack_s,
            forward_backward_s: stats.forward_backward_s,
            optimizer_s: t.elapsed().as_secs_f64(),
        };
        Ok((part, update.rows))
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
        let rollouts = batch.rollouts_for_update(self.config.loss.mask_truncated_completions);
        let rows = pack_rollouts(rollouts, packing, self.config.update.token_budget)?;
        let (mut best, mut last) = (f64::INFINITY, UpdateStats::default());
        for _ in 0..repeats.max(1) {
            let run = accumulate_gradients(&self.core.model.lm, None, &rows, &self.objective());
            crate::train::zero_grads(self.core.model.trainable());
            last = run?;
            best = best.min(last.forward_backward_s);
        }
        Ok((best, last))
    }

    /// The environment's tool calls since the last step, summed over the ranks (every rank
    /// asks, a collective), as `tools/...` frequencies without the prefix.
    fn tool_metrics(&self) -> Result<std::collections::BTreeMap<String, f64>, TrainError> {
        let Some(mut tally) = self.multi_turn.as_ref().and_then(|t| t.environment.tool_tally()) else {
            return Ok(Default::default());
        };
        let mut counts = tally.counts();
        self.core.world.sum(&mut counts)?;
        tally.set_counts(&counts);
        let metrics = tally.metrics().into_iter();
        Ok(metrics
            .map(|(k, v)| (k.trim_start_matches("tools/").to_string(), v))
            .collect())
    }

    fn record(&mut self, batch: &RolloutBatch, m: &GrpoStepMetrics) {
        self.state.recent_failures = batch.groups.iter().flat_map(|g| g.rewards.failures.clone()).collect();
        self.state.total_failures += m.rollouts.reward_failures;
        // The samples: completions taken round-robin across groups.
        let mut samples = Vec::new();
        let most = match self.config.eval.log_unique_prompts {
            true => 1,
            false => batch.groups.iter().map(|g| g.completions.len()).max().unwrap_or(0),
        };
        'fill: for i in 0..most {
            for g in &batch.groups {
                if samples.len() >= self.config.eval.log_completions {
                    break 'fill;
                }
                if i < g.completions.len() {
                    samples.push(SampleCompletion {
                        step: m.step,
                        dataset_row: g.dataset_row,
                        prompt: prompt_summary(&self.prompts.prompts[g.prompt], &self.config.rollouts.prompt_field),
                        completion: g.texts[i].clone(),
                        rewards: g.rewards.per_function.iter().map(|f| f[i]).collect(),
                        total: g.rewards.total[i],
                        advantage: g.advantages[i],
                    });
                }
            }
        }
        // The table is text for TensorBoard alone: made only when the run writes there.
        let to_tensorboard = self.core.logging_dir().is_some();
        if to_tensorboard && crate::train::every(self.config.train.output.logging_steps, m.step) && !samples.is_empty()
        {
            let table = completions_markdown(&samples, &self.rewards);
            self.core.log_text("completions", m.step, &table);
        }
        self.state.samples = samples;
        self.state.history.push(m.clone());
        self.core.log(m);
    }

    /// Reward functions of the run.
    pub fn rewards(&self) -> &[RewardFn] {
        &self.rewards
    }
}

impl Trainer for GrpoTrainer {
    type Config = GrpoConfig;
    type Metrics = GrpoStepMetrics;
    type Eval = EvalResult;
    type State = GrpoState;

    fn from_config(config: GrpoConfig, resume_from: Option<&Path>) -> Result<Self, TrainError> {
        let builder = GrpoTrainer::builder(config);
        match resume_from {
            Some(checkpoint) => builder.resume(checkpoint).build(),
            None => builder.build(),
        }
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
        let Some(prompts) = &self.held_out else {
            return Ok(None);
        };
        let eval = self.evaluate(prompts, self.config.eval.eval_samples, self.config.train.seed ^ 0xe7a1)?;
        self.core.log_eval(&eval);
        Ok(Some(eval))
    }
    /// Aligned step numbers and every reward function, for a terminal scrolling through a run;
    /// then `num_completions_to_print` of the step's sample completions.
    fn log_line(&self, m: &GrpoStepMetrics) -> String {
        let per_fn: Vec<String> = m
            .rollouts
            .rewards
            .iter()
            .map(|r| format!("{} {:.2}", r.name, r.mean))
            .collect();
        let printed = self.config.eval.num_completions_to_print.unwrap_or(0);
        let samples: String = (self.state.samples.iter().filter(|s| s.step == m.step).take(printed))
            .map(|s| {
                let total = s.total.map_or("failed".to_string(), |t| format!("{t:.2}"));
                format!(
                    "    row {}: {:?} -> {:?} (reward {total}, advantage {:+.2})\n",
                    s.dataset_row, s.prompt, s.completion, s.advantage
                )
            })
            .collect();
        format!(
            "step {:>4}: reward {:.3} ({}) flat {:.2} len {:.1} loss {:+.4} clip {:.3} kl~ {:.1e} ent {:.2} pack {:.2}x stale {} | gen {:.2}s fwd/bwd {:.2}s\n",
            m.step,
            m.rollouts.reward_mean,
            per_fn.join(", "),
            m.rollouts.frac_reward_zero_std,
            m.rollouts.completion_length,
            m.update.loss,
            m.update.clip_ratio,
            m.update.approx_kl,
            m.update.entropy,
            m.update.packing_ratio,
            m.origin.staleness,
            m.times.generation_s,
            m.times.forward_backward_s
        ) + &samples
    }
    /// A synced reference (`sync_ref_model`) is part of the run: its weights go with the
    /// checkpoint.
    fn write_own_files(&self, dir: &std::path::Path) -> Result<(), String> {
        if let Some(r) = &self.reference {
            r.write(dir, &self.config.reference)?;
        }
        super::pending::write(dir, &self.pending)
    }
    fn describe(&self) -> String {
        let c = &self.config;
        format!(
            "{} prompts ({} skipped), {} steps of {} prompts x {} completions, {} rollouts, {} packing",
            self.prompts.prompts.len(),
            self.state.skipped_prompts,
            self.state.total_steps,
            c.rollouts.prompts_per_step,
            c.rollouts.num_generations,
            crate::display::serde_name(&c.rollouts.mode),
            crate::display::serde_name(&c.update.packing)
        )
    }
}

/// The sampled completions as a markdown table (TRL's completions table: prompt, completion,
/// each reward, advantage), for TensorBoard's text tab.
fn completions_markdown(samples: &[SampleCompletion], rewards: &[RewardFn]) -> String {
    let cell = |s: &str| s.replace('|', "\\|").replace(['\r', '\n'], "<br>");
    let names: Vec<String> = rewards.iter().map(|r| cell(&r.name)).collect();
    let mut md = format!("| prompt | completion | {} | advantage |\n", names.join(" | "));
    md.push_str(&"|---".repeat(names.len() + 3));
    md.push_str("|\n");
    for s in samples {
        let scores: Vec<String> = s
            .rewards
            .iter()
            .map(|r| r.map_or("failed".into(), |r| format!("{r:.3}")))
            .collect();
        md.push_str(&format!(
            "| {} | {} | {} | {:.3} |\n",
            cell(&s.prompt),
            cell(&s.completion),
            scores.join(" | "),
            s.advantage
        ));
    }
    md
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
