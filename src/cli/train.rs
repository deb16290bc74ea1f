//! `treetrain sft` and `treetrain grpo`: a config file, optional overrides, then one run loop
//! for any [`Trainer`].

use std::path::PathBuf;

use anyhow::Result;
use treetrain::display::Rich;
use treetrain::grpo::{GrpoConfig, GrpoTrainer, RolloutMode};
use treetrain::pack::Packing;
use treetrain::sft::{SftConfig, SftTrainer};
use treetrain::train::{Trainer, every};

/// Arguments of `sft`.
#[derive(clap::Args)]
pub struct SftArgs {
    /// The config file.
    #[arg(long)]
    config: PathBuf,
    /// Resume from this checkpoint folder.
    #[arg(long)]
    resume_from: Option<PathBuf>,
}

/// Arguments of `grpo`.
#[derive(clap::Args)]
pub struct GrpoArgs {
    /// The config file.
    #[arg(long)]
    config: PathBuf,
    /// Override `max_steps`.
    #[arg(long)]
    max_steps: Option<u64>,
    /// Override `mode`.
    #[arg(long, value_parser = super::choice::<RolloutMode>("--mode"))]
    mode: Option<RolloutMode>,
    /// Override `packing`.
    #[arg(long, value_parser = super::choice::<Packing>("--packing"))]
    packing: Option<Packing>,
    /// Resume from this checkpoint folder.
    #[arg(long)]
    resume_from: Option<PathBuf>,
}

/// Runs `sft`.
pub fn sft(args: &SftArgs) -> Result<()> {
    let cfg = SftConfig::from_toml_file(&args.config)?;
    run(SftTrainer::from_config(cfg, args.resume_from.as_deref())?)
}

/// Runs `grpo`.
pub fn grpo(args: &GrpoArgs) -> Result<()> {
    let mut cfg = GrpoConfig::from_toml_file(&args.config)?;
    cfg.max_steps = args.max_steps.unwrap_or(cfg.max_steps);
    cfg.mode = args.mode.unwrap_or(cfg.mode);
    cfg.packing = args.packing.unwrap_or(cfg.packing);
    run(GrpoTrainer::from_config(cfg, args.resume_from.as_deref())?)
}

/// Trains to the last step: an evaluation first (when `eval_steps` is set), a line every
/// `logging_steps`, evaluations every `eval_steps`, checkpoints every `save_steps` and at the
/// end (when `output_dir` is set), then the state.
fn run<T: Trainer>(mut t: T) -> Result<()> {
    eprintln!("{}", t.describe());
    let cfg = t.train_config().clone();
    if cfg.eval_steps.is_some()
        && let Some(e) = t.evaluate_held_out()?
    {
        print!("{}", e.text());
    }
    t.train_with(u64::MAX, |t, m, bar| {
        let step = t.progress().done;
        if every(cfg.logging_steps, step) {
            bar.suspend(|| print!("{}", t.log_line(m)));
        }
        if every(cfg.eval_steps, step)
            && let Some(e) = t.evaluate_held_out()?
        {
            bar.suspend(|| print!("{}", e.text()));
        }
        if every(cfg.save_steps, step) && cfg.output_dir.is_some() {
            let dir = t.save_checkpoint()?;
            bar.suspend(|| println!("saved {}", dir.display()));
        }
        Ok(())
    })?;
    if cfg.output_dir.is_some() {
        println!("saved {}", t.save_checkpoint()?.display());
    }
    print!("{}", t.state().text());
    Ok(())
}
