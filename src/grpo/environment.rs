//! Multi-turn rollouts: an [`Environment`] answers every assistant turn with either the
//! conversation's reward ([`EnvReply::Done`]) or the next message (a tool result or a user
//! turn, [`EnvReply::Message`]), and the generator continues each conversation from its cache.
//!
//! The data contract, whatever the environment:
//! - A rollout is one whole conversation: the prompt, then assistant turns and the
//!   environment's messages as the chat template renders them (`tools=` from
//!   [`Environment::tools`]). Only the assistant's generated tokens are trained; message tokens
//!   (and the template's text around them) are context with completion mask 0.
//! - After the first turn, each conversation that goes on is forked into `turn_generations`
//!   continuations sharing everything before (nested forks: the tree packing forwards the
//!   shared turns once). A prompt's group is all its conversations, leaves of that tree.
//! - The reward is the environment's `Done` value, read by [`RewardFn::environment`] beside
//!   any other reward function (which then sees the whole conversation as the completion).
//! - An environment that fails, panics, returns a non-finite reward, a message after the last
//!   turn, or a message the chat template cannot render or the context cannot hold, fails that
//!   conversation like a failing reward: it is reported with its conversation named and gets
//!   advantage 0; the step goes on.

use serde_json::{Map, Value};

use crate::generate::{Completion, FinishReason};
use crate::tokenizer::{ChatOptions, Tokenizer};

/// Who speaks in a message the environment adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvRole {
    /// A user turn (feedback, a follow-up question).
    User,
    /// A tool's result (`role: "tool"` in transformers' chat format).
    Tool,
}

/// What the environment says after an assistant turn.
#[derive(Debug, Clone, PartialEq)]
pub enum EnvReply {
    /// The conversation is over; this is its reward.
    Done(f32),
    /// The next message; the assistant answers it in the next turn.
    Message {
        /// User or tool.
        role: EnvRole,
        /// Its text.
        content: String,
    },
}

/// One conversation as the environment sees it after an assistant turn.
#[derive(Debug, Clone, Copy)]
pub struct Conversation<'a> {
    /// The dataset row of the prompt (every column, e.g. `answer`).
    pub row: &'a Map<String, Value>,
    /// Every message so far, the prompt's first and the assistant's latest last
    /// (`{"role", "content"}` objects).
    pub messages: &'a [Value],
    /// Assistant turns taken (1 after the first).
    pub turn: usize,
    /// Whether this was the last turn allowed (`max_turns`): the reply must be `Done`.
    pub last_turn: bool,
}

impl Conversation<'_> {
    /// The assistant's latest message text.
    pub fn last_reply(&self) -> &str {
        self.messages
            .last()
            .and_then(|m| m.get("content"))
            .and_then(Value::as_str)
            .unwrap_or("")
    }
}

/// A multi-turn environment: tools, games, simulated users. `Err` (or a panic) fails the
/// conversation, reported with its reason.
pub trait Environment: Send + Sync {
    /// Names the environment's reward in metrics and displays.
    fn name(&self) -> &str;
    /// Tool schemas the chat template renders into the prompt (transformers' `tools=`).
    fn tools(&self) -> Option<Value> {
        None
    }
    /// The reply to the conversation's latest assistant turn.
    fn reply(&self, conversation: &Conversation) -> Result<EnvReply, String>;
}

/// An [`Environment`] from a closure (see [`environment`]).
pub struct FnEnvironment<F> {
    name: String,
    tools: Option<Value>,
    reply: F,
}

/// An environment named `name` that answers with `reply`.
pub fn environment<F>(name: &str, reply: F) -> FnEnvironment<F>
where
    F: Fn(&Conversation) -> Result<EnvReply, String> + Send + Sync,
{
    FnEnvironment {
        name: name.to_string(),
        tools: None,
        reply,
    }
}

impl<F> FnEnvironment<F> {
    /// With tool schemas for the chat template.
    pub fn with_tools(mut self, tools: Value) -> Self {
        self.tools = Some(tools);
        self
    }
}

impl<F> Environment for FnEnvironment<F>
where
    F: Fn(&Conversation) -> Result<EnvReply, String> + Send + Sync,
{
    fn name(&self) -> &str {
        &self.name
    }
    fn tools(&self) -> Option<Value> {
        self.tools.clone()
    }
    fn reply(&self, conversation: &Conversation) -> Result<EnvReply, String> {
        (self.reply)(conversation)
    }
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
    /// Generator log-probs (untruncated) of generated tokens, 0 on messages.
    pub logprobs: Vec<f32>,
    /// How the latest turn ended.
    pub finish: FinishReason,
    /// Assistant turns taken.
    pub turns: usize,
}

impl Talk {
    /// A conversation that starts from its prompt's messages and rendering.
    pub fn new(prompt: usize, messages: Vec<Value>, rendered: String) -> Self {
        Talk {
            prompt,
            messages,
            rendered,
            ids: Vec::new(),
            trained: Vec::new(),
            logprobs: Vec::new(),
            finish: FinishReason::Length,
            turns: 0,
        }
    }

    /// Appends an assistant turn the generator made; its text (special tokens removed) becomes
    /// the assistant message.
    pub fn absorb(&mut self, turn: &Completion, tokenizer: &Tokenizer) -> Result<(), String> {
        let ids: Vec<u32> = turn.output_ids.iter().map(|&t| t as u32).collect();
        let content = tokenizer
            .decode(&ids, true)
            .map_err(|e| format!("turn {} does not decode: {e}", self.turns + 1))?;
        self.ids.extend(&turn.output_ids);
        self.trained.extend(std::iter::repeat_n(1, turn.output_ids.len()));
        self.logprobs.extend(&turn.untruncated_logprobs);
        self.finish = turn.finish_reason;
        self.turns += 1;
        self.messages
            .push(serde_json::json!({"role": "assistant", "content": content}));
        Ok(())
    }

    /// Appends the environment's message: the template's text from the end of the assistant's
    /// content to the next generation prompt, tokenized (the end-of-turn token the model
    /// generated is not repeated). Refused when the template does not render the conversation
    /// as an extension of what the model saw.
    pub fn add_message(
        &mut self,
        role: EnvRole,
        content: &str,
        tokenizer: &Tokenizer,
        chat: &ChatOptions,
        ended_with: Option<&str>,
    ) -> Result<(), String> {
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
        let closing = with_reply.strip_prefix(seen.as_str()).ok_or_else(|| {
            "the chat template renders the assistant turn otherwise than the model generated it".to_string()
        })?;
        let role_name = match role {
            EnvRole::User => "user",
            EnvRole::Tool => "tool",
        };
        self.messages
            .push(serde_json::json!({"role": role_name, "content": content}));
        let next = render(&self.messages, true)?;
        let message = next
            .strip_prefix(with_reply.as_str())
            .ok_or_else(|| "the chat template does not extend the conversation with the message".to_string())?;
        let mut tail = format!("{closing}{message}");
        if let Some(end) = ended_with.filter(|e| tail.starts_with(*e)) {
            tail.drain(..end.len());
        }
        let ids = tokenizer
            .encode(&tail, false)
            .map_err(|e| format!("the message does not tokenize: {e}"))?;
        self.ids.extend(ids.iter().map(|&t| i64::from(t)));
        self.trained.extend(std::iter::repeat_n(0, ids.len()));
        self.logprobs.extend(std::iter::repeat_n(0.0, ids.len()));
        self.rendered = next;
        Ok(())
    }

    /// The conversation after its prompt as one completion (all turns and messages).
    pub fn completion(&self, prompt_index: usize) -> Completion {
        Completion {
            prompt_index,
            output_ids: self.ids.clone(),
            logprobs: self.logprobs.clone(),
            untruncated_logprobs: self.logprobs.clone(),
            finish_reason: self.finish,
        }
    }
}
