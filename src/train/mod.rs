//! The training core both trainers (SFT, GRPO) are built on: the shared settings
//! ([`TrainConfig`]), model/tokenizer/optimizer loading ([`TrainCore`]), the end of every step
//! ([`Optimization`]: clipping, the non-finite policy, the update), checkpoints that resume
//! exactly (rotated by `save_total_limit`, found by `resume_from_checkpoint = true`), the run
//! logs ([`report`]: `log.jsonl`, TensorBoard, CSV), the typed [`TrainError`] and the [`Trainer`] trait whose
//! [`Trainer::train_for`] every caller drives. Plus AdamW with savable state and transformers'
//! learning-rate schedules.

mod adamw;
mod checkpoint;
mod config;
pub(crate) mod config_file;
mod core;
pub mod distributed;
mod error;
mod optimization;
mod output_lock;
pub mod report;
mod resume;
mod schedule;
mod sharding;
pub(crate) mod snapshot;
mod trainer;

pub use crate::run_state;
pub use adamw::{AdamW, AdamWConfig, OptimizerSnapshot, decays, zero_grads};
pub use checkpoint::save_atomically;
pub use config::{
    DataSettings, NanPolicy, OptimizerSettings, OutputSettings, ParallelSettings, PrecisionSettings, TrainConfig,
};
pub use core::TrainCore;
pub use error::TrainError;
pub use optimization::{MAX_CONSECUTIVE_SKIPS, Optimization, StepOutcome};
pub use report::{EventScalars, ReportTo, Scalars};
pub use resume::{ResumeFrom, checkpoints, latest_checkpoint};
pub use schedule::{LrSchedule, ScheduleKind};
pub use sharding::{BackwardPrefetch, Fsdp, FsdpConfig};
pub use trainer::{Progress, RunState, Trainer, every};
