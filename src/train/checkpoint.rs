//! What every trainer writes: atomic checkpoint folders and a JSON-lines log.

use std::path::{Path, PathBuf};

use super::{AdamW, OptimizerSnapshot, TrainError};
use crate::model::Model;

/// Writes `out/checkpoint-<step>/` through `write` into a temporary folder that is renamed into
/// place, so a crash never leaves a half-written checkpoint under the real name. The temporary
/// name is this process's own: another process saving into `out` never shares it.
pub fn save_atomically(
    out: &Path,
    step: u64,
    write: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<PathBuf, TrainError> {
    let dir = out.join(format!("checkpoint-{step}"));
    let tmp = out.join(format!(".checkpoint-{step}.{}.tmp", std::process::id()));
    let fail = |message: String| TrainError::Checkpoint {
        path: dir.clone(),
        message,
    };
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| fail(format!("{}: {e}", tmp.display())))?;
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(fail(e));
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(|e| fail(e.to_string()))?;
    Ok(dir)
}

/// Writes `out/checkpoint-<step>/` atomically: the model as a Hugging Face folder, or its LoRA
/// adapter as PEFT's folder (with the tokenizer files of `tokenizer_dir`), the optimizer state
/// (unless `optimizer` is `None`: `save_only_model`), `trainer_state.json` and whatever
/// `extra` writes into the folder (a trainer's own files).
pub fn save_checkpoint(
    out: &Path,
    step: u64,
    model: &Model,
    tokenizer_dir: &Path,
    optimizer: Option<&OptimizerSnapshot>,
    state: &impl serde::Serialize,
    extra: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<PathBuf, TrainError> {
    save_atomically(out, step, |tmp| {
        match &model.adapter {
            // A LoRA run's checkpoint is the adapter in PEFT's format (plus the tokenizer): the
            // base is the run's `model`.
            Some(adapter) => adapter
                .write_files(tmp)
                .and_then(|_| Ok(crate::tokenizer::copy_tokenizer_files(tokenizer_dir, tmp)?)),
            None => model.save(tmp, Some(tokenizer_dir)),
        }
        .map_err(|e| e.to_string())?;
        if let Some(optimizer) = optimizer {
            optimizer.write(tmp).map_err(|e| e.to_string())?;
        }
        let state = serde_json::to_string_pretty(state).map_err(|e| e.to_string())?;
        std::fs::write(tmp.join(STATE_FILE), state).map_err(|e| e.to_string())?;
        extra(tmp)
    })
}

/// Restores `optimizer` from a folder written by [`save_checkpoint`] and returns the trainer
/// state saved with it.
pub fn load_checkpoint<T: serde::de::DeserializeOwned>(
    checkpoint: &Path,
    optimizer: &mut AdamW,
) -> Result<T, TrainError> {
    let fail = |message: String| TrainError::Checkpoint {
        path: checkpoint.into(),
        message,
    };
    optimizer.load(checkpoint).map_err(|e| fail(e.to_string()))?;
    let path = checkpoint.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| fail(format!("{}: {e}", path.display())))
}

pub(crate) const STATE_FILE: &str = "trainer_state.json";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_no_checkpoint_and_a_good_one_replaces_the_old() {
        let out = std::env::temp_dir().join(format!("treetrain-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let err = save_atomically(&out, 3, |_| Err("disk full".into())).unwrap_err();
        assert!(err.to_string().ends_with("checkpoint-3: disk full"), "{err}");
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0, "no temporary folder left");
        assert!(!out.join("checkpoint-3").exists());
        for text in ["old", "new"] {
            let dir = save_atomically(&out, 3, |tmp| {
                std::fs::write(tmp.join("x"), text).map_err(|e| e.to_string())
            })
            .unwrap();
            assert_eq!(std::fs::read_to_string(dir.join("x")).unwrap(), text);
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}
