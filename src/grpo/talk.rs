//! One conversation being rolled out, and how its tokens follow the chat template's rendering.
//!
//! After every assistant turn the conversation is rendered again with the environment's
//! message. When the rendering extends what the model saw (the usual case), only the new text
//! is tokenized and appended: the model's own tokens are never re-tokenized. A template that
//! renders the history otherwise (Qwen3 drops earlier turns' reasoning) departs from the held
//! tokens; the rendering after the prompt is then tokenized and reconciled as TRL's async GRPO
//! does, by `fork_threshold_tokens`:
//! - *realign*: the departure lies inside the latest assistant turn and moves fewer held tokens
//!   than the threshold: the held tokens from there on are replaced by the rendering's, as
//!   context (that part of the turn is no longer trained);
//! - *fork*: it lies earlier or moves more: the held tokens close a training row of their own
//!   (its turns keep their training signal) and the conversation goes on in a new row that
//!   holds the rendering as context. Every row of a conversation trains with its advantage.
//!
//! The generator follows either way: a row whose tokens departed is rewound to what it shares
//! with the new ones ([`crate::generate::Generator::continue_conversations`]).

use serde_json::Value;

use crate::generate::{Completion, FinishReason};
use crate::tokenizer::{ChatOptions, Tokenizer};

/// How a conversation's tokens followed the rendering after a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Drift {
    /// The rendering extended the held tokens.
    Clean,
    /// It departed inside the latest turn: this many held tokens became context.
    Realigned(usize),
    /// It departed earlier or by more: this many held tokens were past the departure, and
    /// the held tokens closed a row.
    Forked(usize),
}

/// A row closed by a fork: its completion (after the prompt) and trained mask.
#[derive(Debug, Clone)]
pub(super) struct ClosedRow {
    pub completion: Completion,
    pub trained: Vec<u8>,
}

/// One conversation being rolled out: what the model saw, what it generated, what it trains.
#[derive(Debug, Clone)]
pub(super) struct Talk {
    /// Index into the batch's prompts.
    pub prompt: usize,
    /// Messages so far (the prompt's, then assistant and environment turns).
    pub messages: Vec<Value>,
    /// The conversation as the template renders it so far (generation prompt included).
    pub rendered: String,
    /// Tokens after the prompt.
    pub ids: Vec<i64>,
    /// 1 on the assistant's generated tokens, 0 on messages.
    pub trained: Vec<u8>,
    /// Generator log-probs of generated tokens under the distribution drawn from (the old
    /// log-probs), 0 on messages.
    pub logprobs: Vec<f32>,
    /// The same tokens' untruncated log-probs, 0 on messages.
    pub untruncated: Vec<f32>,
    /// Where the latest assistant turn starts in `ids`.
    pub turn_start: usize,
    /// Rows this conversation closed by forks, oldest first.
    pub closed: Vec<ClosedRow>,
    /// How the latest turn ended.
    pub finish: FinishReason,
    /// Assistant turns taken.
    pub turns: usize,
}

/// What reconciling a rendering needs besides the conversation.
pub(super) struct Reconcile<'a> {
    /// The prompt as rendered (the text `prompt_ids` encode).
    pub prompt_text: &'a str,
    /// Most held tokens a departure inside the latest turn may move and still realign.
    pub fork_threshold: usize,
}

impl Talk {
    /// A conversation that starts from its prompt's messages and rendering.
    pub(super) fn new(prompt: usize, messages: Vec<Value>, rendered: String) -> Self {
        Talk {
            prompt,
            messages,
            rendered,
            ids: Vec::new(),
            trained: Vec::new(),
            logprobs: Vec::new(),
            untruncated: Vec::new(),
            turn_start: 0,
            closed: Vec::new(),
            finish: FinishReason::Length,
            turns: 0,
        }
    }

    /// Appends an assistant turn the generator made; its text (special tokens removed) becomes
    /// the assistant message.
    pub(crate) fn absorb(&mut self, turn: &Completion, tokenizer: &Tokenizer) -> Result<(), String> {
        let ids: Vec<u32> = turn.output_ids.iter().map(|&t| t as u32).collect();
        let content = tokenizer
            .decode(&ids, true)
            .map_err(|e| format!("turn {} does not decode: {e}", self.turns + 1))?;
        self.turn_start = self.ids.len();
        self.ids.extend(&turn.output_ids);
        self.trained.extend(std::iter::repeat_n(1, turn.output_ids.len()));
        self.logprobs.extend(&turn.logprobs);
        self.untruncated.extend(&turn.untruncated_logprobs);
        self.finish = turn.finish_reason;
        self.turns += 1;
        self.messages
            .push(serde_json::json!({"role": "assistant", "content": content}));
        Ok(())
    }

    /// Appends the environment's messages and the next generation prompt as context. Where the
    /// template renders the conversation as an extension of what the model saw, the text from
    /// the end of the assistant's content on is tokenized (the end-of-turn token the model
    /// generated is not repeated); otherwise the rendering is reconciled (module docs).
    pub(crate) fn add_messages(
        &mut self,
        added: Vec<Value>,
        tokenizer: &Tokenizer,
        chat: &ChatOptions,
        ended_with: Option<&str>,
        reconcile: &Reconcile<'_>,
    ) -> Result<Drift, String> {
        let render = |messages: &[Value], add_generation_prompt: bool| {
            let opts = ChatOptions {
                add_generation_prompt,
                ..chat.clone()
            };
            tokenizer
                .apply_chat_template(&Value::Array(messages.to_vec()), &opts)
                .map(|r| r.text)
                .map_err(|e| format!("the chat template cannot render the conversation: {e}"))
        };
        let reply = self
            .messages
            .last()
            .and_then(|m| m.get("content")?.as_str())
            .unwrap_or("")
            .to_string();
        let with_reply = render(&self.messages, false)?;
        let seen = format!("{}{reply}", self.rendered);
        self.messages.extend(added);
        let next = render(&self.messages, true)?;
        let extension = with_reply
            .strip_prefix(seen.as_str())
            .zip(next.strip_prefix(with_reply.as_str()));
        let drift = match extension {
            Some((closing, message)) => {
                let mut tail = format!("{closing}{message}");
                if let Some(end) = ended_with.filter(|e| tail.starts_with(*e)) {
                    tail.drain(..end.len());
                }
                let ids = encode(tokenizer, &tail)?;
                self.extend_context(&ids);
                Drift::Clean
            }
            None => self.reconcile(&next, tokenizer, reconcile)?,
        };
        self.rendered = next;
        Ok(drift)
    }

    /// Follows a rendering `next` that departs from the held tokens: realigned or forked.
    fn reconcile(&mut self, next: &str, tokenizer: &Tokenizer, r: &Reconcile<'_>) -> Result<Drift, String> {
        // What the model saw before its latest turn is kept token for token when the
        // rendering still starts with it; otherwise everything after the prompt is re-read.
        let (kept, text) = match next.strip_prefix(self.rendered.as_str()) {
            Some(rest) => (self.turn_start, rest),
            None => match next.strip_prefix(r.prompt_text) {
                Some(rest) => (0, rest),
                None => return Err("the chat template renders the prompt otherwise than the model saw it".into()),
            },
        };
        let mut rendered = self.ids[..kept].to_vec();
        rendered.extend(encode(tokenizer, text)?);
        let matched = crate::generate::common_prefix(&self.ids, &rendered);
        let moved = self.ids.len() - matched;
        // Nothing held moved (the tokens extend after all), or little inside the latest turn.
        if moved == 0 || (matched >= self.turn_start && moved < r.fork_threshold) {
            self.truncate(matched);
            self.extend_context(&rendered[matched..]);
            return Ok(if moved == 0 {
                Drift::Clean
            } else {
                Drift::Realigned(moved)
            });
        }
        self.closed.push(ClosedRow {
            completion: self.completion(self.prompt),
            trained: self.trained.clone(),
        });
        self.truncate(0);
        self.extend_context(&rendered);
        Ok(Drift::Forked(moved))
    }

    /// Keeps the first `n` tokens after the prompt.
    fn truncate(&mut self, n: usize) {
        self.ids.truncate(n);
        self.trained.truncate(n);
        self.logprobs.truncate(n);
        self.untruncated.truncate(n);
    }

    /// Appends `ids` as context (untrained).
    fn extend_context(&mut self, ids: &[i64]) {
        self.ids.extend(ids);
        self.trained.extend(std::iter::repeat_n(0, ids.len()));
        self.logprobs.extend(std::iter::repeat_n(0.0, ids.len()));
        self.untruncated.extend(std::iter::repeat_n(0.0, ids.len()));
    }

    /// The conversation's current row after its prompt as one completion (all turns and
    /// messages since the last fork).
    pub(super) fn completion(&self, prompt_index: usize) -> Completion {
        Completion {
            prompt_index,
            output_ids: self.ids.clone(),
            logprobs: self.logprobs.clone(),
            untruncated_logprobs: self.untruncated.clone(),
            finish_reason: self.finish,
        }
    }

    /// Tokens the model generated in all of the conversation's rows.
    pub(crate) fn generated_tokens(&self) -> usize {
        let closed = self.closed.iter().flat_map(|c| &c.trained);
        closed.chain(&self.trained).filter(|&&m| m == 1).count()
    }
}

/// `text` tokenized without special tokens added.
fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<i64>, String> {
    let ids = tokenizer
        .encode(text, false)
        .map_err(|e| format!("the message does not tokenize: {e}"))?;
    Ok(ids.into_iter().map(i64::from).collect())
}
