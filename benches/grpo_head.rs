//! One GRPO update's peak memory and time with the LM head fused (`LmHead::Fused`: each chunk
//! of logits recomputed and back-propagated in turn) against the head's graph kept until
//! backward (`LmHead::Kept`), interleaved and repeated.
//!
//! cargo bench --bench grpo_head -- [--config benches/configs/smollm2-135m.json]
//!     [--length 8192] [--rollouts 4] [--shared 0.9375] [--repeats 2]
//!
//! Default: a random model with SmolLM2-135M's published config, fp32 CPU, gradient
//! checkpointing on; one group of 4 rollouts of 8,192 tokens whose first 93.75% is one shared
//! prompt (the release benchmark's f = 0.9375), tree-packed into one row, every completion
//! token a loss term. Peaks are the resident-set growth of the update above what was resident
//! before it (gradients allocated by a warm-up update first). Under `cargo test` a
//! seconds-long smoke run on the shipped tiny model.

mod common;

use std::time::Instant;

use clap::Parser;
use tch::Kind;
use treetrain::device::Device;
use treetrain::grpo::{GrpoObjective, LmHead, accumulate_gradients, pack_rollouts};
use treetrain::model::{Activations, HfConfig, LoadOptions, Model};
use treetrain::pack::{PackedRow, Packing, Rollout};
use treetrain::util::SplitMix64;

/// The bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Tokens of each rollout (a full run).
    #[arg(long, default_value_t = 8192)]
    length: usize,
    /// Rollouts sharing the prompt.
    #[arg(long, default_value_t = 4)]
    rollouts: usize,
    /// Share of each rollout that is the shared prompt.
    #[arg(long, default_value_t = 0.9375)]
    shared: f64,
    /// Measurements of each head, interleaved.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
}

fn main() {
    let cli = Cli::parse();
    let args = &cli.common;
    let root = &common::root();
    let (config, length) = match args.full {
        true => (
            args.config_file(root.join("benches/configs/smollm2-135m.json")),
            cli.length,
        ),
        false => (root.join("datasets/tiny-qwen3/config.json"), 256),
    };
    let hf = HfConfig::from_file(&config).expect("config.json");
    let opts = LoadOptions {
        dtype: Some(Kind::Float),
        device: Device::Cpu,
    };
    let model = Model::seeded(hf, opts, 1, 0.02).expect("model");
    let vocab = model.lm.config.vocab_size;
    let rows = rows(vocab, length, cli.rollouts, cli.shared);
    let (forwarded, terms): (usize, usize) = (
        rows.iter().map(PackedRow::len).sum(),
        rows.iter().map(|r| r.token_index.len()).sum(),
    );
    println!(
        "one GRPO update, {} ({:.1} M parameters, vocab {vocab}), fp32 CPU, gradient checkpointing; {} rollouts x {length} tokens, {:.2}% shared: {forwarded} tokens forwarded, {terms} loss terms",
        config
            .file_name()
            .map_or("?".into(), |f| f.to_string_lossy().into_owned()),
        model.lm.config.num_parameters() as f64 / 1e6,
        cli.rollouts,
        100.0 * cli.shared,
    );
    update(&model, &rows, LmHead::Fused);
    println!("{:<10}{:>14}{:>12}", "head", "peak MiB", "update s");
    let mut results = Vec::new();
    for _ in 0..cli.repeats.max(1) {
        for head in [LmHead::Kept, LmHead::Fused] {
            common::allocator(common::AllocatorMode::Measure);
            let base = common::status_kib("VmRSS:");
            common::reset_peak_rss();
            let t = Instant::now();
            let loss = update(&model, &rows, head);
            let secs = t.elapsed().as_secs_f64();
            let peak = (common::status_kib("VmHWM:") - base) / 1024.0;
            common::allocator(common::AllocatorMode::Time);
            println!("{:<10}{peak:>14.0}{secs:>12.1}   (loss {loss:.6})", format!("{head:?}"));
            results.push((head, peak, secs));
        }
    }
    // The median over the interleaved (kept, fused) pairs of each pair's ratio.
    let ratio = |field: fn(&(LmHead, f64, f64)) -> f64| {
        let mut r: Vec<f64> = results.chunks(2).map(|p| field(&p[1]) / field(&p[0])).collect();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    let (peak_ratio, time_ratio) = (ratio(|r| r.1), ratio(|r| r.2));
    println!("fused / kept (median of the pairs): peak {peak_ratio:.3}, time {time_ratio:.3}");
    let json = |(head, peak, secs): &(LmHead, f64, f64)| serde_json::json!({"head": format!("{head:?}"), "peak_mib": peak, "update_s": secs});
    let result = serde_json::json!({
        "config": config.display().to_string(), "length": length, "rollouts": cli.rollouts,
        "shared": cli.shared, "forwarded_tokens": forwarded, "loss_terms": terms,
        "runs": results.iter().map(json).collect::<Vec<_>>(),
        "peak_ratio": peak_ratio, "time_ratio": time_ratio,
    });
    args.write_result("grpo_head", &result);
}

/// One group of `n` rollouts of `length` random tokens sharing their first `shared` part,
/// tree-packed; old log-probs near a random model's (`-ln vocab`), advantages of both signs.
fn rows(vocab: i64, length: usize, n: usize, shared: f64) -> Vec<PackedRow> {
    let mut rng = SplitMix64::new(9);
    let prompt_len = (length as f64 * shared) as usize;
    let prompt: Vec<i64> = (0..prompt_len).map(|_| rng.below(vocab as u64) as i64).collect();
    let rollouts = (0..n)
        .map(|k| {
            let mut ids = prompt.clone();
            ids.extend((prompt_len..length).map(|_| rng.below(vocab as u64) as i64));
            Rollout {
                completion_mask: (0..length).map(|i| u8::from(i >= prompt_len)).collect(),
                old_log_probs: vec![-(vocab as f32).ln(); length],
                input_ids: ids,
                advantage: if k % 2 == 0 { 1.0 } else { -1.0 },
                group_id: "g".into(),
            }
        })
        .collect();
    pack_rollouts(rollouts, Packing::Tree, 2 * length + n * length).expect("packing")
}

/// One update's forward and backward over `rows`; the gradients are cleared after.
fn update(model: &Model, rows: &[PackedRow], lm_head: LmHead) -> f64 {
    let objective = GrpoObjective {
        lm_head,
        activations: Activations::Recomputed,
        ..GrpoObjective::default()
    };
    let stats = accumulate_gradients(&model.lm, None, rows, &objective).expect("update");
    treetrain::train::zero_grads(&model.vs);
    stats.loss
}
