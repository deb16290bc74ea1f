//! Checkpoint folders written atomically, by one process or by every rank of a run (a run's
//! logs are written by `train::report`).

use std::path::{Path, PathBuf};

use super::error::TrainError;
use crate::distributed::World;

/// A checkpoint folder every rank of a run writes its part into: `out/.checkpoint-<step>.<pid
/// of rank 0>.tmp`, renamed to `out/checkpoint-<step>` by rank 0 once every rank has said its
/// part is written. Until the rename nothing under the real name exists, so a rank killed at
/// any moment leaves the previous checkpoint the newest complete one. Sharded runs need
/// `output_dir` on a filesystem every rank sees.
pub(crate) struct Staged {
    dir: PathBuf,
    tmp: PathBuf,
}

impl Staged {
    /// Every rank: the folder, made by rank 0 (a collective).
    pub(crate) fn new(out: &Path, step: u64, world: &World) -> Result<Self, TrainError> {
        let mut pid = [if world.is_main() {
            std::process::id() as f64
        } else {
            0.0
        }];
        world.sum(&mut pid)?;
        let staged = Staged {
            dir: out.join(format!("checkpoint-{step}")),
            tmp: out.join(format!("{STAGING_PREFIX}{step}.{}{STAGING_SUFFIX}", pid[0] as u32)),
        };
        let made = match world.is_main() {
            true => {
                let _ = std::fs::remove_dir_all(&staged.tmp);
                std::fs::create_dir_all(&staged.tmp).map_err(|e| staged.error(format!("{}: {e}", staged.tmp.display())))
            }
            false => Ok(()),
        };
        staged.agree(world, made)?;
        Ok(staged)
    }

    /// Where the ranks write.
    pub(crate) fn path(&self) -> &Path {
        &self.tmp
    }

    /// A checkpoint error of this folder.
    pub(crate) fn error(&self, message: String) -> TrainError {
        TrainError::Checkpoint {
            path: self.dir.clone(),
            message,
        }
    }

    /// Every rank, with how its part went: once every rank's is written, rank 0 runs `seal`
    /// (the last file, naming the others) and renames the folder into place. A failure of any
    /// rank removes the folder and is every rank's error, naming the rank.
    pub(crate) fn commit(
        self,
        world: &World,
        mine: Result<(), TrainError>,
        seal: impl FnOnce(&Path) -> Result<(), String>,
    ) -> Result<PathBuf, TrainError> {
        self.agree(world, mine)?;
        let sealed = match world.is_main() {
            true => seal(&self.tmp).map_err(|m| self.error(m)).and_then(|()| {
                let _ = std::fs::remove_dir_all(&self.dir);
                std::fs::rename(&self.tmp, &self.dir).map_err(|e| self.error(e.to_string()))
            }),
            false => Ok(()),
        };
        self.agree(world, sealed)?;
        Ok(self.dir)
    }

    /// Every rank learns whether every rank's `mine` succeeded; on a failure rank 0 removes
    /// the temporary folder.
    fn agree(&self, world: &World, mine: Result<(), TrainError>) -> Result<(), TrainError> {
        let said = mine.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        let all = world.all_gather_bytes(said.as_bytes())?;
        let failed = all.iter().position(|m| !m.is_empty());
        if failed.is_some() && world.is_main() {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
        mine?;
        match failed {
            Some(rank) => Err(self.error(format!(
                "rank {rank} could not write its part: {}",
                String::from_utf8_lossy(&all[rank])
            ))),
            None => Ok(()),
        }
    }
}

/// Reads the trainer state `trainer_state.json` of a checkpoint folder.
pub(crate) fn read_state(checkpoint: &Path) -> Result<serde_json::Value, TrainError> {
    let path = checkpoint.join(STATE_FILE);
    let fail = |e: String| TrainError::Checkpoint {
        path: checkpoint.into(),
        message: format!("{}: {e}", path.display()),
    };
    let text = std::fs::read_to_string(&path).map_err(|e| fail(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| fail(e.to_string()))
}

pub(crate) const STATE_FILE: &str = "trainer_state.json";

/// A staged checkpoint folder's name is `.checkpoint-<step>.<pid of rank 0>.tmp`.
const STAGING_PREFIX: &str = ".checkpoint-";
const STAGING_SUFFIX: &str = ".tmp";

/// Whether a folder of this name is a staged (so, unless renamed, half-written) checkpoint.
pub(crate) fn is_staged_name(name: &str) -> bool {
    name.starts_with(STAGING_PREFIX) && name.ends_with(STAGING_SUFFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `out/checkpoint-<step>/` through `write` into a temporary folder that is renamed into
    /// place, so a crash never leaves a half-written checkpoint under the real name. The temporary
    /// name is this process's own: another process saving into `out` never shares it.
    fn save_atomically(
        out: &Path,
        step: u64,
        write: impl FnOnce(&Path) -> Result<(), String>,
    ) -> Result<PathBuf, TrainError> {
        let world = World::single();
        let staged = Staged::new(out, step, &world)?;
        let written = write(staged.path()).map_err(|message| staged.error(message));
        staged.commit(&world, written, |_| Ok(()))
    }

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

    /// Two ranks (threads on a file store) stage one checkpoint; rank 1 fails to write its
    /// part: both get an error (rank 0's names rank 1), nothing is left in the output folder,
    /// and a second attempt where both succeed puts the folder in place with both parts.
    #[test]
    fn a_rank_failing_its_part_fails_every_rank_and_leaves_nothing() {
        let dir = std::env::temp_dir().join(format!("treetrain-staged-{}", std::process::id()));
        let out = dir.join("out");
        std::fs::create_dir_all(&out).unwrap();
        let store = dir.join("store");
        let _ = std::fs::remove_file(&store);
        let run = |rank: usize| {
            let (store, out) = (store.clone(), out.clone());
            std::thread::spawn(move || {
                let world = World::with_file_store(&store, rank, 2, std::time::Duration::from_secs(30)).unwrap();
                let attempt = |fail: bool| {
                    let staged = Staged::new(&out, 5, &world)?;
                    let part = staged.path().join(format!("part-{rank}"));
                    std::fs::write(part, "x").unwrap();
                    let mine = match fail {
                        true => Err(staged.error("disk full".into())),
                        false => Ok(()),
                    };
                    staged.commit(&world, mine, |tmp| {
                        std::fs::write(tmp.join("manifest"), "m").map_err(|e| e.to_string())
                    })
                };
                let failed = attempt(rank == 1).unwrap_err().to_string();
                let listed = std::fs::read_dir(&out).unwrap().count();
                world.barrier().unwrap();
                (failed, listed, attempt(false).unwrap())
            })
        };
        let (a, b) = (run(0), run(1));
        let ((e0, n0, dir0), (e1, _, _)) = (a.join().unwrap(), b.join().unwrap());
        assert!(
            e0.contains("rank 1 could not write its part") && e0.contains("disk full"),
            "{e0}"
        );
        assert!(e1.ends_with("checkpoint-5: disk full"), "{e1}");
        assert_eq!(n0, 0, "the temporary folder was left behind");
        for f in ["part-0", "part-1", "manifest"] {
            assert!(dir0.join(f).is_file(), "{f}");
        }
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
