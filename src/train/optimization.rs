//! The end of every optimizer step, for both trainers: clip, check for non-finite values, update
//! at the scheduled rate, clear the gradients.

use super::distributed::World;
use super::{AdamW, LrSchedule, NanPolicy, TrainConfig, TrainError};

/// AdamW and its learning-rate schedule.
#[derive(Debug)]
pub struct Optimization {
    /// The optimizer (its moments are checkpointed).
    pub adamw: AdamW,
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
pub struct StepOutcome {
    /// Gradient norm before clipping (NaN or inf when a gradient was not finite).
    pub grad_norm: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// The weights were left untouched (non-finite loss or gradient under `on_nan = skip`).
    pub skipped: bool,
}

impl Optimization {
    /// AdamW at `schedule`'s rates.
    pub fn new(adamw: AdamW, schedule: LrSchedule) -> Self {
        Self {
            adamw,
            schedule,
            consecutive_skips: 0,
        }
    }

    /// Ends optimizer step `step` (0-based) whose gradients are accumulated and whose loss was
    /// `loss`: the gradients summed over `world`'s ranks (each rank's loss already divides by
    /// the global window's count; the identity for one process; each rank its shard under
    /// `fsdp = "shard_grad_op"`), clipping at
    /// `config.optimizer.max_grad_norm`, then either the update at the scheduled rate or, when the loss or
    /// the gradient norm is not finite, `config.optimizer.on_nan` (skip: the step is dropped; stop: an
    /// error naming `rows()`; [`MAX_CONSECUTIVE_SKIPS`] skips in a row are an error under skip
    /// too). Gradients are cleared in every case. In a multi-process run
    /// `loss` is the global one, so every rank decides alike.
    pub fn finish_step(
        &mut self,
        world: &World,
        config: &TrainConfig,
        step: u64,
        loss: f64,
        rows: impl FnOnce() -> Vec<usize>,
    ) -> Result<StepOutcome, TrainError> {
        let reduced = self
            .adamw
            .reduce_grads(world)
            .and_then(|()| self.adamw.clip_in(config.optimizer.max_grad_norm, world));
        let grad_norm = match reduced {
            Ok(norm) => norm,
            Err(e) => {
                self.adamw.zero_grad();
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
            None => self.adamw.step_in(lr, world),
            Some(_) => Ok(()),
        };
        self.adamw.zero_grad();
        updated?;
        // Finite gradients at a finite rate can still overflow a weight (a huge rate, low
        // precision): the run stops whatever `on_nan` says, before any checkpoint (which would
        // refuse the tensor anyway) or another step trains on it.
        if bad.is_none()
            && let Some(name) = self.adamw.first_non_finite_in(world)?
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
    pub fn discard_gradients(&self) {
        self.adamw.clear_param_grads();
    }
}
