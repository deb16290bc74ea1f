//! Data parallelism's cost: an SFT step on 2 ranks (c10d Gloo on loopback) split into compute,
//! gradient communication and waiting for the slower rank, the bytes moved per step, against
//! one process on the same global batch, interleaved (1 rank, 2 ranks `no_shard`, 2 ranks
//! `shard_grad_op`, 1 rank, ...); per rank the bytes of parameters, gradients and optimizer
//! state it holds and its peak resident memory.
//!
//! cargo bench --bench distributed -- [--steps 10] [--rounds 3] [--config config.json | --model DIR]
//!
//! On this 2-core machine two ranks share the cores one process uses (1 libtorch thread each
//! against 2), so this measures the overhead of data parallelism, not a speedup; scaling is
//! measured on several accelerators (scripts/gpu-check.sh). Gradients are reduced after
//! backward (4 MiB all-reduce buckets, or one reduce-scatter a sharding unit); communication
//! does not overlap backward (not implemented).
//! The shipped tiny model (or a random model of a published config), shipped SFT data, bfd rows of 256 tokens, 8 rows a global step.
//! Under `cargo test` a 2-step smoke run of one round.

mod common;

use clap::Parser;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use treetrain::sft::{PackingStrategy, SftConfig, SftTrainer, TokenizeOptions};
use treetrain::train::{Fsdp, TrainConfig, Trainer};

const WORKER: &str = "TREETRAIN_BENCH_DIST_WORKER";
/// The model folder the parent hands its workers.
const WORKER_MODEL: &str = "TREETRAIN_BENCH_DIST_MODEL";
/// The `fsdp` setting of the workers (`no_shard`, `shard_grad_op`).
const WORKER_FSDP: &str = "TREETRAIN_BENCH_DIST_FSDP";

/// What rank 0 of a run measured, per step (medians over the measured steps).
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Measured {
    step_s: f64,
    all_reduce_s: f64,
    wait_s: f64,
    compute_s: f64,
    bytes_per_step: f64,
    /// Rank 0's parameters, gradients and optimizer state (moments, master weights), bytes.
    #[serde(default)]
    param_bytes: f64,
    #[serde(default)]
    grad_bytes: f64,
    #[serde(default)]
    optimizer_bytes: f64,
    /// Rank 0's peak resident memory over the run, MiB.
    #[serde(default)]
    peak_rss_mib: f64,
}

impl Measured {
    /// Parameters + gradients + optimizer state, bytes.
    fn state_bytes(&self) -> f64 {
        self.param_bytes + self.grad_bytes + self.optimizer_bytes
    }
}

/// The data-parallel bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Interleaved 1-process / 2-rank rounds (a full run).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

fn main() {
    if std::env::var_os(WORKER).is_some() {
        return worker();
    }
    let cli = Cli::parse();
    let args = &cli.common;
    let steps = args.steps(10, 2);
    let root = &common::root();
    let model = args.model_dir(root.join("datasets/tiny-qwen3-sft"));
    let rounds: usize = match args.full {
        true => cli.rounds,
        false => 1,
    };
    let (mut ones, mut twos, mut sharded) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        ones.push(run(1, steps, &model, Fsdp::NoShard));
        twos.push(run(2, steps, &model, Fsdp::NoShard));
        sharded.push(run(2, steps, &model, Fsdp::ShardGradOp));
    }
    let ratios = |runs: &[Measured]| -> Vec<f64> { ones.iter().zip(runs).map(|(a, b)| b.step_s / a.step_s).collect() };
    let (ratios, sharded_ratios) = (ratios(&twos), ratios(&sharded));
    println!(
        "SFT step, {} fp32, 8 rows of 256 a global step, {steps} steps after 2 warm-ups, {rounds} interleaved rounds",
        model.display()
    );
    println!(
        "{:<34}{:>9}{:>11}{:>10}{:>10}{:>13}{:>10}{:>10}{:>10}{:>10}",
        "", "step s", "compute s", "comm s", "wait s", "bytes/step", "param MB", "grad MB", "optim MB", "peak MiB"
    );
    let runs = [
        ("1 process, batch 8", &ones),
        ("2 ranks no_shard, batch 4", &twos),
        ("2 ranks shard_grad_op, batch 4", &sharded),
    ];
    for (name, runs) in runs {
        let m = median_of(runs);
        println!(
            "{name:<34}{:>9.3}{:>11.3}{:>10.4}{:>10.4}{:>13.0}{:>10.1}{:>10.1}{:>10.1}{:>10.0}",
            m.step_s,
            m.compute_s,
            m.all_reduce_s,
            m.wait_s,
            m.bytes_per_step,
            m.param_bytes / 1e6,
            m.grad_bytes / 1e6,
            m.optimizer_bytes / 1e6,
            m.peak_rss_mib
        );
    }
    let ratio = common::median(&ratios);
    let sharded_ratio = common::median(&sharded_ratios);
    println!(
        "2-rank step / 1-process step: no_shard {ratio:.2} (pairs {ratios:.2?}), shard_grad_op {sharded_ratio:.2} (pairs {sharded_ratios:.2?})"
    );
    let (two, zero2) = (median_of(&twos), median_of(&sharded));
    println!(
        "per-rank state (parameters + gradients + optimizer): shard_grad_op / no_shard {:.2}; peak resident memory {:.2}",
        zero2.state_bytes() / two.state_bytes(),
        zero2.peak_rss_mib / two.peak_rss_mib
    );
    println!(
        "all-reduce rate: {:.2} GB/s of gradient bytes per rank",
        two.bytes_per_step / two.all_reduce_s.max(1e-9) / 1e9
    );
    args.write_result(
        "distributed",
        &serde_json::json!({
            "steps": steps, "rounds": rounds, "model": model.display().to_string(), "one_process": ones, "two_ranks": twos,
            "two_ranks_shard_grad_op": sharded, "pairwise_step_ratios": ratios, "median_step_ratio": ratio,
            "shard_grad_op_pairwise_step_ratios": sharded_ratios, "shard_grad_op_median_step_ratio": sharded_ratio,
            "state_ratio_shard_grad_op": zero2.state_bytes() / two.state_bytes(),
        }),
    );
}

/// One run of `ranks` worker processes (rank 0 hosting the store on loopback); rank 0's numbers.
fn run(ranks: usize, steps: u64, model: &Path, fsdp: Fsdp) -> Measured {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let exe = std::env::current_exe().expect("bench binary");
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            let mut c = Command::new(&exe);
            c.env(WORKER, steps.to_string())
                .env(WORKER_MODEL, model)
                .env(WORKER_FSDP, fsdp.name())
                .env("OMP_NUM_THREADS", (cores / ranks).max(1).to_string())
                .stdout(Stdio::piped());
            if ranks > 1 {
                c.env("RANK", rank.to_string())
                    .env("WORLD_SIZE", ranks.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string());
            }
            c.spawn().expect("worker")
        })
        .collect();
    let outputs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("worker"))
        .collect();
    for o in &outputs {
        assert!(o.status.success(), "a worker failed: {o:?}");
    }
    let text = String::from_utf8_lossy(&outputs[0].stdout);
    serde_json::from_str(text.lines().last().expect("rank 0 prints its numbers")).expect("numbers")
}

/// A worker: 2 warm-up steps, then `steps` timed ones; rank 0 prints its medians as JSON.
fn worker() {
    let steps: u64 = std::env::var(WORKER).expect("steps").parse().expect("steps");
    let world: usize = std::env::var("WORLD_SIZE").map_or(1, |w| w.parse().expect("WORLD_SIZE"));
    let root = &common::root();
    let cfg = SftConfig {
        train: TrainConfig {
            model: std::env::var(WORKER_MODEL).expect("model folder"),
            dataset: root.join("datasets/sft/train.parquet"),
            learning_rate: 2e-3,
            distributed_timeout_s: 120.0,
            fsdp: match std::env::var(WORKER_FSDP).as_deref() {
                Ok("shard_grad_op") => Fsdp::ShardGradOp,
                _ => Fsdp::NoShard,
            },
            ..Default::default()
        },
        tokenize: TokenizeOptions {
            max_length: 256,
            ..Default::default()
        },
        packing: Some(PackingStrategy::Bfd),
        batch_size: 8 / world,
        max_steps: Some(steps + 2),
        eval_fraction: 0.0,
        ..Default::default()
    };
    let mut t = SftTrainer::new(cfg).expect("trainer");
    t.train_for(2).expect("warm-up");
    let w = &t.core().world;
    w.measure_waiting(true);
    let mut per_step = Vec::new();
    for _ in 0..steps {
        let before = t.core().world.comm_totals();
        let start = Instant::now();
        t.train_for(1).expect("step");
        let step_s = start.elapsed().as_secs_f64();
        let after = t.core().world.comm_totals();
        let all_reduce_s = after.seconds - before.seconds;
        let wait_s = after.wait_seconds - before.wait_seconds;
        per_step.push(Measured {
            step_s,
            all_reduce_s,
            wait_s,
            compute_s: step_s - all_reduce_s - wait_s,
            bytes_per_step: (after.bytes - before.bytes) as f64,
            ..held(&t)
        });
    }
    if t.core().world.is_main() {
        println!("{}", serde_json::to_string(&median_of(&per_step)).expect("json"));
    }
}

/// What rank 0 holds after a step's backward: the trained parameters, their gradients (and a
/// sharded optimizer's gradient shards, fp32), the optimizer state; and its peak resident
/// memory so far.
fn held(t: &SftTrainer) -> Measured {
    let core = t.core();
    let bytes = |t: &tch::Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as f64;
    let params: Vec<tch::Tensor> = core.model.trainable().trainable_variables();
    let param_bytes: f64 = params.iter().map(bytes).sum();
    let adamw = &core.optim.adamw;
    // Every rank's backward fills whole gradients (freed after the reduce-scatter when
    // sharded, kept and zeroed when not); a sharded step adds its fp32 gradient shards (held
    // between the reduce-scatter and the update: 0 here, after it).
    let grad_bytes = param_bytes + adamw.gradient_shard_bytes() as f64;
    Measured {
        step_s: 0.0,
        all_reduce_s: 0.0,
        wait_s: 0.0,
        compute_s: 0.0,
        bytes_per_step: 0.0,
        param_bytes,
        grad_bytes,
        optimizer_bytes: adamw.state_bytes() as f64,
        peak_rss_mib: common::status_kib("VmHWM:") / 1024.0,
    }
}

fn median_of(runs: &[Measured]) -> Measured {
    let field = |f: fn(&Measured) -> f64| common::median(&runs.iter().map(f).collect::<Vec<_>>());
    Measured {
        step_s: field(|m| m.step_s),
        all_reduce_s: field(|m| m.all_reduce_s),
        wait_s: field(|m| m.wait_s),
        compute_s: field(|m| m.compute_s),
        bytes_per_step: field(|m| m.bytes_per_step),
        param_bytes: field(|m| m.param_bytes),
        grad_bytes: field(|m| m.grad_bytes),
        optimizer_bytes: field(|m| m.optimizer_bytes),
        peak_rss_mib: field(|m| m.peak_rss_mib),
    }
}
