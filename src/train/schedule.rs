//! Learning-rate schedules as transformers defines them (`get_scheduler`): a multiplier of the
//! base rate per optimizer step, with linear warmup.

/// The shape of the schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Flat after warmup.
    Constant,
    /// Linear decay to 0 at the last step.
    Linear,
    /// Half a cosine down to 0 at the last step.
    Cosine,
}

/// A schedule over `total_steps` optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    /// Base learning rate.
    pub lr: f64,
    /// Shape after warmup.
    pub kind: ScheduleKind,
    /// Warmup steps (linear from 0).
    pub warmup_steps: u64,
    /// Steps of the whole run.
    pub total_steps: u64,
}

impl LrSchedule {
    /// Warmup given as a fraction of the run (transformers' `warmup_ratio`, rounded up).
    pub fn with_warmup_ratio(lr: f64, kind: ScheduleKind, ratio: f64, total_steps: u64) -> Self {
        LrSchedule {
            lr,
            kind,
            warmup_steps: (ratio * total_steps as f64).ceil() as u64,
            total_steps,
        }
    }

    /// The multiplier at optimizer step `step` (0-based: the rate used by the `step + 1`-th update).
    pub fn factor(&self, step: u64) -> f64 {
        let (s, w, t) = (step as f64, self.warmup_steps as f64, self.total_steps as f64);
        if step < self.warmup_steps {
            return s / w.max(1.0);
        }
        match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::Linear => ((t - s) / (t - w).max(1.0)).max(0.0),
            ScheduleKind::Cosine => {
                let progress = (s - w) / (t - w).max(1.0);
                (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
            }
        }
    }

    /// The learning rate at `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        self.lr * self.factor(step)
    }
}
