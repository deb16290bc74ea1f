//! The subcommands, one file each, and what they share: reading models, JSON lines, and
//! typed option values.

pub(crate) mod convert;
pub(crate) mod generate;
pub(crate) mod jsonl;
pub(crate) mod launch;
pub(crate) mod pack;
pub(crate) mod render;
pub(crate) mod score;
pub(crate) mod shapes;
pub(crate) mod train;

use std::path::{Path, PathBuf};

use anyhow::Result;
use treetrain::display::Rich;

/// `treetrain env`.
pub(crate) fn env(json: bool) -> Result<()> {
    let report = treetrain::EnvReport::collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&report.to_json())?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// `treetrain env --check-device DEVICE`: the device self-check alone.
pub(crate) fn check_device(device: treetrain::device::DeviceSpec) -> Result<()> {
    let report = treetrain::model::check_device(device.resolve()?)?;
    print!("{}", report.text());
    Ok(())
}

/// `treetrain demo`: the library's demo, its summary printed and written to `summary.json`.
pub(crate) fn demo(out: &Path) -> Result<()> {
    let summary = treetrain::demo::run(out, &mut std::io::stdout())?;
    let path = out.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)?;
    println!("\nWrote {}", summary.files.join(", "));
    Ok(())
}

/// `treetrain make-shipped-data`.
pub(crate) fn make_shipped_data(out: &Path) -> Result<()> {
    treetrain::shipped::datasets::write_all(out).map_err(anyhow::Error::msg)?;
    treetrain::shipped::tiny_model::write_model_files(&out.join("tiny-qwen3")).map_err(anyhow::Error::msg)?;
    treetrain::shipped::tiny_model::write_mixture_files(&out.join("tiny-qwen3-moe")).map_err(anyhow::Error::msg)?;
    treetrain::shipped::tiny_model::write_muse_spark_files(&out.join("tiny-muse-spark")).map_err(anyhow::Error::msg)?;
    println!("wrote {}", out.display());
    Ok(())
}

/// How a subcommand wants a `--adapter` applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AdapterUse {
    /// Kept separate: PEFT's forward exactly (`score`).
    Attached,
    /// Folded into the weights: no adapter work per step (`generate`).
    Merged,
}

/// How a subcommand loads its model: the folder or cached repo id, the dtype (default: the
/// checkpoint's), the device, and a PEFT adapter folder to apply.
pub(crate) struct ModelSpec<'a> {
    /// A model folder or cached repo id.
    pub(crate) model: &'a str,
    /// Parameter dtype (`None`: the checkpoint's).
    pub(crate) dtype: Option<treetrain::model::Dtype>,
    /// Where the model runs.
    pub(crate) device: treetrain::device::DeviceSpec,
    /// A PEFT LoRA adapter folder.
    pub(crate) adapter: Option<&'a Path>,
    /// How the adapter is applied.
    pub(crate) adapter_use: AdapterUse,
}

/// Loads what `spec` names.
pub(crate) fn load_model(spec: &ModelSpec) -> Result<(PathBuf, treetrain::model::Model)> {
    let dir = treetrain::hub::HubCache::from_env().model_dir(spec.model)?;
    let opts = treetrain::model::LoadOptions {
        dtype: spec.dtype.map(treetrain::model::Dtype::kind),
        device: spec.device.resolve()?,
    };
    let (adapter, mode) = (spec.adapter, spec.adapter_use);
    let mut model = treetrain::model::Model::load(&dir, opts)?;
    if let Some(adapter) = adapter {
        model.load_adapter(adapter)?;
        if mode == AdapterUse::Merged {
            model.merge_adapter()?;
        }
    }
    Ok((dir, model))
}

/// The model folder's tokenizer, when it has one.
pub(crate) fn tokenizer_of(dir: &Path) -> Result<Option<treetrain::tokenizer::Tokenizer>> {
    Ok(dir
        .join("tokenizer.json")
        .exists()
        .then(|| treetrain::tokenizer::Tokenizer::from_dir(dir))
        .transpose()?)
}

/// A value parser for an option with a fixed set of values: `--flag value` errors list them.
pub(crate) fn choice<T: clap::ValueEnum + Clone + Send + Sync + 'static>(
    flag: &'static str,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        T::from_str(s, true).map_err(|_| {
            let names: Vec<String> = T::value_variants()
                .iter()
                .filter_map(|v| v.to_possible_value().map(|p| p.get_name().to_string()))
                .collect();
            format!("{flag} {s}: expected one of {}", names.join(", "))
        })
    }
}
