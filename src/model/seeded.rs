//! Seeded checkpoints: weights made from a seed, identical on every machine, so a folder can
//! ship a model without its weights (the shipped tiny model does).

use std::path::Path;

use tch::Kind;

use super::weights::{init_seeded, write_safetensors};
use super::{HfConfig, LoadOptions, Model, ModelError};
use crate::device::{Device, privateuse1};

/// Marks a seeded checkpoint folder (see [`Model::load`]).
pub const SEED_FILE: &str = "treetrain_init.json";

pub(super) fn materialise_seeded(dir: &Path, hf_config: &HfConfig) -> Result<(), ModelError> {
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
    let tmp = dir.join(format!(".model.safetensors.tmp-{}", std::process::id()));
    write_safetensors(&tmp, &model.vs.variables(), Kind::Float)?;
    let dest = dir.join("model.safetensors");
    std::fs::rename(&tmp, &dest).map_err(|e| ModelError::io(&dest, e))
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
