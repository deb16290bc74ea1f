//! Training building blocks shared by the SFT and GRPO trainers: AdamW with savable state,
//! learning-rate schedules, checkpoint folders and the step log.

mod adamw;
mod checkpoint;
pub(crate) mod config_file;
mod schedule;

pub use adamw::{AdamW, AdamWConfig, decays, zero_grads};
pub use checkpoint::{append_log, load_checkpoint, save_atomically, save_checkpoint};
pub use schedule::{LrSchedule, ScheduleKind};
