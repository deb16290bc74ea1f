//! Training memory at real size: the resident-memory peak of one SFT step (forward, NLL,
//! backward; the path `SftTrainer` takes) with the LM head whole or in chunks, and with layer
//! activations kept or recomputed (`gradient_checkpointing`).
//!
//! cargo bench --bench memory -- [--config benches/configs/smollm2-135m.json] [--tokens 4096]
//!
//! Default: a random model with SmolLM2-135M's published config, fp32 CPU, one packed row of
//! 4,096 random tokens (4 sequences of 1,024). Each variant's peak is the resident-set growth
//! of one step above what was resident before it (large tensors on their own mappings, so the
//! peak is the step's own), gradients already allocated by a warm-up step. Under `cargo test` a
//! seconds-long smoke run on the shipped tiny model.

mod common;

use clap::Parser;

use std::time::Instant;

use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::model::{
    Activations, AttentionLayout, HfConfig, LoadOptions, LogprobChunks, Model, nll_backward_chunked, target_logprobs,
};
use treetrain::util::SplitMix64;

/// How the step computes the loss and keeps activations.
#[derive(Clone, Copy)]
struct Variant {
    name: &'static str,
    /// Tokens per LM-head chunk in backward (`None`: the head's graph kept whole).
    head_chunk: Option<i64>,
    activations: Activations,
}

const VARIANTS: [Variant; 3] = [
    Variant {
        name: "head whole, activations kept",
        head_chunk: None,
        activations: Activations::Kept,
    },
    Variant {
        name: "head in 1024-token chunks",
        head_chunk: Some(1024),
        activations: Activations::Kept,
    },
    Variant {
        name: "chunks + checkpointing",
        head_chunk: Some(1024),
        activations: Activations::Recomputed,
    },
];

/// The memory bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Tokens of the step (a full run).
    #[arg(long, default_value_t = 4096)]
    tokens: i64,
}

fn main() {
    let cli = Cli::parse();
    let args = &cli.common;
    let root = &common::root();
    let (config, tokens) = match args.full {
        true => (
            args.config_file(root.join("benches/configs/smollm2-135m.json")),
            cli.tokens,
        ),
        false => (root.join("datasets/tiny-qwen3/config.json"), 64),
    };
    let hf = HfConfig::from_file(&config).expect("config.json");
    let opts = LoadOptions {
        dtype: Some(Kind::Float),
        device: Device::Cpu,
    };
    let model = Model::seeded(hf, opts, 1, 0.02).expect("model");
    let mut rng = SplitMix64::new(9);
    let vocab = model.lm.config.vocab_size as u64;
    let ids: Vec<i64> = (0..tokens).map(|_| rng.below(vocab) as i64).collect();
    let lengths = vec![tokens / 4; 4];
    println!(
        "one SFT step, {} ({:.1} M parameters, vocab {}), fp32 CPU, {tokens} tokens packed as {lengths:?}",
        config
            .file_name()
            .map_or("?".into(), |f| f.to_string_lossy().into_owned()),
        model.lm.config.num_parameters() as f64 / 1e6,
        vocab
    );
    step(&model, &ids, &lengths, VARIANTS[1]);
    println!("{:<32}{:>14}{:>12}", "variant", "peak MiB", "step s");
    let mut rows = Vec::new();
    for v in VARIANTS {
        common::allocator(common::AllocatorMode::Measure);
        let base = common::status_kib("VmRSS:");
        common::reset_peak_rss();
        let t = Instant::now();
        let loss = step(&model, &ids, &lengths, v);
        let secs = t.elapsed().as_secs_f64();
        let peak = (common::status_kib("VmHWM:") - base) / 1024.0;
        common::allocator(common::AllocatorMode::Time);
        println!("{:<32}{peak:>14.0}{secs:>12.1}   (loss {loss:.4})", v.name);
        rows.push(serde_json::json!({"variant": v.name, "peak_mib": peak, "step_s": secs, "loss": loss}));
    }
    let result = serde_json::json!({"config": config.display().to_string(), "tokens": tokens, "variants": rows});
    args.write_result("memory", &result);
}

/// One forward + backward of the mean NLL of the packed row; the gradients are cleared after.
fn step(model: &Model, ids: &[i64], lengths: &[i64], v: Variant) -> f64 {
    let n = ids.len() as i64;
    let input = Tensor::from_slice(ids).view([1, n]);
    let (layout, pos) = AttentionLayout::packed_row(lengths, Device::Cpu).expect("layout");
    let targets = Tensor::from_slice(&ids[1..]);
    let head = model.lm.lm_head_weight();
    let loss = model
        .lm
        .forward_backward(&input, &pos, &layout, v.activations, |hidden| {
            let h = hidden.view([n, -1]).narrow(0, 0, n - 1);
            let scale = 1.0 / (n - 1) as f64;
            match v.head_chunk {
                Some(tokens) => {
                    let chunks = LogprobChunks {
                        tokens,
                        ..LogprobChunks::default()
                    };
                    let (sum, rest) = nll_backward_chunked(&h, head, &targets, scale, chunks)?;
                    Ok((rest, sum * scale))
                }
                None => {
                    let nll = -target_logprobs(&h, head, &targets, LogprobChunks::default())?.sum(Kind::Float) * scale;
                    let value = nll.double_value(&[]);
                    Ok((Some(nll), value))
                }
            }
        })
        .expect("step");
    treetrain::train::zero_grads(&model.vs);
    loss
}
