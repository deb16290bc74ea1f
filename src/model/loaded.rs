//! A loaded model: var store, decoder and the config it came with.

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor, nn};

use super::lora::{LoraAdapter, LoraConfig};
use super::weights::{check_finite_to_write, init_seeded, load_into, weight_files, write_json, write_safetensors};
use super::{AttentionLayout, CausalLm, HfConfig, LogprobChunks, ModelError, host_memory, parse_kind, target_logprobs};
use crate::device::{Device, privateuse1};
use crate::display::{self, Rich, escape};

/// Where and how to materialise parameters.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Parameter dtype; `None` keeps the checkpoint's (`dtype`/`torch_dtype`, f32 if absent).
    /// `Some(Kind::Float)` on a bf16 checkpoint gives f32 master weights.
    pub dtype: Option<Kind>,
    /// Device for the parameters (and everything made for them: caches, masks, batches). On a
    /// PrivateUse1 device the weights are loaded on the host and moved, since tch cannot
    /// create tensors there.
    pub device: Device,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            dtype: None,
            device: Device::Cpu,
        }
    }
}

/// The `torch_dtype` name of a parameter kind (`float32`, `bfloat16`, `float16`).
pub fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// Marks a seeded checkpoint folder (see [`Model::load`]).
pub const SEED_FILE: &str = "treetrain_init.json";

fn materialise_seeded(dir: &Path, hf_config: &HfConfig) -> Result<(), ModelError> {
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

/// A causal LM with its var store and original config.
#[derive(Debug)]
pub struct Model {
    /// Owns every parameter (names = PyTorch `state_dict` names).
    pub vs: nn::VarStore,
    /// The network.
    pub lm: CausalLm,
    /// `config.json` as read (written back on save).
    pub hf_config: HfConfig,
    /// The folder it was loaded from, if any.
    pub source: Option<PathBuf>,
    /// The attached LoRA adapter, if any (its tensors are then the only trainable ones).
    pub adapter: Option<LoraAdapter>,
}

impl Model {
    /// An error naming the first parameter (by name) that holds NaN or infinite values:
    /// checkpoints are never written with them.
    pub fn check_finite(&self) -> Result<(), ModelError> {
        check_finite_to_write(&self.vs.variables())
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
    /// Loads a checkpoint folder (`config.json` + safetensors, sharded or not).
    ///
    /// A folder without weights but with `treetrain_init.json` (`{"seed": u64, "std": f64}`) is
    /// a seeded checkpoint: its weights are made from the seed, written to `model.safetensors`
    /// once (when the folder is writable), and loaded. The shipped tiny model works this way.
    pub fn load(dir: &Path, opts: LoadOptions) -> Result<Self, ModelError> {
        privateuse1::checked(opts.device, || Self::load_on(dir, opts))
    }

    fn load_on(dir: &Path, opts: LoadOptions) -> Result<Self, ModelError> {
        let hf_config = HfConfig::from_file(&dir.join("config.json"))?;
        let files = match weight_files(dir) {
            Err(ModelError::NoWeights { .. }) if dir.join(SEED_FILE).exists() => {
                materialise_seeded(dir, &hf_config)?;
                weight_files(dir)?
            }
            other => other?,
        };
        let mut model = Self::declare(hf_config, opts)?;
        load_into(&model.vs, &files, dir)?;
        model.source = Some(dir.to_path_buf());
        model.finish(opts.device)?;
        Ok(model)
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

    fn declare(hf_config: HfConfig, opts: LoadOptions) -> Result<Self, ModelError> {
        let config = hf_config.validate()?;
        let kind = match opts.dtype {
            Some(k) => k,
            None => hf_config
                .checkpoint_dtype()
                .map(parse_kind)
                .transpose()?
                .unwrap_or(Kind::Float),
        };
        let mut vs = nn::VarStore::new(opts.device.host());
        let lm = CausalLm::new(&vs, config);
        if kind != Kind::Float {
            // set_data in place: the layers' tensor handles see the converted values.
            vs.set_kind(kind);
        }
        Ok(Model {
            vs,
            lm,
            hf_config,
            source: None,
            adapter: None,
        })
    }

    /// Places the loaded parameters on `device` (a no-op unless that is a PrivateUse1 device,
    /// where the var store could not create them), then ties the fused projections there:
    /// after the dtype and device are final, since moving or converting a tied weight would
    /// give it storage of its own again.
    fn finish(&mut self, device: Device) -> Result<(), ModelError> {
        if device.is_privateuse1() {
            self.lm.place(&self.vs, device)?;
        }
        self.lm.tie_fused()?;
        self.gather_host_parameters()
    }

    /// Moves every CPU parameter the fused buffers do not hold into one buffer per dtype, in
    /// huge pages ([`super::host_memory`]), in name order: a decode step streams them all.
    fn gather_host_parameters(&self) -> Result<(), ModelError> {
        let fused = self.lm.buffers();
        let mut vars: Vec<(String, Tensor)> = self
            .vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.device() == tch::Device::Cpu)
            .filter(|(_, t)| !fused.iter().any(|(_, b)| host_memory::lies_in(t, b)))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut kinds: Vec<Kind> = Vec::new();
        for (_, t) in &vars {
            if !kinds.contains(&t.kind()) {
                kinds.push(t.kind());
            }
        }
        for kind in kinds {
            let mut same: Vec<&mut Tensor> = vars
                .iter_mut()
                .filter(|(_, t)| t.kind() == kind)
                .map(|(_, t)| t)
                .collect();
            host_memory::gather(&mut same)?;
        }
        Ok(())
    }

    /// The device the parameters live on.
    pub fn device(&self) -> Device {
        self.lm.device()
    }

    /// Parameter dtype.
    pub fn kind(&self) -> Kind {
        self.lm.kind()
    }

    /// Log-probabilities of each token given its prefix for one sequence `ids` (`len - 1`
    /// values; the first token has none).
    pub fn score(&self, ids: &[i64]) -> Result<Vec<f32>, ModelError> {
        Ok(self.score_packed(&[ids])?.pop().unwrap_or_default())
    }

    /// Scores several sequences in one packed row (position resets, no cross-sequence
    /// attention); same numbers as scoring each alone.
    pub fn score_packed(&self, rows: &[&[i64]]) -> Result<Vec<Vec<f32>>, ModelError> {
        privateuse1::checked(self.device(), || self.score_packed_here(rows))
    }

    fn score_packed_here(&self, rows: &[&[i64]]) -> Result<Vec<Vec<f32>>, ModelError> {
        let lengths: Vec<i64> = rows.iter().map(|r| r.len() as i64).collect();
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        if flat.is_empty() {
            return Ok(rows.iter().map(|_| Vec::new()).collect());
        }
        let device = self.lm.device();
        let n = flat.len() as i64;
        let ids = Tensor::from_slice(&flat).view([1, n]);
        let (layout, positions) = AttentionLayout::packed_row(&lengths, device)?;
        let hidden = tch::no_grad(|| self.lm.forward_hidden(&ids, &positions, &layout))?;
        // Position i predicts token i + 1 within the same sequence.
        let mut src = Vec::new();
        let mut tgt = Vec::new();
        let mut offset = 0i64;
        for &len in &lengths {
            for i in 0..(len - 1).max(0) {
                src.push(offset + i);
                tgt.push(flat[(offset + i + 1) as usize]);
            }
            offset += len;
        }
        let h = hidden.squeeze_dim(0).f_index_select(0, &device.from_slice(&src)?)?;
        let lp = tch::no_grad(|| {
            target_logprobs(
                &h,
                self.lm.lm_head_weight(),
                &Tensor::from_slice(&tgt),
                LogprobChunks::default(),
            )
        })?;
        let values = Vec::<f32>::try_from(&Device::to_host(&lp)?)?;
        let mut out = Vec::with_capacity(rows.len());
        let mut at = 0;
        for &len in &lengths {
            let k = (len - 1).max(0) as usize;
            out.push(values[at..at + k].to_vec());
            at += k;
        }
        Ok(out)
    }

    /// Writes a folder transformers' `from_pretrained` loads unchanged: `config.json`,
    /// `model.safetensors`, `generation_config.json`, plus the tokenizer files of
    /// `tokenizer_from` when given. Written to a temporary sibling and renamed into place, so a
    /// crash never leaves a half-written checkpoint. `dir` must not exist or be an empty
    /// folder: nothing of the user's is replaced ([`Model::save_over`] replaces a folder).
    pub fn save(&self, dir: &Path, tokenizer_from: Option<&Path>) -> Result<(), ModelError> {
        self.save_as(dir, tokenizer_from, false)
    }

    /// [`Model::save`] that replaces an existing folder `dir` whole (`convert --overwrite`).
    /// A file at `dir` is still refused: only folders are replaced, never renamed away.
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
        save_folder(dir, replace, |tmp| self.write_files(tmp, tokenizer_from))
    }

    fn write_files(&self, dir: &Path, tokenizer_from: Option<&Path>) -> Result<(), ModelError> {
        self.check_finite()?;
        let kind = self.kind();
        let mut cfg = self.hf_config.clone();
        if cfg.dtype.is_some() || cfg.torch_dtype.is_none() {
            cfg.dtype = Some(kind_name(kind).into());
        }
        if cfg.torch_dtype.is_some() {
            cfg.torch_dtype = Some(kind_name(kind).into());
        }
        let json = |v: &serde_json::Value, file: &str| write_json(&dir.join(file), v);
        json(
            &serde_json::to_value(&cfg).map_err(|e| ModelError::Json {
                path: dir.join("config.json"),
                message: e.to_string(),
            })?,
            "config.json",
        )?;
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
        let tensors = self.vs.variables();
        write_safetensors(&dir.join("model.safetensors"), &tensors, kind)?;
        match tokenizer_from {
            Some(src) => Ok(crate::tokenizer::copy_tokenizer_files(src, dir)?),
            None => Ok(()),
        }
    }

    fn parameter_rows(&self) -> Vec<(String, Vec<i64>, i64)> {
        let mut rows: Vec<(String, Vec<i64>, i64)> = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.size(), t.numel() as i64))
            .collect();
        rows.sort_by_key(|r| natural_key(&r.0));
        rows
    }
}

/// LoRA: attaching, saving, merging adapters ([`crate::model::lora`]).
impl Model {
    /// Attaches a new adapter (PEFT's initialisation: outputs unchanged until it trains) and
    /// freezes the base weights.
    pub fn add_lora(&mut self, config: LoraConfig) -> Result<&LoraAdapter, ModelError> {
        let base = self.base_name();
        let adapter = LoraAdapter::create(&mut self.lm, config, &base)?;
        Ok(self.hold(adapter))
    }

    /// Attaches the PEFT adapter saved in `dir` and freezes the base weights.
    pub fn load_adapter(&mut self, dir: &Path) -> Result<&LoraAdapter, ModelError> {
        let adapter = LoraAdapter::load(&mut self.lm, dir)?;
        Ok(self.hold(adapter))
    }

    /// Attaches a copy of `other`'s adapter (same config, same values): a generator's copy of
    /// the policy.
    pub fn copy_adapter_from(&mut self, other: &LoraAdapter) -> Result<&LoraAdapter, ModelError> {
        let adapter = LoraAdapter::duplicate(other, &mut self.lm)?;
        Ok(self.hold(adapter))
    }

    fn hold(&mut self, adapter: LoraAdapter) -> &LoraAdapter {
        self.vs.freeze();
        self.adapter.insert(adapter)
    }

    fn base_name(&self) -> String {
        self.source
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    }

    /// Writes the attached adapter as PEFT's folder.
    pub fn save_adapter(&self, dir: &Path) -> Result<(), ModelError> {
        self.require_adapter()?.save(dir, false)
    }

    fn require_adapter(&self) -> Result<&LoraAdapter, ModelError> {
        self.adapter.as_ref().ok_or_else(no_adapter)
    }

    /// Folds the adapter into the base weights (same outputs, no adapter work per forward).
    pub fn merge_adapter(&mut self) -> Result<(), ModelError> {
        self.adapter.as_mut().ok_or_else(no_adapter)?.merge(&mut self.lm)
    }

    /// Takes a merged adapter back out of the base weights.
    pub fn unmerge_adapter(&mut self) -> Result<(), ModelError> {
        match self.adapter.as_mut() {
            Some(a) => a.unmerge(&mut self.lm),
            None => Ok(()),
        }
    }

    /// Merges the adapter for good and removes it: a plain model that [`Model::save`] writes
    /// as a checkpoint transformers loads (PEFT's `merge_and_unload`).
    pub fn merge_and_unload(&mut self) -> Result<(), ModelError> {
        if let Some(adapter) = self.adapter.take() {
            adapter.merge_and_unload(&mut self.lm)?;
            self.vs.unfreeze();
        }
        Ok(())
    }

    /// The variables training updates: the adapter's when one is attached, else the model's.
    pub fn trainable(&self) -> &nn::VarStore {
        self.adapter.as_ref().map_or(&self.vs, |a| &a.vs)
    }

    /// Turns the adapter's dropout on (training) or off.
    pub fn set_training(&self, training: bool) {
        if let Some(a) = &self.adapter {
            a.set_training(training);
        }
    }

    /// Training mode (adapter dropout on) until the guard is dropped, however the step ends.
    pub fn training(&self) -> TrainingMode<'_> {
        self.set_training(true);
        TrainingMode(self)
    }

    /// The model with its adapter off, sharing the base tensors (GRPO's reference without a
    /// second copy of the weights). An error while the adapter is merged into them.
    pub fn base_view(&self) -> Result<CausalLm, ModelError> {
        if self.adapter.as_ref().is_some_and(|a| a.merged) {
            return Err(ModelError::Adapter {
                place: "model".into(),
                message: "has its adapter merged into the base weights; unmerge it to see the base".into(),
            });
        }
        Ok(self.lm.base_view())
    }
}

/// What asking a model without an adapter for one gives.
fn no_adapter() -> ModelError {
    ModelError::Adapter {
        place: "model".into(),
        message: "has no adapter attached".into(),
    }
}

/// While held, the model is in training mode ([`Model::training`]).
#[derive(Debug)]
pub struct TrainingMode<'a>(&'a Model);

impl Drop for TrainingMode<'_> {
    fn drop(&mut self) {
        self.0.set_training(false);
    }
}

fn natural_key(name: &str) -> Vec<(u64, String)> {
    name.split('.')
        .map(|p| {
            p.parse::<u64>()
                .map_or((u64::MAX, p.to_string()), |n| (n, String::new()))
        })
        .collect()
}

impl Rich for Model {
    fn html(&self) -> String {
        let c = &self.lm.config;
        let cfg_rows = vec![
            (
                "architecture",
                format!("{} ({})", c.arch.name(), escape(&self.hf_config.model_type)),
            ),
            ("parameters", format!("{:.2} M", c.num_parameters() as f64 / 1e6)),
            ("dtype", kind_name(self.kind()).to_string()),
            (
                "layers / hidden / intermediate",
                format!("{} / {} / {}", c.num_layers, c.hidden_size, c.intermediate_size),
            ),
            (
                "heads / kv heads / head dim",
                format!("{} / {} / {}", c.num_heads, c.num_kv_heads, c.head_dim),
            ),
            ("vocab", c.vocab_size.to_string()),
            ("RoPE", format!("theta {}, {}", c.rope_theta, c.rope_scaling.describe())),
            ("tied embeddings", c.tie_word_embeddings.to_string()),
            (
                "LoRA adapter",
                self.adapter.as_ref().map_or("none".into(), |a| escape(&a.summary())),
            ),
            (
                "source",
                escape(
                    &self
                        .source
                        .as_ref()
                        .map_or("(in memory)".into(), |p| p.display().to_string()),
                ),
            ),
        ];
        let rows: Vec<Vec<String>> = self
            .parameter_rows()
            .into_iter()
            .filter(|(n, _, _)| !n.starts_with("model.layers.") || n.starts_with("model.layers.0."))
            .map(|(n, s, k)| {
                vec![
                    format!("<code>{}</code>", escape(&n)),
                    format!("<code class=\"chip\">{s:?}</code>"),
                    k.to_string(),
                ]
            })
            .collect();
        let note = if c.num_layers > 1 {
            format!(
                "<p class=\"muted\">model.layers.1 to model.layers.{} have the same parameters as layer 0.</p>",
                c.num_layers - 1
            )
        } else {
            String::new()
        };
        display::style::container(&format!(
            "{}{}",
            display::section("Model", &display::kv_table(&cfg_rows)),
            display::section(
                "Parameters",
                &format!("{}{note}", display::table(&["name", "shape", "numel"], &rows))
            )
        ))
    }

    fn text(&self) -> String {
        let c = &self.lm.config;
        let adapter = self
            .adapter
            .as_ref()
            .map_or(String::new(), |a| format!("LoRA adapter: {}\n", a.summary()));
        format!(
            "{} model: {:.2} M parameters, {}, {} layers, hidden {}, heads {}/{} x {}, vocab {}\n{adapter}",
            c.arch.name(),
            c.num_parameters() as f64 / 1e6,
            kind_name(self.kind()),
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size
        )
    }
}

crate::rich_display!(Model);
