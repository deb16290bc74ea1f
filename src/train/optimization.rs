//! The end of every optimizer step, for both trainers: the gradients summed over the ranks,
//! clipped, checked for non-finite values, the update at the scheduled rate, the gradients
//! cleared; all through the run's parallel strategy, which this holds.

use std::path::Path;

use tch::Tensor;

use super::config::{NanPolicy, TrainConfig};
use super::error::TrainError;
use super::parallel::Strategy;
use super::schedule::LrSchedule;
use crate::distributed::HeldState;
use crate::model::ModelError;

/// AdamW under the run's parallel strategy, and its learning-rate schedule.
#[derive(Debug)]
pub struct Optimization {
    /// How the ranks share the parameters, gradients and AdamW state (chosen once).
    strategy: Box<dyn Strategy>,
    /// The learning rate per step.
    pub schedule: LrSchedule,
    /// Steps skipped in a row just before this one (`on_nan = skip`).
    consecutive_skips: u64,
}

/// Under `on_nan = skip`, this many non-finite steps in a row stop the run: a transient spike
/// skips a step or two, while a run whose every step fails (broken weights, a bad setting) would
/// otherwise end with exit 0 and a checkpoint of untrained weights.
pub const MAX_CONSECUTIVE_SKIPS: u64 = 8;

/// What the end of a step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct StepOutcome {
    /// Gradient norm before clipping (NaN or inf when a gradient was not finite).
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// The weights were left untouched (non-finite loss or gradient under `on_nan = skip`).
    pub skipped: bool,
}

impl Optimization {
    /// `strategy`'s AdamW at `schedule`'s rates.
    pub(crate) fn new(strategy: Box<dyn Strategy>, schedule: LrSchedule) -> Self {
        Self {
            strategy,
            schedule,
            consecutive_skips: 0,
        }
    }

    /// Ends optimizer step `step` (0-based) whose gradients are accumulated and whose loss was
    /// `loss`: the gradients summed over the ranks (each rank's loss already divides by the
    /// global window's count; the identity for one process; each rank its shard when
    /// sharded), clipping at
    /// `config.optimizer.max_grad_norm`, then either the update at the scheduled rate or, when the loss or
    /// the gradient norm is not finite, `config.optimizer.on_nan` (skip: the step is dropped; stop: an
    /// error naming `rows()`; [`MAX_CONSECUTIVE_SKIPS`] skips in a row are an error under skip
    /// too). Gradients are cleared in every case. In a multi-process run
    /// `loss` is the global one, so every rank decides alike.
    pub(crate) fn finish_step(
        &mut self,
        config: &TrainConfig,
        step: u64,
        loss: f64,
        rows: impl FnOnce() -> Vec<usize>,
    ) -> Result<StepOutcome, TrainError> {
        let reduced = (self.strategy.reduce_grads()).and_then(|()| self.strategy.clip(config.optimizer.max_grad_norm));
        let grad_norm = match reduced {
            Ok(norm) => norm,
            Err(e) => {
                self.strategy.discard_grads();
                return Err(e.into());
            }
        };
        let lr = self.schedule.lr_at(step);
        let bad = if !loss.is_finite() {
            Some("loss")
        } else if !grad_norm.is_finite() {
            Some("gradient norm")
        } else {
            None
        };
        let updated = match bad {
            None => self.strategy.update(lr),
            Some(_) => Ok(()),
        };
        self.strategy.discard_grads();
        updated?;
        // Finite gradients at a finite rate can still overflow a weight (a huge rate, low
        // precision): the run stops whatever `on_nan` says, before any checkpoint (which would
        // refuse the tensor anyway) or another step trains on it.
        if bad.is_none()
            && let Some(name) = self.strategy.first_non_finite()?
        {
            return Err(TrainError::NonFiniteWeights { step: step + 1, name });
        }
        self.consecutive_skips = if bad.is_some() { self.consecutive_skips + 1 } else { 0 };
        match bad {
            Some(what) if config.optimizer.on_nan == NanPolicy::Stop => Err(TrainError::NonFinite {
                step: step + 1,
                what,
                rows: rows(),
            }),
            Some(what) if self.consecutive_skips >= MAX_CONSECUTIVE_SKIPS => Err(TrainError::KeepsSkipping {
                step: step + 1,
                count: self.consecutive_skips,
                what,
                rows: rows(),
            }),
            _ => Ok(StepOutcome {
                grad_norm,
                lr,
                skipped: bad.is_some(),
            }),
        }
    }

    /// Clears gradients a failed forward or backward left behind, so the next step starts clean.
    pub(crate) fn discard_gradients(&mut self) {
        self.strategy.discard_grads();
    }

    /// Updates done.
    pub fn updates(&self) -> u64 {
        self.strategy.updates()
    }

    /// The optimizer's state tensors by their names in its checkpoint file (this rank's shards
    /// when sharded).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.strategy.state_tensors()
    }

    /// The whole fp32 master weight of a half-precision parameter (mixed precision), when this
    /// rank holds one (not when the state is sharded).
    pub fn master_weight(&self, name: &str) -> Option<Tensor> {
        self.strategy.master_weight(name)
    }

    /// What this rank holds of the run's state, in bytes.
    pub(crate) fn held(&self) -> HeldState {
        self.strategy.held()
    }

    /// This rank's part of the optimizer state in the checkpoint folder `dir`.
    pub(crate) fn write_state(&self, dir: &Path) -> Result<(), ModelError> {
        self.strategy.write_state(dir)
    }

    /// Rank 0, once every rank's part is written: the file naming them (sharded state).
    pub(crate) fn write_manifest(&self, dir: &Path) -> Result<(), ModelError> {
        self.strategy.write_manifest(dir)
    }

    /// The optimizer state of the checkpoint folder `dir`.
    pub(crate) fn load(&mut self, dir: &Path) -> Result<(), ModelError> {
        self.strategy.load(dir)
    }
}
