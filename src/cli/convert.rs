//! `treetrain convert`: load a model, write it back (e.g. in another dtype).

use std::path::PathBuf;

use anyhow::Result;
use treetrain::model::Dtype;

/// Arguments of `convert`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// A model folder or repo id.
    #[arg(long)]
    model: String,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
    /// Output dtype: fp32, bf16 or fp16 (default: unchanged).
    #[arg(long, value_parser = super::choice::<Dtype>("--dtype"))]
    dtype: Option<Dtype>,
}

/// Runs `convert`.
pub fn run(args: &ConvertArgs) -> Result<()> {
    let (dir, m) = super::load_model(&args.model, args.dtype)?;
    m.save(&args.out, Some(&dir))?;
    println!("wrote {} ({:?})", args.out.display(), m.kind());
    Ok(())
}
