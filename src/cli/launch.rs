//! `treetrain launch`: N workers of this binary on this host, one data-parallel run (across
//! hosts with torchrun's multi-node arguments).

use anyhow::{Context, Result};
use treetrain::distributed::{LaunchPlan, Nodes, launch};

/// Arguments of `launch`.
#[derive(clap::Args)]
pub(crate) struct LaunchArgs {
    /// Worker processes (ranks) on this host.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    nproc_per_node: u64,
    /// Hosts in the run, each running this command with its own `--node-rank`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=4096))]
    nnodes: u64,
    /// This host's index among the `--nnodes` (0 hosts the rendezvous store).
    #[arg(long, alias = "node_rank", default_value_t = 0)]
    node_rank: u64,
    /// Node 0's address: the store listens there and every worker connects to it (default
    /// 127.0.0.1, for one host). Gloo binds the interface `GLOO_SOCKET_IFNAME` names.
    #[arg(long, alias = "master_addr", default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store (default: a free one on one host, 29500 on several, as
    /// torchrun).
    #[arg(long, alias = "master_port")]
    master_port: Option<u16>,
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
pub(crate) fn run(args: &LaunchArgs) -> Result<()> {
    let sub = args.command.first().map(String::as_str).unwrap_or_default();
    anyhow::ensure!(
        DISTRIBUTED.contains(&sub),
        "launch -- {sub}: only training runs across processes (sft, grpo); run `treetrain {sub}` without launch"
    );
    let max = treetrain::train::MAX_TIMEOUT_S;
    anyhow::ensure!(
        args.timeout_s > 0.0 && args.timeout_s <= max,
        "--timeout-s {:?}: must be > 0 and at most {max:e} seconds",
        args.timeout_s
    );
    let several = args.nnodes > 1;
    let plan = LaunchPlan {
        nproc: args.nproc_per_node as usize,
        nodes: Nodes {
            count: args.nnodes as usize,
            rank: args.node_rank as usize,
            master_addr: args.master_addr.clone(),
        },
        program: std::env::current_exe().context("cannot find this treetrain binary")?,
        args: args.command.clone(),
        env: Vec::new(),
        port: args.master_port.unwrap_or(if several { 29500 } else { 0 }),
        timeout: std::time::Duration::from_secs_f64(args.timeout_s),
    };
    Ok(launch(&plan)?)
}
