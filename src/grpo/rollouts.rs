//! Prompts, the seeded prompt order, and turning generated groups into scored rollouts.

use serde_json::{Map, Value};

use super::advantage::mean_std;
use super::advantage::{MultiObjective, ScaleRewards};
use super::reward::GroupRewards;
use crate::data::Dataset;
use crate::distributed::{DistError, World};
use crate::generate::{Completion, FinishReason};
use crate::pack::Rollout;
use crate::tokenizer::{ChatOptions, Tokenizer};
use crate::train::TrainError;
use crate::util::SplitMix64;

/// One usable prompt.
#[derive(Debug, Clone)]
pub struct PromptRow {
    /// Row of the dataset it came from.
    pub dataset_row: usize,
    /// Prompt token ids (chat template with the generation prompt applied).
    pub ids: Vec<i64>,
    /// Prompt text as rendered.
    pub text: String,
    /// The whole dataset row (reward functions read `answer` and the like from it).
    pub row: Map<String, Value>,
}

/// The prompts of a run.
#[derive(Debug, Clone, Default)]
pub struct PromptSet {
    /// Usable prompts, in dataset order.
    pub prompts: Vec<PromptRow>,
    /// Rows skipped (`skip_invalid_rows`).
    pub skipped: usize,
}

impl PromptSet {
    /// Reads `field` of every row: a list of chat messages (rendered with the generation
    /// prompt) or a string (tokenized as is). A row without it, of another type or longer than
    /// `max_len` tokens is an error naming it, or skipped and counted with `skip_invalid`.
    pub fn load(
        ds: &Dataset,
        tokenizer: &Tokenizer,
        field: &str,
        max_len: usize,
        skip_invalid: bool,
    ) -> Result<Self, TrainError> {
        Self::load_with_tools(ds, tokenizer, field, max_len, skip_invalid, None)
    }

    /// [`PromptSet::load`], chat prompts rendered with `tools` (transformers' `tools=`).
    pub(crate) fn load_with_tools(
        ds: &Dataset,
        tokenizer: &Tokenizer,
        field: &str,
        max_len: usize,
        skip_invalid: bool,
        tools: Option<Value>,
    ) -> Result<Self, TrainError> {
        let chat = ChatOptions {
            tools,
            ..Default::default()
        };
        Self::load_with_chat(ds, tokenizer, field, max_len, skip_invalid, chat)
    }

    /// [`PromptSet::load`], chat prompts rendered with `chat`'s tools and template variables
    /// (always with the generation prompt).
    pub(crate) fn load_with_chat(
        ds: &Dataset,
        tokenizer: &Tokenizer,
        field: &str,
        max_len: usize,
        skip_invalid: bool,
        chat: ChatOptions,
    ) -> Result<Self, TrainError> {
        let mut set = PromptSet::default();
        let opts = ChatOptions {
            add_generation_prompt: true,
            ..chat
        };
        for (i, row) in ds.rows().enumerate() {
            let row = row.map_err(|e| TrainError::Data(e.to_string()))?;
            let made = match row.get(field) {
                Some(messages @ Value::Array(_)) => tokenizer
                    .tokenize_chat(messages, &opts)
                    .map(|c| (c.text, c.input_ids))
                    .map_err(|e| e.to_string()),
                Some(Value::String(text)) => tokenizer
                    .encode(text, true)
                    .map(|ids| (text.clone(), ids))
                    .map_err(|e| e.to_string()),
                Some(other) => Err(format!("`{field}` is neither messages nor text: {other}")),
                None => Err(format!("has no `{field}` column")),
            }
            .and_then(|(text, ids)| match ids.len() {
                0 => Err(format!("`{field}` tokenizes to nothing")),
                n if n > max_len => Err(format!("prompt has {n} tokens, max_prompt_length is {max_len}")),
                _ => Ok((text, ids)),
            });
            match made {
                Ok((text, ids)) => set.prompts.push(PromptRow {
                    dataset_row: i,
                    ids: ids.into_iter().map(i64::from).collect(),
                    text,
                    row,
                }),
                Err(_) if skip_invalid => set.skipped += 1,
                Err(message) => return Err(TrainError::Data(format!("prompt row {i} (0-based): {message}"))),
            }
        }
        if set.prompts.is_empty() {
            return Err(TrainError::Data("no usable prompt".into()));
        }
        Ok(set)
    }
}

/// Seeded prompt order: a fresh permutation every epoch.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PromptSampler {
    seed: u64,
    epoch: u64,
    cursor: usize,
    order: Vec<usize>,
}

impl PromptSampler {
    /// An order over `n` prompts.
    pub fn new(n: usize, seed: u64) -> Self {
        let mut s = PromptSampler {
            seed,
            epoch: 0,
            cursor: 0,
            order: (0..n).collect(),
        };
        s.shuffle();
        s
    }

    fn shuffle(&mut self) {
        let mut rng = SplitMix64::new(self.seed.wrapping_add(self.epoch.wrapping_mul(0x9e37_79b9)));
        for i in (1..self.order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            self.order.swap(i, j);
        }
    }

    /// The next `k` prompt indices (wrapping into a new epoch).
    pub fn take(&mut self, k: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(k);
        while out.len() < k && !self.order.is_empty() {
            if self.cursor == self.order.len() {
                self.epoch += 1;
                self.cursor = 0;
                self.shuffle();
            }
            out.push(self.order[self.cursor]);
            self.cursor += 1;
        }
        out
    }
}

/// The completions of one prompt with their rewards and advantages.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ScoredGroup {
    /// Weight version that generated it.
    pub version: u64,
    /// Running number of the generation call that made it.
    pub origin: u64,
    /// Index into the run's [`PromptSet`].
    pub prompt: usize,
    /// Dataset row of the prompt.
    pub dataset_row: usize,
    /// Prompt ids.
    pub prompt_ids: Vec<i64>,
    /// The prompt as the model saw it (chat template applied).
    pub prompt_text: String,
    /// The G completions.
    pub completions: Vec<Completion>,
    /// Their text.
    pub texts: Vec<String>,
    /// Scores per function and totals.
    pub rewards: GroupRewards,
    /// One per completion.
    pub advantages: Vec<f32>,
    /// Multi-turn: per completion, 1 on the tokens the model generated, 0 on the environment's
    /// messages (empty: single-turn, every completion token trained).
    #[serde(default)]
    pub trained_masks: Vec<Vec<u8>>,
    /// Multi-turn: rows that conversations closed when the chat template re-rendered their
    /// history (`fork_threshold_tokens`); each trains with its conversation's advantage.
    #[serde(default)]
    pub forked_rows: Vec<ForkedRow>,
    /// Multi-turn: how its conversations' tokens followed the re-rendered history.
    #[serde(default)]
    pub drift: DriftTally,
    /// A mixture model's routing of each completion's tokens as the generator recorded it (see
    /// `Generator::record_routing`); empty when not recorded (multi-turn conversations).
    #[serde(skip)]
    pub routing: Vec<crate::model::moe::RoutingTrace>,
}

/// Over a group's turn transitions (an environment message after an assistant turn): how
/// many were realigned or forked, and how many held tokens the departures moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DriftTally {
    /// Transitions counted.
    pub transitions: usize,
    /// Realigned ones.
    pub realigned: usize,
    /// Forked ones.
    pub forked: usize,
    /// Held tokens moved, summed.
    pub drift_tokens: usize,
    /// The most moved at one transition.
    pub drift_max: usize,
}

impl DriftTally {
    /// Counts one transition.
    pub(super) fn add(&mut self, drift: super::talk::Drift) {
        use super::talk::Drift;
        self.transitions += 1;
        let moved = match drift {
            Drift::Clean => 0,
            Drift::Realigned(n) => {
                self.realigned += 1;
                n
            }
            Drift::Forked(n) => {
                self.forked += 1;
                n
            }
        };
        self.drift_tokens += moved;
        self.drift_max = self.drift_max.max(moved);
    }

    /// The tallies of `groups` together.
    pub(crate) fn over<'a>(groups: impl IntoIterator<Item = &'a ScoredGroup>) -> Self {
        groups.into_iter().fold(DriftTally::default(), |a, g| DriftTally {
            transitions: a.transitions + g.drift.transitions,
            realigned: a.realigned + g.drift.realigned,
            forked: a.forked + g.drift.forked,
            drift_tokens: a.drift_tokens + g.drift.drift_tokens,
            drift_max: a.drift_max.max(g.drift.drift_max),
        })
    }
}

/// A row a multi-turn conversation closed by a fork: the turns so far, trained with the
/// advantage of conversation `conversation` (an index into its group's completions).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ForkedRow {
    /// The conversation it belongs to.
    pub conversation: usize,
    /// Its tokens after the prompt.
    pub completion: Completion,
    /// 1 on the tokens the model generated.
    pub trained_mask: Vec<u8>,
}

impl ScoredGroup {
    /// Tokens the model generated for completion `i` (multi-turn: its turns, not the
    /// environment's messages).
    pub(crate) fn generated_tokens(&self, i: usize) -> usize {
        let trained = |mask: &[u8]| mask.iter().filter(|&&m| m == 1).count();
        let forked = self.forked_rows.iter().filter(|f| f.conversation == i);
        match self.trained_masks.get(i) {
            Some(mask) => trained(mask) + forked.map(|f| trained(&f.trained_mask)).sum::<usize>(),
            None => self.completions.get(i).map_or(0, |c| c.output_ids.len()),
        }
    }
}

/// One step's worth of scored groups and how they were made.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RolloutBatch {
    /// Weight version (optimizer steps) of the oldest weights that generated its groups.
    pub version: u64,
    /// Running number of the batch (generated, or assembled from queued groups in async mode).
    pub index: u64,
    /// The groups.
    pub groups: Vec<ScoredGroup>,
    /// Seconds spent generating (async: the groups' shares of their generation calls).
    pub generation_s: f64,
    /// Seconds spent scoring (async: the groups' shares).
    pub reward_s: f64,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Names of the reward functions, in `per_function` order.
    pub reward_names: Vec<String>,
}

impl RolloutBatch {
    /// The rollouts to train on, group by group: prompt tokens untrained, completion tokens
    /// trained with the generator's log-probs (under the distribution each token was drawn
    /// from) as old log-probs.
    pub fn rollouts(&self) -> Vec<Rollout> {
        self.rollouts_for_update(false)
    }

    /// [`RolloutBatch::rollouts`], leaving out completions cut at the length limit when
    /// `mask_truncated` (their advantages still came from the whole group; a multi-turn
    /// conversation's forked rows go with it).
    pub fn rollouts_for_update(&self, mask_truncated: bool) -> Vec<Rollout> {
        let mut out = Vec::new();
        for g in &self.groups {
            let kept = |i: usize| !(mask_truncated && g.completions[i].finish_reason == FinishReason::Length);
            let rows = (0..g.completions.len()).map(|i| (i, &g.completions[i], g.trained_masks.get(i)));
            let forked = g
                .forked_rows
                .iter()
                .map(|f| (f.conversation, &f.completion, Some(&f.trained_mask)));
            for (i, c, mask) in rows.chain(forked).filter(|(i, _, _)| kept(*i)) {
                let p = g.prompt_ids.len();
                let mut completion_mask = vec![0; p];
                match mask {
                    Some(mask) => completion_mask.extend(mask),
                    None => completion_mask.extend(std::iter::repeat_n(1, c.output_ids.len())),
                }
                out.push(Rollout {
                    completion_mask,
                    old_log_probs: std::iter::repeat_n(0.0, p).chain(c.logprobs.iter().copied()).collect(),
                    input_ids: g.prompt_ids.iter().chain(&c.output_ids).copied().collect(),
                    advantage: g.advantages[i],
                    group_id: format!("{}/{}", g.origin, g.dataset_row),
                });
            }
        }
        out
    }

    /// The recorded routing of each rollout [`RolloutBatch::rollouts_for_update`] gives, in
    /// its order (`None` where none was recorded: a forked multi-turn row, say).
    pub(crate) fn routing_for_update(&self, mask_truncated: bool) -> Vec<Option<&crate::model::moe::RoutingTrace>> {
        let mut out = Vec::new();
        for g in &self.groups {
            let kept = |i: usize| !(mask_truncated && g.completions[i].finish_reason == FinishReason::Length);
            out.extend((0..g.completions.len()).filter(|&i| kept(i)).map(|i| g.routing.get(i)));
            out.extend(g.forked_rows.iter().filter(|f| kept(f.conversation)).map(|_| None));
        }
        out
    }

    /// All rollouts' total rewards (None: failed).
    pub fn totals(&self) -> impl Iterator<Item = Option<f32>> + '_ {
        self.groups.iter().flat_map(|g| g.rewards.total.iter().copied())
    }

    /// The batch cut into single groups, each carrying its share of the batch's time and tokens
    /// (what the async generation thread queues).
    pub(crate) fn into_groups(self) -> Vec<QueuedGroup> {
        let n = self.groups.len().max(1) as f64;
        let (generation_s, reward_s) = (self.generation_s / n, self.reward_s / n);
        self.groups
            .into_iter()
            .map(|group| QueuedGroup {
                generated_tokens: group.completions.iter().map(|c| c.output_ids.len()).sum(),
                group,
                generation_s,
                reward_s,
            })
            .collect()
    }

    /// The whole step's batch from every rank's share (each rank generated and scored its
    /// prompts): groups in rank order, which is the order one process would have made them in.
    /// Tokens add up; seconds are the slowest rank's (the ranks worked in parallel).
    pub fn gather(self, world: &World) -> Result<Self, TrainError> {
        if !world.is_distributed() {
            return Ok(self);
        }
        let share = BatchShare {
            version: self.version,
            groups: self.groups,
            generation_s: self.generation_s,
            reward_s: self.reward_s,
            generated_tokens: self.generated_tokens,
        };
        let fail = |e: serde_json::Error| DistError::new(world.rank, "all_gather (rollouts)", e.to_string());
        let bytes = serde_json::to_vec(&share).map_err(fail)?;
        let mut out = RolloutBatch {
            version: u64::MAX,
            groups: Vec::new(),
            generation_s: 0.0,
            reward_s: 0.0,
            generated_tokens: 0,
            ..self
        };
        for part in world.all_gather_bytes(&bytes)? {
            let share: BatchShare = serde_json::from_slice(&part).map_err(fail)?;
            out.version = out.version.min(share.version);
            out.groups.extend(share.groups);
            out.generation_s = out.generation_s.max(share.generation_s);
            out.reward_s = out.reward_s.max(share.reward_s);
            out.generated_tokens += share.generated_tokens;
        }
        Ok(out)
    }

    /// Share of groups whose scored rewards are all equal (within 1e-6): their advantages
    /// are 0 and they add no gradient (TRL's `frac_reward_zero_std`).
    pub fn frac_reward_zero_std(&self) -> f64 {
        let flat = self
            .groups
            .iter()
            .filter(|g| {
                let (_, std) = mean_std(
                    &g.rewards
                        .total
                        .iter()
                        .flatten()
                        .map(|&r| f64::from(r))
                        .collect::<Vec<_>>(),
                );
                std <= 1e-6
            })
            .count();
        flat as f64 / self.groups.len().max(1) as f64
    }

    /// The step-wide stage of the advantages, once the step's batch is complete (all ranks'
    /// groups gathered): `scale_rewards = "batch"` divides every group's centred advantages by
    /// the standard deviation of all the step's scored rewards (+1e-4, as TRL); GDPO
    /// (`normalize_then_sum`) centres and scales the groups' decoupled sums over the step's
    /// scored rollouts (failed ones stay 0).
    pub(crate) fn scale_advantages(&mut self, scale: ScaleRewards, aggregation: MultiObjective) {
        if aggregation == MultiObjective::NormalizeThenSum {
            let scored: Vec<(usize, usize)> = (self.groups.iter().enumerate())
                .flat_map(|(g, group)| (0..group.advantages.len()).map(move |i| (g, i)))
                .filter(|&(g, i)| self.groups[g].rewards.total.get(i).copied().flatten().is_some())
                .collect();
            let values: Vec<f64> = scored
                .iter()
                .map(|&(g, i)| f64::from(self.groups[g].advantages[i]))
                .collect();
            let (mean, std) = mean_std(&values);
            for (&(g, i), v) in scored.iter().zip(values) {
                self.groups[g].advantages[i] = ((v - mean) / (std + 1e-4)) as f32;
            }
            return;
        }
        if scale != ScaleRewards::Batch {
            return;
        }
        let all: Vec<f64> = self.totals().flatten().map(f64::from).collect();
        let (_, std) = mean_std(&all);
        for a in self.groups.iter_mut().flat_map(|g| g.advantages.iter_mut()) {
            *a = (f64::from(*a) / (std + 1e-4)) as f32;
        }
    }

    /// The batch cut into `n` slices of consecutive groups (equal when `n` divides the groups),
    /// each with its share of the generation and scoring seconds and its own tokens.
    pub fn split(self, n: usize) -> Vec<RolloutBatch> {
        let total = self.groups.len().max(1) as f64;
        let size = self.groups.len().div_ceil(n.max(1)).max(1);
        let mut groups = self.groups.into_iter().peekable();
        let mut out = Vec::new();
        while groups.peek().is_some() {
            let part: Vec<ScoredGroup> = groups.by_ref().take(size).collect();
            let share = part.len() as f64 / total;
            out.push(RolloutBatch {
                version: self.version,
                index: self.index,
                generation_s: self.generation_s * share,
                reward_s: self.reward_s * share,
                generated_tokens: part
                    .iter()
                    .map(|g| (0..g.completions.len()).map(|i| g.generated_tokens(i)).sum::<usize>())
                    .sum(),
                groups: part,
                reward_names: self.reward_names.clone(),
            });
        }
        out
    }

    /// A batch assembled from queued groups (async mode).
    pub(crate) fn from_groups(index: u64, groups: Vec<QueuedGroup>, reward_names: Vec<String>) -> Self {
        RolloutBatch {
            version: groups.iter().map(|g| g.group.version).min().unwrap_or(0),
            index,
            generation_s: groups.iter().map(|g| g.generation_s).sum(),
            reward_s: groups.iter().map(|g| g.reward_s).sum(),
            generated_tokens: groups.iter().map(|g| g.generated_tokens).sum(),
            groups: groups.into_iter().map(|g| g.group).collect(),
            reward_names,
        }
    }
}

/// One rank's part of a step's batch, as sent to the others.
#[derive(serde::Serialize, serde::Deserialize)]
struct BatchShare {
    version: u64,
    groups: Vec<ScoredGroup>,
    generation_s: f64,
    reward_s: f64,
    generated_tokens: usize,
}

/// One scored group as the async generation thread queues it.
#[derive(Debug, Clone)]
pub struct QueuedGroup {
    /// The group (with the weight version that generated it).
    pub group: ScoredGroup,
    /// Its share of its generation call's seconds.
    pub generation_s: f64,
    /// Its share of the scoring seconds.
    pub reward_s: f64,
    /// Tokens generated for it.
    pub generated_tokens: usize,
}
