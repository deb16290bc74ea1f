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
//! - A chat template that renders the history otherwise than the model saw it (Qwen3 drops
//!   earlier turns' reasoning) is followed: the departure is realigned as context or forks a
//!   new training row, by `fork_threshold_tokens` (`grpo::talk`, as TRL's async GRPO).
//! - An environment that fails, panics, returns a non-finite reward, a message after the last
//!   turn, or a message the chat template cannot render or the context cannot hold, fails that
//!   conversation like a failing reward: it is reported with its conversation named and gets
//!   advantage 0; the step goes on.

use serde_json::{Map, Value};

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
    /// One tool message per call of the turn, in the calls' order (`{"role": "tool", "name",
    /// "content"}`); the assistant answers them in the next turn.
    ToolResults(Vec<ToolMessage>),
}

impl EnvReply {
    /// The messages this reply adds to the conversation, as the chat template reads them
    /// (`None` for `Done`, which adds none; an empty list of tool results adds none either).
    pub(crate) fn into_messages(self) -> Option<Vec<Value>> {
        match self {
            EnvReply::Done(_) => None,
            EnvReply::Message { role, content } => {
                let role = match role {
                    EnvRole::User => "user",
                    EnvRole::Tool => "tool",
                };
                Some(vec![serde_json::json!({"role": role, "content": content})])
            }
            EnvReply::ToolResults(results) => Some(
                (results.into_iter())
                    .map(|m| serde_json::json!({"role": "tool", "name": m.name, "content": m.content}))
                    .collect(),
            ),
        }
    }
}

/// A tool's reply to one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolMessage {
    /// The tool called (as the model named it).
    pub name: String,
    /// Its result, or `{"error": ...}`.
    pub content: String,
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
    /// The tool calls and failures counted since the last call (a [`super::ToolEnvironment`]'s),
    /// logged with each step as `tools/call_frequency` and the rest; none by default.
    fn tool_tally(&self) -> Option<super::ToolTally> {
        None
    }
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
