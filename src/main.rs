//! The `treetrain` command line: parses and dispatches; each subcommand lives in `cli/`.

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "treetrain",
    version,
    about = "Tree-packed language-model training over libtorch"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Report versions, accelerators and the policies that follow (like `trl env`).
    Env {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Run only the device self-check on this device (cuda[:N], neuron[:N]): a tiny seeded
        /// forward and backward compared with the CPU; exits 1 naming the first op that differs.
        #[arg(long, value_name = "DEVICE")]
        check_device: Option<treetrain::device::DeviceSpec>,
    },
    /// Log-probability of every token given its prefix, for rows of a JSONL file.
    Score(cli::score::ScoreArgs),
    /// Each line's conversation as the model's chat template renders it (NUL after each), as
    /// transformers' `apply_chat_template(..., tokenize=False)` returns it.
    Render(cli::render::RenderArgs),
    /// Load a model and write it back as a Hugging Face folder (e.g. to change its dtype).
    Convert(cli::convert::ConvertArgs),
    /// Supervised fine-tuning from a TOML config (fields of `treetrain::sft::SftConfig`).
    Sft(cli::train::SftArgs),
    /// GRPO from a TOML config (see datasets/grpo.toml); one line per step, the logs of
    /// `report_to` and a final checkpoint in `output_dir`.
    Grpo(cli::train::GrpoArgs),
    /// Generate completions with a static KV cache (one JSON line per completion).
    Generate(cli::generate::GenerateArgs),
    /// Pack GRPO rollouts (JSONL) into rows as TRL v1.16 does; one JSON object per row.
    Pack(cli::pack::PackArgs),
    /// Forecast distinct input shapes (= Neuron compiles) with and without padding.
    Shapes(cli::shapes::ShapesArgs),
    /// Run a command on N processes of this host as one data-parallel job (torchrun's job,
    /// without Python): `treetrain launch --nproc-per-node 2 -- sft --config run.toml`; on
    /// several hosts with `--nnodes`, `--node-rank`, `--master-addr` and `--master-port`.
    Launch(cli::launch::LaunchArgs),
    /// Regenerate the shipped datasets and tiny model files from their seeds (maintainers).
    #[command(hide = true)]
    MakeShippedData {
        /// Target folder (the repository's datasets/).
        #[arg(long, default_value = "datasets")]
        out: std::path::PathBuf,
    },
    /// The main job on the shipped defaults: everything treetrain can show on this machine.
    Demo {
        /// Folder for the demo's outputs (report.html, shapes.svg, summary.json).
        #[arg(long, default_value = "demo-out")]
        out: std::path::PathBuf,
    },
}

fn main() -> Result<()> {
    // Before any tensor exists, as `import torch_neuronx` does in Python: the backend library
    // TREETRAIN_PRIVATEUSE1_LIB names registers its device now. `env` reports a failure; every
    // other command stops on it.
    let backend = treetrain::device::privateuse1::load_from_env();
    // And before anything asks libtorch about CUDA (it caches the first answer): the CUDA
    // library TREETRAIN_TORCH_CUDA names.
    let cuda = treetrain::device::load_torch_cuda_from_env();
    // A failed allocation inside a step unwinds to the trainer, which returns it as an
    // out-of-memory error: print libtorch's one line, not its C++ frames, on the way.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        match info.payload_as_str().and_then(treetrain::train::allocation_failure) {
            Some(line) => eprintln!("treetrain: an allocation failed inside libtorch: {line}"),
            None => default_hook(info),
        }
    }));
    let command = Cli::parse().command;
    if !matches!(command, Command::Env { check_device: None, .. }) {
        backend?;
        cuda.transpose()?;
    }
    match command {
        Command::Env {
            check_device: Some(device),
            ..
        } => cli::check_device(device),
        Command::Env { json, .. } => cli::env(json),
        Command::Score(args) => cli::score::run(&args),
        Command::Render(args) => cli::render::run(&args),
        Command::Convert(args) => cli::convert::run(&args),
        Command::Sft(args) => cli::train::sft(&args),
        Command::Grpo(args) => cli::train::grpo(&args),
        Command::Generate(args) => cli::generate::run(&args),
        Command::Pack(args) => cli::pack::run(&args),
        Command::Shapes(args) => cli::shapes::run(&args),
        Command::Launch(args) => cli::launch::run(&args),
        Command::MakeShippedData { out } => cli::make_shipped_data(&out),
        Command::Demo { out } => cli::demo(&out),
    }
}
