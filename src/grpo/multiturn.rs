//! Rolling out multi-turn conversations with an [`Environment`] (the contract is in
//! [`super::environment`]): the first turn of `group` conversations per prompt, then turn after
//! turn the environment's reply, each going-on conversation continued from its cache and forked
//! `turn_generations` ways, until every conversation is done, failed or out of turns.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use super::environment::{Conversation, EnvReply, Environment};
use super::producer::RolloutProducer;
use super::reward::{RewardInput, score_group};
use super::rollouts::{DriftTally, ForkedRow, RolloutBatch, ScoredGroup};
use super::talk::{Reconcile, Talk};
use crate::generate::{Conversations, FinishReason, GenerationConfig};
use crate::model::CausalLm;
use crate::train::TrainError;
use crate::util::SplitMix64;

/// How multi-turn rollouts run: the environment and the limits of a conversation.
#[derive(Clone)]
pub struct MultiTurn {
    /// Replies to every assistant turn.
    pub environment: Arc<dyn Environment>,
    /// Most assistant turns per conversation; the environment must answer `Done` after it.
    pub max_turns: usize,
    /// Continuations forked from each conversation that goes on after a turn.
    pub turn_generations: usize,
    /// Most tokens of a whole conversation (its KV cache holds this many slots).
    pub max_conversation_length: usize,
    /// The dataset column holding the prompt's messages.
    pub prompt_field: String,
    /// Variables every rendering of the conversation sees (`chat_template_kwargs`).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Re-rendered histories that depart inside the latest turn by fewer held tokens than
    /// this are realigned, others fork a row (`grpo::talk`).
    pub fork_threshold_tokens: usize,
}

impl std::fmt::Debug for MultiTurn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiTurn")
            .field("environment", &self.environment.name())
            .field("max_turns", &self.max_turns)
            .field("turn_generations", &self.turn_generations)
            .field("max_conversation_length", &self.max_conversation_length)
            .finish()
    }
}

/// A conversation that ended: its record and its outcome (reward, or why it failed).
type Ended = (Talk, Result<f32, String>);

/// A conversation that goes on (its cache row) and how its tokens followed the rendering.
type GoingOn = (usize, Talk, super::talk::Drift);

impl RolloutProducer {
    /// Multi-turn rollouts of the prompts `picked`, scored and grouped per prompt.
    pub(super) fn produce_conversations(
        &mut self,
        model: &CausalLm,
        picked: &[usize],
        cfg: &GenerationConfig,
        turns: &MultiTurn,
        version: u64,
    ) -> Result<RolloutBatch, TrainError> {
        let start = Instant::now();
        let mut cfg = cfg.clone();
        cfg.max_cache_len = Some(turns.max_conversation_length as i64);
        let prompt_ids: Vec<Vec<i64>> = picked.iter().map(|&i| self.prompts.prompts[i].ids.clone()).collect();
        let mut live = self.first_talks(picked, turns)?;
        let (mut conv, mut outs) = self
            .generator
            .start_conversations(model, &prompt_ids, self.group, &cfg)?;
        let mut ended: Vec<Ended> = Vec::new();
        let mut drift = vec![DriftTally::default(); picked.len()];
        for turn in 1..=turns.max_turns {
            let round = Round {
                picked,
                conv: &conv,
                turns,
                turn,
                cfg: &cfg,
            };
            let going_on = self.take_turn(&round, std::mem::take(&mut live), &outs, &mut ended);
            if going_on.is_empty() {
                break;
            }
            for (_, talk, d) in &going_on {
                drift[talk.prompt].add(*d);
            }
            // Continuation rows depend on the outcomes, so each rank draws from streams of its
            // own (the first turn's rows are the whole batch's, as in single-turn runs).
            cfg.sampling.seed ^= SplitMix64::new(((self.shard.rank as u64) << 32) | turn as u64).next_u64();
            let whole: Vec<(usize, Vec<i64>)> = going_on
                .iter()
                .map(|(row, talk, _)| {
                    let ids = prompt_ids[talk.prompt].iter().chain(&talk.ids).copied().collect();
                    (*row, ids)
                })
                .collect();
            outs = self
                .generator
                .continue_conversations(model, &mut conv, &whole, turns.turn_generations, &cfg)?;
            live = going_on
                .into_iter()
                .flat_map(|(_, talk, _)| std::iter::repeat_n(talk, turns.turn_generations))
                .collect();
        }
        let generation_s = start.elapsed().as_secs_f64();
        let generated_tokens = ended.iter().map(|(t, _)| t.generated_tokens()).sum();
        let start = Instant::now();
        let groups = picked
            .iter()
            .enumerate()
            .map(|(k, &p)| {
                let mine: Vec<&Ended> = ended.iter().filter(|(t, _)| t.prompt == k).collect();
                let mut group = self.score_conversations(p, &mine, turns.environment.name(), version);
                group.drift = drift[k];
                group
            })
            .collect();
        Ok(self.batch(version, groups, generation_s, start, generated_tokens))
    }

    /// `group` conversations of each prompt `picked`, from its messages.
    fn first_talks(&self, picked: &[usize], turns: &MultiTurn) -> Result<Vec<Talk>, TrainError> {
        let mut live = Vec::with_capacity(picked.len() * self.group);
        for (k, &p) in picked.iter().enumerate() {
            let prompt = &self.prompts.prompts[p];
            let Some(Value::Array(messages)) = prompt.row.get(&turns.prompt_field) else {
                return Err(TrainError::Data(format!(
                    "prompt row {}: multi-turn rollouts need `{}` to be a list of chat messages",
                    prompt.dataset_row, turns.prompt_field
                )));
            };
            let talk = Talk::new(k, messages.clone(), prompt.text.clone());
            live.extend(std::iter::repeat_n(talk, self.group));
        }
        Ok(live)
    }

    /// Absorbs every live conversation's latest turn and asks the environment; ended ones go
    /// to `ended`, the rest (with the environment's message appended) come back with their
    /// cache row.
    fn take_turn(
        &self,
        round: &Round,
        live: Vec<Talk>,
        outs: &[crate::generate::Completion],
        ended: &mut Vec<Ended>,
    ) -> Vec<GoingOn> {
        let Round {
            picked, turns, turn, ..
        } = *round;
        let env = turns.environment.as_ref();
        let chat = crate::tokenizer::ChatOptions {
            tools: env.tools(),
            extra: turns.chat_template_kwargs.clone(),
            ..Default::default()
        };
        let mut going_on = Vec::new();
        for (row, (mut talk, out)) in live.into_iter().zip(outs).enumerate() {
            if let Err(e) = talk.absorb(out, &self.tokenizer) {
                ended.push((talk, Err(e)));
                continue;
            }
            let prompt = &self.prompts.prompts[picked[talk.prompt]];
            let view = Conversation {
                row: &prompt.row,
                messages: &talk.messages,
                turn,
                last_turn: turn == turns.max_turns,
            };
            let reply = match catch_unwind(AssertUnwindSafe(|| env.reply(&view))) {
                Ok(r) => r,
                Err(panic) => Err(format!("panicked: {}", super::panic_message(panic.as_ref()))),
            };
            match reply {
                Ok(EnvReply::Done(r)) if r.is_finite() => ended.push((talk, Ok(r))),
                Ok(EnvReply::Done(r)) => ended.push((talk, Err(format!("returned reward {r}")))),
                Ok(EnvReply::Message { .. } | EnvReply::ToolResults(_)) if turn == turns.max_turns => {
                    let why = format!(
                        "replied with a message after the last turn (max_turns {})",
                        turns.max_turns
                    );
                    ended.push((talk, Err(why)));
                }
                Ok(reply @ (EnvReply::Message { .. } | EnvReply::ToolResults(_))) => {
                    let added = reply.into_messages().unwrap_or_default();
                    if added.is_empty() {
                        ended.push((talk, Err("replied with no tool message".into())));
                        continue;
                    }
                    let end = (out.finish_reason == FinishReason::Eos)
                        .then(|| {
                            out.output_ids
                                .last()
                                .map(|&t| self.tokenizer.decode(&[t as u32], false))
                        })
                        .flatten()
                        .and_then(Result::ok);
                    let reconcile = Reconcile {
                        prompt_text: &prompt.text,
                        fork_threshold: turns.fork_threshold_tokens,
                    };
                    let extended = talk.add_messages(added, &self.tokenizer, &chat, end.as_deref(), &reconcile);
                    match extended.and_then(|d| round.fits(&prompt.ids, &talk, row).map(|()| d)) {
                        Ok(d) => going_on.push((row, talk, d)),
                        Err(e) => ended.push((talk, Err(e))),
                    }
                }
                Err(e) => ended.push((talk, Err(e))),
            }
        }
        going_on
    }

    /// Scores the conversations of prompt `p`: every reward function sees the conversation
    /// after the prompt (as the template renders it) as the completion, and the environment's
    /// reward; a failed conversation is reported under the environment's name with its reason.
    fn score_conversations(&self, p: usize, ended: &[&Ended], env_name: &str, version: u64) -> ScoredGroup {
        let prompt = &self.prompts.prompts[p];
        let texts: Vec<String> = ended
            .iter()
            .map(|(t, _)| {
                let reply = t.messages.last().and_then(|m| m.get("content")?.as_str()).unwrap_or("");
                format!("{}{reply}", t.rendered.get(prompt.text.len()..).unwrap_or(""))
            })
            .collect();
        let inputs: Vec<RewardInput> = ended
            .iter()
            .zip(&texts)
            .map(|((t, outcome), text)| RewardInput {
                prompt: &prompt.text,
                completion: text,
                completion_ids: &t.ids,
                truncated: t.finish == FinishReason::Length,
                row: &prompt.row,
                environment: outcome.as_ref().ok().copied(),
            })
            .collect();
        let mut rewards = score_group(&self.rewards, prompt.dataset_row, &inputs);
        for (i, (_, outcome)) in ended.iter().enumerate() {
            if let Err(reason) = outcome {
                // (Replaces the environment reward's own "returned None" for it.)
                let reason = format!("conversation {i} of prompt row {}: {reason}", prompt.dataset_row);
                rewards.fail_completion(i, prompt.dataset_row, env_name, reason);
            }
        }
        let completions = ended.iter().map(|(t, _)| t.completion(t.prompt)).collect();
        let masks = ended.iter().map(|(t, _)| t.trained.clone()).collect();
        let mut group = self.scored_group(p, version, completions, texts, rewards, masks);
        group.forked_rows = ended
            .iter()
            .enumerate()
            .flat_map(|(conversation, (t, _))| {
                t.closed.iter().map(move |c| ForkedRow {
                    conversation,
                    completion: c.completion.clone(),
                    trained_mask: c.trained.clone(),
                })
            })
            .collect();
        group
    }
}

/// One turn of a batch's conversations: what deciding each conversation's fate needs.
struct Round<'a> {
    /// The batch's prompts (indices into the run's).
    picked: &'a [usize],
    /// Their conversations' cache.
    conv: &'a Conversations,
    turns: &'a MultiTurn,
    /// Assistant turns taken.
    turn: usize,
    cfg: &'a GenerationConfig,
}

impl Round<'_> {
    /// Refuses a conversation (cache row `row`) whose next turn would overrun its context:
    /// more tokens than `max_conversation_length`, or more cache slots than are left.
    fn fits(&self, prompt_ids: &[i64], talk: &Talk, row: usize) -> Result<(), String> {
        let (conv, turns, cfg) = (self.conv, self.turns, self.cfg);
        let whole = prompt_ids.len() + talk.ids.len();
        let total = whole + cfg.max_new_tokens;
        if total > turns.max_conversation_length {
            return Err(format!(
                "overruns the context: {total} tokens with the next turn, max_conversation_length is {}",
                turns.max_conversation_length
            ));
        }
        let ids: Vec<i64> = prompt_ids.iter().chain(&talk.ids).copied().collect();
        let tail = conv.tail_len(row, &ids).unwrap_or(whole);
        let need = Conversations::slots_needed(tail, cfg);
        if need > conv.slots_left() {
            return Err(format!(
                "overruns the cache: the next turn needs {need} slots, {} are left of max_conversation_length {} (turns and messages are padded to the prefill chunk)",
                conv.slots_left(),
                turns.max_conversation_length
            ));
        }
        Ok(())
    }
}
