//! The KL term's reference policy (`beta > 0`): frozen at the starting weights (a loaded copy,
//! or with LoRA the policy's own base tensors, no copy), or with `sync_ref_model` (TR-DPO)
//! moved toward the policy every `ref_model_sync_steps` steps:
//! `reference = alpha * policy + (1 - alpha) * reference`, alpha = `ref_model_mixup_alpha`.
//! A synced reference is part of the run's state: checkpoints carry it and a resume restores it.

use std::path::Path;

use tch::nn;

use super::config::KlReference;
use crate::model::{CausalLm, Model, write_safetensors};
use crate::train::{TrainCore, TrainError};

/// The reference's weights in a checkpoint of a run with `sync_ref_model`.
pub const REFERENCE_FILE: &str = "reference.safetensors";

/// The reference policy of a run.
pub(crate) struct Reference {
    /// What the KL term scores with.
    pub lm: CausalLm,
    /// Its own weights by name: a loaded copy (`None`: LoRA's base view, which is the policy's
    /// base itself).
    vars: Option<nn::VarStore>,
}

impl Reference {
    /// The starting weights: with LoRA the policy's base, sharing its tensors; else loaded again.
    pub(super) fn of(core: &TrainCore) -> Result<Self, TrainError> {
        Ok(match core.model.adapter {
            Some(_) => Reference {
                lm: core.model.base_view()?,
                vars: None,
            },
            None => {
                let Model { vs, lm, .. } = Model::load(&core.model_dir, core.load_options)?;
                Reference { lm, vars: Some(vs) }
            }
        })
    }

    /// After optimizer step `step` (1-based): every `ref_model_sync_steps` steps the reference
    /// moves toward `policy` by `ref_model_mixup_alpha` (in place: the layers' tensors see it).
    /// Nothing without `sync_ref_model`.
    pub(super) fn sync(&self, policy: &nn::VarStore, step: u64, reference: &KlReference) -> Result<(), TrainError> {
        let Some(vars) = self.vars.as_ref().filter(|_| self.due(step, reference)) else {
            return Ok(());
        };
        let alpha = reference.ref_model_mixup_alpha;
        let policy = policy.variables();
        for (name, r) in vars.variables() {
            let p = policy.get(&name).ok_or_else(|| {
                crate::model::ModelError::Input(format!("the policy has no `{name}` to sync the reference to"))
            })?;
            let mixed = tch::no_grad(|| -> Result<(), tch::TchError> {
                let moved = p.f_to_kind(r.kind())?.f_sub(&r)?.f_mul_scalar(alpha)?;
                let _ = r.shallow_clone().f_add_(&moved)?;
                Ok(())
            });
            mixed.map_err(crate::model::ModelError::from)?;
        }
        Ok(())
    }

    /// Whether [`Reference::sync`] moves the reference after step `step`.
    pub(crate) fn due(&self, step: u64, reference: &KlReference) -> bool {
        self.vars.is_some()
            && reference.sync_ref_model
            && step != 0
            && step.is_multiple_of(reference.ref_model_sync_steps)
    }

    /// Writes the reference's weights into checkpoint folder `dir` (a synced reference only:
    /// a frozen one is the starting weights, loaded again on resume).
    pub(super) fn write(&self, dir: &Path, reference: &KlReference) -> Result<(), String> {
        match self.vars.as_ref().filter(|_| reference.sync_ref_model) {
            Some(vars) => write_safetensors(&dir.join(REFERENCE_FILE), &vars.variables(), self.lm.kind())
                .map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }

    /// Restores a synced reference from `checkpoint` of a run at step `step`; before its first
    /// sync the reference is still the starting weights, and a checkpoint without the file is
    /// then fine.
    pub(crate) fn restore(&self, checkpoint: &Path, step: u64, reference: &KlReference) -> Result<(), TrainError> {
        let Some(vars) = self.vars.as_ref().filter(|_| reference.sync_ref_model) else {
            return Ok(());
        };
        let file = checkpoint.join(REFERENCE_FILE);
        if !file.exists() {
            if step >= reference.ref_model_sync_steps {
                return Err(TrainError::Checkpoint {
                    path: checkpoint.into(),
                    message: format!(
                        "{REFERENCE_FILE} is missing, but the run synced its reference (sync_ref_model) by step {step}"
                    ),
                });
            }
            return Ok(());
        }
        crate::model::load_into(vars, &[file], checkpoint)?;
        Ok(())
    }
}
