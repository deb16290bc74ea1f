//! Stop strings matched on the decoded text, as transformers' `StopStringCriteria` does: a
//! completion ends at the token where the text first contains a stop string, whether the
//! string spans several tokens or ends inside one (`"28"` stops `"Answer: 28."` even when the
//! last token is `"28."`). Token ids alone cannot do this: `" 28"` in context is not the ids
//! of `"28"` on its own.

use std::sync::Arc;

use crate::tokenizer::Tokenizer;

/// Stop strings with the tokenizer that turns ids into text.
#[derive(Debug, Clone)]
pub struct StopStrings {
    strings: Vec<String>,
    tokenizer: Arc<Tokenizer>,
    /// Tokens decoded to find a new occurrence: enough for the longest string, one byte a
    /// token at worst, plus the token it may end inside.
    window: usize,
}

impl PartialEq for StopStrings {
    fn eq(&self, other: &Self) -> bool {
        self.strings == other.strings && Arc::ptr_eq(&self.tokenizer, &other.tokenizer)
    }
}

impl StopStrings {
    /// `strings` (empty ones dropped) decoded with `tokenizer`.
    pub fn new(strings: Vec<String>, tokenizer: Arc<Tokenizer>) -> Self {
        let strings: Vec<String> = strings.into_iter().filter(|s| !s.is_empty()).collect();
        let window = strings.iter().map(String::len).max().unwrap_or(0) + 2;
        StopStrings {
            strings,
            tokenizer,
            window,
        }
    }

    /// The stop strings.
    pub fn strings(&self) -> &[String] {
        &self.strings
    }

    /// Whether the text of `ids` gained a stop string with its last token: an occurrence that
    /// ends past the text of the tokens before it.
    pub(crate) fn ends_in_last_token(&self, ids: &[i64]) -> bool {
        if self.strings.is_empty() || ids.is_empty() {
            return false;
        }
        let tail = &ids[ids.len().saturating_sub(self.window)..];
        let (Some(before), Some(with)) = (self.text(&tail[..tail.len() - 1]), self.text(tail)) else {
            return false;
        };
        let boundary = common_prefix(&before, &with);
        self.strings
            .iter()
            .any(|s| with.match_indices(s.as_str()).any(|(at, _)| at + s.len() > boundary))
    }

    /// `text` cut right after the first stop string it contains (whole when it has none).
    pub fn cut<'t>(&self, text: &'t str) -> &'t str {
        let end = self
            .strings
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|at| at + s.len()))
            .min();
        &text[..end.unwrap_or(text.len())]
    }

    fn text(&self, ids: &[i64]) -> Option<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| u32::try_from(i).ok()).collect::<Option<_>>()?;
        self.tokenizer.decode(&ids, true).ok()
    }
}

/// Bytes `a` and `b` share from the start (at a character boundary).
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_prefix_stops_at_the_first_difference() {
        assert_eq!(common_prefix("Answer: 2", "Answer: 28."), 9);
        assert_eq!(common_prefix("ab\u{fffd}", "abé"), 2);
        assert_eq!(common_prefix("", "x"), 0);
    }
}
