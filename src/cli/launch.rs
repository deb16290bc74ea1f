//! `treetrain launch`: N workers of this binary on this host, one data-parallel run.

use anyhow::{Context, Result};
use treetrain::train::distributed::{LaunchPlan, launch};

/// Arguments of `launch`.
#[derive(clap::Args)]
pub struct LaunchArgs {
    /// Worker processes (ranks) on this host.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    nproc_per_node: u64,
    /// Port of the rendezvous store on 127.0.0.1 (default: a free one).
    #[arg(long, default_value_t = 0)]
    master_port: u16,
    /// Seconds the store waits for the workers to connect.
    #[arg(long, default_value_t = 1800.0)]
    timeout_s: f64,
    /// The treetrain subcommand every worker runs, after `--` (e.g. `-- sft --config run.toml`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    command: Vec<String>,
}

/// Runs `launch`.
pub fn run(args: &LaunchArgs) -> Result<()> {
    anyhow::ensure!(
        args.timeout_s.is_finite() && args.timeout_s > 0.0,
        "--timeout-s {}: must be finite and > 0",
        args.timeout_s
    );
    let plan = LaunchPlan {
        nproc: args.nproc_per_node as usize,
        program: std::env::current_exe().context("cannot find this treetrain binary")?,
        args: args.command.clone(),
        env: Vec::new(),
        port: args.master_port,
        timeout: std::time::Duration::from_secs_f64(args.timeout_s),
    };
    Ok(launch(&plan)?)
}
