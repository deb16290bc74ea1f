//! Seeded checkpoints: weights made from a seed, identical on every machine, so a folder can
//! ship a model without its weights (the shipped tiny model does).

use std::path::{Path, PathBuf};

use tch::Kind;

use super::weights::{init_seeded, load_into, weight_files, write_safetensors};
use super::{HfConfig, LoadOptions, Model, ModelError};
use crate::device::{Device, privateuse1};

/// Marks a seeded checkpoint folder (see [`Model::load`]).
pub const SEED_FILE: &str = "treetrain_init.json";

/// Where a checkpoint's weights are read from.
pub(super) enum Weights {
    /// Safetensors files.
    Files(Vec<PathBuf>),
    /// A seeded folder that would not take its weights file (read-only, full disk): the fp32
    /// CPU model made from the seed, with no temporary file left behind.
    InMemory(Box<Model>),
}

impl Weights {
    /// Copies the weights into `vs`, converting dtype and device (`dir`: the checkpoint, for
    /// errors).
    pub(super) fn load_into(&self, vs: &tch::nn::VarStore, dir: &Path) -> Result<(), ModelError> {
        let seeded = match self {
            Weights::Files(files) => return load_into(vs, files, dir),
            Weights::InMemory(model) => model.vs.variables(),
        };
        for (name, var) in vs.variables() {
            let src = seeded
                .get(&name)
                .ok_or_else(|| ModelError::Input(format!("the seeded weights of {} lack `{name}`", dir.display())))?;
            tch::no_grad(|| var.shallow_clone().f_copy_(src))?;
        }
        Ok(())
    }
}

/// Makes the weights of the seeded folder `dir` and writes them there once.
pub(super) fn materialise_seeded(dir: &Path, hf_config: &HfConfig) -> Result<Weights, ModelError> {
    let path = dir.join(SEED_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
        path: path.clone(),
        message: e.to_string(),
    })?;
    let (Some(seed), Some(std)) = (v["seed"].as_u64(), v["std"].as_f64()) else {
        return Err(ModelError::Json {
            path,
            message: "expected {\"seed\": integer, \"std\": number}".into(),
        });
    };
    let model = Model::seeded(
        hf_config.clone(),
        LoadOptions {
            dtype: Some(Kind::Float),
            device: Device::Cpu,
        },
        seed,
        std,
    )?;
    // Written beside the config under a temporary name, then renamed: concurrent first uses
    // (two notebook kernels) each write identical bytes and never see a partial file.
    // A folder that cannot take the file (a read-only checkout, a full disk) still loads: the
    // same weights from memory, made again on the next load.
    let tmp = dir.join(format!(".model.safetensors.tmp-{}", std::process::id()));
    let written = write_safetensors(&tmp, &model.vs.variables(), Kind::Float)
        .and_then(|()| std::fs::rename(&tmp, dir.join("model.safetensors")).map_err(|e| ModelError::io(&tmp, e)));
    match written {
        Ok(()) => Ok(Weights::Files(weight_files(dir)?)),
        Err(_) => {
            let _ = std::fs::remove_file(&tmp);
            Ok(Weights::InMemory(Box::new(model)))
        }
    }
}

impl Model {
    /// A model with seeded random weights (N(0, `std`), norms 1): identical on every machine.
    pub fn seeded(hf_config: HfConfig, opts: LoadOptions, seed: u64, std: f64) -> Result<Self, ModelError> {
        privateuse1::checked(opts.device, || {
            let mut model = Self::declare(hf_config, opts)?;
            init_seeded(&model.vs, seed, std)?;
            model.finish(opts.device)?;
            Ok(model)
        })
    }
}
