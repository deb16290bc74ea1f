//! What treetrain ships so every demo and notebook runs offline: small verifiable task
//! datasets and a tiny Qwen3 with its own tokenizer (folder `datasets/` of the repository).
//!
//! Everything here is generated from fixed seeds by `treetrain make-shipped-data`; a test checks
//! the committed files equal what the generator makes.

pub mod datasets;
pub mod retry;
pub mod tasks;
pub mod tiny_model;

use std::path::{Path, PathBuf};

/// The repository's `datasets/` folder (where this crate was built from), or
/// `TREETRAIN_DATASETS` when set.
pub fn datasets_dir() -> PathBuf {
    std::env::var_os("TREETRAIN_DATASETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets"))
}

/// The shipped tiny model's folder, with weights made on first use.
pub fn tiny_model_dir() -> Result<PathBuf, crate::model::ModelError> {
    tiny_model::ensure_weights(&datasets_dir().join("tiny-qwen3"))
}
