//! A loaded model: var store, decoder and the config it came with.

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor, nn};

use super::config::HfConfig;
use super::decoder::CausalLm;
use super::error::ModelError;
use super::layout::AttentionLayout;
use super::logprobs::{LogprobChunks, target_logprobs};
use super::lora::{LoraAdapter, LoraConfig};
use super::seeded::{SEED_FILE, Weights, materialise_seeded};
use super::weights::{check_finite_to_write, weight_files};
use super::{host_memory, parse_kind};
use crate::device::{Device, privateuse1};

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
    pub(crate) fn check_finite(&self) -> Result<(), ModelError> {
        check_finite_to_write(&self.vs.variables())
    }
}

impl Model {
    /// Loads a checkpoint folder (`config.json` + safetensors, sharded or not).
    ///
    /// A folder without weights but with `treetrain_init.json` (`{"seed": u64, "std": f64}`) is
    /// a seeded checkpoint: its weights are made from the seed, written to `model.safetensors`
    /// once (when the folder takes the file; otherwise used from memory), and loaded. The shipped tiny model works this way.
    pub fn load(dir: &Path, opts: LoadOptions) -> Result<Self, ModelError> {
        privateuse1::checked(opts.device, || {
            refuse_adapter_folder(dir)?;
            if let Device::Cuda(_) = opts.device {
                crate::device::load_torch_cuda_from_env().transpose()?;
            }
            // Nothing runs on a device that computes wrong (see `model::check_device`).
            if opts.device != Device::Cpu && super::device_check_enabled() {
                super::check_device(opts.device)?;
            }
            let hf_config = HfConfig::from_file(&dir.join("config.json"))?;
            let weights = match weight_files(dir) {
                Err(ModelError::NoWeights { .. }) if dir.join(SEED_FILE).exists() => {
                    materialise_seeded(dir, &hf_config)?
                }
                other => Weights::Files(other?),
            };
            let mut model = Self::declare(hf_config, opts)?;
            weights.load_into(&model.vs, dir)?;
            model.source = Some(dir.to_path_buf());
            model.finish(opts.device)?;
            Ok(model)
        })
    }

    pub(super) fn declare(hf_config: HfConfig, opts: LoadOptions) -> Result<Self, ModelError> {
        let config = hf_config.validate()?;
        let kind = match opts.dtype {
            Some(k) => k,
            None => hf_config
                .checkpoint_dtype()
                .map(parse_kind)
                .transpose()?
                .unwrap_or(Kind::Float),
        };
        check_fits_in_memory(&config)?;
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
    pub(super) fn finish(&mut self, device: Device) -> Result<(), ModelError> {
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
        privateuse1::checked(self.device(), || {
            if let Some((i, why)) = rows
                .iter()
                .enumerate()
                .find_map(|(i, r)| Some((i, self.lm.config.tower_token(r)?)))
            {
                return Err(ModelError::Input(format!("row {i}: {why}")));
            }
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
                target_logprobs(&h, self.lm.head(), &Tensor::from_slice(&tgt), LogprobChunks::default())
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
        })
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
    pub(crate) fn copy_adapter_from(&mut self, other: &LoraAdapter) -> Result<&LoraAdapter, ModelError> {
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

/// The model's parameters are made in fp32 on the host first: a config whose sizes need more
/// than the host has is refused before any allocation (which would abort the process).
fn check_fits_in_memory(config: &super::ModelConfig) -> Result<(), ModelError> {
    let params = config.num_parameters();
    let need = params as u128 * 4;
    match crate::device::host_shortfall(need) {
        Some(available) => Err(ModelError::unsupported(
            "hidden_size, intermediate_size, num_hidden_layers, vocab_size",
            format!("{params} parameters"),
            &format!(
                "making the model needs {:.1} GB of host memory (fp32); {:.1} GB is available",
                need as f64 / 1e9,
                available as f64 / 1e9
            ),
        )),
        None => Ok(()),
    }
}

/// A LoRA adapter's folder (PEFT's files, no `config.json`) named where a model is expected:
/// say so and name its base, instead of "config.json: no such file".
fn refuse_adapter_folder(dir: &Path) -> Result<(), ModelError> {
    let adapter = dir.join(super::lora::ADAPTER_CONFIG);
    if dir.join("config.json").exists() || !adapter.exists() {
        return Ok(());
    }
    let base = std::fs::read_to_string(&adapter)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("base_model_name_or_path")?.as_str().map(str::to_string))
        .unwrap_or_else(|| "unknown".into());
    Err(ModelError::Json {
        path: dir.join("config.json"),
        message: format!(
            "missing: {} holds a LoRA adapter, not a model; load its base model ({base}) and the adapter (CLI: --model BASE --adapter {}; a run: its `model` and `[lora]`)",
            dir.display(),
            dir.display()
        ),
    })
}
