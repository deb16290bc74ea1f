//! A LoRA adapter attached to a [`CausalLm`]: its own var store under PEFT's tensor names, the
//! layers it wraps, PEFT's initialisation, and PEFT's two files.

use std::path::Path;
use std::sync::Arc;

use tch::{Kind, Tensor, nn};

use super::config::target_matches;
use super::config::{LoraConfig, TargetModules};
use super::delta::{DropoutStream, LoraDelta};
use crate::model::layers::{Linear, LinearAdapter};
use crate::model::weights::{check_finite_to_write, load_into, write_json, write_safetensors};
use crate::model::{CausalLm, ModelError};
use crate::util::SplitMix64;

/// PEFT's config file.
pub(crate) const ADAPTER_CONFIG: &str = "adapter_config.json";
/// PEFT's weights file.
pub(crate) const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// A LoRA adapter: the trainable tensors (the only ones with gradients and optimizer state
/// while it is attached) and what they wrap.
#[derive(Debug)]
pub struct LoraAdapter {
    /// Its settings.
    pub config: LoraConfig,
    /// The trainable tensors, named as in PEFT's `adapter_model.safetensors`
    /// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, ...).
    pub vs: nn::VarStore,
    /// The wrapped layers (`model.layers.0.self_attn.q_proj`, ...).
    pub modules: Vec<String>,
    /// Layers trained whole (`modules_to_save`).
    pub saved_modules: Vec<String>,
    /// `base_model_name_or_path` written to `adapter_config.json`.
    pub base_model: String,
    /// Parameters of the base model (for the trainable share).
    pub base_parameters: i64,
    /// Whether the updates are folded into the base weights.
    pub merged: bool,
    dropout: Arc<DropoutStream>,
}

/// How the new adapter tensors start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Init {
    /// PEFT's default: `A` Kaiming-uniform (a = sqrt 5, so U(-1/sqrt(in), 1/sqrt(in))), `B` 0:
    /// the adapted model starts as the base.
    Peft,
    /// Zeros, to be overwritten by loaded tensors.
    Zeros,
}

/// The layers a config wraps and trains whole, or an error naming what does not fit.
fn select(lm: &mut CausalLm, config: &LoraConfig) -> Result<(Vec<String>, Vec<String>), ModelError> {
    let names: Vec<String> = lm.linears_mut().into_iter().map(|(n, _)| n).collect();
    let refuse = |field: &str, message: String| ModelError::Adapter {
        place: format!("`{field}`"),
        message,
    };
    let short: std::collections::BTreeSet<&str> = names.iter().filter_map(|n| n.rsplit('.').next()).collect();
    let listed: Vec<(&str, &String)> = match &config.target_modules {
        TargetModules::Names(t) => t.iter().map(|t| ("target_modules", t)).collect(),
        TargetModules::AllLinear => Vec::new(),
    };
    for (field, target) in listed
        .into_iter()
        .chain(config.modules_to_save.iter().map(|t| ("modules_to_save", t)))
    {
        if !names.iter().any(|n| target_matches(target, n)) {
            return Err(refuse(
                field,
                format!(
                    "names `{target}`, which matches no linear layer of this model (it has {}; embeddings and norms cannot be wrapped)",
                    short.iter().copied().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
    }
    let lora: Vec<String> = names
        .iter()
        .filter(|n| config.target_modules.matches(n))
        .cloned()
        .collect();
    let saved: Vec<String> = names
        .iter()
        .filter(|n| config.modules_to_save.iter().any(|t| target_matches(t, n)))
        .cloned()
        .collect();
    if lora.iter().any(|n| n == "lm_head") {
        return Err(refuse(
            "target_modules",
            "wraps `lm_head`: treetrain computes the LM head in chunks from its weight alone, so LoRA on it is not implemented (train it whole with modules_to_save = [\"lm_head\"])".into(),
        ));
    }
    // PEFT moves a mixture model's MLP module targets onto its experts with per-tensor ranks
    // (`rank_pattern`), which treetrain does not implement: wrapping the dense layers' MLPs
    // alone would differ. The experts are targeted by name instead.
    if lm.config.mixture.is_some()
        && let Some(mlp) = lora.iter().chain(&saved).find(|n| n.contains(".mlp."))
    {
        return Err(refuse(
            "target_modules",
            format!(
                "wraps `{mlp}` of a mixture-of-experts model: PEFT would move feed-forward module targets onto the experts with per-tensor ranks; target the experts with target_parameters = [\"experts.gate_up_proj\", \"experts.down_proj\"] instead"
            ),
        ));
    }
    if let Some(both) = lora.iter().find(|n| saved.contains(n)) {
        return Err(refuse(
            "modules_to_save",
            format!("names `{both}`, which target_modules already wraps with LoRA"),
        ));
    }
    Ok((lora, saved))
}

/// The var-store path of a PEFT tensor prefix: `base_model.model.<module>` split at its dots.
pub(super) fn path_of<'a>(root: &nn::Path<'a>, module: &str) -> nn::Path<'a> {
    let mut path = root / "base_model";
    for part in format!("model.{module}").split('.') {
        path = &path / part;
    }
    path
}

impl LoraAdapter {
    /// A new adapter on `lm` with PEFT's initialisation (the model's outputs are unchanged
    /// until `B` trains); `base_model` is recorded for `adapter_config.json`.
    pub fn create(lm: &mut CausalLm, config: LoraConfig, base_model: &str) -> Result<Self, ModelError> {
        Self::attach(lm, config, base_model, Init::Peft)
    }

    /// Loads a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) onto
    /// `lm`. Every tensor must be one this config and model imply, with its shape: an adapter
    /// for another base is an error naming the tensor.
    pub fn load(lm: &mut CausalLm, dir: &Path) -> Result<Self, ModelError> {
        let (config, base) = LoraConfig::from_peft_json(&dir.join(ADAPTER_CONFIG))?;
        let weights = dir.join(ADAPTER_WEIGHTS);
        if !weights.exists() {
            let pickle = dir.join("adapter_model.bin");
            return Err(ModelError::Adapter {
                place: format!("{}", dir.display()),
                message: match pickle.exists() {
                    true => {
                        "holds only adapter_model.bin (pickle); save the adapter with safe_serialization=True".into()
                    }
                    false => format!("has no {ADAPTER_WEIGHTS}"),
                },
            });
        }
        let adapter = Self::attach(lm, config, &base.unwrap_or_default(), Init::Zeros)?;
        if let Err(e) = load_into(&adapter.vs, &[weights], dir) {
            adapter.detach(lm);
            return Err(e);
        }
        Ok(adapter)
    }

    /// The same adapter (config and values, copied) on another instance `lm` of its base: a
    /// generation thread's copy of the policy.
    pub fn duplicate(other: &LoraAdapter, lm: &mut CausalLm) -> Result<Self, ModelError> {
        let adapter = Self::attach(lm, other.config.clone(), &other.base_model, Init::Zeros)?;
        let mine = adapter.vs.variables();
        tch::no_grad(|| -> Result<(), ModelError> {
            for (name, t) in other.vs.variables() {
                if let Some(dst) = mine.get(&name) {
                    dst.shallow_clone().f_copy_(&t)?;
                }
            }
            Ok(())
        })?;
        Ok(adapter)
    }

    fn attach(lm: &mut CausalLm, config: LoraConfig, base_model: &str, init: Init) -> Result<Self, ModelError> {
        config.validate()?;
        let (mut modules, saved_modules) = select(lm, &config)?;
        if let Some((name, _)) = lm.linears_mut().into_iter().find(|(_, l)| l.adapter.is_some()) {
            return Err(ModelError::Adapter {
                place: format!("`{name}`"),
                message: "already has an adapter: one adapter at a time (merge or detach the other first)".into(),
            });
        }
        let base_parameters = lm.config.num_parameters();
        // Made on the host side of the model's device, moved there once declared.
        let vs = nn::VarStore::new(lm.device().host());
        let root = vs.root();
        let dropout = Arc::new(DropoutStream::new(config.lora_dropout, config.seed));
        let mut rng = SplitMix64::new(config.seed);
        let scale = config.scale();
        for (name, linear) in lm.linears_mut() {
            let path = path_of(&root, &name);
            if modules.contains(&name) {
                let [out, inp] = linear.weight.size()[..] else { continue };
                let a = (&path / "lora_A").var("weight", &[config.r, inp], nn::Init::Const(0.0));
                let b = (&path / "lora_B").var("weight", &[out, config.r], nn::Init::Const(0.0));
                if init == Init::Peft {
                    kaiming_uniform(&a, inp, &mut rng)?;
                }
                linear.adapter = Some(LinearAdapter::Lora(LoraDelta {
                    lora_a: a,
                    lora_b: b,
                    scale,
                    merged: false,
                    dropout: dropout.clone(),
                }));
            } else if saved_modules.contains(&name) {
                linear.adapter = Some(trained_copy(&path, linear)?);
            }
        }
        modules.extend(super::experts::attach(
            lm,
            &config,
            &root,
            init == Init::Peft,
            &mut rng,
        )?);
        for (_, mut var) in vs.variables() {
            lm.device().move_parameter(&mut var)?;
        }
        Ok(LoraAdapter {
            config,
            vs,
            modules,
            saved_modules,
            base_model: base_model.into(),
            base_parameters,
            merged: false,
            dropout,
        })
    }

    /// Removes the adapter from `lm`'s layers (unmerging first if merged).
    pub fn detach(mut self, lm: &mut CausalLm) {
        let _ = self.unmerge(lm);
        for (_, linear) in lm.linears_mut() {
            linear.adapter = None;
        }
        for (_, experts) in lm.experts_mut() {
            (experts.gate_up_lora, experts.down_lora) = (None, None);
        }
    }

    /// Trainable parameters (adapter tensors and `modules_to_save` copies).
    pub fn num_parameters(&self) -> i64 {
        self.vs.variables().values().map(|t| t.numel() as i64).sum()
    }

    /// Dropout applies only while training.
    pub fn set_training(&self, training: bool) {
        self.dropout.set_training(training);
    }

    /// Dropout masks drawn so far (saved with a training checkpoint).
    pub fn dropout_draws(&self) -> u64 {
        self.dropout.draws()
    }

    /// Continues the dropout stream after `draws` masks.
    pub fn set_dropout_draws(&self, draws: u64) {
        self.dropout.set_draws(draws);
    }

    /// Writes PEFT's two files into `dir` (atomically; `dir` must not hold anything yet unless
    /// `replace`): `adapter_config.json` and `adapter_model.safetensors` (f32).
    pub fn save(&self, dir: &Path, replace: bool) -> Result<(), ModelError> {
        crate::model::save::save_folder(dir, replace, |tmp| self.write_files(tmp))
    }

    /// The two files, into an existing folder (a checkpoint being written).
    pub(crate) fn write_files(&self, dir: &Path) -> Result<(), ModelError> {
        let vars = self.vs.variables();
        check_finite_to_write(&vars)?;
        write_json(&dir.join(ADAPTER_CONFIG), &self.config.to_peft_json(&self.base_model))?;
        write_safetensors(&dir.join(ADAPTER_WEIGHTS), &vars, Kind::Float)
    }

    /// Folds every update into its base weight (`W += scale * B A`, in `W`'s dtype): the same
    /// outputs with no adapter work per forward. Undone by `LoraAdapter::unmerge`.
    pub fn merge(&mut self, lm: &mut CausalLm) -> Result<(), ModelError> {
        self.fold(lm, true)
    }

    /// Takes merged updates back out of the base weights.
    pub(crate) fn unmerge(&mut self, lm: &mut CausalLm) -> Result<(), ModelError> {
        self.fold(lm, false)
    }

    fn fold(&mut self, lm: &mut CausalLm, merge: bool) -> Result<(), ModelError> {
        if self.merged == merge {
            return Ok(());
        }
        tch::no_grad(|| -> Result<(), ModelError> {
            for (_, linear) in lm.linears_mut() {
                let Some(LinearAdapter::Lora(lora)) = &mut linear.adapter else {
                    continue;
                };
                let delta = lora.delta_weight().f_to_kind(linear.weight.kind())?;
                let mut w = linear.weight.shallow_clone();
                let _ = match merge {
                    true => w.f_add_(&delta)?,
                    false => w.f_sub_(&delta)?,
                };
                lora.merged = merge;
            }
            for (_, experts) in lm.experts_mut() {
                let e = experts.num_experts();
                let pairs = [
                    (&experts.gate_up_proj, &mut experts.gate_up_lora),
                    (&experts.down_proj, &mut experts.down_lora),
                ];
                for (w, lora) in pairs {
                    let Some(d) = lora else { continue };
                    let delta = d.delta(e)?;
                    let folded = match merge {
                        true => super::experts::low_precision_add(w, &delta)?,
                        false => super::experts::low_precision_add(w, &delta.f_neg()?)?,
                    };
                    w.shallow_clone().f_copy_(&folded)?;
                    d.merged = merge;
                }
            }
            Ok(())
        })?;
        self.merged = merge;
        Ok(())
    }

    /// Merges, writes the `modules_to_save` copies into their base layers and removes the
    /// adapter: `lm` is then a plain model (PEFT's `merge_and_unload`).
    pub fn merge_and_unload(mut self, lm: &mut CausalLm) -> Result<(), ModelError> {
        self.merge(lm)?;
        tch::no_grad(|| -> Result<(), ModelError> {
            for (_, linear) in lm.linears_mut() {
                if let Some(LinearAdapter::Copy { weight, bias }) = linear.adapter.take() {
                    linear.weight.shallow_clone().f_copy_(&weight)?;
                    if let (Some(b), Some(src)) = (&linear.bias, &bias) {
                        b.shallow_clone().f_copy_(src)?;
                    }
                }
                linear.adapter = None;
            }
            for (_, experts) in lm.experts_mut() {
                (experts.gate_up_lora, experts.down_lora) = (None, None);
            }
            Ok(())
        })
    }
}

/// Fills `a` `[r, in]` with U(-1/sqrt(in), 1/sqrt(in)) from `rng`: `kaiming_uniform_(a=sqrt(5))`.
pub(super) fn kaiming_uniform(a: &Tensor, fan_in: i64, rng: &mut SplitMix64) -> Result<(), ModelError> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    let values: Vec<f32> = (0..a.numel())
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32)
        .collect();
    let src = Tensor::from_slice(&values).view(a.size().as_slice());
    tch::no_grad(|| a.shallow_clone().f_copy_(&src))?;
    Ok(())
}

/// A trainable copy of `linear`'s weights under `path` (PEFT's `modules_to_save`), in the
/// layer's dtype.
fn trained_copy(path: &nn::Path, linear: &Linear) -> Result<LinearAdapter, ModelError> {
    let copy = |name: &str, t: &Tensor| -> Result<Tensor, ModelError> {
        let mut v = path.f_var_copy(name, t)?;
        if v.kind() != t.kind() {
            tch::no_grad(|| v.f_set_data(&t.detach().copy()))?;
        }
        Ok(v)
    };
    Ok(LinearAdapter::Copy {
        weight: copy("weight", &linear.weight)?,
        bias: linear.bias.as_ref().map(|b| copy("bias", b)).transpose()?,
    })
}
