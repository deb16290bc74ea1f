//! The contract both trainers implement, and the one step loop every caller (notebook cell,
//! CLI, tests) drives them through.

use std::path::{Path, PathBuf};

use super::config::TrainConfig;
use super::core::TrainCore;
use super::error::TrainError;
use crate::display::Rich;

/// Steps done and steps of the whole run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Optimizer steps done.
    pub done: u64,
    /// Steps of the run.
    pub total: u64,
}

impl Progress {
    /// Whether the run has taken its last step.
    pub fn finished(self) -> bool {
        self.done >= self.total
    }
}

/// A trainer's saved state knows how far the run is.
pub trait RunState {
    /// Steps done and steps of the run.
    fn progress(&self) -> Progress;
}

/// Implements [`RunState`] for a state with `global_step` and `total_steps` fields.
macro_rules! run_state {
    ($ty:ty) => {
        impl $crate::train::RunState for $ty {
            fn progress(&self) -> $crate::train::Progress {
                $crate::train::Progress {
                    done: self.global_step,
                    total: self.total_steps,
                }
            }
        }
    };
}
pub(crate) use run_state;

/// A trainer: built from its config (resuming from a checkpoint or not), stepped, saved.
pub trait Trainer: Sized {
    /// The configuration it is built from.
    type Config;
    /// What one step reports.
    type Metrics: Rich + serde::Serialize;
    /// What a held-out evaluation reports.
    type Eval: Rich;
    /// Progress and history, saved with checkpoints.
    type State: Rich + RunState + serde::Serialize;

    /// Builds a trainer, continuing from `resume_from` (a checkpoint folder this trainer wrote)
    /// when given.
    fn from_config(config: Self::Config, resume_from: Option<&Path>) -> Result<Self, TrainError>;
    /// One optimizer step.
    fn step(&mut self) -> Result<Self::Metrics, TrainError>;
    /// The model, tokenizer and optimizer.
    fn core(&self) -> &TrainCore;
    /// The shared settings of the run.
    fn train_config(&self) -> &TrainConfig;
    /// Progress and history.
    fn state(&self) -> &Self::State;
    /// Evaluates on the run's held-out data, `None` when it has none.
    fn evaluate_held_out(&mut self) -> Result<Option<Self::Eval>, TrainError>;
    /// One line saying what the run will do (data, steps, modes).
    fn describe(&self) -> String;
    /// The line a run loop prints for a logged step (default: the metrics' text).
    fn log_line(&self, metrics: &Self::Metrics) -> String {
        metrics.text()
    }

    /// Steps done of the run.
    fn progress(&self) -> Progress {
        self.state().progress()
    }

    /// Writes `output_dir/checkpoint-<step>/` atomically: the model as a Hugging Face folder,
    /// the optimizer, the state and the trainer's own files ([`Trainer::write_own_files`]).
    fn save_checkpoint(&self) -> Result<PathBuf, TrainError> {
        self.core()
            .save_checkpoint_with(self.train_config(), self.progress().done, self.state(), |dir| {
                self.write_own_files(dir)
            })
    }

    /// Files of this trainer's own that a checkpoint needs to resume exactly, written into the
    /// checkpoint's (temporary) folder `dir`. None by default.
    fn write_own_files(&self, _dir: &Path) -> Result<(), String> {
        Ok(())
    }

    /// Runs up to `n` steps (fewer when the run ends first) with a progress bar on a terminal;
    /// returns the last step's metrics.
    ///
    /// Prints (on the main rank) the log line of every `logging_steps`-th step as it finishes
    /// (a notebook cell streams it), and, when the run ends before `n` steps, that it stopped at
    /// its last step and why.
    fn train_for(&mut self, n: u64) -> Result<Option<Self::Metrics>, TrainError> {
        let start = self.progress().done;
        let last = self.train_with(n, |t, m, bar| {
            t.log_step(m, bar);
            Ok(())
        })?;
        let ran = self.progress().done - start;
        if self.core().world.is_main() && ran < n {
            println!("{}", stopped_early(ran, n, self.progress()));
        }
        Ok(last)
    }

    /// Prints `metrics`' log line on the main rank when the step just taken is a
    /// `logging_steps` step (through `bar`, so the line and the bar do not interleave).
    fn log_step(&self, metrics: &Self::Metrics, bar: &indicatif::ProgressBar) {
        if self.core().world.is_main() && every(self.train_config().output.logging_steps, self.progress().done) {
            bar.suspend(|| print!("{}", self.log_line(metrics)));
        }
    }

    /// [`Trainer::train_for`], calling `after_step` after every step with the trainer, the
    /// step's metrics and the progress bar (print through `bar.suspend` so lines and the bar
    /// do not interleave).
    fn train_with(
        &mut self,
        n: u64,
        mut after_step: impl FnMut(&mut Self, &Self::Metrics, &indicatif::ProgressBar) -> Result<(), TrainError>,
    ) -> Result<Option<Self::Metrics>, TrainError> {
        let bar = match self.core().world.is_main() {
            true => progress_bar(self.progress()),
            false => indicatif::ProgressBar::hidden(),
        };
        let mut last = None;
        for _ in 0..n {
            if self.progress().finished() {
                break;
            }
            let m = self.step()?;
            bar.set_position(self.progress().done);
            bar.set_message(m.text().trim().to_string());
            after_step(self, &m, &bar)?;
            last = Some(m);
        }
        bar.finish_and_clear();
        Ok(last)
    }
}

/// What `train_for(n)` says when the run ended before `n` steps.
pub(crate) fn stopped_early(ran: u64, asked: u64, p: Progress) -> String {
    format!(
        "stopped after {ran} of the {asked} steps asked: the run reached its last step ({} of max_steps {})",
        p.done, p.total
    )
}

/// A bar on standard error (hidden where that is not a terminal, as in a notebook).
fn progress_bar(p: Progress) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(p.total);
    bar.set_position(p.done);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}] {wide_msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

/// Whether step `step` is one of every `every` (never when unset).
pub fn every(every: Option<u64>, step: u64) -> bool {
    every.is_some_and(|n| step.is_multiple_of(n))
}

impl crate::display::Rich for Progress {
    fn html(&self) -> String {
        let rows = [("steps", format!("{} / {}", self.done, self.total))];
        crate::display::style::container(&crate::display::kv_table(&rows))
    }
    fn text(&self) -> String {
        format!("step {} / {}\n", self.done, self.total)
    }
}

crate::display::rich_display!(Progress);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_early_stop_says_where_and_why() {
        let line = stopped_early(39, 60, Progress { done: 40, total: 40 });
        assert_eq!(
            line,
            "stopped after 39 of the 60 steps asked: the run reached its last step (40 of max_steps 40)"
        );
    }
}
