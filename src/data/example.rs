//! One training example in TRL's dataset formats.

use serde_json::Value;

use super::DataError;

/// A row, normalised: conversations become lists of `{role, content}` messages (ShareGPT's
/// `from`/`value` too), extra fields on messages are kept (tool calls, reasoning).
#[derive(Debug, Clone, PartialEq)]
pub enum Example {
    /// `messages`: a whole conversation.
    Conversation {
        /// The messages.
        messages: Vec<Value>,
        /// The row's `tools` column (TRL's per-row tool schemas, rendered by the chat template
        /// as transformers' `tools=`): a list of schemas, stored as a list or as JSON text.
        tools: Option<Value>,
    },
    /// `prompt` + `completion`, each a string or a list of messages.
    PromptCompletion {
        /// The prompt.
        prompt: Value,
        /// The completion.
        completion: Value,
    },
    /// `prompt` only (online methods such as GRPO generate the completion).
    Prompt(Value),
}

const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

fn sharegpt_role(from: &str) -> &str {
    match from {
        "human" | "user" => "user",
        "gpt" | "assistant" | "model" => "assistant",
        "system" => "system",
        "tool" | "function" | "observation" => "tool",
        other => other,
    }
}

/// Validates and normalises one message list of row `row`, field `field`.
pub fn messages(value: &Value, row: usize, field: &'static str) -> Result<Vec<Value>, DataError> {
    let bad = |message: String| DataError::Row { row, field, message };
    let list = value
        .as_array()
        .ok_or_else(|| bad("must be a list of messages".into()))?;
    if list.is_empty() {
        return Err(bad("is an empty conversation".into()));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let obj = m
                .as_object()
                .ok_or_else(|| bad(format!("message {i} is not an object")))?;
            let mut out = obj.clone();
            if let (None, Some(from)) = (obj.get("role"), obj.get("from").and_then(Value::as_str)) {
                out.remove("from");
                out.insert("role".into(), sharegpt_role(from).into());
                if let Some(v) = out.remove("value") {
                    out.insert("content".into(), v);
                }
            }
            let role = out
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("message {i} has no role")))?;
            if !ROLES.contains(&role) {
                return Err(bad(format!("message {i} has unknown role {role:?}")));
            }
            if role == "assistant" {
                let empty = match out.get("content") {
                    None | Some(Value::Null) => true,
                    Some(Value::String(s)) => s.trim().is_empty(),
                    _ => false,
                };
                if empty && out.get("tool_calls").is_none_or(Value::is_null) {
                    return Err(bad(format!("message {i} is an empty assistant turn")));
                }
            }
            // Arrow structs carry every field of every message: drop the nulls they add.
            out.retain(|k, v| !v.is_null() || k == "content");
            Ok(Value::Object(out))
        })
        .collect()
}

/// The `tools` column of row `row`: absent or null is none; JSON text is parsed; either way it
/// must be a list (of tool schemas).
fn tools(row: &serde_json::Map<String, Value>, row_index: usize) -> Result<Option<Value>, DataError> {
    let bad = |message: String| DataError::Row {
        row: row_index,
        field: "tools",
        message,
    };
    let value = match row.get("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(text)) => serde_json::from_str(text).map_err(|e| bad(format!("is not JSON: {e}")))?,
        Some(v) => v.clone(),
    };
    match value {
        Value::Array(list) if list.is_empty() => Ok(None),
        Value::Array(_) => Ok(Some(value)),
        _ => Err(bad("must be a list of tool schemas".into())),
    }
}

impl Example {
    /// Builds an example from a row's JSON object, by the columns present: `messages` (or
    /// `conversations`), else `prompt` (+ `completion`).
    pub fn from_row(row_index: usize, row: &serde_json::Map<String, Value>) -> Result<Self, DataError> {
        let text_or_messages = |v: &Value, field: &'static str| -> Result<Value, DataError> {
            match v {
                Value::String(_) => Ok(v.clone()),
                Value::Array(_) => Ok(Value::Array(messages(v, row_index, field)?)),
                _ => Err(DataError::Row {
                    row: row_index,
                    field,
                    message: "must be a string or a list of messages".into(),
                }),
            }
        };
        for field in ["messages", "conversations"] {
            if let Some(m) = row.get(field).filter(|v| !v.is_null()) {
                return Ok(Example::Conversation {
                    messages: messages(m, row_index, field)?,
                    tools: tools(row, row_index)?,
                });
            }
        }
        match (
            row.get("prompt").filter(|v| !v.is_null()),
            row.get("completion").filter(|v| !v.is_null()),
        ) {
            (Some(p), Some(c)) => Ok(Example::PromptCompletion {
                prompt: text_or_messages(p, "prompt")?,
                completion: text_or_messages(c, "completion")?,
            }),
            (Some(p), None) => Ok(Example::Prompt(text_or_messages(p, "prompt")?)),
            _ => Err(DataError::Row {
                row: row_index,
                field: "messages",
                message: "missing column: expected `messages`, `conversations` or `prompt` (+ `completion`)".into(),
            }),
        }
    }
}
