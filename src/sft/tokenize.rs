//! Examples to token ids and loss masks, as TRL's SFTTrainer prepares them.

use serde_json::Value;

use crate::data::Example;
use crate::tokenizer::{ChatOptions, Tokenizer};

/// A tokenized training example.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainExample {
    /// Token ids.
    pub input_ids: Vec<i64>,
    /// 1 where the token is trained (its prediction enters the loss).
    pub loss_mask: Vec<u8>,
}

/// How examples become training rows.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TokenizeOptions {
    /// Truncate rows to this many tokens (from the right).
    pub max_length: usize,
    /// Conversations: train only the assistant's tokens (needs `{% generation %}` in the template).
    pub assistant_only_loss: bool,
    /// Prompt/completion rows: train only the completion.
    pub completion_only_loss: bool,
}

impl Default for TokenizeOptions {
    fn default() -> Self {
        TokenizeOptions {
            max_length: 1024,
            assistant_only_loss: true,
            completion_only_loss: true,
        }
    }
}

fn ids(v: Vec<u32>) -> Vec<i64> {
    v.into_iter().map(i64::from).collect()
}

/// Tokenizes example `row` (the index names it in errors).
pub fn tokenize(tok: &Tokenizer, ex: &Example, row: usize, opts: &TokenizeOptions) -> Result<TrainExample, String> {
    let at = |e: String| format!("row {row} (0-based): {e}");
    let mut out = match ex {
        Example::Conversation { messages, tools } => conversation(tok, messages, tools, opts).map_err(at)?,
        Example::PromptCompletion {
            prompt: Value::String(p),
            completion: Value::String(c),
        } => text_pair(tok, p, c, opts).map_err(at)?,
        Example::PromptCompletion {
            prompt: Value::Array(p),
            completion: Value::Array(c),
        } => message_pair(tok, p, c, opts).map_err(at)?,
        Example::PromptCompletion { .. } => {
            return Err(at(
                "prompt and completion must both be strings or both be message lists".into(),
            ));
        }
        Example::Prompt(_) => return Err(at("a prompt-only row has nothing to train on in SFT".into())),
    };
    if out.input_ids.len() > opts.max_length {
        out.input_ids.truncate(opts.max_length);
        out.loss_mask.truncate(opts.max_length);
    }
    if out.input_ids.len() < 2 || !out.loss_mask[1..].contains(&1) {
        return Err(at(
            "no trained token left (empty completion, or truncated away by max_length)".into(),
        ));
    }
    Ok(out)
}

/// A conversation through the chat template (with its row's tools); the assistant's tokens
/// trained, or all of them.
fn conversation(
    tok: &Tokenizer,
    messages: &[Value],
    tools: &Option<Value>,
    opts: &TokenizeOptions,
) -> Result<TrainExample, String> {
    let chat_opts = ChatOptions {
        tools: tools.clone(),
        ..Default::default()
    };
    let chat = tok
        .tokenize_chat(&Value::Array(messages.to_vec()), &chat_opts)
        .map_err(|e| e.to_string())?;
    let mask = if opts.assistant_only_loss {
        if !chat.assistant_masks.contains(&1) {
            return Err(
                "assistant_only_loss needs a chat template with {% generation %} blocks and an assistant turn".into(),
            );
        }
        chat.assistant_masks
    } else {
        vec![1; chat.input_ids.len()]
    };
    Ok(TrainExample {
        input_ids: ids(chat.input_ids),
        loss_mask: mask,
    })
}

/// A text prompt and completion (EOS appended); the completion trained, or both.
fn text_pair(tok: &Tokenizer, p: &str, c: &str, opts: &TokenizeOptions) -> Result<TrainExample, String> {
    let prompt = ids(tok.encode(p, true).map_err(|e| e.to_string())?);
    let mut completion = ids(tok.encode(c, false).map_err(|e| e.to_string())?);
    if let Some(eos) = tok.eos_token_id() {
        completion.push(i64::from(eos));
    }
    let mut mask = vec![u8::from(!opts.completion_only_loss); prompt.len()];
    mask.extend(std::iter::repeat_n(1, completion.len()));
    Ok(TrainExample {
        input_ids: [prompt, completion].concat(),
        loss_mask: mask,
    })
}

/// Prompt and completion messages through the chat template (the prompt must render as a
/// prefix of the whole); the completion trained, or both.
fn message_pair(tok: &Tokenizer, p: &[Value], c: &[Value], opts: &TokenizeOptions) -> Result<TrainExample, String> {
    let with_prompt = ChatOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let prompt = tok
        .tokenize_chat(&Value::Array(p.to_vec()), &with_prompt)
        .map_err(|e| e.to_string())?;
    let full = tok
        .tokenize_chat(&Value::Array([p, c].concat()), &ChatOptions::default())
        .map_err(|e| e.to_string())?;
    if !full.input_ids.starts_with(&prompt.input_ids) {
        return Err("the chat template does not render the prompt as a prefix of prompt + completion".into());
    }
    let n = prompt.input_ids.len();
    let mask = (0..full.input_ids.len())
        .map(|i| u8::from(i >= n || !opts.completion_only_loss))
        .collect();
    Ok(TrainExample {
        input_ids: ids(full.input_ids),
        loss_mask: mask,
    })
}
