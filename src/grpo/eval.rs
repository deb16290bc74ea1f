//! Held-out evaluation of a GRPO policy: mean rewards on prompts it does not train on, whole
//! or by the values of a prompt column.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use super::config::GrpoConfig;
use super::metrics::{EvalResult, RewardStat};
use super::multiturn::MultiTurn;
use super::producer::{BatchShape, RolloutProducer, Shard};
use super::rollouts::PromptSet;
use super::trainer::GrpoTrainer;
use crate::data::Dataset;
use crate::tokenizer::{ChatOptions, Tokenizer};
use crate::train::TrainError;

impl GrpoTrainer {
    /// Prompts of another file or folder (a held-out split), read like the training prompts.
    pub fn load_prompts(&self, path: &Path) -> Result<PromptSet, TrainError> {
        let tools = self.multi_turn.as_ref().and_then(|m| m.environment.tools());
        load_prompt_set(
            &self.config,
            &self.core.tokenizer,
            &Dataset::open_held_out(path)?,
            tools,
        )
    }

    /// Mean rewards of the current policy on `prompts`: `samples` completions per prompt at the
    /// run's sampling settings with a fixed `seed` (so two calls differ only by the weights),
    /// or one greedy completion when `samples` is 0. Multi-turn: one conversation per sample
    /// (no forks after a turn).
    pub fn evaluate(&self, prompts: &PromptSet, samples: usize, seed: u64) -> Result<EvalResult, TrainError> {
        let mut generation = self.generation.clone();
        generation.sampling.seed = seed;
        generation.sampling.do_sample = samples > 0;
        let shape = BatchShape {
            group: samples.max(1),
            per_batch: prompts.prompts.len(),
            shard: Shard::from(&*self.core.world),
            scale: self.config.loss.scale_rewards,
            aggregation: self.config.loss.multi_objective_aggregation,
            seed,
        };
        // One conversation per sample: forks would weigh conversations that go on more.
        let multi_turn = self.multi_turn.clone().map(|m| MultiTurn {
            turn_generations: 1,
            ..m
        });
        let prompts = Arc::new(prompts.clone());
        let mut producer = RolloutProducer::new(
            prompts,
            self.rewards.clone(),
            self.core.tokenizer.clone(),
            generation,
            shape,
        )
        .with_multi_turn(multi_turn);
        let lm = &self.core.model.lm;
        let produced = lm.with_whole_weights(|| producer.produce(lm, self.state.global_step))?;
        let batch = produced.gather(&self.core.world)?;
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

/// The prompts of `ds`, read as the run's config says.
pub(super) fn load_prompt_set(
    config: &GrpoConfig,
    tokenizer: &Tokenizer,
    ds: &Dataset,
    tools: Option<Value>,
) -> Result<PromptSet, TrainError> {
    let chat = ChatOptions {
        tools,
        extra: config.rollouts.chat_template_kwargs.clone(),
        ..Default::default()
    };
    PromptSet::load_with_chat(
        ds,
        tokenizer,
        &config.rollouts.prompt_field,
        config.rollouts.max_prompt_length,
        config.train.data.skip_invalid_rows,
        chat,
    )
}
