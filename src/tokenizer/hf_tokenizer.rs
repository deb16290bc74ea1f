use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::chat_template::{ChatTemplate, RenderedChat};
use super::error::TokenizerError;

/// Options of [`Tokenizer::apply_chat_template`], as transformers names them.
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// Append the assistant turn header so the model continues as the assistant.
    pub add_generation_prompt: bool,
    /// Tool (function) schemas, passed to the template as `tools`.
    pub tools: Option<Value>,
    /// Everything else the template may read (`enable_thinking`, `documents`, ...).
    pub extra: Map<String, Value>,
}

/// A tokenized conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizedChat {
    /// The rendered prompt text.
    pub text: String,
    /// Token ids (no special tokens added beyond what the template writes).
    pub input_ids: Vec<u32>,
    /// 1 on tokens produced inside `{% generation %}` blocks (the assistant's), else 0; all 0
    /// when the template has no generation blocks.
    pub assistant_masks: Vec<u8>,
}

/// A tokenizer folder: `tokenizer.json`, `tokenizer_config.json` and the chat template.
#[derive(Debug)]
pub struct Tokenizer {
    /// The tokenizers-crate tokenizer.
    pub inner: tokenizers::Tokenizer,
    /// `tokenizer_config.json` (empty when absent).
    pub config: Map<String, Value>,
    /// The chat template, when the folder has one.
    pub chat_template: Option<ChatTemplate>,
    /// Where it was loaded from.
    pub dir: PathBuf,
}

fn read_json(path: &Path) -> Result<Value, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::File {
        path: path.into(),
        message: e.to_string(),
    })?;
    serde_json::from_str(&text).map_err(|e| TokenizerError::File {
        path: path.into(),
        message: e.to_string(),
    })
}

/// A token in tokenizer_config.json: a string, or an AddedToken object with `content`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The default chat template of tokenizer_config.json: a string, or a list of
/// `{name, template}` of which `default` (else the first) is used.
fn config_template(config: &Map<String, Value>) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let named = |n: &str| list.iter().find(|t| t.get("name").and_then(Value::as_str) == Some(n));
            named("default")
                .or(list.first())?
                .get("template")?
                .as_str()
                .map(str::to_string)
        }
        _ => None,
    }
}

impl Tokenizer {
    /// Loads a folder. The chat template comes from `chat_template.jinja`, else
    /// `tokenizer_config.json`, else `chat_template.json` (transformers' order).
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let file = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&file).map_err(|e| TokenizerError::File {
            path: file.clone(),
            message: e.to_string(),
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            match read_json(&config_path)? {
                Value::Object(m) => m,
                _ => {
                    return Err(TokenizerError::File {
                        path: config_path,
                        message: "not a JSON object".into(),
                    });
                }
            }
        } else {
            Map::new()
        };
        let jinja = dir.join("chat_template.jinja");
        let json = dir.join("chat_template.json");
        let source = if jinja.exists() {
            Some(std::fs::read_to_string(&jinja).map_err(|e| TokenizerError::File {
                path: jinja,
                message: e.to_string(),
            })?)
        } else if let Some(t) = config_template(&config) {
            Some(t)
        } else if json.exists() {
            read_json(&json)?
                .get("chat_template")
                .and_then(Value::as_str)
                .map(str::to_string)
        } else {
            None
        };
        let chat_template = source.as_deref().map(ChatTemplate::new).transpose()?;
        Ok(Tokenizer {
            inner,
            config,
            chat_template,
            dir: dir.into(),
        })
    }

    /// A special token's text from tokenizer_config.json (`bos_token`, `eos_token`, ...).
    pub(crate) fn special_token(&self, name: &str) -> Option<String> {
        token_string(self.config.get(name))
    }

    /// The id of a token's text.
    pub(crate) fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The EOS id named by tokenizer_config.json.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.special_token("eos_token").and_then(|t| self.token_id(&t))
    }

    /// One past the largest id the tokenizer has a token for (added tokens included): ids from
    /// here on cannot be decoded.
    pub fn id_limit(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&id| id as usize + 1)
    }

    /// The padding id named by tokenizer_config.json.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.special_token("pad_token").and_then(|t| self.token_id(&t))
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS...).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        Ok(self.encoding(text, add_special_tokens)?.get_ids().to_vec())
    }

    fn encoding(&self, text: &str, add_special_tokens: bool) -> Result<tokenizers::Encoding, TokenizerError> {
        self.inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError::Tokenize(e.to_string()))
    }

    /// Text of `ids`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        // The tokenizers crate silently drops ids it has no token for; text missing tokens
        // must not pass for the model's output (models often have more ids than tokens).
        if let Some(id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(TokenizerError::Tokenize(format!(
                "token id {id} is outside the tokenizer's vocabulary of {}",
                self.inner.get_vocab_size(true)
            )));
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Tokenize(e.to_string()))
    }

    /// Renders a conversation (`messages`: a list of `{role, content, ...}` objects) through
    /// the chat template.
    pub fn apply_chat_template(&self, messages: &Value, opts: &ChatOptions) -> Result<RenderedChat, TokenizerError> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| TokenizerError::NoChatTemplate(self.dir.clone()))?;
        validate_messages(messages)?;
        let mut ctx = Map::new();
        for name in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(t) = self.special_token(name) {
                ctx.insert(name.into(), t.into());
            }
        }
        if let Some(extra) = self.config.get("additional_special_tokens") {
            ctx.insert("additional_special_tokens".into(), extra.clone());
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), opts.add_generation_prompt.into());
        if let Some(tools) = &opts.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        for (k, v) in &opts.extra {
            ctx.insert(k.clone(), v.clone());
        }
        template.render(&Value::Object(ctx))
    }

    /// Renders and tokenizes a conversation, with the assistant mask transformers returns for
    /// `return_assistant_tokens_mask=True`: tokens from the one holding a generation span's
    /// first byte to the one holding its last byte.
    pub fn tokenize_chat(&self, messages: &Value, opts: &ChatOptions) -> Result<TokenizedChat, TokenizerError> {
        let rendered = self.apply_chat_template(messages, opts)?;
        let enc = self.encoding(&rendered.text, false)?;
        let offsets = enc.get_offsets();
        let token_at = |byte: usize| offsets.iter().position(|&(s, e)| s <= byte && byte < e);
        let mut mask = vec![0u8; offsets.len()];
        for span in &rendered.generation_spans {
            if span.is_empty() {
                continue;
            }
            let Some(first) = token_at(span.start) else {
                continue;
            };
            let last = token_at(span.end - 1).unwrap_or(offsets.len() - 1);
            for m in &mut mask[first..=last] {
                *m = 1;
            }
        }
        Ok(TokenizedChat {
            text: rendered.text,
            input_ids: enc.get_ids().to_vec(),
            assistant_masks: mask,
        })
    }
}

fn validate_messages(messages: &Value) -> Result<(), TokenizerError> {
    let list = messages.as_array().ok_or_else(|| TokenizerError::Message {
        index: 0,
        message: "messages must be a list".into(),
    })?;
    for (index, m) in list.iter().enumerate() {
        let err = |message: &str| TokenizerError::Message {
            index,
            message: message.into(),
        };
        let obj = m
            .as_object()
            .ok_or_else(|| err("must be an object with `role` and `content`"))?;
        match obj.get("role") {
            Some(Value::String(_)) => {}
            _ => return Err(err("missing string field `role`")),
        }
    }
    Ok(())
}

crate::display::rich_display!(Tokenizer);

impl crate::display::Rich for Tokenizer {
    fn html(&self) -> String {
        use crate::display::{self, escape};
        let rows = vec![
            ("folder", escape(&self.dir.display().to_string())),
            ("vocabulary", self.inner.get_vocab_size(true).to_string()),
            (
                "eos / pad",
                escape(&format!(
                    "{} / {}",
                    self.special_token("eos_token").unwrap_or("none".into()),
                    self.special_token("pad_token").unwrap_or("none".into())
                )),
            ),
            (
                "chat template",
                if self.chat_template.is_some() {
                    "yes".into()
                } else {
                    "none".into()
                },
            ),
        ];
        display::style::container(&display::section("Tokenizer", &display::kv_table(&rows)))
    }

    fn text(&self) -> String {
        format!(
            "Tokenizer from {}: {} tokens, eos {}, chat template {}\n",
            self.dir.display(),
            self.inner.get_vocab_size(true),
            self.special_token("eos_token").unwrap_or("none".into()),
            if self.chat_template.is_some() { "yes" } else { "none" }
        )
    }
}
