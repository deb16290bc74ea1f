//! Which checkpoint a run continues from, and which checkpoints an output folder keeps:
//! `resume_from_checkpoint` (`true`/`"latest"` or a path, transformers' setting; the CLI's
//! `--resume-from`) and `save_total_limit` rotation.

use std::path::{Path, PathBuf};

use super::config::TrainConfig;
use super::error::TrainError;

/// Where a run continues from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeFrom {
    /// The newest resumable checkpoint in `output_dir`.
    Latest,
    /// This checkpoint folder.
    Checkpoint(PathBuf),
}

impl std::str::FromStr for ResumeFrom {
    type Err = std::convert::Infallible;
    /// `latest`, or a checkpoint folder.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "latest" => ResumeFrom::Latest,
            path => ResumeFrom::Checkpoint(path.into()),
        })
    }
}

/// `resume_from_checkpoint` in a file: `true` / `"latest"`, `false`, or a path.
pub(crate) mod setting {
    use super::ResumeFrom;
    use serde::{Deserialize, Deserializer, Serializer};

    /// `true`, a path, or nothing.
    pub(crate) fn serialize<S: Serializer>(value: &Option<ResumeFrom>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(ResumeFrom::Latest) => s.serialize_bool(true),
            Some(ResumeFrom::Checkpoint(p)) => s.serialize_str(&p.to_string_lossy()),
            None => s.serialize_bool(false),
        }
    }

    /// A boolean or a string.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ResumeFrom>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Flag(bool),
            Path(String),
        }
        Ok(match Raw::deserialize(d)? {
            Raw::Flag(true) => Some(ResumeFrom::Latest),
            Raw::Flag(false) => None,
            Raw::Path(p) => Some(p.parse().unwrap_or(ResumeFrom::Latest)),
        })
    }
}

impl TrainConfig {
    /// The checkpoint this run continues from: `explicit` (a caller's argument) first, then
    /// `resume_from_checkpoint`. `Latest` with no resumable checkpoint in `output_dir` is an
    /// error, as in transformers.
    pub(crate) fn checkpoint_to_resume(&self, explicit: Option<&Path>) -> Result<Option<PathBuf>, TrainError> {
        if let Some(path) = explicit {
            return Ok(Some(path.into()));
        }
        match &self.output.resume_from_checkpoint {
            None => Ok(None),
            Some(ResumeFrom::Checkpoint(path)) => Ok(Some(path.clone())),
            Some(ResumeFrom::Latest) => {
                let out = self.output.output_dir.as_deref().ok_or_else(|| {
                    TrainError::config("resume_from_checkpoint", "is latest, but output_dir is not set")
                })?;
                latest_checkpoint(out)?.map(Some).ok_or_else(|| {
                    TrainError::config(
                        "resume_from_checkpoint",
                        format!(
                            "is latest, but {} holds no resumable checkpoint-N folder",
                            out.display()
                        ),
                    )
                })
            }
        }
    }
}

/// The `checkpoint-<step>` folders of `out`, oldest first.
pub fn checkpoints(out: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let e = e.ok()?;
            let step = e.file_name().to_str()?.strip_prefix("checkpoint-")?.parse().ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// Whether `dir` holds what a resume needs (a `save_only_model` checkpoint does not): the
/// state, `optimizer.json`, and the whole optimizer state or a sharded one's manifest.
pub(crate) fn resumable(dir: &Path) -> bool {
    missing_for_resume(dir).is_none()
}

/// The first file a resume needs that `dir` lacks, named.
fn missing_for_resume(dir: &Path) -> Option<String> {
    let has = |f: &str| dir.join(f).is_file();
    let (state, step) = (super::checkpoint::STATE_FILE, super::adamw::STEP_FILE);
    let (moments, manifest) = (super::adamw::MOMENTS_FILE, super::parallel::MANIFEST_FILE);
    if !has(state) {
        Some(format!("no {state}"))
    } else if !has(step) {
        Some(format!("no {step}"))
    } else if !has(moments) && !has(manifest) {
        Some(format!("neither {moments} nor {manifest}"))
    } else {
        None
    }
}

/// The checkpoints of `out` newer than `taken` that a resume passed over, each with what it
/// lacks (a `save_only_model` save, a folder someone emptied).
pub fn passed_over(out: &Path, taken: &Path) -> Vec<(PathBuf, String)> {
    let all = checkpoints(out);
    let Some(at) = all.iter().position(|(_, dir)| same_dir(dir, taken)) else {
        return Vec::new();
    };
    all[at + 1..]
        .iter()
        .filter_map(|(_, dir)| missing_for_resume(dir).map(|why| (dir.clone(), why)))
        .collect()
}

/// The newest resumable checkpoint of `out`. Checkpoint folders only ever appear whole (they
/// are renamed into place), so the newest one is complete.
pub fn latest_checkpoint(out: &Path) -> Result<Option<PathBuf>, TrainError> {
    let all = checkpoints(out);
    let newest = all.iter().rev().find(|(_, dir)| resumable(dir)).map(|c| c.1.clone());
    if newest.is_none()
        && let Some((_, dir)) = all.last()
    {
        return Err(not_resumable(dir));
    }
    Ok(newest)
}

/// Why a resume cannot take `dir`, which lacks what [`missing_for_resume`] names: a
/// `save_only_model` save holds no optimizer file at all; shard files without their manifest
/// are a checkpoint cut short or edited, not a model-only save.
pub(crate) fn not_resumable(dir: &Path) -> TrainError {
    let why = missing_for_resume(dir).unwrap_or_default();
    let shards = std::fs::read_dir(dir).into_iter().flatten().flatten().any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name.starts_with("optimizer.shard-") && name.ends_with(".safetensors")
    });
    let message = if shards {
        format!(
            "holds optimizer shard files but not {}, which rank 0 writes once every shard is in: the checkpoint was cut short or edited; resume from an earlier one",
            super::parallel::MANIFEST_FILE
        )
    } else if dir.join(super::adamw::STEP_FILE).is_file() || !dir.join(super::checkpoint::STATE_FILE).is_file() {
        format!("cannot be resumed from: it has {why} (a checkpoint cut short or edited?)")
    } else {
        "holds no optimizer state (saved with save_only_model): it loads as a model, but no run can resume from it"
            .into()
    };
    TrainError::Checkpoint {
        path: dir.into(),
        message,
    }
}

/// Deletes the temporary folders (`.checkpoint-<step>.<pid>.tmp`) that interrupted runs left
/// in `out` (a rank killed while a checkpoint was written); returns them. Called by the run
/// holding `out`'s lock, so no live run is writing them.
pub(crate) fn remove_partial(out: &Path) -> Vec<PathBuf> {
    let partial = std::fs::read_dir(out).into_iter().flatten().flatten().filter(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        super::checkpoint::is_staged_name(&name) && e.path().is_dir()
    });
    partial
        .map(|e| e.path())
        .filter(|p| std::fs::remove_dir_all(p).is_ok())
        .collect()
}

/// Deletes every `checkpoint-N` folder of `out` but the newest `limit` and `keep` (the
/// checkpoint just written, the one the run resumed from).
pub(crate) fn rotate(out: &Path, limit: u64, keep: &[&Path]) -> Result<(), TrainError> {
    let all = checkpoints(out);
    let older = all.len().saturating_sub(limit as usize);
    for (_, dir) in &all[..older] {
        if keep.iter().any(|k| same_dir(k, dir)) {
            continue;
        }
        std::fs::remove_dir_all(dir).map_err(|e| TrainError::Checkpoint {
            path: dir.clone(),
            message: format!("could not be deleted for save_total_limit: {e}"),
        })?;
    }
    Ok(())
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_keeps_the_newest_and_spares_the_resumed_one() {
        let out = std::env::temp_dir().join(format!("treetrain-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        for step in [2u64, 4, 6, 8, 10] {
            let dir = out.join(format!("checkpoint-{step}"));
            std::fs::create_dir_all(&dir).unwrap();
            if step != 10 {
                for f in ["trainer_state.json", "optimizer.json", "optimizer.safetensors"] {
                    std::fs::write(dir.join(f), "").unwrap();
                }
            }
        }
        std::fs::create_dir_all(out.join("checkpoint-x")).unwrap();
        assert_eq!(latest_checkpoint(&out).unwrap(), Some(out.join("checkpoint-8")));
        rotate(&out, 2, &[&out.join("checkpoint-10"), &out.join("checkpoint-2")]).unwrap();
        let left: Vec<u64> = checkpoints(&out).into_iter().map(|c| c.0).collect();
        assert_eq!(left, [2, 8, 10]);
        // A killed run's half-written folder goes; a file of that shape is not a folder.
        std::fs::create_dir_all(out.join(".checkpoint-12.4242.tmp")).unwrap();
        std::fs::write(out.join(".checkpoint-13.1.tmp"), "").unwrap();
        assert_eq!(remove_partial(&out), [out.join(".checkpoint-12.4242.tmp")]);
        assert!(out.join(".checkpoint-13.1.tmp").is_file());
        let _ = std::fs::remove_dir_all(&out);
    }
}
