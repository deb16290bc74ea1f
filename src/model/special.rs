//! The special token ids a run needs, merged from the tokenizer and `config.json` once.

use super::config::ModelConfig;
use crate::tokenizer::Tokenizer;

/// End-of-sequence ids (the tokenizer's first, then `config.json`'s, without repeats) and the
/// padding id (the tokenizer's, else `config.json`'s, else 0: padding is always masked, so any
/// id in the vocabulary serves).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Ids that end a completion.
    pub eos: Vec<i64>,
    /// Id written into padding positions.
    pub pad: i64,
    /// Ids from here on are padding rows of the LM head the tokenizer has no token for: never
    /// sampled (`None`: the tokenizer covers every row, or there is no tokenizer).
    pub token_limit: Option<usize>,
}

impl SpecialTokens {
    /// Merges what `tokenizer` (if any) and `config` declare.
    pub fn resolve(tokenizer: Option<&Tokenizer>, config: &ModelConfig) -> Self {
        let mut eos: Vec<i64> = tokenizer
            .and_then(Tokenizer::eos_token_id)
            .map(i64::from)
            .into_iter()
            .collect();
        for &e in &config.eos_token_ids {
            if !eos.contains(&e) {
                eos.push(e);
            }
        }
        let pad = tokenizer
            .and_then(Tokenizer::pad_token_id)
            .map(i64::from)
            .or(config.pad_token_id)
            .unwrap_or(0);
        let token_limit = tokenizer
            .map(Tokenizer::id_limit)
            .filter(|&limit| (limit as i64) < config.vocab_size);
        SpecialTokens { eos, pad, token_limit }
    }
}
