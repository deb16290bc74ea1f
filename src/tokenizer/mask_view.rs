//! A tokenized conversation token by token, the trained (assistant) tokens highlighted.

use super::error::TokenizerError;
use super::hf_tokenizer::{TokenizedChat, Tokenizer};
use crate::display::{self, Rich};

/// Every token of a [`TokenizedChat`] with its text and whether the loss trains it (from
/// [`Tokenizer::mask_view`]).
#[derive(Debug, Clone, PartialEq)]
pub struct MaskView {
    /// `(token id, text, trained)` in order.
    pub tokens: Vec<(u32, String, bool)>,
}

impl Tokenizer {
    /// The tokens of `chat` with their text and assistant mask, for display.
    pub fn mask_view(&self, chat: &TokenizedChat) -> Result<MaskView, TokenizerError> {
        let tokens = chat
            .input_ids
            .iter()
            .zip(&chat.assistant_masks)
            .map(|(&id, &m)| Ok((id, self.decode(&[id], false)?, m == 1)))
            .collect::<Result<_, TokenizerError>>()?;
        Ok(MaskView { tokens })
    }
}

impl MaskView {
    fn trained(&self) -> usize {
        self.tokens.iter().filter(|t| t.2).count()
    }
}

impl Rich for MaskView {
    fn html(&self) -> String {
        let spans: String = self
            .tokens
            .iter()
            .map(|(id, text, trained)| {
                // A rendered newline ends the line, as in the text the template wrote.
                let br = if text.ends_with('\n') { "<br>" } else { "" };
                format!(
                    "{}{br}",
                    display::style::token_span(text, &format!("id {id}"), *trained)
                )
            })
            .collect();
        let legend = display::style::token_legend("trained (assistant mask 1)", "context (mask 0)");
        display::style::container(&format!(
            "{}{legend}<div>{spans}</div>",
            display::section(&format!("{} tokens, {} trained", self.tokens.len(), self.trained()), "")
        ))
    }

    fn text(&self) -> String {
        let marked: String = self
            .tokens
            .iter()
            .map(|(_, t, trained)| match trained {
                true => format!("[{t}]"),
                false => t.clone(),
            })
            .collect();
        format!(
            "{} tokens, {} trained ([...]):\n{marked}\n",
            self.tokens.len(),
            self.trained()
        )
    }
}

crate::display::rich_display!(MaskView);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trained_tokens_are_marked_in_both_renderings() {
        let view = MaskView {
            tokens: vec![
                (1, "user\n".into(), false),
                (2, "Answer".into(), true),
                (3, "<x>".into(), true),
            ],
        };
        let html = view.html();
        assert_eq!(html.matches("class=\"tok on\"").count(), 2);
        assert_eq!(html.matches("class=\"tok off\"").count(), 1);
        assert!(html.contains("user⏎</span><br>") && html.contains("&lt;x&gt;"));
        assert!(view.text().contains("user\n[Answer][<x>]"));
        assert!(view.text().starts_with("3 tokens, 2 trained"));
    }
}
