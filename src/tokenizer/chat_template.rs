//! Chat templates rendered with minijinja the way transformers' `apply_chat_template` renders
//! them with Jinja2: `trim_blocks` and `lstrip_blocks` on, Python string methods available,
//! `tojson` formatting like Python's `json.dumps`, `raise_exception` and `strftime_now`, and
//! `{% generation %}...{% endgeneration %}` blocks recorded as spans of the output.

use std::ops::Range;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use super::error::TokenizerError;
use super::pyjson;

const GEN_START: char = '\u{E000}';
const GEN_END: char = '\u{E001}';

/// Most bytes one rendering may produce: some 16M tokens, far beyond any model's context, so a
/// template that loops out gigabytes (a hostile or broken one) is an error, not an abort when
/// memory runs out.
pub const MAX_RENDERED_BYTES: usize = 64 << 20;

/// The work one rendering may do, in minijinja's fuel: one a template instruction, and one per
/// 64 bytes of every string it builds (so about 1 GiB in all, checked before each allocation).
/// Some templates look back over the messages at every message (quadratic), yet thousands of
/// turns under every template TRL ships stay far inside it (tests/chat_templates.rs), while a
/// runaway nest of loops, or a string doubled with `~` until memory runs out, stops instead.
const RENDER_FUEL: u64 = 16_000_000;

/// Collects rendered bytes up to [`MAX_RENDERED_BYTES`], then fails the write (and so the render).
struct Bounded {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("rendered output over the limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template source as given.
    pub source: String,
}

/// Output of rendering: the text, and the byte ranges produced inside `{% generation %}` blocks
/// (the assistant's own tokens, for assistant-only loss).
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedChat {
    /// The prompt text.
    pub text: String,
    /// Byte ranges of `text` rendered inside generation blocks.
    pub generation_spans: Vec<Range<usize>>,
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from(pyjson::dumps(&json, indent, sort_keys.unwrap_or(false))))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)` over the current UTC date (Llama 3.x templates print today's date).
fn strftime_now(format: String) -> String {
    use crate::util::clock::{MONTHS, civil_from_days, unix_seconds};
    let (y, m, d) = civil_from_days(unix_seconds().div_euclid(86_400));
    let month = MONTHS[(m - 1) as usize];
    format
        .replace("%Y", &y.to_string())
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", month)
        .replace("%b", &month[..3])
}

/// Replaces `{% generation %}` / `{% endgeneration %}` tags by expressions printing marker
/// characters, keeping what Jinja2's whitespace control would have done to the tags:
/// `-` trims as before, `trim_blocks` eats the newline after a plain `%}`, and `lstrip_blocks`
/// the indentation before a plain `{%`.
fn mark_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let dash_open = after.starts_with('-');
        let body = if dash_open { &after[1..] } else { after };
        let trimmed = body.trim_start();
        let (keyword, marker) = if trimmed.starts_with("endgeneration") {
            ("endgeneration", GEN_END)
        } else if trimmed.starts_with("generation") {
            ("generation", GEN_START)
        } else {
            out.push_str(&rest[..start + 2]);
            rest = after;
            continue;
        };
        let tail = trimmed[keyword.len()..].trim_start();
        let (dash_close, close_len) = if tail.starts_with("-%}") {
            (true, 3)
        } else if tail.starts_with("%}") {
            (false, 2)
        } else {
            out.push_str(&rest[..start + 2]);
            rest = after;
            continue;
        };
        let mut prefix = &rest[..start];
        if !dash_open {
            // lstrip_blocks: drop spaces/tabs between the line start and the tag.
            let line_start = prefix.rfind('\n').map_or(0, |i| i + 1);
            if prefix[line_start..].chars().all(|c| c == ' ' || c == '\t') {
                prefix = &prefix[..line_start];
            }
        }
        out.push_str(prefix);
        out.push_str(if dash_open { "{{-" } else { "{{" });
        out.push_str(&format!(" \"{marker}\" "));
        out.push_str(if dash_close { "-}}" } else { "}}" });
        rest = &tail[close_len..];
        if !dash_close && rest.starts_with('\n') {
            rest = &rest[1..];
        }
    }
    out.push_str(rest);
    out
}

impl ChatTemplate {
    /// Compiles a template source.
    pub fn new(source: &str) -> Result<Self, TokenizerError> {
        Self::with_fuel(source, RENDER_FUEL)
    }

    /// Compiles a template whose renderings may each run `fuel` instructions.
    fn with_fuel(source: &str, fuel: u64) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(fuel));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", mark_generation_blocks(source))
            .map_err(|e| TokenizerError::Template(format!("{e:#}")))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
        })
    }

    /// Renders with a context (`messages`, `tools`, `add_generation_prompt`, special tokens,
    /// anything else the template reads).
    pub fn render(&self, context: &serde_json::Value) -> Result<RenderedChat, TokenizerError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizerError::Template(e.to_string()))?;
        let mut out = Bounded {
            bytes: Vec::new(),
            overflowed: false,
        };
        let rendered = tmpl.render_captured_to(Value::from(minijinja::value::Serde(context)), &mut out);
        match rendered {
            Err(_) if out.overflowed => {
                return Err(TokenizerError::Template(format!(
                    "rendering produced more than {MAX_RENDERED_BYTES} bytes (the most a chat may render); the template or its messages run away"
                )));
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                let fuel = self.env.fuel().unwrap_or(RENDER_FUEL);
                return Err(TokenizerError::Template(format!(
                    "rendering took more than {fuel} fuel (the most a chat may take: a fuel a template instruction, one per 64 bytes of strings built); the template loops without end, builds strings without bound, or its messages are huge"
                )));
            }
            Err(e) => return Err(TokenizerError::Template(format!("{e:#}"))),
            Ok(_) => {}
        }
        let raw = String::from_utf8(out.bytes).map_err(|e| TokenizerError::Template(e.to_string()))?;
        let mut text = String::with_capacity(raw.len());
        let mut spans = Vec::new();
        let mut open: Option<usize> = None;
        for c in raw.chars() {
            match c {
                GEN_START => open = Some(text.len()),
                GEN_END => {
                    if let Some(s) = open.take() {
                        spans.push(s..text.len());
                    }
                }
                _ => text.push(c),
            }
        }
        if let Some(s) = open {
            spans.push(s..text.len());
        }
        Ok(RenderedChat {
            text,
            generation_spans: spans,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn generation_tags_keep_jinja_whitespace_rules() {
        assert_eq!(
            mark_generation_blocks("a\n  {% generation %}\nx{% endgeneration %}b"),
            "a\n{{ \"\u{E000}\" }}x{{ \"\u{E001}\" }}b"
        );
        assert_eq!(
            mark_generation_blocks("{%- generation -%} y {%-endgeneration%}"),
            "{{- \"\u{E000}\" -}} y {{- \"\u{E001}\" }}"
        );
        assert_eq!(mark_generation_blocks("{% if x %}{% endif %}"), "{% if x %}{% endif %}");
    }

    #[test]
    fn spans_cover_generation_output() {
        let t = ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</s>{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}").unwrap();
        let r = t
            .render(&json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}))
            .unwrap();
        assert_eq!(r.text, "<user>hi<assistant>yo</s>");
        assert_eq!(&r.text[r.generation_spans[0].clone()], "yo</s>");
    }

    #[test]
    fn python_methods_tojson_and_errors() {
        let t = ChatTemplate::new(
            "{{ s.strip().upper() }}|{{ s.split(',')[1] }}|{{ d | tojson }}|{{ xs[::-1] | join('') }}",
        )
        .unwrap();
        let r = t
            .render(&json!({"s": " a,b ", "d": {"k": [1, "x"]}, "xs": ["1", "2", "3"]}))
            .unwrap();
        assert_eq!(r.text, "A,B|b |{\"k\": [1, \"x\"]}|321");
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}").unwrap();
        assert!(
            t.render(&json!({}))
                .unwrap_err()
                .to_string()
                .contains("roles must alternate")
        );
        assert!(ChatTemplate::new("{% if %}").is_err());
    }

    #[test]
    fn runaway_templates_are_errors_not_aborts() {
        // A gigabyte of output stops at the byte limit, long before memory runs out.
        let t = ChatTemplate::new("{% for i in range(1000) %}{{ 'x' * 1000000 }}{% endfor %}").unwrap();
        let err = t.render(&json!({})).unwrap_err().to_string();
        assert!(err.contains(&format!("more than {MAX_RENDERED_BYTES} bytes")), "{err}");
        // Loops without output stop when the fuel is spent (a small fuel keeps the test fast).
        let t = ChatTemplate::with_fuel(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            10_000,
        )
        .unwrap();
        let err = t.render(&json!({})).unwrap_err().to_string();
        assert!(err.contains("more than 10000 fuel"), "{err}");
        // A string doubled with `~` stops before the allocation that would pass the budget.
        let t = ChatTemplate::new(
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        )
        .unwrap();
        let err = t.render(&json!({})).unwrap_err().to_string();
        assert!(err.contains(&format!("more than {RENDER_FUEL} fuel")), "{err}");
        // Just under the limit renders.
        let t = ChatTemplate::new("{{ 'x' * n }}").unwrap();
        assert_eq!(
            t.render(&json!({"n": MAX_RENDERED_BYTES})).unwrap().text.len(),
            MAX_RENDERED_BYTES
        );
    }
}
