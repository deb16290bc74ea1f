//! Training building blocks shared by the SFT and GRPO trainers: AdamW with savable state,
//! learning-rate schedules.

mod adamw;
mod schedule;

pub use adamw::{AdamW, AdamWConfig, decays};
pub use schedule::{LrSchedule, ScheduleKind};
