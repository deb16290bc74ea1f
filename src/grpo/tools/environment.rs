//! [`ToolEnvironment`]: a multi-turn environment that runs the calls of each assistant turn
//! against a list of typed tools (the contract is in `tools/mod.rs`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde_json::{Value, json};

use super::calls::{CallFormat, ToolCall};
use super::coerce::coerce_arguments;
use super::{Tool, ToolError};
use crate::grpo::{Conversation, EnvReply, Environment, ToolMessage, extract_answer};
use crate::tokenizer::Tokenizer;

/// Where calls that name no tool of the list, or cannot be read at all, are counted.
const UNKNOWN: &str = "(unknown tool)";
const UNREADABLE: &str = "(unreadable call)";

/// What a conversation's reward is, once the model answers without calling a tool.
type RewardOf = dyn Fn(&Conversation) -> Result<f32, String> + Send + Sync;

/// A multi-turn environment of typed tools: each assistant turn's calls are run in order and
/// answered with one tool message each; a turn without calls ends the conversation with the
/// reward (by default 1 when the answer `extract_answer` finds equals the row's `answer`
/// column, else 0).
pub struct ToolEnvironment {
    name: String,
    tools: Vec<Box<dyn Tool>>,
    schemas: Value,
    format: CallFormat,
    max_calls: usize,
    reward: Box<RewardOf>,
    tally: Mutex<ToolTally>,
    names: Vec<String>,
}

/// Calls and failures counted per tool since the tally was last taken, and the conversations
/// they came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ToolTally {
    /// Conversations that took a first turn.
    pub conversations: u64,
    /// Calls run, by tool (unknown tools and unreadable calls under their own keys).
    pub calls: BTreeMap<String, u64>,
    /// Calls that failed (a schema violation, an unknown tool, malformed JSON, the tool's error
    /// or panic), by tool.
    pub failures: BTreeMap<String, u64>,
}

impl ToolTally {
    /// A tally of nothing yet for the tools `names` (every rank's tally has the same keys, so
    /// the counts add up over ranks in one order).
    fn of(names: &[&str]) -> Self {
        let keys = names.iter().copied().chain([UNKNOWN, UNREADABLE]);
        let zeros: BTreeMap<String, u64> = keys.map(|k| (k.to_string(), 0)).collect();
        ToolTally {
            conversations: 0,
            calls: zeros.clone(),
            failures: zeros,
        }
    }

    /// The counts in one fixed order (conversations, then each tool's calls and failures).
    pub(crate) fn counts(&self) -> Vec<f64> {
        let per_tool = self
            .calls
            .iter()
            .flat_map(|(k, &n)| [n, self.failures.get(k).copied().unwrap_or(0)]);
        std::iter::once(self.conversations)
            .chain(per_tool)
            .map(|n| n as f64)
            .collect()
    }

    /// The counts of [`ToolTally::counts`] (summed over ranks) taken back.
    pub(crate) fn set_counts(&mut self, counts: &[f64]) {
        let mut it = counts.iter().map(|&c| c.round() as u64);
        self.conversations = it.next().unwrap_or(0);
        for (name, calls) in self.calls.iter_mut() {
            *calls = it.next().unwrap_or(0);
            self.failures.insert(name.clone(), it.next().unwrap_or(0));
        }
    }

    /// TRL's `tools/call_frequency` (calls per conversation) and `tools/failure_frequency`
    /// (failures per call), then the same per tool (`tools/<name>/...`; a tool never called,
    /// and the unknown and unreadable calls when there were none, are left out).
    pub fn metrics(&self) -> Vec<(String, f64)> {
        let per = |n: u64, of: u64| if of == 0 { 0.0 } else { n as f64 / of as f64 };
        let (calls, failures): (u64, u64) = (self.calls.values().sum(), self.failures.values().sum());
        let mut out = vec![
            ("tools/call_frequency".to_string(), per(calls, self.conversations)),
            ("tools/failure_frequency".to_string(), per(failures, calls)),
        ];
        for (name, &n) in self.calls.iter().filter(|(_, n)| **n > 0) {
            let failed = self.failures.get(name).copied().unwrap_or(0);
            out.push((format!("tools/{name}/call_frequency"), per(n, self.conversations)));
            out.push((format!("tools/{name}/failure_frequency"), per(failed, n)));
        }
        out
    }
}

impl ToolEnvironment {
    /// An environment named `name` offering `tools` to a model whose chat template is
    /// `tokenizer`'s. Refused: no tools, two of one name, or a template that teaches no tool-call
    /// format.
    pub fn new(name: &str, tokenizer: &Tokenizer, tools: Vec<Box<dyn Tool>>) -> Result<Self, ToolError> {
        let source = tokenizer
            .chat_template
            .as_ref()
            .map(|t| t.source.as_str())
            .unwrap_or("");
        let format = CallFormat::of_template(source).ok_or_else(|| {
            ToolError(format!(
                "the chat template of {} has no tool-call format (it writes neither <tool_call> blocks nor Llama 3's JSON calls): this model was not trained to call tools",
                tokenizer.dir.display()
            ))
        })?;
        if tools.is_empty() {
            return Err(ToolError("a tool environment needs at least one tool".into()));
        }
        for (i, t) in tools.iter().enumerate() {
            if tools[..i].iter().any(|u| u.name() == t.name()) {
                return Err(ToolError(format!("two tools are named `{}`", t.name())));
            }
        }
        let schemas = Value::Array(tools.iter().map(|t| t.schema().clone()).collect());
        let names: Vec<String> = tools.iter().map(|t| t.name().to_string()).collect();
        let tally = ToolTally::of(&names.iter().map(String::as_str).collect::<Vec<_>>());
        Ok(ToolEnvironment {
            name: name.to_string(),
            tools,
            schemas,
            format,
            max_calls: 1,
            reward: Box::new(answer_reward),
            tally: Mutex::new(tally),
            names,
        })
    }

    /// With `n` tool-calling turns answered per conversation (default 1); a turn that calls
    /// after them ends the conversation with reward 0. The run's `max_turns` should be at least
    /// `n + 1`.
    pub fn with_max_calls(mut self, n: usize) -> Self {
        self.max_calls = n;
        self
    }

    /// With the reward of a conversation the model ended by answering.
    pub fn with_reward(
        mut self,
        reward: impl Fn(&Conversation) -> Result<f32, String> + Send + Sync + 'static,
    ) -> Self {
        self.reward = Box::new(reward);
        self
    }

    /// The format calls are read in.
    pub fn format(&self) -> CallFormat {
        self.format
    }

    /// The tool messages answering `reply`'s calls, in order (none when it calls no tool),
    /// counted in the tally.
    pub fn answer(&self, reply: &str) -> Vec<ToolMessage> {
        self.answer_calls(self.format.calls(reply))
    }

    /// The tool messages answering `calls`, counted in the tally.
    fn answer_calls(&self, calls: Vec<Result<ToolCall, String>>) -> Vec<ToolMessage> {
        let answers: Vec<(String, Result<String, String>)> = calls.into_iter().map(|c| self.run_one(c)).collect();
        let mut tally = self.tally.lock().unwrap_or_else(|p| p.into_inner());
        answers
            .into_iter()
            .map(|(name, outcome)| {
                *tally.calls.entry(name.clone()).or_default() += 1;
                let content = outcome.unwrap_or_else(|why| {
                    *tally.failures.entry(name.clone()).or_default() += 1;
                    json!({"error": why}).to_string()
                });
                ToolMessage { name, content }
            })
            .collect()
    }

    /// One call: the name it is counted under and the tool's reply or the failure.
    fn run_one(&self, call: Result<ToolCall, String>) -> (String, Result<String, String>) {
        let call = match call {
            Ok(c) => c,
            Err(why) => return (UNREADABLE.into(), Err(why)),
        };
        let Some(tool) = self.tools.iter().find(|t| t.name() == call.name) else {
            let names: Vec<&str> = self.tools.iter().map(|t| t.name()).collect();
            let why = format!("unknown tool `{}`; the tools are: {}", call.name, names.join(", "));
            return (UNKNOWN.into(), Err(why));
        };
        let parameters = &tool.schema()["function"]["parameters"];
        let outcome = coerce_arguments(parameters, &call.arguments).and_then(|args| tool.run(args));
        (call.name, outcome)
    }

    /// The calls and failures counted since the last take, and a fresh count.
    pub fn take_tally(&self) -> ToolTally {
        let names: Vec<&str> = self.names.iter().map(String::as_str).collect();
        let mut tally = self.tally.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut *tally, ToolTally::of(&names))
    }
}

/// 1 when the answer the reply gives equals the row's `answer` column, else 0.
fn answer_reward(c: &Conversation) -> Result<f32, String> {
    let answer = (c.row.get("answer"))
        .map(|a| match a {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .ok_or("the prompt row has no `answer` column (or give the environment a reward)")?;
    Ok(f32::from(u8::from(extract_answer(c.last_reply()) == answer.trim())))
}

impl Environment for ToolEnvironment {
    fn name(&self) -> &str {
        &self.name
    }

    fn tools(&self) -> Option<Value> {
        Some(self.schemas.clone())
    }

    fn reply(&self, c: &Conversation) -> Result<EnvReply, String> {
        if c.turn == 1 {
            self.tally.lock().unwrap_or_else(|p| p.into_inner()).conversations += 1;
        }
        let calls = self.format.calls(c.last_reply());
        if calls.is_empty() {
            return (self.reward)(c).map(EnvReply::Done);
        }
        if c.last_turn || c.turn > self.max_calls {
            // A call with no turn left to read its result.
            return Ok(EnvReply::Done(0.0));
        }
        Ok(EnvReply::ToolResults(self.answer_calls(calls)))
    }

    fn tool_tally(&self) -> Option<ToolTally> {
        Some(self.take_tally())
    }
}

impl ToolTally {
    fn rows(&self) -> Vec<(String, String)> {
        let mut rows = vec![("conversations".to_string(), self.conversations.to_string())];
        for (name, n) in self.calls.iter().filter(|(_, n)| **n > 0) {
            let failed = self.failures.get(name).copied().unwrap_or(0);
            rows.push((format!("{name} calls"), format!("{n} ({failed} failed)")));
        }
        rows.extend(self.metrics().into_iter().map(|(k, v)| (k, format!("{v:.3}"))));
        rows
    }
}

impl crate::display::Rich for ToolTally {
    fn html(&self) -> String {
        card("Tool calls", &self.rows())
    }
    fn text(&self) -> String {
        card_text(&self.rows())
    }
}

crate::display::rich_display!(ToolTally);

impl ToolEnvironment {
    fn rows(&self) -> Vec<(String, String)> {
        let mut rows = vec![
            ("environment".to_string(), self.name.clone()),
            ("call format".to_string(), format!("{:?}", self.format)),
            ("tool-calling turns".to_string(), self.max_calls.to_string()),
        ];
        for t in &self.tools {
            let schema = crate::tokenizer::python_json(t.schema(), None, false);
            rows.push((format!("tool {}", t.name()), schema));
        }
        // Counts since the last step (or since made).
        let tally = self.tally.lock().unwrap_or_else(|p| p.into_inner()).clone();
        rows.extend(tally.rows());
        rows
    }
}

impl crate::display::Rich for ToolEnvironment {
    fn html(&self) -> String {
        card("Tool environment", &self.rows())
    }
    fn text(&self) -> String {
        card_text(&self.rows())
    }
}

/// A card of rows whose names are made at run time (tool names).
fn card(title: &str, rows: &[(String, String)]) -> String {
    let rows: Vec<(&str, String)> = rows.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    crate::display::rows_card(title, &rows)
}

fn card_text(rows: &[(String, String)]) -> String {
    let rows: Vec<(&str, String)> = rows.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    crate::display::rows_text(&rows)
}

crate::display::rich_display!(ToolEnvironment);
