//! LoRA vs full fine-tuning: memory and time of one SFT step (forward, NLL through the chunked LM
//! head, backward, AdamW update) on the same model and tokens.
//!
//! cargo bench --bench lora -- [--config benches/configs/smollm2-135m.json] [--tokens 1024]
//!     [--r 16] [--repeats 5]
//!
//! Default: a random model with SmolLM2-135M's published config, fp32 on CPU, one packed row of
//! 1024 tokens, LoRA r = 16 on every linear layer (all-linear). Prints the training state each
//! side holds (trainable weights, gradients, AdamW moments: counted exactly), the resident-memory
//! peak of a first step above what was resident before it (the optimizer state allocated
//! included; CPU, measured), and step times measured interleaved (full, LoRA, full, LoRA, ...),
//! with the median of the pairwise ratios. Under `cargo test` a seconds-long smoke run on the
//! shipped tiny model.

mod common;

use clap::Parser;

use std::time::Instant;

use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::model::lora::{LoraConfig, TargetModules};
use treetrain::model::{AttentionLayout, HfConfig, LoadOptions, LogprobChunks, Model, target_logprobs};
use treetrain::train::{AdamW, AdamWConfig};
use treetrain::util::SplitMix64;

/// The LoRA bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Tokens of the packed row (a full run).
    #[arg(long, default_value_t = 1024)]
    tokens: i64,
    /// Interleaved full / LoRA pairs (a full run).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// The adapter's rank.
    #[arg(long = "r", default_value_t = 16)]
    r: i64,
}

fn main() {
    let cli = Cli::parse();
    let args = &cli.common;
    let root = &common::root();
    let (config, tokens, repeats) = match args.full {
        true => (
            args.config_file(root.join("benches/configs/smollm2-135m.json")),
            cli.tokens,
            cli.repeats,
        ),
        false => (root.join("datasets/tiny-qwen3/config.json"), 64, 1),
    };
    let r = cli.r;
    let hf = HfConfig::from_file(&config).expect("config.json");
    let make = || {
        let opts = LoadOptions {
            dtype: Some(Kind::Float),
            device: Device::Cpu,
        };
        Model::seeded(hf.clone(), opts, 1, 0.02).expect("model")
    };
    let full = make();
    let mut lora = make();
    let lora_config = LoraConfig {
        r,
        lora_alpha: 2.0 * r as f64,
        target_modules: TargetModules::AllLinear,
        ..LoraConfig::default()
    };
    lora.add_lora(lora_config).expect("adapter");
    let vocab = full.lm.config.vocab_size as u64;
    let mut rng = SplitMix64::new(5);
    let ids: Vec<i64> = (0..tokens).map(|_| rng.below(vocab) as i64).collect();
    println!(
        "one SFT step, {} ({:.1} M parameters), fp32 CPU, {tokens} tokens, {} threads",
        config
            .file_name()
            .map_or("?".into(), |f| f.to_string_lossy().into_owned()),
        full.lm.config.num_parameters() as f64 / 1e6,
        tch::get_num_threads()
    );
    let mut sides = [
        Side::new("full fine-tune", &full),
        Side::new(&format!("LoRA r={r} all-linear"), &lora),
    ];
    for side in sides.iter_mut() {
        side.first_step_peak(&ids);
    }
    // Interleaved: full, LoRA, full, LoRA, ...; the ratio is taken within each pair.
    let mut ratios = Vec::new();
    for _ in 0..repeats {
        let a = sides[0].timed_step(&ids);
        let b = sides[1].timed_step(&ids);
        ratios.push(a / b);
    }
    let mut result = serde_json::json!({"config": config.display().to_string(), "tokens": tokens, "r": r});
    report(&sides, &ratios, &mut result);
    args.write_result("lora", &result);
}

/// Prints each side's state sizes, peak and step time, and the ratios, into `result` too.
fn report(sides: &[Side<'_>], ratios: &[f64], result: &mut serde_json::Value) {
    println!(
        "{:<26}{:>14}{:>14}{:>14}{:>16}{:>12}",
        "", "trainable", "grads", "AdamW state", "first-step peak", "step ms"
    );
    for s in sides {
        let (p, g, o) = s.state_bytes();
        println!(
            "{:<26}{:>11.1} MB{:>11.1} MB{:>11.1} MB{:>13.1} MiB{:>12.1}",
            s.name,
            p / 1e6,
            g / 1e6,
            o / 1e6,
            s.peak_mib,
            common::median(&s.times)
        );
        result[&s.name] = serde_json::json!({"trainable_bytes": p, "grad_bytes": g, "optimizer_bytes": o,
            "first_step_peak_mib": s.peak_mib, "step_ms_median": common::median(&s.times)});
    }
    let ratio = common::median(ratios);
    println!(
        "first-step peak: LoRA {:.2}x lower; step time full / LoRA (median of {} interleaved pairs): {ratio:.2}",
        sides[0].peak_mib / sides[1].peak_mib,
        ratios.len()
    );
    result["peak_ratio_full_over_lora"] = (sides[0].peak_mib / sides[1].peak_mib).into();
    result["time_ratio_full_over_lora"] = ratio.into();
}

struct Side<'a> {
    name: String,
    model: &'a Model,
    adamw: Option<AdamW>,
    peak_mib: f64,
    times: Vec<f64>,
}

impl<'a> Side<'a> {
    fn new(name: &str, model: &'a Model) -> Self {
        Side {
            name: name.into(),
            model,
            adamw: None,
            peak_mib: 0.0,
            times: Vec::new(),
        }
    }

    /// Resident memory added by creating the optimizer and running one step (MiB).
    fn first_step_peak(&mut self, ids: &[i64]) {
        common::allocator(common::AllocatorMode::Measure);
        let base = common::status_kib("VmRSS:");
        common::reset_peak_rss();
        self.adamw = Some(AdamW::new(self.model.trainable(), AdamWConfig::default()));
        self.step(ids);
        self.peak_mib = (common::status_kib("VmHWM:") - base) / 1024.0;
        common::allocator(common::AllocatorMode::Time);
    }

    fn timed_step(&mut self, ids: &[i64]) -> f64 {
        let t = Instant::now();
        self.step(ids);
        let ms = t.elapsed().as_secs_f64() * 1e3;
        self.times.push(ms);
        ms
    }

    fn step(&mut self, ids: &[i64]) {
        let n = ids.len() as i64;
        let input = Tensor::from_slice(ids).view([1, n]);
        let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
        let lm = &self.model.lm;
        let hidden = lm
            .forward_hidden(&input, &pos, &AttentionLayout::Causal)
            .expect("forward");
        let h = hidden.squeeze_dim(0).narrow(0, 0, n - 1);
        let targets = Tensor::from_slice(&ids[1..]);
        let lp = target_logprobs(&h, lm.lm_head_weight(), &targets, LogprobChunks::default()).expect("head");
        (-lp.mean(Kind::Float)).backward();
        let adamw = self.adamw.as_mut().expect("optimizer");
        adamw.step(1e-4).expect("update");
        adamw.zero_grad();
    }

    /// Bytes of trainable weights, their gradients and AdamW's two f32 moments.
    fn state_bytes(&self) -> (f64, f64, f64) {
        let vars = self.model.trainable().variables();
        let p: f64 = vars
            .values()
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as f64)
            .sum();
        let g: f64 = vars
            .values()
            .map(|t| t.grad())
            .filter(Tensor::defined)
            .map(|g| (g.numel() * g.kind().elt_size_in_bytes()) as f64)
            .sum();
        let o: f64 = vars.values().map(|t| (2 * 4 * t.numel()) as f64).sum();
        (p, g, o)
    }
}
