//! The files of a Hugging Face tokenizer folder.

/// Files that make up a Hugging Face tokenizer folder (copied with a saved model).
pub(crate) const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
];

/// Copies the tokenizer files `from` holds into `to` (a checkpoint being written).
pub(crate) fn copy_tokenizer_files(from: &std::path::Path, to: &std::path::Path) -> Result<(), super::TokenizerError> {
    for f in TOKENIZER_FILES {
        let src = from.join(f);
        if src.exists() {
            std::fs::copy(&src, to.join(f)).map_err(|e| super::TokenizerError::File {
                path: src.clone(),
                message: e.to_string(),
            })?;
        }
    }
    Ok(())
}
