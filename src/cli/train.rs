//! `treetrain sft` and `treetrain grpo`: a config file, optional overrides, then one run loop
//! for any [`Trainer`].

use std::path::PathBuf;

use anyhow::Result;
use treetrain::display::Rich;
use treetrain::grpo::{GrpoConfig, GrpoTrainer, RolloutMode};
use treetrain::pack::Packing;
use treetrain::sft::{SftConfig, SftTrainer};
use treetrain::shipped::ShippedEnvironment;
use treetrain::train::{ResumeFrom, Trainer, every};

/// Arguments of `sft`.
#[derive(clap::Args)]
pub(crate) struct SftArgs {
    /// The config file.
    #[arg(long)]
    config: PathBuf,
    /// Override `device` (cpu, cuda[:N], mps, neuron[:N], auto).
    #[arg(long)]
    device: Option<treetrain::device::DeviceSpec>,
    /// Resume from this checkpoint folder, or `latest`: the newest resumable one in
    /// `output_dir` (overrides `resume_from_checkpoint`).
    #[arg(long, value_name = "DIR|latest")]
    resume_from: Option<ResumeFrom>,
}

/// Arguments of `grpo`.
#[derive(clap::Args)]
pub(crate) struct GrpoArgs {
    /// The config file.
    #[arg(long)]
    config: PathBuf,
    /// Override `device` (cpu, cuda[:N], mps, neuron[:N], auto).
    #[arg(long)]
    device: Option<treetrain::device::DeviceSpec>,
    /// Override `max_steps`.
    #[arg(long)]
    max_steps: Option<u64>,
    /// Override `mode`.
    #[arg(long, value_parser = super::choice::<RolloutMode>("--mode"))]
    mode: Option<RolloutMode>,
    /// Override `packing`.
    #[arg(long, value_parser = super::choice::<Packing>("--packing"))]
    packing: Option<Packing>,
    /// Resume from this checkpoint folder, or `latest`: the newest resumable one in
    /// `output_dir` (overrides `resume_from_checkpoint`).
    #[arg(long, value_name = "DIR|latest")]
    resume_from: Option<ResumeFrom>,
    /// Multi-turn rollouts with a shipped environment (its reward replaces `rewards`).
    #[arg(long, value_parser = super::choice::<ShippedEnvironment>("--environment"))]
    environment: Option<ShippedEnvironment>,
}

/// Runs `sft`.
pub(crate) fn sft(args: &SftArgs) -> Result<()> {
    let mut cfg = SftConfig::from_toml_file(&args.config)?;
    cfg.train.device = args.device.unwrap_or(cfg.train.device);
    if let Some(r) = &args.resume_from {
        cfg.train.output.resume_from_checkpoint = Some(r.clone());
    }
    run(SftTrainer::from_config(cfg, None)?)
}

/// Runs `grpo`.
pub(crate) fn grpo(args: &GrpoArgs) -> Result<()> {
    let mut cfg = GrpoConfig::from_toml_file(&args.config)?;
    cfg.train.device = args.device.unwrap_or(cfg.train.device);
    cfg.max_steps = args.max_steps.unwrap_or(cfg.max_steps);
    cfg.rollouts.mode = args.mode.unwrap_or(cfg.rollouts.mode);
    cfg.update.packing = args.packing.unwrap_or(cfg.update.packing);
    if let Some(r) = &args.resume_from {
        cfg.train.output.resume_from_checkpoint = Some(r.clone());
    }
    match args.environment {
        Some(env) => run(env.trainer(cfg, None)?),
        None => run(GrpoTrainer::from_config(cfg, None)?),
    }
}

/// Trains to the last step: an evaluation first (when `eval_steps` is set), a line every
/// `logging_steps`, evaluations every `eval_steps`, checkpoints every `save_steps` and at the
/// end (when `output_dir` is set and the last step was not just saved), then the state.
///
/// In a multi-process run every rank steps, evaluates and saves (collectives need them all);
/// only rank 0 prints.
fn run<T: Trainer>(mut t: T) -> Result<()> {
    let main = t.core().world.is_main();
    let say = |text: &str| {
        if main {
            print!("{text}");
        }
    };
    if main {
        eprintln!("{}{}", t.describe(), world_note(&t));
        if let Some(from) = t.core().resumed_from() {
            eprintln!("resumed from {} (step {})", from.display(), t.progress().done);
            if let Some(out) = t.train_config().output.output_dir.as_deref() {
                for (dir, why) in treetrain::train::passed_over(out, from) {
                    eprintln!("  passed over {}: it cannot be resumed ({why})", dir.display());
                }
            }
        }
    }
    // A finished run resumed: nothing to train, and its last checkpoint is already there.
    let progress = t.progress();
    if progress.finished() && progress.done > 0 {
        say(&format!(
            "the run is finished (step {} of {}): nothing to do; raise max_steps to train further\n",
            progress.done, progress.total
        ));
        return Ok(());
    }
    let cfg = t.train_config().output.clone();
    if cfg.eval_steps.is_some()
        && let Some(e) = t.evaluate_held_out()?
    {
        say(&e.text());
    }
    if let Some(dir) = t.core().logging_dir() {
        say(&format!("TensorBoard logs: tensorboard --logdir {}\n", dir.display()));
    }
    let mut saved_at = None;
    t.train_with(u64::MAX, |t, m, bar| {
        let step = t.progress().done;
        t.log_step(m, bar);
        if every(cfg.eval_steps, step)
            && let Some(e) = t.evaluate_held_out()?
        {
            bar.suspend(|| say(&e.text()));
        }
        if every(cfg.save_steps, step) && cfg.output_dir.is_some() {
            let dir = t.save_checkpoint()?;
            saved_at = Some(step);
            bar.suspend(|| say(&format!("saved {}\n", dir.display())));
        }
        Ok(())
    })?;
    if cfg.output_dir.is_some() && saved_at != Some(t.progress().done) {
        let dir = t.save_checkpoint()?;
        say(&format!("saved {}\n", dir.display()));
    }
    say(&t.state().text());
    Ok(())
}

/// `, on N processes` when the run has several.
fn world_note<T: Trainer>(t: &T) -> String {
    let w = &t.core().world;
    match w.is_distributed() {
        true => format!(", on {} processes (batch sizes are per process)", w.size),
        false => String::new(),
    }
}
