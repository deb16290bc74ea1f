//! `treetrain pack`: GRPO rollouts (JSONL) into packed rows, one JSON object per row.

use std::path::PathBuf;

use anyhow::{Context, Result};
use treetrain::pack::{Packing, Rollout, pack_flat};

/// Arguments of `pack`.
#[derive(clap::Args)]
pub(crate) struct PackArgs {
    /// JSONL: `{"input_ids", "completion_mask", "old_log_probs", "advantage", "group_id"}` per line.
    #[arg(long)]
    input: PathBuf,
    /// Token budget per row (unique tokens for trees); without it every rollout goes into one
    /// row, in input order.
    #[arg(long)]
    budget: Option<usize>,
    /// Flat sequence packing instead of the prefix tree.
    #[arg(long)]
    flat: bool,
}

/// Runs `pack`.
pub(crate) fn run(args: &PackArgs) -> Result<()> {
    let mut rollouts = Vec::new();
    for line in super::jsonl::read(&args.input)? {
        let r: Rollout = serde_json::from_value(line.value).with_context(|| {
            format!(
                "{}: not a rollout (input_ids, completion_mask, old_log_probs, advantage, group_id)",
                line.at
            )
        })?;
        r.validate(rollouts.len()).with_context(|| line.at.clone())?;
        rollouts.push(r);
    }
    anyhow::ensure!(!rollouts.is_empty(), "{}: no rollouts to pack", args.input.display());
    let packing = if args.flat { Packing::Flat } else { Packing::Tree };
    let rows = match args.budget {
        Some(budget) => packing.plan(rollouts, budget, 1)?.into_iter().flatten().collect(),
        None if args.flat => vec![pack_flat(&rollouts)?],
        None => vec![treetrain::pack::pack_tree(&rollouts)?],
    };
    super::jsonl::write(rows.iter().map(|r| r.to_json()))
}
