//! The shipped tool task: sums and differences of two numbers below 50, which the tiny model
//! cannot compute, and a calculator it can call. The calculator is offered as a tool schema
//! (transformers' `tools=`, rendered by the chat template); the model calls it by writing
//! `<tool_call>{"name": "calculator", "arguments": {"question": "What is 23 + 19?"}}</tool_call>`,
//! the environment answers with a tool message `result: 42`, and the model answers. A right
//! final answer earns 1, anything else 0. What GRPO learns here: to call the tool rather than to
//! guess, and to copy the question into the call and the result into the answer.
//!
//! Why this form of call and result: each is a copy of tokens the model has just seen, in the
//! order it saw them (the question, then the token after `:`), which a tiny model learns.
//! Operands as JSON numbers or an expression string (`{"a": 23, ...}`, `"23 + 19"`) would have
//! it re-spell what it read, which a tiny model rarely gets right.
//!
//! The shipped SFT data holds each of its arithmetic questions twice: answered directly (and
//! correctly: the tiny model still cannot learn to add from them) and through the calculator.
//! No question is tied to one way of answering, so the SFT model learns to call the tool on new
//! questions too instead of memorising which questions it called on. The measurements behind
//! both choices are in `datasets/README.md`.

use serde_json::{Value, json};

use crate::generate::Completion;
use crate::grpo::{Conversation, EnvReply, EnvRole, Environment, RolloutBatch, extract_answer};
use crate::tokenizer::{Tokenizer, python_json};

/// The tool's name.
pub(crate) const TOOL_NAME: &str = "calculator";

/// The calculator environment: up to `max_calls` tool calls, then an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Calculator {
    /// Tool calls answered per conversation; a call after them ends it with reward 0. The run's
    /// `max_turns` should be at least `max_calls + 1`.
    pub max_calls: usize,
}

impl Default for Calculator {
    fn default() -> Self {
        Calculator { max_calls: 1 }
    }
}

/// Why a tool call cannot be answered with a result (told to the model as the tool's reply).
fn tool_error(why: &str) -> String {
    format!("error: {why}")
}

impl Calculator {
    /// The tool's schema, in the OpenAI/transformers function format.
    pub fn schema() -> Value {
        json!({
            "type": "function",
            "function": {
                "name": TOOL_NAME,
                "description": "Answers a question asking for a + b or a - b.",
                "parameters": {
                    "type": "object",
                    "properties": {"question": {"type": "string"}},
                    "required": ["question"]
                }
            }
        })
    }

    /// The call asking `question`, as the model writes it and the chat template renders
    /// structured `tool_calls`.
    pub(crate) fn call_text(question: &str) -> String {
        let call = json!({"name": TOOL_NAME, "arguments": {"question": question}});
        format!("<tool_call>{}</tool_call>", python_json(&call, None, false))
    }

    /// The `a + b` or `a - b` a question asks about, as written there.
    pub(crate) fn expression_in(question: &str) -> Option<String> {
        let words: Vec<&str> = question.split_whitespace().collect();
        let number = |w: &str| w.trim_end_matches(['?', '.', '=']).parse::<i64>().ok();
        words.windows(3).find_map(|w| {
            let op_ok = w[1] == "+" || w[1] == "-";
            let (a, b) = (number(w[0])?, number(w[2])?);
            op_ok.then(|| format!("{a} {} {b}", w[1]))
        })
    }

    /// The value of `a + b` or `a - b` (integers), or why not.
    pub fn evaluate(expression: &str) -> Result<i64, String> {
        let words: Vec<&str> = expression.split_whitespace().collect();
        let [a, op, b] = words[..] else {
            return Err(format!("expected 'a + b' or 'a - b', got {expression:?}"));
        };
        let number = |w: &str| w.parse::<i64>().map_err(|_| format!("{w:?} is not an integer"));
        let (a, b) = (number(a)?, number(b)?);
        match op {
            "+" => a.checked_add(b).ok_or_else(|| "overflow".to_string()),
            "-" => a.checked_sub(b).ok_or_else(|| "overflow".to_string()),
            _ => Err(format!("unknown operator {op:?}")),
        }
    }

    /// The tool call in `reply`: `None` when it calls no tool, else the question it asks or
    /// why the call is malformed.
    pub(crate) fn parse_call(reply: &str) -> Option<Result<String, String>> {
        let (_, rest) = reply.split_once("<tool_call>")?;
        let body = rest.split_once("</tool_call>").map_or(rest, |(b, _)| b);
        let call: Value = match serde_json::from_str(body.trim()) {
            Ok(v) => v,
            Err(e) => return Some(Err(format!("the tool call is not JSON ({e})"))),
        };
        if call.get("name").and_then(Value::as_str) != Some(TOOL_NAME) {
            return Some(Err(format!("unknown tool; the one tool is {TOOL_NAME}")));
        }
        let question = call.pointer("/arguments/question").and_then(Value::as_str);
        Some(
            question
                .map(str::to_string)
                .ok_or_else(|| "missing argument 'question'".into()),
        )
    }

    /// Share of `batch`'s conversations that call the tool (their tokens hold `<tool_call>`).
    pub fn call_share(batch: &RolloutBatch, tokenizer: &Tokenizer) -> f64 {
        let Some(call) = tokenizer.token_id("<tool_call>").map(i64::from) else {
            return 0.0;
        };
        let conversations: Vec<&Completion> = batch.groups.iter().flat_map(|g| &g.completions).collect();
        let calling = conversations.iter().filter(|c| c.output_ids.contains(&call)).count();
        calling as f64 / conversations.len().max(1) as f64
    }

    /// The tool's reply to a call asking a question: `result: value`, or an error the model
    /// reads.
    pub(crate) fn respond(call: Result<String, String>) -> String {
        let expression = |q: String| Self::expression_in(&q).ok_or_else(|| format!("no a + b or a - b in {q:?}"));
        match call.and_then(expression).and_then(|e| Self::evaluate(&e)) {
            Ok(value) => format!("result: {value}"),
            Err(why) => tool_error(&why),
        }
    }
}

impl Environment for Calculator {
    fn name(&self) -> &str {
        TOOL_NAME
    }

    fn tools(&self) -> Option<Value> {
        Some(json!([Self::schema()]))
    }

    fn reply(&self, c: &Conversation) -> Result<EnvReply, String> {
        let answer = c
            .row
            .get("answer")
            .and_then(Value::as_str)
            .ok_or("the prompt row has no string `answer` column")?;
        let reply = c.last_reply();
        match Self::parse_call(reply) {
            Some(_) if c.last_turn || c.turn > self.max_calls => Ok(EnvReply::Done(0.0)),
            Some(call) => Ok(EnvReply::Message {
                role: EnvRole::Tool,
                content: Self::respond(call),
            }),
            None => Ok(EnvReply::Done(f32::from(u8::from(extract_answer(reply) == answer)))),
        }
    }
}

impl Calculator {
    fn rows(&self) -> Vec<(&'static str, String)> {
        vec![
            ("environment", self.name().to_string()),
            ("tool", python_json(&Self::schema(), None, false)),
            ("a call", Self::call_text("What is 23 + 19?")),
            ("its reply", Self::respond(Ok("What is 23 + 19?".into()))),
            ("calls allowed", self.max_calls.to_string()),
            ("reward", "1 for a right final answer, else 0".into()),
        ]
    }
}

impl crate::display::Rich for Calculator {
    fn html(&self) -> String {
        crate::display::rows_card("Calculator tool task", &self.rows())
    }
    fn text(&self) -> String {
        crate::display::rows_text(&self.rows())
    }
}

crate::display::rich_display!(Calculator);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn reply_to(text: &str, turn: usize, last_turn: bool) -> EnvReply {
        let row: Map<String, Value> = serde_json::from_str(r#"{"answer": "42"}"#).unwrap();
        let messages = [
            json!({"role": "user", "content": "What is 23 + 19?"}),
            json!({"role": "assistant", "content": text}),
        ];
        let c = Conversation {
            row: &row,
            messages: &messages,
            turn,
            last_turn,
        };
        Calculator::default().reply(&c).unwrap()
    }

    fn tool(content: &str) -> EnvReply {
        EnvReply::Message {
            role: EnvRole::Tool,
            content: content.into(),
        }
    }

    #[test]
    fn calls_get_results_answers_get_rewards() {
        let call = Calculator::call_text("What is 23 + 19?");
        assert_eq!(
            call,
            r#"<tool_call>{"name": "calculator", "arguments": {"question": "What is 23 + 19?"}}</tool_call>"#
        );
        assert_eq!(reply_to(&call, 1, false), tool("result: 42"));
        assert_eq!(
            reply_to(&Calculator::call_text("3 - 9 = ?"), 1, false),
            tool("result: -6")
        );
        assert_eq!(reply_to(&call, 2, false), EnvReply::Done(0.0), "one call allowed");
        assert_eq!(reply_to(&call, 1, true), EnvReply::Done(0.0), "no turn left to answer");
        assert_eq!(reply_to("Answer: 42", 2, false), EnvReply::Done(1.0));
        assert_eq!(reply_to("Answer: 42", 1, false), EnvReply::Done(1.0));
        assert_eq!(reply_to("Answer: 41", 2, false), EnvReply::Done(0.0));
    }

    #[test]
    fn malformed_calls_get_errors_the_model_reads() {
        let err = |text: &str| match reply_to(text, 1, false) {
            EnvReply::Message {
                role: EnvRole::Tool,
                content,
            } => content,
            other => panic!("{other:?}"),
        };
        assert!(err("<tool_call>{\"name\": \"calc").contains("not JSON"));
        assert!(err(r#"<tool_call>{"name": "search", "arguments": {}}</tool_call>"#).contains("unknown tool"));
        assert!(err(r#"<tool_call>{"name": "calculator", "arguments": {}}</tool_call>"#).contains("'question'"));
        assert!(err(&Calculator::call_text("What is 2 * 3?")).contains("no a + b or a - b"));
        assert_eq!(Calculator::evaluate("2 * 3"), Err("unknown operator \"*\"".into()));
        assert!(Calculator::evaluate("two + 3").unwrap_err().contains("not an integer"));
    }

    #[test]
    fn expressions_are_read_as_questions_write_them() {
        assert_eq!(Calculator::expression_in("What is 23 + 19?"), Some("23 + 19".into()));
        assert_eq!(Calculator::expression_in("Compute 4 - 40."), Some("4 - 40".into()));
        assert_eq!(Calculator::expression_in("7 + 0 = ?"), Some("7 + 0".into()));
        assert_eq!(Calculator::expression_in("Which is first: 4, 5?"), None);
        for t in crate::shipped::tasks::arithmetic_tasks(200, 5) {
            let e = Calculator::expression_in(&t.question).unwrap();
            assert_eq!(
                Calculator::evaluate(&e).unwrap().to_string(),
                t.answer,
                "{}",
                t.question
            );
        }
    }

    /// The shipped template renders the tools into the system turn, a text call and a
    /// structured `tool_calls` alike, the result as a user turn, and trains the assistant only.
    #[test]
    fn the_shipped_template_renders_tools_calls_and_results() {
        use crate::tokenizer::{ChatOptions, Tokenizer};
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/tiny-qwen3");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let question = "What is 23 + 19?";
        let conversation = |call: Value| {
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": question},
                call,
                {"role": "tool", "content": "result: 42"},
                {"role": "assistant", "content": "Answer: 42"},
            ])
        };
        let text_call = json!({"role": "assistant", "content": Calculator::call_text(question)});
        let structured = json!({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"question": question}}}
        ]});
        let with_tools = ChatOptions {
            tools: Calculator::default().tools(),
            ..Default::default()
        };
        let rendered = tok
            .apply_chat_template(&conversation(text_call.clone()), &with_tools)
            .unwrap()
            .text;
        let want = format!(
            "<|im_start|>system\nBe brief.\n\n# Tools\nTo call one: <tool_call>{{\"name\": <name>, \"arguments\": <object>}}</tool_call>\n{}<|im_end|>\n\
             <|im_start|>user\n{question}<|im_end|>\n\
             <|im_start|>assistant\n{}<|im_end|>\n\
             <|im_start|>user\n<tool_response>result: 42</tool_response><|im_end|>\n\
             <|im_start|>assistant\nAnswer: 42<|im_end|>\n",
            python_json(&Calculator::schema(), None, false),
            Calculator::call_text(question)
        );
        assert_eq!(rendered, want);
        let structured_text = tok
            .apply_chat_template(&conversation(structured), &with_tools)
            .unwrap()
            .text;
        assert_eq!(
            structured_text, want,
            "structured tool_calls render as the model writes them"
        );
        // Without tools the system turn is the plain one, as before tools existed.
        let plain = tok
            .apply_chat_template(&conversation(text_call.clone()), &ChatOptions::default())
            .unwrap()
            .text;
        assert!(
            plain.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"),
            "{plain}"
        );
        // Markup is one token each; only the assistant's turns are trained.
        let chat = tok.tokenize_chat(&conversation(text_call), &with_tools).unwrap();
        for tag in ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"] {
            let id = tok.token_id(tag).unwrap();
            assert_eq!(
                chat.input_ids.iter().filter(|&&t| t == id).count(),
                1 + usize::from(tag.contains("call")),
                "{tag}"
            );
        }
        let trained: Vec<u32> = chat
            .input_ids
            .iter()
            .zip(&chat.assistant_masks)
            .filter(|(_, m)| **m == 1)
            .map(|(t, _)| *t)
            .collect();
        let trained_text = tok.decode(&trained, false).unwrap();
        assert_eq!(
            trained_text,
            format!("{}<|im_end|>Answer: 42<|im_end|>", Calculator::call_text(question))
        );
    }

    #[test]
    fn the_card_shows_the_tool_and_a_call() {
        let html = crate::display::Rich::html(&Calculator::default());
        assert!(
            html.contains("Calculator tool task") && html.contains("&quot;calculator&quot;"),
            "{html}"
        );
        let text = crate::display::Rich::text(&Calculator::default());
        assert!(text.contains("its reply: result: 42"), "{text}");
    }
}
