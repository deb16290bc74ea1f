//! Multi-turn decoding: conversations continued turn after turn from their static KV cache.
//! After a turn, each conversation that goes on is given its whole token sequence so far (its
//! prompt, what it generated, then the next message and the generation prompt); only the part
//! its cache does not hold yet is prefilled (the last generated token, the message), and the
//! row is then forked into any number of continuations that share that prefix in the cache
//! (nested forks). Shapes stay the generator's two (`prefill [rows, chunk]`, `decode [rows, 1]`).

use crate::device::privateuse1;
use crate::model::{CausalLm, KvCache, StaticCache};

use super::completion::Completion;
use super::config::{GenerateError, GenerationConfig};
use super::decoding::Decoding;
use super::generator::Generator;

/// Conversations being decoded turn by turn: one cache row each.
pub struct Conversations {
    state: Decoding<StaticCache>,
    /// Every row's tokens so far: what it was given and what it generated.
    tokens: Vec<Vec<i64>>,
    /// The prompt each row continues (an index into the prompts it was started with).
    pub prompt_index: Vec<usize>,
}

impl std::fmt::Debug for Conversations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conversations")
            .field("rows", &self.rows())
            .field("slots_used", &self.state.cache.len())
            .field("slots", &self.state.cache.max_len)
            .finish()
    }
}

impl Conversations {
    /// Rows (conversations) held.
    pub fn rows(&self) -> usize {
        self.prompt_index.len()
    }

    /// Row `row`'s tokens so far: what it was given and what it generated.
    pub fn tokens(&self, row: usize) -> Option<&[i64]> {
        self.tokens.get(row).map(Vec::as_slice)
    }

    /// Tokens of `row` held in the cache (its prompt, earlier turns and messages; a turn's last
    /// generated token is added with the next message).
    pub(crate) fn cached_tokens(&self, row: usize) -> Option<usize> {
        self.state.next_pos.get(row).map(|&p| p as usize)
    }

    /// How many tokens at the end of `whole` row `row` must prefill to go on from it: those
    /// past what its cache holds, and past where `whole` departs from the row's tokens (the row
    /// is then rewound). `None`: no such row.
    pub(crate) fn tail_len(&self, row: usize, whole: &[i64]) -> Option<usize> {
        let shared = common_prefix(self.tokens(row)?, whole);
        Some(whole.len() - self.cached_tokens(row)?.min(shared))
    }

    /// Cache slots not used yet. Every row advances the same slots (a turn's decode steps and
    /// each continuation's prefill chunks), so one number holds for all.
    pub(crate) fn slots_left(&self) -> i64 {
        self.state.cache.max_len - self.state.cache.len()
    }

    /// Slots a continuation with a new tail of `tail` tokens and a turn of `max_new_tokens`
    /// needs: the tail padded to the prefill chunk, then the decode steps.
    pub(crate) fn slots_needed(tail: usize, cfg: &GenerationConfig) -> i64 {
        let chunk = cfg.prefill_chunk_size.max(1);
        (tail as i64 + chunk - 1) / chunk * chunk + cfg.max_new_tokens as i64
    }
}

impl Conversations {
    fn rows_shown(&self) -> Vec<(&'static str, String)> {
        vec![
            ("conversations", self.rows().to_string()),
            (
                "cache slots used / held",
                format!("{} / {}", self.state.cache.len(), self.state.cache.max_len),
            ),
            (
                "tokens per conversation",
                match (
                    self.tokens.iter().map(Vec::len).min(),
                    self.tokens.iter().map(Vec::len).max(),
                ) {
                    (Some(lo), Some(hi)) => format!("{lo} to {hi}"),
                    _ => "none".into(),
                },
            ),
        ]
    }
}

impl crate::display::Rich for Conversations {
    fn html(&self) -> String {
        crate::display::rows_card("Conversations", &self.rows_shown())
    }
    fn text(&self) -> String {
        crate::display::rows_text(&self.rows_shown())
    }
}

crate::display::rich_display!(Conversations);

impl Generator {
    /// Starts `group` conversations per prompt: each prompt prefilled once, its cache row
    /// forked into `group` rows, the first assistant turn decoded. The cache holds
    /// `cfg.max_cache_len` slots (set it for the whole conversation; default: the first turn
    /// only). Rows come prompt by prompt, as [`Generator::generate_groups`]'s completions.
    pub fn start_conversations(
        &mut self,
        model: &CausalLm,
        prompts: &[Vec<i64>],
        group: usize,
        cfg: &GenerationConfig,
    ) -> Result<(Conversations, Vec<Completion>), GenerateError> {
        self.check(model, prompts, cfg)?;
        if group == 0 {
            return Err(GenerateError::Config("num_generations must be at least 1".into()));
        }
        privateuse1::checked(model.device(), || {
            let (mut state, prompt_index) = self.prefill_groups(model, prompts, group, cfg)?;
            let out = tch::no_grad(|| self.decode(model, &mut state, &prompt_index, cfg))?;
            let tokens = out
                .iter()
                .map(|c| prompts[c.prompt_index].iter().chain(&c.output_ids).copied().collect())
                .collect();
            Ok((
                Conversations {
                    state,
                    tokens,
                    prompt_index,
                },
                out,
            ))
        })
    }

    /// Continues conversations. `turns[i] = (row, whole)`: row `row` of `conv` goes on, `whole`
    /// being its whole token sequence so far. It extends what the row was given and generated,
    /// or departs from it (a chat template that renders the history otherwise than the model saw
    /// it): the row is then rewound to the tokens both share, its cache past them dropped. The
    /// part the cache lacks is prefilled, then each turn is forked into `forks`
    /// rows that decode the next assistant turn. Afterwards `conv` holds exactly those rows
    /// (`turns.len() x forks`, turn by turn); the completions come in that order. Rows not
    /// named are dropped (finished conversations).
    pub fn continue_conversations(
        &mut self,
        model: &CausalLm,
        conv: &mut Conversations,
        turns: &[(usize, Vec<i64>)],
        forks: usize,
        cfg: &GenerationConfig,
    ) -> Result<Vec<Completion>, GenerateError> {
        let tails = self.check_turns(model, conv, turns, forks, cfg)?;
        let rows: Vec<i64> = turns.iter().map(|(r, _)| *r as i64).collect();
        privateuse1::checked(model.device(), || {
            let mut state = tch::no_grad(|| conv.state.fork(&rows))?;
            for (t, ((_, whole), tail)) in turns.iter().zip(&tails).enumerate() {
                let keep = whole.len() - tail.len();
                if (keep as i64) < state.next_pos[t] {
                    tch::no_grad(|| state.rewind(t, &whole[..keep], model.config.vocab_size))?;
                }
            }
            tch::no_grad(|| self.extend(model, &mut state, &tails, cfg))?;
            let forked: Vec<i64> = (0..turns.len() as i64)
                .flat_map(|t| std::iter::repeat_n(t, forks))
                .collect();
            let mut state = tch::no_grad(|| state.fork(&forked))?;
            let prompt_index: Vec<usize> = forked.iter().map(|&t| conv.prompt_index[turns[t as usize].0]).collect();
            let out = tch::no_grad(|| self.decode(model, &mut state, &prompt_index, cfg))?;
            let tokens = forked
                .iter()
                .zip(&out)
                .map(|(&t, c)| turns[t as usize].1.iter().chain(&c.output_ids).copied().collect())
                .collect();
            *conv = Conversations {
                state,
                tokens,
                prompt_index,
            };
            Ok(out)
        })
    }

    /// Each turn's new tail (what its row's cache lacks), refusing turns that name no row, do
    /// not extend it, overrun the model's positions, or together overrun the cache.
    fn check_turns(
        &self,
        model: &CausalLm,
        conv: &Conversations,
        turns: &[(usize, Vec<i64>)],
        forks: usize,
        cfg: &GenerationConfig,
    ) -> Result<Vec<Vec<i64>>, GenerateError> {
        if turns.is_empty() || forks == 0 {
            return Err(GenerateError::Config(
                "no conversation to continue (or forks = 0)".into(),
            ));
        }
        let vocab = model.config.vocab_size;
        let mut tails = Vec::with_capacity(turns.len());
        for (index, (row, whole)) in turns.iter().enumerate() {
            let bad = |message: String| GenerateError::Prompt { index, message };
            let (Some(tail), Some(so_far)) = (conv.tail_len(*row, whole), conv.tokens(*row)) else {
                return Err(bad(format!("row {row}: the conversations hold {} rows", conv.rows())));
            };
            if common_prefix(so_far, whole) == whole.len() {
                return Err(bad(format!(
                    "row {row}: {} tokens that do not extend the row's {} (its prompt and what it generated) by a message",
                    whole.len(),
                    so_far.len()
                )));
            }
            if let Some(t) = whole.iter().find(|&&t| t < 0 || t >= vocab) {
                return Err(bad(format!("token {t} outside 0..{vocab}")));
            }
            model
                .config
                .check_positions(
                    whole.len().saturating_add(cfg.max_new_tokens),
                    &format!("conversation {index} + max_new_tokens {}", cfg.max_new_tokens),
                )
                .map_err(GenerateError::Config)?;
            tails.push(whole[whole.len() - tail..].to_vec());
        }
        let longest = tails.iter().map(Vec::len).max().unwrap_or(0);
        let need = Conversations::slots_needed(longest, cfg);
        if need > conv.slots_left() {
            return Err(GenerateError::Config(format!(
                "the cache has {} slots left; a {longest}-token message and {} new tokens need {need} (raise max_cache_len)",
                conv.slots_left(),
                cfg.max_new_tokens
            )));
        }
        Ok(tails)
    }
}

/// How many tokens at the start `a` and `b` share.
pub(crate) fn common_prefix(a: &[i64], b: &[i64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
