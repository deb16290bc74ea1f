//! Saving a model as a folder transformers loads unchanged, written atomically: a temporary
//! sibling renamed into place, never over the user's files.

use std::collections::BTreeMap;
use std::path::Path;

use tch::{Kind, Tensor};

use super::error::ModelError;
use super::hooks::ParamUnit;
use super::loaded::Model;
use super::safetensors_out::SafetensorsOut;
use super::weights::all_finite;
use super::weights::{write_json, write_safetensors};

/// The `torch_dtype` name of a parameter kind (`float32`, `bfloat16`, `float16`).
pub fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// Refuses a save target holding the user's data: a file always, a non-empty folder unless
/// `replace`.
fn check_target(dir: &Path, replace: bool) -> Result<(), ModelError> {
    let refuse = |reason: &str| ModelError::WouldOverwrite {
        path: dir.into(),
        reason: reason.into(),
    };
    match std::fs::symlink_metadata(dir) {
        Err(_) => Ok(()),
        Ok(m) if !m.is_dir() => Err(refuse("exists and is not a folder; choose another output path")),
        Ok(_) if replace => Ok(()),
        Ok(_) => match std::fs::read_dir(dir).map(|mut d| d.next().is_none()) {
            Ok(true) => Ok(()),
            _ => Err(refuse(
                "is a folder that is not empty; choose another path or pass --overwrite to replace it",
            )),
        },
    }
}

/// Refuses an output folder `dir` that equals, contains or lies inside one of `sources` (the
/// folders a save reads from: the model, its tokenizer, an adapter): replacing it would delete
/// them, writing into them would mix the output into the input. Paths are compared after
/// resolving links and `..`, the part of `dir` that does not exist yet taken as written.
pub fn refuse_overlap(dir: &Path, sources: &[&Path]) -> Result<(), ModelError> {
    let out = resolved(dir);
    for source in sources {
        let src = resolved(source);
        if out.starts_with(&src) || src.starts_with(&out) {
            return Err(ModelError::WouldOverwrite {
                path: dir.into(),
                reason: format!(
                    "equals, contains or lies inside {}, which this save reads from; choose an output path outside it",
                    source.display()
                ),
            });
        }
    }
    Ok(())
}

/// `path` with links and `..` resolved as far as it exists, the rest appended as written.
fn resolved(path: &Path) -> std::path::PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut rest = Vec::new();
    let mut existing = absolute.as_path();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return rest.iter().rev().fold(real, |p, c| p.join(c));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

/// Writes a folder through `write` into a temporary sibling renamed into place, so a crash never
/// leaves a half-written folder under the real name. `dir` must not exist or be an empty folder
/// unless `replace` (then an existing folder is replaced whole; a file is always refused).
pub(crate) fn save_folder(
    dir: &Path,
    replace: bool,
    write: impl FnOnce(&Path) -> Result<(), ModelError>,
) -> Result<(), ModelError> {
    check_target(dir, replace)?;
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    if let Err(e) = write(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if dir.is_dir() && std::fs::remove_dir(dir).is_ok() {
        // It was an empty folder.
        std::fs::rename(&tmp, dir).map_err(|e| ModelError::io(dir, e))?;
    } else if dir.is_dir() {
        let old = parent.join(format!(".{name}.old-{}", std::process::id()));
        std::fs::rename(dir, &old).map_err(|e| ModelError::io(dir, e))?;
        std::fs::rename(&tmp, dir).map_err(|e| ModelError::io(dir, e))?;
        let _ = std::fs::remove_dir_all(&old);
    } else {
        std::fs::rename(&tmp, dir).map_err(|e| ModelError::io(dir, e))?;
    }
    Ok(())
}

impl Model {
    /// Writes a folder transformers' `from_pretrained` loads unchanged: `config.json`,
    /// `model.safetensors`, `generation_config.json`, plus the tokenizer files of
    /// `tokenizer_from` when given. Written to a temporary sibling and renamed into place, so a
    /// crash never leaves a half-written checkpoint. `dir` must not exist or be an empty
    /// folder: nothing of the user's is replaced ([`Model::save_over`] replaces a folder).
    pub fn save(&self, dir: &Path, tokenizer_from: Option<&Path>) -> Result<(), ModelError> {
        self.save_as(dir, tokenizer_from, false)
    }

    /// [`Model::save`] that replaces an existing folder `dir` whole (`convert --overwrite`).
    /// A file at `dir` is still refused: only folders are replaced, never renamed away; so is a
    /// `dir` that equals, contains or lies inside the folder the model was loaded from or
    /// `tokenizer_from` ([`refuse_overlap`]).
    pub fn save_over(&self, dir: &Path, tokenizer_from: Option<&Path>) -> Result<(), ModelError> {
        self.save_as(dir, tokenizer_from, true)
    }

    fn save_as(&self, dir: &Path, tokenizer_from: Option<&Path>, replace: bool) -> Result<(), ModelError> {
        if self.adapter.as_ref().is_some_and(|a| !a.merged) {
            return Err(ModelError::Adapter {
                place: format!("saving {}:", dir.display()),
                message: "the model has an unmerged LoRA adapter, which a plain checkpoint would lose; \
                          save_adapter writes the adapter, merge_and_unload then save writes the merged model"
                    .into(),
            });
        }
        if replace {
            // Replacing a folder that holds the model it is written from would delete it.
            let sources: Vec<&Path> = self.source.as_deref().into_iter().chain(tokenizer_from).collect();
            refuse_overlap(dir, &sources)?;
        }
        save_folder(dir, replace, |tmp| self.write_files(tmp, tokenizer_from))
    }

    fn write_files(&self, dir: &Path, tokenizer_from: Option<&Path>) -> Result<(), ModelError> {
        self.check_finite()?;
        self.write_config_files(dir, tokenizer_from)?;
        let mut tensors = self.vs.variables();
        tensors.extend(self.passthrough_tensors()?);
        write_safetensors(&dir.join("model.safetensors"), &tensors, self.kind())
    }

    /// `config.json` and `generation_config.json` (the weights' dtype), and the tokenizer files
    /// of `tokenizer_from` when given: a model folder but its weights.
    pub(crate) fn write_config_files(&self, dir: &Path, tokenizer_from: Option<&Path>) -> Result<(), ModelError> {
        let kind = self.kind();
        let mut cfg = self.hf_config.clone();
        if cfg.dtype.is_some() || cfg.torch_dtype.is_none() {
            cfg.dtype = Some(kind_name(kind).into());
        }
        if cfg.torch_dtype.is_some() {
            cfg.torch_dtype = Some(kind_name(kind).into());
        }
        let json = |v: &serde_json::Value, file: &str| write_json(&dir.join(file), v);
        let config = match &cfg.wrapper {
            // A multimodal checkpoint's own config.json, the weights' dtype updated.
            Some(outer) => {
                let mut outer = outer.clone();
                outer["dtype"] = kind_name(kind).into();
                outer
            }
            None => serde_json::to_value(&cfg).map_err(|e| ModelError::Json {
                path: dir.join("config.json"),
                message: e.to_string(),
            })?,
        };
        json(&config, "config.json")?;
        let c = &self.lm.config;
        let mut generation = serde_json::Map::new();
        if let Some(b) = c.bos_token_id {
            generation.insert("bos_token_id".into(), b.into());
        }
        match c.eos_token_ids.as_slice() {
            [] => {}
            [one] => {
                generation.insert("eos_token_id".into(), (*one).into());
            }
            many => {
                generation.insert("eos_token_id".into(), many.to_vec().into());
            }
        }
        if let Some(p) = c.pad_token_id {
            generation.insert("pad_token_id".into(), p.into());
        }
        json(&serde_json::Value::Object(generation), "generation_config.json")?;
        match tokenizer_from {
            Some(src) => Ok(crate::tokenizer::copy_tokenizer_files(src, dir)?),
            None => Ok(()),
        }
    }

    /// `model.safetensors` of a model whose parameters are sharded (`full_shard`), a
    /// collective: every rank calls it, and the rank given a `file` writes. One unit at a time
    /// is gathered, written and freed, in the model's order, so no process holds more of the
    /// model whole than the root and one layer, and the file is written as the units come. A
    /// failure to write (a non-finite weight, the disk) stops the writing, never the gathers
    /// the other ranks wait on. Unsharded, the writing rank writes and the others do nothing.
    pub(crate) fn write_weights_by_unit(&self, file: Option<&Path>) -> Result<(), ModelError> {
        let vars: BTreeMap<String, Tensor> = self.vs.variables().into_iter().collect();
        let mut units: BTreeMap<ParamUnit, Vec<&String>> = BTreeMap::new();
        for name in vars.keys() {
            units.entry(ParamUnit::of(name)).or_default().push(name);
        }
        // The towers a multimodal checkpoint carries past the decoder go last (the writer's).
        let passthrough = match file {
            Some(_) => self.passthrough_tensors()?,
            None => Vec::new(),
        };
        let entries = units
            .values()
            .flatten()
            .map(|n| ((*n).clone(), vars[*n].size()))
            .chain(passthrough.iter().map(|(n, t)| (n.clone(), t.size())))
            .collect();
        let mut out = file
            .map(|f| SafetensorsOut::create(f, entries, self.kind(), &[]))
            .transpose();
        for (&unit, names) in &units {
            self.lm.gather(unit)?;
            if let Ok(Some(writer)) = &mut out
                && let Err(e) = write_checked(writer, names, &vars)
            {
                out = Err(e);
            }
            // The root stays gathered until `release_all`.
            self.lm.release(unit)?;
        }
        self.lm.release_all()?;
        let mut out = out?;
        if let Some(writer) = &mut out {
            for (_, t) in &passthrough {
                writer.write(t)?;
            }
        }
        out.map_or(Ok(()), SafetensorsOut::finish)
    }
}

/// Writes `names` of `vars`, each refused when not finite.
fn write_checked(
    out: &mut SafetensorsOut,
    names: &[&String],
    vars: &BTreeMap<String, Tensor>,
) -> Result<(), ModelError> {
    for name in names {
        if !all_finite(&vars[*name])? {
            return Err(ModelError::NonFinite {
                name: (*name).clone(),
                place: "to be written".into(),
            });
        }
        out.write(&vars[*name])?;
    }
    Ok(())
}
