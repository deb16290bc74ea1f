//! The optimizer's files in a checkpoint: `optimizer.json` (the step and hyper-parameters)
//! and the whole state in `optimizer.safetensors`. (A sharded run writes one file per rank
//! instead: `train::parallel`, which also reads either kind back whatever its own sharding.)

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use tch::{Kind, Tensor};

use super::{AdamW, AdamWConfig};
use crate::model::{ModelError, write_safetensors};

/// Where [`AdamW::save`] writes the moments (and master weights).
pub(crate) const MOMENTS_FILE: &str = "optimizer.safetensors";
/// Where [`AdamW::save`] writes the step and hyper-parameters.
pub(crate) const STEP_FILE: &str = "optimizer.json";

impl AdamW {
    /// Writes the state (`optimizer.safetensors` with `exp_avg.<name>` / `exp_avg_sq.<name>`
    /// and, in mixed precision, `master.<name>`; `optimizer.json` with the step and
    /// hyper-parameters) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), ModelError> {
        let tensors: HashMap<String, Tensor> = self.state_tensors().into_iter().collect();
        write_safetensors(&dir.join(MOMENTS_FILE), &tensors, Kind::Float)?;
        write_step(dir, self.step, &self.config)
    }

    /// Restores a state written by [`AdamW::save`]. Every moment must be present, fp32, in its
    /// parameter's shape and finite, and the file must hold no state of another parameter:
    /// errors name the file and the tensor.
    pub fn load(&mut self, dir: &Path) -> Result<(), ModelError> {
        let step = read_step(dir)?;
        let read = read_whole(dir, &self.named_shapes())?;
        self.restore(step, &read)
    }

    /// Takes update count `step` and the whole state `read` (every name of
    /// [`AdamW::named_shapes`], checked by the reader).
    pub(crate) fn restore(&mut self, step: u64, read: &BTreeMap<String, Tensor>) -> Result<(), ModelError> {
        self.step = step;
        // The parameters are the master weights rounded (as the checkpoint's weights already
        // are; this keeps them consistent whatever wrote the weights).
        tch::no_grad(|| -> Result<(), ModelError> {
            for (key, src) in read {
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
        })
    }

    /// Every state tensor's name in `optimizer.safetensors` and its shape.
    pub(crate) fn named_shapes(&self) -> Vec<(String, Vec<i64>)> {
        self.state_tensors().into_iter().map(|(k, t)| (k, t.size())).collect()
    }
}

/// Every state tensor of `wanted` (name, shape) from the `optimizer.safetensors` of `dir`, by
/// name; a tensor the file holds beyond them is an error (another model's state).
pub(crate) fn read_whole(dir: &Path, wanted: &[(String, Vec<i64>)]) -> Result<BTreeMap<String, Tensor>, ModelError> {
    let file = dir.join(MOMENTS_FILE);
    let bytes = std::fs::read(&file).map_err(|e| ModelError::io(&file, e))?;
    let bad = |message: String| ModelError::Safetensors {
        file: file.clone(),
        message,
    };
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut read = BTreeMap::new();
    for (key, shape) in wanted {
        let view = st.tensor(key).map_err(|_| ModelError::MissingTensor {
            name: key.clone(),
            dir: dir.into(),
            files: MOMENTS_FILE.into(),
        })?;
        let src = moment_from(&view, key, shape).map_err(bad)?;
        read.insert(key.clone(), src);
    }
    if let Some(extra) = st.names().into_iter().find(|n| !read.contains_key(*n)) {
        return Err(bad(format!(
            "holds `{extra}`, a state of no parameter this run trains (a checkpoint of another model or adapter?)"
        )));
    }
    Ok(read)
}

/// Writes `optimizer.json`: the update count and the hyper-parameters.
pub(crate) fn write_step(dir: &Path, step: u64, config: &AdamWConfig) -> Result<(), ModelError> {
    let meta = serde_json::json!({"step": step, "config": config});
    let path = dir.join(STEP_FILE);
    std::fs::write(&path, meta.to_string()).map_err(|e| ModelError::io(&path, e))
}

/// The update count `optimizer.json` of `dir` holds.
pub(crate) fn read_step(dir: &Path) -> Result<u64, ModelError> {
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
