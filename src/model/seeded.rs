//! Seeded checkpoints: weights made from a seed, identical on every machine, so a folder can
//! ship a model without its weights (the shipped tiny model does).

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use super::config::HfConfig;
use super::error::ModelError;
use super::loaded::{LoadOptions, Model};
use super::weights::{init_seeded, load_into, weight_files, write_safetensors};
use crate::device::{Device, privateuse1};

/// Marks a seeded checkpoint folder (see [`Model::load`]).
pub(crate) const SEED_FILE: &str = "treetrain_init.json";

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
    /// A model with random weights drawn on its own device (N(0, `std`), norms 1, biases 0) from
    /// a counter-based hash of `seed` and each element's index: no host loop and no copy, so a
    /// multi-billion-parameter config is drawn by the device's own kernels instead of
    /// [`Model::seeded`]'s loop on the host. The weights depend only on the seed (up to
    /// float rounding of `ln` and `cos` between devices), but are not [`Model::seeded`]'s: for
    /// benchmarks of real-size configs, not for shipped checkpoints.
    pub fn drawn(hf_config: HfConfig, opts: LoadOptions, seed: u64, std: f64) -> Result<Self, ModelError> {
        privateuse1::checked(opts.device, || {
            let mut model = Self::declare(hf_config, opts)?;
            let mut offset = 0i64;
            // By name: the offsets (and so the weights) do not depend on the map's order.
            let vars: std::collections::BTreeMap<String, Tensor> = model.vs.variables().into_iter().collect();
            for (name, var) in vars {
                let n = var.numel() as i64;
                tch::no_grad(|| -> Result<(), ModelError> {
                    let mut flat = var.f_view([n])?;
                    if name.ends_with("norm.weight") {
                        let _ = flat.f_fill_(1.0)?;
                    } else if name.ends_with(".bias") {
                        let _ = flat.f_fill_(0.0)?;
                    } else {
                        fill_normal(&flat, opts.device, seed, offset, std)?;
                    }
                    Ok(())
                })?;
                offset += n;
            }
            model.finish(opts.device)?;
            Ok(model)
        })
    }

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

/// Elements drawn per chunk by [`fill_normal`] (its int64 temporaries: 128 MiB each).
const DRAW_CHUNK: i64 = 1 << 24;

/// Fills the 1-d `flat` with N(0, `std`) draws: Box-Muller on two uniforms hashed from `seed`
/// and the global element index (`offset` + position), on `device`, chunk by chunk.
fn fill_normal(flat: &Tensor, device: Device, seed: u64, offset: i64, std: f64) -> Result<(), ModelError> {
    // SplitMix64's finaliser, in wrapping int64 arithmetic (shifts are arithmetic; the 24 bits
    // taken lie below the sign-filled ones).
    let mix = |x: Tensor| -> Result<Tensor, tch::TchError> {
        let x = x.f_bitwise_xor_tensor(&x.f_bitwise_right_shift_tensor_scalar(30)?)?;
        let x = x.f_mul_scalar(0xBF58_476D_1CE4_E5B9_u64 as i64)?;
        let x = x.f_bitwise_xor_tensor(&x.f_bitwise_right_shift_tensor_scalar(27)?)?;
        let x = x.f_mul_scalar(0x94D0_49BB_1331_11EB_u64 as i64)?;
        x.f_bitwise_xor_tensor(&x.f_bitwise_right_shift_tensor_scalar(31)?)
    };
    let n = flat.size()[0];
    let mut start = 0;
    while start < n {
        let len = DRAW_CHUNK.min(n - start);
        let index = device.arange(len, Kind::Int64)?.f_add_scalar(offset + start)?;
        let key = index
            .f_mul_scalar(2)?
            .f_add_scalar(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) as i64)?;
        // Uniforms in (0, 1): 24 hashed bits and a half.
        let uniform = |k: Tensor| -> Result<Tensor, tch::TchError> {
            mix(k)?
                .f_bitwise_right_shift_tensor_scalar(8)?
                .f_bitwise_and(0xFF_FFFF)?
                .f_to_kind(Kind::Float)?
                .f_add_scalar(0.5)?
                .f_div_scalar(16_777_216.0)
        };
        let (u1, u2) = (uniform(key.shallow_clone())?, uniform(key.f_add_scalar(1)?)?);
        let radius = u1.f_log()?.f_mul_scalar(-2.0)?.f_sqrt()?;
        let z = radius
            .f_mul(&u2.f_mul_scalar(std::f64::consts::TAU)?.f_cos()?)?
            .f_mul_scalar(std)?;
        flat.f_narrow(0, start, len)?.f_copy_(&z)?;
        start += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> HfConfig {
        serde_json::from_value(serde_json::json!({
            "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 256
        }))
        .unwrap()
    }

    fn draw(seed: u64) -> std::collections::BTreeMap<String, Tensor> {
        let opts = LoadOptions {
            dtype: Some(Kind::Float),
            device: Device::Cpu,
        };
        Model::drawn(config(), opts, seed, 0.02)
            .unwrap()
            .vs
            .variables()
            .into_iter()
            .collect()
    }

    /// Drawn weights are N(0, std) (moments and the one-sigma mass), norms 1, repeatable for a
    /// seed, different across seeds and across tensors.
    #[test]
    fn drawn_weights_are_seeded_normals() {
        let (a, b, c) = (draw(7), draw(7), draw(8));
        let all: Vec<Tensor> = a
            .iter()
            .filter(|(name, _)| !name.ends_with("norm.weight"))
            .map(|(_, t)| t.flatten(0, -1))
            .collect();
        let all = Tensor::cat(&all, 0);
        let (mean, std) = (
            all.mean(Kind::Double).double_value(&[]),
            all.std(true).double_value(&[]),
        );
        let within = all
            .abs()
            .le(0.02)
            .to_kind(Kind::Double)
            .mean(Kind::Double)
            .double_value(&[]);
        assert!(all.size()[0] > 100_000);
        assert!(mean.abs() < 2e-4, "mean {mean}");
        assert!((std / 0.02 - 1.0).abs() < 0.01, "std {std}");
        assert!((within - 0.6827).abs() < 0.005, "one-sigma mass {within}");
        for (name, t) in &a {
            assert!(t.equal(&b[name]), "{name} repeats");
            if name.ends_with("norm.weight") {
                assert_eq!(t.min().double_value(&[]), 1.0, "{name}");
            } else {
                assert!(!t.equal(&c[name]), "{name} changes with the seed");
            }
        }
        let (q, k) = (
            &a["model.layers.0.self_attn.q_proj.weight"],
            &a["model.layers.1.self_attn.q_proj.weight"],
        );
        assert!(!q.equal(k), "tensors of one shape differ");
    }
}
