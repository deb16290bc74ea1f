//! `treetrain render`: each line's conversation as the model's chat template renders it,
//! exactly what transformers' `apply_chat_template(messages, tools=tools, tokenize=False,
//! add_generation_prompt=...)` returns: the first thing to check when a model misbehaves with
//! a template or with tools.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde_json::Value;
use treetrain::tokenizer::{ChatOptions, Tokenizer};

/// Arguments of `render`.
#[derive(clap::Args)]
pub(crate) struct RenderArgs {
    /// A model folder (its tokenizer and chat template are read; no weights) or a Hugging Face
    /// repo id (org/name[@revision]) in the local cache.
    #[arg(long)]
    model: String,
    /// JSONL input (`-` for stdin): `{"messages": [...]}` per line, with `tools` (a list of
    /// schemas, or that list as JSON text) and `chat_template_kwargs` (an object: e.g.
    /// `{"enable_thinking": false}`) when wanted.
    #[arg(long)]
    input: PathBuf,
    /// Append the assistant's header to every line, even one that ends with the assistant's
    /// message (default: only to lines that do not).
    #[arg(long, conflicts_with = "no_generation_prompt")]
    add_generation_prompt: bool,
    /// Never append the assistant's header.
    #[arg(long)]
    no_generation_prompt: bool,
}

/// Runs `render`: each line's text, each followed by a NUL byte (a rendering may hold any
/// other character, newlines included).
pub(crate) fn run(args: &RenderArgs) -> Result<()> {
    let dir = treetrain::hub::HubCache::from_env().model_dir(&args.model)?;
    let tokenizer = Tokenizer::from_dir(&dir)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for line in super::jsonl::read(&args.input)? {
        let at = &line.at;
        let messages = line
            .value
            .get("messages")
            .filter(|m| m.is_array())
            .with_context(|| format!("{at}: needs `messages`, a list of messages"))?;
        let ends_with_assistant = (messages.as_array().and_then(|m| m.last()))
            .and_then(|m| m.get("role"))
            .is_some_and(|r| r == "assistant");
        let opts = ChatOptions {
            add_generation_prompt: match (args.add_generation_prompt, args.no_generation_prompt) {
                (true, _) => true,
                (_, true) => false,
                _ => !ends_with_assistant,
            },
            tools: tools(&line.value).with_context(|| format!("{at}: `tools`"))?,
            extra: match line.value.get("chat_template_kwargs") {
                None | Some(Value::Null) => Default::default(),
                Some(Value::Object(kwargs)) => kwargs.clone(),
                Some(_) => bail!("{at}: `chat_template_kwargs` must be an object"),
            },
        };
        let rendered = tokenizer
            .apply_chat_template(messages, &opts)
            .with_context(|| format!("{at}: rendering"))?;
        out.write_all(rendered.text.as_bytes())?;
        out.write_all(b"\0")?;
    }
    out.flush()?;
    Ok(())
}

/// A line's `tools`: absent or null is none; a list, or JSON text of one (as datasets store it).
fn tools(line: &Value) -> Result<Option<Value>> {
    let value = match line.get("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(text)) => serde_json::from_str(text).context("is text but not JSON")?,
        Some(v) => v.clone(),
    };
    match value {
        Value::Array(_) => Ok(Some(value)),
        _ => bail!("must be a list of tool schemas"),
    }
}
