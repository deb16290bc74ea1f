//! The tool calls of an assistant turn, read in the format its chat template teaches: Qwen's
//! and Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (any number of them),
//! or Llama 3.x's JSON tool calls (the reply, after an optional `<|python_tag|>`, is
//! `{"name": ..., "parameters": {...}}`, several separated by `;`). Calls inside reasoning
//! (`<think>...</think>`) are thoughts, not calls.

use serde_json::Value;

/// How a chat template family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// `<tool_call>` JSON `</tool_call>` blocks (Qwen 2.5 and 3, Hermes, the shipped tiny
    /// models).
    Hermes,
    /// A JSON object as the whole reply (Llama 3.1 to 3.3).
    Llama3Json,
}

/// One call as the model wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments, not yet checked against the schema.
    pub arguments: Value,
}

impl CallFormat {
    /// The format a chat template's source teaches, or `None` when it has none (a template
    /// that never renders `tools`).
    pub fn of_template(source: &str) -> Option<Self> {
        if source.contains("<tool_call>") {
            Some(CallFormat::Hermes)
        } else if source.contains("<|python_tag|>") || source.contains("Environment: ipython") {
            Some(CallFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The calls of `reply`, in order: each read, or why it cannot be (the model is told).
    pub fn calls(self, reply: &str) -> Vec<Result<ToolCall, String>> {
        let reply = without_reasoning(reply);
        match self {
            CallFormat::Hermes => hermes_blocks(reply)
                .into_iter()
                .map(|b| call_of(b, "arguments"))
                .collect(),
            CallFormat::Llama3Json => {
                let body = reply.trim_start();
                let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
                if !body.starts_with('{') {
                    return Vec::new();
                }
                split_top_level(body)
                    .into_iter()
                    .map(|b| call_of(b, "parameters"))
                    .collect()
            }
        }
    }
}

/// `reply` after its reasoning block, when it has one.
fn without_reasoning(reply: &str) -> &str {
    match reply.rfind("</think>") {
        Some(end) => &reply[end + "</think>".len()..],
        None => reply,
    }
}

/// The bodies of `<tool_call>` blocks; a last block cut off before `</tool_call>` (generation
/// stopped there) still counts.
fn hermes_blocks(reply: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = reply;
    while let Some((_, after)) = rest.split_once("<tool_call>") {
        let (body, next) = after.split_once("</tool_call>").unwrap_or((after, ""));
        out.push(body.trim());
        rest = next;
    }
    out
}

/// Llama's `;`-separated calls: split where a `;` stands outside any string or bracket.
fn split_top_level(body: &str) -> Vec<&str> {
    let (mut depth, mut in_string, mut escaped, mut start) = (0i32, false, false, 0);
    let mut out = Vec::new();
    for (i, c) in body.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_string => escaped = true,
            '"' => in_string = !in_string,
            '{' | '[' if !in_string => depth += 1,
            '}' | ']' if !in_string => depth -= 1,
            ';' if !in_string && depth == 0 => {
                out.push(body[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(body[start..].trim());
    out.retain(|b| !b.is_empty());
    out
}

/// A call from its JSON text: `{"name": ..., <arguments_key>: {...}}` (arguments written as a
/// JSON string are read as the object they hold, as some models write them).
fn call_of(text: &str, arguments_key: &str) -> Result<ToolCall, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("the tool call is not JSON ({e})"))?;
    let name = (value.get("name").and_then(Value::as_str))
        .ok_or("the tool call has no \"name\" string")?
        .to_string();
    let arguments = match value.get(arguments_key).or_else(|| value.get("arguments")) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::String(s)) => serde_json::from_str(s)
            .map_err(|e| format!("the tool call's \"{arguments_key}\" is a string but not JSON ({e})"))?,
        Some(v) => v.clone(),
    };
    Ok(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, arguments: Value) -> Result<ToolCall, String> {
        Ok(ToolCall {
            name: name.into(),
            arguments,
        })
    }

    #[test]
    fn hermes_calls_are_read_in_order_and_thoughts_are_not_calls() {
        let f = CallFormat::Hermes;
        let two = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": \"{\\\"y\\\": 2}\"}</tool_call>";
        assert_eq!(f.calls(two), [call("a", json!({"x": 1})), call("b", json!({"y": 2}))]);
        assert_eq!(f.calls("Answer: 4"), []);
        let thought = "<think>maybe <tool_call>{\"name\": \"a\"}</tool_call></think>Answer: 4";
        assert_eq!(f.calls(thought), []);
        let cut = "<tool_call>{\"name\": \"a\", \"arguments\": {}}";
        assert_eq!(f.calls(cut), [call("a", json!({}))]);
        let broken = f.calls("<tool_call>{\"name\": \"a\", </tool_call>");
        assert!(
            broken[0].as_ref().unwrap_err().starts_with("the tool call is not JSON"),
            "{broken:?}"
        );
        let nameless = f.calls("<tool_call>{\"arguments\": {}}</tool_call>");
        assert_eq!(nameless, [Err("the tool call has no \"name\" string".to_string())]);
    }

    #[test]
    fn llama_calls_are_the_whole_reply() {
        let f = CallFormat::Llama3Json;
        let two =
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"s\": \"x;y\"}}; {\"name\": \"b\", \"parameters\": {}}";
        assert_eq!(f.calls(two), [call("a", json!({"s": "x;y"})), call("b", json!({}))]);
        assert_eq!(f.calls("The answer is 4."), []);
    }

    #[test]
    fn the_format_is_the_templates() {
        assert_eq!(CallFormat::of_template("{{ '<tool_call>' }}"), Some(CallFormat::Hermes));
        assert_eq!(
            CallFormat::of_template("Environment: ipython"),
            Some(CallFormat::Llama3Json)
        );
        assert_eq!(CallFormat::of_template("{{ messages }}"), None);
    }
}
