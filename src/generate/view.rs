//! The completions table.

use super::completion::Completion;
use crate::display::{self, Rich, escape};
use crate::tokenizer::Tokenizer;

/// Completions with their prompt and completion text, for display and JSON output.
#[derive(Debug, Clone)]
pub struct Completions {
    /// The completions.
    pub items: Vec<Completion>,
    /// Prompt text per prompt index (token ids when no tokenizer was given).
    pub prompts: Vec<String>,
    /// Completion text per item.
    pub texts: Vec<String>,
}

fn ids_text(ids: &[i64]) -> String {
    let shown: Vec<String> = ids.iter().map(i64::to_string).collect();
    shown.join(" ")
}

impl Completions {
    /// Decodes prompts and completions with `tokenizer` when given (special tokens skipped in
    /// completions).
    pub fn new(items: Vec<Completion>, prompts: &[Vec<i64>], tokenizer: Option<&Tokenizer>) -> Self {
        let decode = |ids: &[i64], skip: bool| -> String {
            let ids32: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
            tokenizer
                .and_then(|t| t.decode(&ids32, skip).ok())
                .unwrap_or_else(|| ids_text(ids))
        };
        Completions {
            prompts: prompts.iter().map(|p| decode(p, false)).collect(),
            texts: items.iter().map(|c| decode(&c.output_ids, true)).collect(),
            items,
        }
    }

    fn mean_logprob(c: &Completion) -> f64 {
        if c.logprobs.is_empty() {
            0.0
        } else {
            c.logprobs.iter().map(|&x| f64::from(x)).sum::<f64>() / c.logprobs.len() as f64
        }
    }
}

impl Rich for Completions {
    fn html(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .items
            .iter()
            .zip(&self.texts)
            .map(|(c, t)| {
                let prompt = display::tail(self.prompts.get(c.prompt_index).map_or("", String::as_str), 80);
                vec![
                    c.prompt_index.to_string(),
                    format!("<code>{}</code>", escape(&prompt)),
                    format!("<code>{}</code>", escape(t)),
                    c.output_ids.len().to_string(),
                    c.finish_reason.as_str().to_string(),
                    format!("{:.3}", Self::mean_logprob(c)),
                ]
            })
            .collect();
        display::style::container(&display::section(
            "Completions",
            &display::table(
                &[
                    "prompt",
                    "prompt (end)",
                    "completion",
                    "tokens",
                    "finish",
                    "mean log-prob",
                ],
                &rows,
            ),
        ))
    }

    fn text(&self) -> String {
        let mut s = String::new();
        for (c, t) in self.items.iter().zip(&self.texts) {
            s.push_str(&format!(
                "[{}] {:>4} tok {:<6} {:>8.3}  {}\n",
                c.prompt_index,
                c.output_ids.len(),
                c.finish_reason.as_str(),
                Self::mean_logprob(c),
                t.replace('\n', "⏎")
            ));
        }
        s
    }
}

crate::display::rich_display!(Completions);
