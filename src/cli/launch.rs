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

/// The subcommands that are one run across processes; any other would run once per worker
/// (`score` would write every row N times).
const DISTRIBUTED: [&str; 2] = ["sft", "grpo"];

/// Runs `launch`.
pub fn run(args: &LaunchArgs) -> Result<()> {
    let sub = args.command.first().map(String::as_str).unwrap_or_default();
    anyhow::ensure!(
        DISTRIBUTED.contains(&sub),
        "launch -- {sub}: only training runs across processes (sft, grpo); run `treetrain {sub}` without launch"
    );
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
