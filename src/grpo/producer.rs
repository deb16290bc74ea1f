//! The producer of scored rollout batches: which prompts a process generates for (its
//! [`Shard`]), how batches are cut ([`BatchShape`]), and [`RolloutProducer`], which generates
//! and scores them with whatever weights it is handed.

use std::sync::Arc;
use std::time::Instant;

use super::advantage::{MultiObjective, ScaleRewards, decoupled_group_rewards, group_advantages};
use super::reward::{GroupRewards, RewardFn, RewardInput, score_group};
use super::rollouts::{PromptSampler, PromptSet, RolloutBatch, ScoredGroup};
use crate::distributed::{World, share};
use crate::generate::{Completion, FinishReason, GenerationConfig, Generator};
use crate::model::CausalLm;
use crate::tokenizer::Tokenizer;
use crate::train::TrainError;
use crate::util::SplitMix64;

/// Which share of every batch's prompts a process generates: rank `rank` of `size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// This process's rank.
    pub rank: usize,
    /// Processes sharing each batch.
    pub size: usize,
}

impl Default for Shard {
    fn default() -> Self {
        Shard { rank: 0, size: 1 }
    }
}

impl From<&World> for Shard {
    fn from(w: &World) -> Self {
        Shard {
            rank: w.rank,
            size: w.size,
        }
    }
}

/// Generates and scores batches with whatever weights it is handed; owned by the trainer in
/// sync mode and by the generation thread in async mode.
#[derive(Debug)]
pub struct RolloutProducer {
    /// The prompts.
    pub prompts: Arc<PromptSet>,
    /// Reward functions.
    pub rewards: Arc<Vec<RewardFn>>,
    /// Decodes completions for the rewards.
    pub tokenizer: Arc<Tokenizer>,
    /// Generation settings (the seed advances per batch).
    pub generation: GenerationConfig,
    /// Completions per prompt.
    pub group: usize,
    /// Prompts per batch (of the whole world: each process generates its share).
    pub per_batch: usize,
    /// This process's share of every batch.
    pub shard: Shard,
    /// Advantage scaling.
    pub scale: ScaleRewards,
    /// How the reward functions combine.
    pub aggregation: MultiObjective,
    /// Prompt order.
    pub sampler: PromptSampler,
    /// Batches produced so far.
    pub produced: u64,
    /// The generator (its shape ledger grows across batches).
    pub generator: Generator,
    /// Multi-turn rollouts with an environment (`None`: one completion per rollout).
    pub multi_turn: Option<super::MultiTurn>,
}

/// How a [`RolloutProducer`] cuts its batches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchShape {
    /// Completions per prompt.
    pub group: usize,
    /// Prompts per batch (of the whole world: each process generates its share).
    pub per_batch: usize,
    /// This process's share of every batch.
    pub shard: Shard,
    /// Advantage scaling.
    pub scale: ScaleRewards,
    /// How the reward functions combine.
    pub aggregation: MultiObjective,
    /// Seeds the prompt order.
    pub seed: u64,
}

impl RolloutProducer {
    /// A producer of single-turn batches of `shape` from `prompts`, drawn in the order a
    /// sampler seeded with `shape.seed` gives, scored by `rewards`.
    pub fn new(
        prompts: Arc<PromptSet>,
        rewards: Arc<Vec<RewardFn>>,
        tokenizer: Arc<Tokenizer>,
        generation: GenerationConfig,
        shape: BatchShape,
    ) -> Self {
        RolloutProducer {
            sampler: PromptSampler::new(prompts.prompts.len(), shape.seed),
            prompts,
            rewards,
            tokenizer,
            generation,
            group: shape.group,
            per_batch: shape.per_batch,
            shard: shape.shard,
            scale: shape.scale,
            aggregation: shape.aggregation,
            produced: 0,
            generator: Default::default(),
            multi_turn: None,
        }
    }

    /// The same producer rolling out conversations with an environment (`None`: one
    /// completion per rollout).
    pub(crate) fn with_multi_turn(self, multi_turn: Option<super::MultiTurn>) -> Self {
        RolloutProducer { multi_turn, ..self }
    }

    /// Skips the prompts of the first `batches` batches, as a resumed run that consumed them
    /// must: the prompt order and the sampling seeds pick up after them.
    pub(crate) fn skip_batches(&mut self, batches: u64) {
        for _ in 0..batches {
            self.sampler.take(self.per_batch);
        }
        self.produced += batches;
    }

    /// Generates `group` completions for each of this shard's share of the next `per_batch`
    /// prompts with `model` (weights of `version`) and scores them. Every completion draws from
    /// the random stream of its place in the whole batch, so the shards together make what one
    /// process would have made.
    pub(crate) fn produce(&mut self, model: &CausalLm, version: u64) -> Result<RolloutBatch, TrainError> {
        let all = self.sampler.take(self.per_batch);
        let mine = share(all.len(), self.shard.rank, self.shard.size);
        let first_row = (mine.start * self.group) as u64;
        let picked = &all[mine];
        let mut cfg = self.generation.clone();
        cfg.sampling.seed = self.generation.sampling.seed ^ SplitMix64::new(self.produced).next_u64();
        cfg.sampling.first_row = first_row;
        let batch = match self.multi_turn.clone() {
            Some(turns) => self.produce_conversations(model, picked, &cfg, &turns, version)?,
            None => self.produce_completions(model, picked, &cfg, version)?,
        };
        self.produced += 1;
        Ok(batch)
    }

    /// One completion per rollout: `group` of them per prompt of `picked`.
    fn produce_completions(
        &mut self,
        model: &CausalLm,
        picked: &[usize],
        cfg: &GenerationConfig,
        version: u64,
    ) -> Result<RolloutBatch, TrainError> {
        let prompt_ids: Vec<Vec<i64>> = picked.iter().map(|&i| self.prompts.prompts[i].ids.clone()).collect();
        let start = Instant::now();
        // A mixture's routing is recorded for the update to replay or compare.
        self.generator.record_routing(model.config.mixture.is_some());
        let completions = self.generator.generate_groups(model, &prompt_ids, self.group, cfg)?;
        let mut traces = self.generator.take_routing().unwrap_or_default().into_iter();
        let generation_s = start.elapsed().as_secs_f64();
        let generated_tokens = completions.iter().map(|c| c.output_ids.len()).sum();
        let start = Instant::now();
        let mut chunks = completions.chunks(self.group);
        let groups = picked
            .iter()
            .map(|&p| {
                let mut group = self.score_completions(
                    p,
                    chunks.next().map(<[Completion]>::to_vec).unwrap_or_default(),
                    version,
                );
                group.routing = traces.by_ref().take(self.group).collect();
                group
            })
            .collect();
        Ok(self.batch(version, groups, generation_s, start, generated_tokens))
    }

    /// The batch of `groups`, scored since `scoring_start`.
    pub(super) fn batch(
        &self,
        version: u64,
        groups: Vec<ScoredGroup>,
        generation_s: f64,
        scoring_start: Instant,
        generated_tokens: usize,
    ) -> RolloutBatch {
        RolloutBatch {
            version,
            index: self.produced,
            groups,
            generation_s,
            reward_s: scoring_start.elapsed().as_secs_f64(),
            generated_tokens,
            reward_names: self.rewards.iter().map(|r| r.name.clone()).collect(),
        }
    }

    /// Decodes and scores the completions of prompt `p` (an index into the prompt set) made by
    /// weights of `version`. A completion that does not decode
    /// (an id outside the tokenizer's vocabulary) is a failure of every reward for it, reported
    /// and given advantage 0, never scored as empty text.
    pub fn score_completions(&self, p: usize, completions: Vec<Completion>, version: u64) -> ScoredGroup {
        let prompt = &self.prompts.prompts[p];
        let (mut texts, mut undecodable) = (Vec::with_capacity(completions.len()), Vec::new());
        for (i, c) in completions.iter().enumerate() {
            let ids: Vec<u32> = c.output_ids.iter().map(|&t| t as u32).collect();
            match self.tokenizer.decode(&ids, true) {
                Ok(text) => texts.push(text),
                Err(e) => {
                    texts.push(String::new());
                    undecodable.push((i, e.to_string()));
                }
            }
        }
        let inputs: Vec<RewardInput> = completions
            .iter()
            .zip(&texts)
            .map(|(c, text)| RewardInput {
                prompt: &prompt.text,
                completion: text,
                completion_ids: &c.output_ids,
                truncated: c.finish_reason == FinishReason::Length,
                row: &prompt.row,
                environment: None,
            })
            .collect();
        let mut rewards = score_group(&self.rewards, prompt.dataset_row, &inputs);
        for (i, reason) in undecodable {
            let reason = format!("completion does not decode: {reason}");
            rewards.fail_completion(i, prompt.dataset_row, "decode", reason);
        }
        self.scored_group(p, version, completions, texts, rewards, Vec::new())
    }

    /// The group of prompt `p` made by weights of `version`: its scored completions (with
    /// multi-turn `trained_masks`) and their advantages.
    pub(super) fn scored_group(
        &self,
        p: usize,
        version: u64,
        completions: Vec<Completion>,
        texts: Vec<String>,
        rewards: GroupRewards,
        trained_masks: Vec<Vec<u8>>,
    ) -> ScoredGroup {
        let prompt = &self.prompts.prompts[p];
        // GDPO's group stage leaves its sums for the step-wide normalisation
        // (`RolloutBatch::scale_advantages`).
        let advantages = match self.aggregation {
            MultiObjective::SumThenNormalize => group_advantages(&rewards.total, self.scale),
            MultiObjective::NormalizeThenSum => {
                let weights: Vec<f32> = self.rewards.iter().map(|r| r.weight).collect();
                let sums = decoupled_group_rewards(&rewards.per_function, &weights);
                sums.iter().map(|s| s.unwrap_or(0.0)).collect()
            }
        };
        ScoredGroup {
            version,
            origin: self.produced,
            prompt: p,
            dataset_row: prompt.dataset_row,
            prompt_ids: prompt.ids.clone(),
            prompt_text: prompt.text.clone(),
            completions,
            texts,
            rewards,
            advantages,
            trained_masks,
            forked_rows: Vec::new(),
            drift: Default::default(),
            routing: Vec::new(),
        }
    }
}
