//! The training core both trainers (SFT, GRPO) are built on: the shared settings
//! ([`TrainConfig`]), model/tokenizer/optimizer loading ([`TrainCore`]), the end of every step
//! ([`Optimization`]: clipping, the non-finite policy, the update), checkpoints that resume
//! exactly (rotated by `save_total_limit`, found by `resume_from_checkpoint = true`), the run
//! logs ([`report`]: `log.jsonl`, TensorBoard, CSV), the typed [`TrainError`] and the [`Trainer`] trait whose
//! [`Trainer::train_for`] every caller drives. Plus AdamW with savable state, transformers'
//! learning-rate schedules, and how several processes share a run's state (`parallel`: one
//! strategy per `fsdp` mode, over the collectives of [`crate::distributed`]).

mod adamw;
mod checkpoint;
mod config;
pub(crate) mod config_file;
mod core;
mod error;
mod optimization;
pub(crate) mod out_of_memory;
mod output_lock;
mod parallel;
pub mod report;
mod resume;
mod schedule;
pub(crate) mod snapshot;
mod trainer;

pub use adamw::{AdamW, AdamWConfig, zero_grads};
pub use config::{
    DataSettings, MAX_TIMEOUT_S, NanPolicy, OptimizerSettings, OutputSettings, ParallelSettings, PrecisionSettings,
    TrainConfig,
};
pub use core::TrainCore;
pub use error::TrainError;
pub(crate) use optimization::StepOutcome;
pub use optimization::{MAX_CONSECUTIVE_SKIPS, Optimization};
pub use out_of_memory::allocation_failure;
pub use parallel::{BackwardPrefetch, Fsdp, FsdpConfig};
pub use report::{EventScalars, ReportTo, Scalars};
pub use resume::{ResumeFrom, checkpoints, latest_checkpoint, passed_over};
pub use schedule::{LrSchedule, ScheduleKind};
pub(crate) use trainer::run_state;
pub use trainer::{Progress, RunState, Trainer, every};
