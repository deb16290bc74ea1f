//! Reading and writing parameters as safetensors under their PyTorch `state_dict` names.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use tch::{Kind, Tensor, nn};

use super::error::ModelError;
use super::moe::checkpoint::{ExpertSlice, Part};
use super::safetensors_out::SafetensorsOut;
use crate::util::SplitMix64;

/// The safetensors files of a checkpoint folder: the shards named by
/// `model.safetensors.index.json`, else `model.safetensors`. Pickle-only folders are refused.
pub(crate) fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    // transformers loads the single file when both it and an index are there (a sharded save
    // over an unsharded one leaves both).
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path: index.clone(),
            message: e.to_string(),
        })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Json {
                path: index.clone(),
                message: "missing object field `weight_map`".into(),
            })?;
        let mut files: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    for pickle in [
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "model.pt",
        "consolidated.00.pth",
    ] {
        if dir.join(pickle).exists() {
            return Err(ModelError::PickleOnly {
                dir: dir.into(),
                file: pickle.into(),
            });
        }
    }
    Err(ModelError::NoWeights { dir: dir.into() })
}

fn kind_of(dtype: Dtype, file: &Path) -> Result<Kind, ModelError> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F64 => Kind::Double,
        other => {
            return Err(ModelError::Safetensors {
                file: file.into(),
                message: format!("unsupported dtype {other:?} (expected F32, BF16, F16 or F64)"),
            });
        }
    })
}

/// Copies every variable of `vs` from the checkpoint files, converting dtype as needed; a
/// mixture's experts come fused or a tensor per expert (`super::moe::checkpoint`).
/// `ignorable` names may be absent from `vs` without complaint (e.g. `lm_head.weight` of a tied
/// model); every variable of `vs` must be found.
pub(crate) fn load_into(vs: &nn::VarStore, files: &[PathBuf], dir: &Path) -> Result<(), ModelError> {
    let vars = vs.variables();
    let mut loaded = HashSet::new();
    // Each fused parameter's pieces read (a piece in two shards counts once).
    let mut pieces: HashMap<String, HashSet<(i64, Part)>> = HashMap::new();
    for file in files {
        let bytes = std::fs::read(file).map_err(|e| ModelError::io(file, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
            file: file.clone(),
            message: e.to_string(),
        })?;
        // By name, so that the first tensor that does not fit is the same on every run.
        let mut tensors: Vec<(&str, safetensors::tensor::TensorView<'_>)> = st.iter().collect();
        tensors.sort_by(|a, b| a.0.cmp(b.0));
        for (name, view) in tensors {
            // A tensor of the hub's per-expert layout fills its rows of a fused parameter.
            let slice = ExpertSlice::of(name, &vars);
            let var = match (vars.get(name), &slice) {
                (Some(var), _) => var.shallow_clone(),
                (None, Some(slice)) => slice.view(&vars[&slice.fused]),
                (None, None) if ignorable(name, &vars) => continue,
                (None, None) => {
                    return Err(ModelError::UnexpectedTensor {
                        name: name.into(),
                        file: file.clone(),
                    });
                }
            };
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            if shape != var.size() {
                return Err(ModelError::ShapeMismatch {
                    name: name.into(),
                    file: file.clone(),
                    expected: var.size(),
                    found: shape,
                });
            }
            let src = Tensor::f_from_data_size(view.data(), &shape, kind_of(view.dtype(), file)?)?;
            if !all_finite(&src)? {
                return Err(ModelError::NonFinite {
                    name: name.into(),
                    place: format!("in {}", file.display()),
                });
            }
            tch::no_grad(|| var.shallow_clone().f_copy_(&src))?;
            match slice.filter(|_| !vars.contains_key(name)) {
                Some(slice) => {
                    pieces
                        .entry(slice.fused)
                        .or_default()
                        .insert((slice.expert, slice.part));
                }
                None => {
                    loaded.insert(name.to_string());
                }
            }
        }
    }
    // A fused parameter is loaded when every per-expert piece of it was.
    for (name, read) in pieces {
        if ExpertSlice::pieces_of(&name, &vars[&name]) == Some(read.len()) {
            loaded.insert(name);
        }
    }
    let mut missing: Vec<&String> = vars.keys().filter(|k| !loaded.contains(*k)).collect();
    missing.sort();
    if let Some(name) = missing.first() {
        let names: Vec<String> = files
            .iter()
            .filter_map(|f| f.file_name())
            .map(|f| f.to_string_lossy().into())
            .collect();
        return Err(ModelError::MissingTensor {
            name: (*name).clone(),
            dir: dir.into(),
            files: names.join(", "),
        });
    }
    Ok(())
}

/// Checkpoint tensors a model may lack on purpose: RoPE's cached inverse frequencies (older
/// transformers saved them), an LM head a tied model takes from its embedding, and in a
/// multimodal checkpoint whose text decoder alone is loaded, everything of `model` outside
/// `model.language_model` (the vision and audio towers and their projections), and in an
/// adapter for one, PEFT's LoRA tensors on those towers (a text-only model never runs them).
fn ignorable(name: &str, vars: &std::collections::HashMap<String, Tensor>) -> bool {
    let tower = |model: &str| {
        let decoder = format!("{model}language_model.");
        vars.keys().any(|k| k.starts_with(&decoder)) && name.starts_with(model) && !name.starts_with(&decoder)
    };
    name.ends_with("rotary_emb.inv_freq")
        || (name == "lm_head.weight" && vars.contains_key("model.embed_tokens.weight"))
        || tower("model.")
        || tower("base_model.model.model.")
}

/// Whether every value of `t` is finite (integer tensors always are).
pub(crate) fn all_finite(t: &Tensor) -> Result<bool, ModelError> {
    if !t.is_floating_point() {
        return Ok(true);
    }
    Ok(t.f_isfinite()?.f_all()?.int64_value(&[]) != 0)
}

/// A short fingerprint of the weights in `vs`: every tensor's name, shape and up to 64 of its
/// values at evenly spaced places, hashed (FNV-1a). Reading 64 values a tensor keeps it cheap at
/// any model size; two different checkpoints of one architecture differ in it.
pub(crate) fn weights_fingerprint(vs: &tch::nn::VarStore) -> Result<String, ModelError> {
    let sorted: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
    let mut hash = crate::util::Fnv1a::new();
    let mut eat = |bytes: &[u8]| hash.eat(bytes);
    for (name, t) in sorted {
        eat(name.as_bytes());
        t.size().iter().for_each(|d| eat(&d.to_le_bytes()));
        let flat = t.f_reshape([-1])?;
        let n = flat.numel() as i64;
        let picks = Tensor::f_linspace(0.0, (n - 1).max(0) as f64, n.min(64), (Kind::Int64, t.device()))?
            .f_to_kind(Kind::Int64)?;
        let values = flat
            .f_index_select(0, &picks)?
            .f_to_kind(Kind::Float)?
            .f_to_device(tch::Device::Cpu)?;
        let values: Vec<f32> = Vec::try_from(&values)?;
        values.iter().for_each(|v| eat(&v.to_bits().to_le_bytes()));
    }
    Ok(hash.hex())
}

/// An error naming the first tensor of `vars` (by name) that holds NaN or infinite values:
/// nothing is written with them.
pub(crate) fn check_finite_to_write(vars: &HashMap<String, Tensor>) -> Result<(), ModelError> {
    let sorted: BTreeMap<&String, &Tensor> = vars.iter().collect();
    for (name, t) in sorted {
        if !all_finite(t)? {
            return Err(ModelError::NonFinite {
                name: name.clone(),
                place: "to be written".into(),
            });
        }
    }
    Ok(())
}

/// Writes `value` as pretty JSON (with a final newline) to `path`.
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), ModelError> {
    let text = serde_json::to_string_pretty(value).map_err(|e| ModelError::Json {
        path: path.into(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text + "\n").map_err(|e| ModelError::io(path, e))
}

/// Fills `vs` deterministically from `seed`: norms 1, biases 0, everything else N(0, std)
/// (transformers' `initializer_range` scheme). Same values on every machine.
pub(crate) fn init_seeded(vs: &nn::VarStore, seed: u64, std: f64) -> Result<(), ModelError> {
    let vars: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
    let mut rng = SplitMix64::new(seed);
    for (name, var) in &vars {
        let n = var.numel();
        let values: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; n]
        } else if name.ends_with(".bias") {
            vec![0.0; n]
        } else {
            (0..n).map(|_| (rng.normal() * std) as f32).collect()
        };
        let src = Tensor::from_slice(&values).view(var.size().as_slice());
        tch::no_grad(|| var.shallow_clone().f_copy_(&src))?;
    }
    Ok(())
}

/// Writes `tensors` (name -> tensor) as one safetensors file in `kind`, with the
/// `{"format": "pt"}` metadata transformers checks; one tensor's bytes in memory at a time
/// (`SafetensorsOut`).
pub fn write_safetensors(path: &Path, tensors: &HashMap<String, Tensor>, kind: Kind) -> Result<(), ModelError> {
    let sorted: BTreeMap<&String, &Tensor> = tensors.iter().collect();
    let entries = sorted.iter().map(|(n, t)| ((*n).clone(), t.size())).collect();
    let mut out = SafetensorsOut::create(path, entries, kind, &[])?;
    for t in sorted.values() {
        out.write(t)?;
    }
    out.finish()
}
