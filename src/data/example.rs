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
            if let Some(Value::Array(parts)) = out.get("content") {
                check_parts(parts).map_err(|m| bad(format!("message {i}'s content {m}")))?;
            }
            // Arrow structs carry every field of every message: drop the nulls they add.
            out.retain(|k, v| !v.is_null() || k == "content");
            Ok(Value::Object(out))
        })
        .collect()
}

/// What a vision-language or audio dataset holds and a text-only decoder cannot take.
const MEDIA: [&str; 6] = ["image", "image_url", "video", "audio", "input_audio", "file"];

/// Why a message's list of content parts (transformers' `[{"type": "text", "text": ...}]`)
/// cannot be trained on: a part that is not an object, or media (images, audio, video).
fn check_parts(parts: &[Value]) -> Result<(), String> {
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str);
        if let Some(kind) = kind.filter(|k| MEDIA.contains(k)) {
            return Err(format!("part {j} is {kind:?}: {UNSUPPORTED}"));
        }
        if !part.is_object() {
            return Err(format!("part {j} is not an object with a \"type\""));
        }
    }
    Ok(())
}

const UNSUPPORTED: &str =
    "treetrain trains text-only decoders; image, audio and video inputs (vision-language datasets) are not supported";

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
        for field in ["images", "image", "audios", "videos"] {
            let media = |v: &Value| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty());
            if row.get(field).is_some_and(media) {
                return Err(DataError::Row {
                    row: row_index,
                    field,
                    message: format!("is a media column: {UNSUPPORTED}"),
                });
            }
        }
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
