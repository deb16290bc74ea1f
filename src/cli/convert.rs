//! `treetrain convert`: load a model, write it back (e.g. in another dtype).

use std::path::PathBuf;

use anyhow::Result;
use treetrain::model::Dtype;

/// Arguments of `convert`.
#[derive(clap::Args)]
pub(crate) struct ConvertArgs {
    /// A model folder or repo id.
    #[arg(long)]
    model: String,
    /// Output folder (must not exist, or be empty, unless --overwrite).
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing output folder (a file there is still refused).
    #[arg(long)]
    overwrite: bool,
    /// A PEFT LoRA adapter folder to merge into the model: the output is a plain checkpoint
    /// (PEFT's `merge_and_unload` + `save_pretrained`).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Output dtype: fp32, bf16 or fp16 (default: unchanged).
    #[arg(long, value_parser = super::choice::<Dtype>("--dtype"))]
    dtype: Option<Dtype>,
}

/// Runs `convert`.
pub(crate) fn run(args: &ConvertArgs) -> Result<()> {
    // Merged in the output's dtype, as PEFT merges in the base model's.
    let (dir, mut m) = super::load_model(&super::ModelSpec {
        model: &args.model,
        dtype: args.dtype,
        device: treetrain::device::DeviceSpec::Cpu,
        adapter: args.adapter.as_deref(),
        adapter_use: super::AdapterUse::Attached,
    })?;
    m.merge_and_unload()?;
    // Never an output over what convert reads: the model folder, its tokenizer, the adapter.
    let sources: Vec<&std::path::Path> = [Some(dir.as_path()), args.adapter.as_deref()]
        .into_iter()
        .flatten()
        .collect();
    treetrain::model::refuse_overlap(&args.out, &sources)?;
    match args.overwrite {
        true => m.save_over(&args.out, Some(&dir))?,
        false => m.save(&args.out, Some(&dir))?,
    }
    println!(
        "wrote {} ({})",
        args.out.display(),
        treetrain::model::kind_name(m.kind())
    );
    Ok(())
}
