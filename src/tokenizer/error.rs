use std::path::PathBuf;

/// Errors from tokenizers and chat templates.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The folder has no chat template (tokenizer_config.json, chat_template.jinja or .json).
    #[error(
        "no chat template in {0} (looked for chat_template.jinja, tokenizer_config.json `chat_template`, chat_template.json)"
    )]
    NoChatTemplate(PathBuf),
    /// The template does not parse or failed while rendering.
    #[error("chat template: {0}")]
    Template(String),
    /// A message is malformed.
    #[error("message {index}: {message}")]
    Message {
        /// Index in the conversation.
        index: usize,
        /// What is wrong.
        message: String,
    },
    /// The tokenizers library failed.
    #[error("tokenizer: {0}")]
    Tokenize(String),
}
