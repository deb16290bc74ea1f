//! The optimizer's files in a checkpoint: `optimizer.json` (the step and hyper-parameters)
//! and the state, whole in `optimizer.safetensors` (replicated runs) or one file per rank
//! (sharded runs, `super::super::sharding`'s files and manifest). A run reads either kind back
//! whatever its own sharding: its own shard file when cut the same way, else the whole
//! tensors, sharded its own way.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use tch::{Kind, Tensor};

use super::{AdamW, AdamWConfig};
use crate::model::{ModelError, write_safetensors};
use crate::train::distributed::World;
use crate::train::sharding::{MANIFEST_FILE, Manifest};

/// Where [`AdamW::save`] writes the moments (and master weights).
pub(crate) const MOMENTS_FILE: &str = "optimizer.safetensors";
/// Where [`AdamW::save`] writes the step and hyper-parameters.
pub(crate) const STEP_FILE: &str = "optimizer.json";

/// The optimizer state as `optimizer.safetensors` and `optimizer.json` hold it.
pub struct OptimizerSnapshot {
    step: u64,
    config: AdamWConfig,
    pub(crate) tensors: Vec<(String, Tensor)>,
}

impl OptimizerSnapshot {
    /// Writes `optimizer.safetensors` (the tensors) and `optimizer.json` (the step and
    /// hyper-parameters) into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), ModelError> {
        let tensors: HashMap<String, Tensor> = self
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.shallow_clone()))
            .collect();
        write_safetensors(&dir.join(MOMENTS_FILE), &tensors, Kind::Float)?;
        write_step(dir, self.step, &self.config)
    }
}

impl AdamW {
    /// The whole state as `optimizer.safetensors` holds it (a replicated state; a sharded one
    /// is written rank by rank, each its own file).
    pub fn snapshot(&self) -> Result<OptimizerSnapshot, ModelError> {
        if self.sharded.is_some() {
            return Err(ModelError::Input(
                "a sharded optimizer state is written one file per rank (a checkpoint's optimizer.shard-*)".into(),
            ));
        }
        Ok(OptimizerSnapshot {
            step: self.step,
            config: self.config,
            tensors: self.state_tensors(),
        })
    }

    /// Writes the state (`optimizer.safetensors` with `exp_avg.<name>` / `exp_avg_sq.<name>`
    /// and, in mixed precision, `master.<name>`; `optimizer.json` with the step and
    /// hyper-parameters) into `dir`: a replicated state, one process.
    pub fn save(&self, dir: &Path) -> Result<(), ModelError> {
        self.snapshot()?.write(dir)
    }

    /// This rank's part of the state in the checkpoint folder `dir` every rank writes into:
    /// sharded, each rank its shard file; replicated, rank 0 the whole state. Rank 0 writes
    /// `optimizer.json` too.
    pub(crate) fn write_state(&self, dir: &Path, world: &World) -> Result<(), ModelError> {
        match self.sharded() {
            Some(s) => {
                s.write_shard(dir)?;
                match world.is_main() {
                    true => write_step(dir, self.step, &self.config),
                    false => Ok(()),
                }
            }
            None if world.is_main() => self.save(dir),
            None => Ok(()),
        }
    }

    /// Rank 0, once every rank's [`AdamW::write_state`] is done: the manifest of a sharded
    /// state's files (nothing replicated).
    pub(crate) fn write_manifest(&self, dir: &Path) -> Result<(), ModelError> {
        self.sharded().map_or(Ok(()), |s| s.write_manifest(dir))
    }

    /// Restores a state written by [`AdamW::save`] or by the ranks of a sharded run (a file
    /// each and the manifest). Every moment must be present, fp32, in its parameter's shape
    /// and finite, and the files must hold no state of another parameter: errors name the file
    /// and the tensor.
    pub fn load(&mut self, dir: &Path) -> Result<(), ModelError> {
        self.step = read_step(dir)?;
        let read = match dir.join(MANIFEST_FILE).is_file() {
            true => {
                let manifest = Manifest::read(dir)?;
                if let Some(s) = self.sharded().filter(|s| s.cut_as(&manifest)) {
                    return s.load_own(dir, &manifest);
                }
                manifest.assemble(dir, &self.named_shapes())?
            }
            false => self.read_whole(dir)?,
        };
        if let Some(mut s) = self.sharded() {
            return s.load_named(&read);
        }
        // The parameters are the master weights rounded (as the checkpoint's weights already
        // are; this keeps them consistent whatever wrote the weights).
        tch::no_grad(|| -> Result<(), ModelError> {
            for (key, src) in &read {
                let (prefix, name) = key.split_once('.').unwrap_or_default();
                let map = match prefix {
                    "exp_avg" => &self.exp_avg,
                    "exp_avg_sq" => &self.exp_avg_sq,
                    _ => &self.master,
                };
                map[name].shallow_clone().f_copy_(src)?;
                if prefix == "master" {
                    self.params[name].shallow_clone().f_copy_(src)?;
                }
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Every state tensor of this run from `optimizer.safetensors`, by name.
    fn read_whole(&self, dir: &Path) -> Result<BTreeMap<String, Tensor>, ModelError> {
        let file = dir.join(MOMENTS_FILE);
        let bytes = std::fs::read(&file).map_err(|e| ModelError::io(&file, e))?;
        let bad = |message: String| ModelError::Safetensors {
            file: file.clone(),
            message,
        };
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
        let mut read = BTreeMap::new();
        for (key, shape) in self.named_shapes() {
            let view = st.tensor(&key).map_err(|_| ModelError::MissingTensor {
                name: key.clone(),
                dir: dir.into(),
                files: MOMENTS_FILE.into(),
            })?;
            let src = moment_from(&view, &key, &shape).map_err(bad)?;
            read.insert(key, src);
        }
        if let Some(extra) = st.names().into_iter().find(|n| !read.contains_key(*n)) {
            return Err(bad(format!(
                "holds `{extra}`, a state of no parameter this run trains (a checkpoint of another model or adapter?)"
            )));
        }
        Ok(read)
    }

    /// Every state tensor's name in `optimizer.safetensors` and its shape.
    fn named_shapes(&self) -> Vec<(String, Vec<i64>)> {
        match self.sharded() {
            Some(s) => s.named_shapes(),
            None => self.state_tensors().into_iter().map(|(k, t)| (k, t.size())).collect(),
        }
    }
}

/// Writes `optimizer.json`: the update count and the hyper-parameters.
fn write_step(dir: &Path, step: u64, config: &AdamWConfig) -> Result<(), ModelError> {
    let meta = serde_json::json!({"step": step, "config": config});
    let path = dir.join(STEP_FILE);
    std::fs::write(&path, meta.to_string()).map_err(|e| ModelError::io(&path, e))
}

/// The update count `optimizer.json` of `dir` holds.
fn read_step(dir: &Path) -> Result<u64, ModelError> {
    let path = dir.join(STEP_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let json = |message: String| ModelError::Json {
        path: path.clone(),
        message,
    };
    let meta: serde_json::Value = serde_json::from_str(&text).map_err(|e| json(e.to_string()))?;
    meta["step"]
        .as_u64()
        .ok_or_else(|| json(format!("`step` is {}; must be a whole number of updates", meta["step"])))
}

/// A stored optimizer tensor as fp32 in `shape`, refusing another dtype or shape and
/// non-finite values (what a corrupt or foreign file holds).
pub(crate) fn moment_from(
    view: &safetensors::tensor::TensorView<'_>,
    key: &str,
    shape: &[i64],
) -> Result<Tensor, String> {
    if view.dtype() != safetensors::Dtype::F32 {
        return Err(format!("`{key}` is {:?}; optimizer state is F32", view.dtype()));
    }
    let stored: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
    if stored != shape {
        return Err(format!("`{key}` has shape {stored:?}; its parameter has {shape:?}"));
    }
    let t = Tensor::f_from_data_size(view.data(), shape, Kind::Float).map_err(|e| format!("`{key}`: {e}"))?;
    match crate::model::all_finite(&t) {
        Ok(true) if !key.starts_with("exp_avg_sq.") || t.numel() == 0 || t.min().double_value(&[]) >= 0.0 => Ok(t),
        Ok(true) => Err(format!("`{key}` holds negative values (second moments are squares)")),
        Ok(false) => Err(format!("`{key}` holds NaN or infinite values")),
        Err(e) => Err(format!("`{key}`: {e}")),
    }
}
