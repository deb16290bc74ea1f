//! The batches a sync run generated for later steps (the other slices of a generation with
//! `steps_per_generation`, the repeats of `num_iterations`) and their place in checkpoints: a
//! resume trains on them as the run would have, instead of generating anew.

use std::collections::VecDeque;
use std::path::Path;

use super::rollouts::RolloutBatch;
use crate::train::TrainError;

/// Where a checkpoint keeps the batches generated for later steps.
const PENDING_FILE: &str = "pending_rollouts.json";

/// Writes the batches generated for later steps into checkpoint folder `dir` (none: no file):
/// a resume trains on them, as the run would have.
pub(super) fn write(dir: &Path, pending: &VecDeque<RolloutBatch>) -> Result<(), String> {
    if pending.is_empty() {
        return Ok(());
    }
    let text = serde_json::to_vec(pending).map_err(|e| e.to_string())?;
    std::fs::write(dir.join(PENDING_FILE), text).map_err(|e| format!("{PENDING_FILE}: {e}"))
}

/// The batches a checkpoint had generated for later steps (none without the file).
pub(super) fn read(checkpoint: &Path) -> Result<VecDeque<RolloutBatch>, TrainError> {
    let path = checkpoint.join(PENDING_FILE);
    if !path.exists() {
        return Ok(Default::default());
    }
    let fail = |message: String| TrainError::Checkpoint {
        path: checkpoint.into(),
        message: format!("{PENDING_FILE}: {message}"),
    };
    let bytes = std::fs::read(&path).map_err(|e| fail(e.to_string()))?;
    serde_json::from_slice(&bytes).map_err(|e| fail(e.to_string()))
}
