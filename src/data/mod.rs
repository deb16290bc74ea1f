//! Datasets from Parquet, Arrow IPC (file and stream; the `datasets` cache and `save_to_disk`
//! layouts), JSON lines (gzipped or not; each line bounded) and CSV, read batch by batch, as
//! TRL's formats: conversations (`messages`, ShareGPT `conversations`), prompt/completion,
//! prompt-only. A folder's links are followed once; a file of another kind is refused naming
//! the kinds read.

mod example;
mod lines;
mod reader;
mod splits;
mod value;

use std::path::PathBuf;

pub use example::{Example, messages};
pub use lines::{BoundedLines, MAX_LINE_BYTES};
pub use reader::Dataset;
pub use value::to_json;

/// Errors from reading datasets.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened or parsed.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A row is malformed.
    #[error("row {row} (0-based): field `{field}` {message}")]
    Row {
        /// Row index in the dataset.
        row: usize,
        /// The field.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}
