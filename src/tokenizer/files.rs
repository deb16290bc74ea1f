//! The files of a Hugging Face tokenizer folder.

/// Files that make up a Hugging Face tokenizer folder (copied with a saved model).
pub const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
];
