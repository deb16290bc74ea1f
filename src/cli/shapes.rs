//! `treetrain shapes`: distinct input shapes (= Neuron compiles) with and without padding.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use treetrain::device::{PadTo, Platform};
use treetrain::display::Rich;
use treetrain::shapes::{PaddingComparison, synthetic_lengths};

/// Arguments of `shapes`.
#[derive(clap::Args)]
pub(crate) struct ShapesArgs {
    /// A file of sequence lengths (one integer per line, or JSON lines with "length" or
    /// "input_ids"). Without it, a seeded synthetic chat-length distribution is used.
    #[arg(long)]
    lengths: Option<PathBuf>,
    /// Synthetic sequences when no file is given.
    #[arg(long, default_value_t = 2000)]
    synthetic: usize,
    /// Rows per batch.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// pad_to_multiple_of: auto, none, or a number.
    #[arg(long, default_value = "auto", value_parser = |s: &str| s.parse::<PadTo>())]
    pad: PadTo,
    /// Platform the policy is resolved for.
    #[arg(long, default_value = "neuron", value_parser = super::choice::<Platform>("--platform"))]
    platform: Platform,
    /// Seconds one compile costs.
    #[arg(long, default_value_t = 60.0)]
    seconds_per_compile: f64,
}

/// Runs `shapes`.
pub(crate) fn run(args: &ShapesArgs) -> Result<()> {
    let lengths = match &args.lengths {
        Some(path) => read_lengths(path)?,
        None => synthetic_lengths(args.synthetic, 350.0, 0.7, 8, 4096, 0),
    };
    let c = PaddingComparison::new(
        &lengths,
        args.batch_size,
        args.pad,
        args.platform,
        args.seconds_per_compile,
    )?;
    print!("{}", c.text());
    Ok(())
}

fn read_lengths(path: &Path) -> Result<Vec<usize>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lengths = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = format!("{}:{}", path.display(), i + 1);
        let line = line.trim();
        if let Ok(n) = line.parse::<usize>() {
            lengths.push(n);
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{at}: neither an integer nor JSON"))?;
        if let Some(n) = v.get("length").and_then(|n| n.as_u64()) {
            lengths.push(n as usize);
        } else if let Some(ids) = v.get("input_ids").and_then(|a| a.as_array()) {
            lengths.push(ids.len());
        } else {
            bail!("{at}: expected a \"length\" or \"input_ids\" field");
        }
    }
    Ok(lengths)
}
