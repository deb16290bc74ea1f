//! Tokenizers (`tokenizer.json` via the tokenizers crate) with their `tokenizer_config.json` and
//! chat template, rendered as transformers' `apply_chat_template` does, with assistant-token
//! masks from `{% generation %}` blocks.

mod chat_template;
mod error;
mod files;
mod hf_tokenizer;
mod mask_view;
mod pyjson;

pub use chat_template::{ChatTemplate, MAX_RENDERED_BYTES, RenderedChat};
pub use error::TokenizerError;
pub(crate) use files::copy_tokenizer_files;
pub use hf_tokenizer::{ChatOptions, TokenizedChat, Tokenizer};
pub use mask_view::MaskView;
pub use pyjson::dumps as python_json;
