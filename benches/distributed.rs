//! Data parallelism's cost: an SFT step on 2 ranks (c10d Gloo on loopback) split into compute,
//! communication the compute did not hide and waiting for the slower rank, the bytes moved per
//! step, against one process on the same global batch, interleaved (1 rank, 2 ranks of each
//! `fsdp` mode, 1 rank, ...); per rank the bytes of parameters, gradients and optimizer state
//! it holds, its peak resident memory and the peaks of all ranks summed. `no_shard` runs twice,
//! its gradient buckets all-reduced during the last backward and after it
//! (`overlap_grad_reduce`), and `full_shard` twice, with its prefetching and without
//! (`fsdp_config`): the communication time the overlapping run no longer waits for is the
//! fraction hidden behind compute.
//!
//! cargo bench --bench distributed -- [--steps 10] [--rounds 3] [--modes no_shard,full_shard]
//!     [--gradient-checkpointing] [--config config.json | --model DIR]
//!
//! Two ranks share the cores one process uses (each rank runs cores / ranks libtorch threads,
//! the process all of them), so this measures the overhead of data parallelism, not a speedup:
//! a speedup needs hardware per rank that this CPU bench does not give. `no_shard` all-reduces
//! 4 MiB buckets as each layer's backward ends; `shard_grad_op` reduce-scatters after backward
//! (one reduce-scatter a sharding unit); `full_shard` reduce-scatters each layer as its
//! backward ends, overlapping the next.
//! The shipped tiny model (or a random model of a published config), shipped SFT data, bfd rows of 256 tokens, 8 rows a global step.
//! Under `cargo test` a 2-step smoke run of one round.

mod common;

use clap::Parser;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use treetrain::sft::{PackingStrategy, SftConfig, SftTrainer, TokenizeOptions};
use treetrain::train::{
    BackwardPrefetch, DataSettings, Fsdp, FsdpConfig, OptimizerSettings, ParallelSettings, PrecisionSettings,
    TrainConfig, Trainer,
};

const WORKER: &str = "TREETRAIN_BENCH_DIST_WORKER";
/// The model folder the parent hands its workers.
const WORKER_MODEL: &str = "TREETRAIN_BENCH_DIST_MODEL";
/// The side the workers run ([`Side::name`]).
const WORKER_FSDP: &str = "TREETRAIN_BENCH_DIST_FSDP";
/// Set when the workers recompute activations.
const WORKER_CHECKPOINTING: &str = "TREETRAIN_BENCH_DIST_CHECKPOINTING";

/// One side of the comparison: a world size and an `fsdp` mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    One,
    NoShard,
    /// `no_shard` with its gradients all-reduced after backward (`overlap_grad_reduce = false`).
    NoShardAfter,
    ShardGradOp,
    FullShard,
    /// `full_shard` without prefetching: every gather and reduction waited for in place.
    FullShardUnhidden,
}

impl Side {
    const ALL: [Side; 6] = [
        Side::One,
        Side::NoShard,
        Side::NoShardAfter,
        Side::ShardGradOp,
        Side::FullShard,
        Side::FullShardUnhidden,
    ];

    fn name(self) -> &'static str {
        match self {
            Side::One => "one_process",
            Side::NoShard => "no_shard",
            Side::NoShardAfter => "no_shard_after_backward",
            Side::ShardGradOp => "shard_grad_op",
            Side::FullShard => "full_shard",
            Side::FullShardUnhidden => "full_shard_no_prefetch",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Side::One => "1 process, batch 8",
            Side::NoShard => "2 ranks no_shard, batch 4",
            Side::NoShardAfter => "2 ranks no_shard, reduce after",
            Side::ShardGradOp => "2 ranks shard_grad_op, batch 4",
            Side::FullShard => "2 ranks full_shard, batch 4",
            Side::FullShardUnhidden => "2 ranks full_shard unprefetched",
        }
    }

    fn ranks(self) -> usize {
        if self == Side::One { 1 } else { 2 }
    }

    /// The workers' settings: `fsdp`, `fsdp_config`, `overlap_grad_reduce`.
    fn settings(self) -> (Fsdp, FsdpConfig, bool) {
        let unhidden = FsdpConfig {
            forward_prefetch: false,
            backward_prefetch: BackwardPrefetch::NoPrefetch,
        };
        match self {
            Side::One | Side::NoShard => (Fsdp::NoShard, FsdpConfig::default(), true),
            Side::NoShardAfter => (Fsdp::NoShard, FsdpConfig::default(), false),
            Side::ShardGradOp => (Fsdp::ShardGradOp, FsdpConfig::default(), true),
            Side::FullShard => (Fsdp::FullShard, FsdpConfig::default(), true),
            Side::FullShardUnhidden => (Fsdp::FullShard, unhidden, true),
        }
    }

    fn named(name: &str) -> Option<Side> {
        Side::ALL.into_iter().find(|s| s.name() == name)
    }
}

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
    /// Every rank's peak resident memory summed (what the run asks of one host), MiB.
    #[serde(default)]
    peak_rss_all_mib: f64,
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
    /// The sides to run, comma separated (`one_process`, `no_shard`,
    /// `no_shard_after_backward`, `shard_grad_op`, `full_shard`, `full_shard_no_prefetch`);
    /// default all.
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Recompute layer activations in backward (every side).
    #[arg(long)]
    gradient_checkpointing: bool,
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
    let sides: Vec<Side> = match cli.modes.is_empty() {
        true => Side::ALL.to_vec(),
        false => cli
            .modes
            .iter()
            .map(|m| Side::named(m).expect("a side's name"))
            .collect(),
    };
    let mut runs: Vec<Vec<Measured>> = vec![Vec::new(); sides.len()];
    for _ in 0..rounds {
        for (side, runs) in sides.iter().zip(&mut runs) {
            runs.push(run(*side, steps, &model, cli.gradient_checkpointing));
        }
    }
    println!(
        "SFT step, {} fp32, 8 rows of 256 a global step, {steps} steps after 2 warm-ups, {rounds} interleaved rounds{}",
        model.display(),
        if cli.gradient_checkpointing {
            ", gradient checkpointing"
        } else {
            ""
        }
    );
    println!(
        "{:<34}{:>9}{:>11}{:>10}{:>10}{:>13}{:>10}{:>10}{:>10}{:>10}{:>10}",
        "",
        "step s",
        "compute s",
        "comm s",
        "wait s",
        "bytes/step",
        "param MB",
        "grad MB",
        "optim MB",
        "peak MiB",
        "all MiB"
    );
    for (side, runs) in sides.iter().zip(&runs) {
        let m = median_of(runs);
        println!(
            "{:<34}{:>9.3}{:>11.3}{:>10.4}{:>10.4}{:>13.0}{:>10.1}{:>10.1}{:>10.1}{:>10.0}{:>10.0}",
            side.label(),
            m.step_s,
            m.compute_s,
            m.all_reduce_s,
            m.wait_s,
            m.bytes_per_step,
            m.param_bytes / 1e6,
            m.grad_bytes / 1e6,
            m.optimizer_bytes / 1e6,
            m.peak_rss_mib,
            m.peak_rss_all_mib
        );
    }
    let mut result = serde_json::json!({"steps": steps, "rounds": rounds, "model": model.display().to_string()});
    for (side, runs) in sides.iter().zip(&runs) {
        result[side.name()] = serde_json::json!(runs);
    }
    compare(&sides, &runs, &mut result);
    args.write_result("distributed", &result);
}

/// Each side against its baseline, printed and added to `result`: step time (the median of
/// ratios paired within rounds), per-rank state and peak memory, and the share of
/// communication that `no_shard`'s overlapped buckets and `full_shard`'s prefetching hide.
fn compare(sides: &[Side], runs: &[Vec<Measured>], result: &mut serde_json::Value) {
    let of = |side: Side| sides.iter().position(|s| *s == side).map(|i| &runs[i]);
    let steps = [
        (Side::NoShard, Side::One),
        (Side::NoShard, Side::NoShardAfter),
        (Side::ShardGradOp, Side::One),
        (Side::FullShard, Side::NoShard),
        (Side::FullShardUnhidden, Side::FullShard),
    ];
    for (side, base) in steps {
        let (Some(a), Some(b)) = (of(side), of(base)) else {
            continue;
        };
        let pairs: Vec<f64> = a.iter().zip(b).map(|(a, b)| a.step_s / b.step_s).collect();
        let ratio = common::median(&pairs);
        println!(
            "step time {} / {}: {ratio:.2} (pairs {pairs:.2?})",
            side.name(),
            base.name()
        );
        result[format!("{}_vs_{}_step_ratio", side.name(), base.name())] = ratio.into();
    }
    for side in [Side::ShardGradOp, Side::FullShard] {
        let (Some(a), Some(b)) = (of(side), of(Side::NoShard)) else {
            continue;
        };
        let (a, b) = (median_of(a), median_of(b));
        let state = a.state_bytes() / b.state_bytes();
        let (peak, all) = (a.peak_rss_mib / b.peak_rss_mib, a.peak_rss_all_mib / b.peak_rss_all_mib);
        println!(
            "{} / no_shard: per-rank state (parameters + gradients + optimizer) {state:.2}; peak resident memory {peak:.2} (all ranks {all:.2})",
            side.name()
        );
        result[format!("{}_vs_no_shard_state_ratio", side.name())] = state.into();
        result[format!("{}_vs_no_shard_peak_ratio", side.name())] = peak.into();
    }
    let hidden = [
        (Side::NoShard, Side::NoShardAfter, "after backward"),
        (Side::FullShard, Side::FullShardUnhidden, "unprefetched"),
    ];
    for (side, base, what) in hidden {
        let (Some(a), Some(b)) = (of(side), of(base)) else {
            continue;
        };
        // Waiting for the slower rank counts as communication on both sides: the overlapped
        // side cannot tell it apart.
        let comm = |m: &Measured| m.all_reduce_s + m.wait_s;
        let (a, b) = (median_of(a), median_of(b));
        let fraction = 1.0 - comm(&a) / comm(&b).max(1e-9);
        println!(
            "{} communication hidden behind compute: {:.0}% ({:.3} s waited of {:.3} s {what})",
            side.name(),
            fraction * 100.0,
            comm(&a),
            comm(&b)
        );
        result[format!("{}_hidden_fraction", side.name())] = fraction.into();
    }
}

/// One run of `ranks` worker processes (rank 0 hosting the store on loopback); rank 0's numbers.
fn run(side: Side, steps: u64, model: &Path, checkpointing: bool) -> Measured {
    let ranks = side.ranks();
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
                .env(WORKER_FSDP, side.name())
                .env(WORKER_CHECKPOINTING, if checkpointing { "1" } else { "" })
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
    let measured: Vec<Measured> = outputs
        .iter()
        .map(|o| {
            let text = String::from_utf8_lossy(&o.stdout);
            serde_json::from_str(text.lines().last().expect("a rank prints its numbers")).expect("numbers")
        })
        .collect();
    Measured {
        peak_rss_all_mib: measured.iter().map(|m| m.peak_rss_mib).sum(),
        ..measured[0]
    }
}

/// A worker: 2 warm-up steps, then `steps` timed ones; each rank prints its medians as JSON.
fn worker() {
    let steps: u64 = std::env::var(WORKER).expect("steps").parse().expect("steps");
    let world: usize = std::env::var("WORLD_SIZE").map_or(1, |w| w.parse().expect("WORLD_SIZE"));
    let root = &common::root();
    let side = std::env::var(WORKER_FSDP)
        .ok()
        .and_then(|n| Side::named(&n))
        .expect("a side");
    let (fsdp, fsdp_config, overlap_grad_reduce) = side.settings();
    let cfg = SftConfig {
        train: TrainConfig {
            model: std::env::var(WORKER_MODEL).expect("model folder"),
            data: DataSettings {
                dataset: root.join("datasets/sft/train.parquet"),
                ..Default::default()
            },
            optimizer: OptimizerSettings {
                learning_rate: 2e-3,
                ..Default::default()
            },
            precision: PrecisionSettings {
                gradient_checkpointing: std::env::var(WORKER_CHECKPOINTING).is_ok_and(|v| v == "1"),
                ..Default::default()
            },
            parallel: ParallelSettings {
                distributed_timeout_s: 120.0,
                fsdp,
                fsdp_config,
                overlap_grad_reduce,
                ..Default::default()
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
    println!("{}", serde_json::to_string(&median_of(&per_step)).expect("json"));
}

/// What this rank holds between steps (the world's account of it: whole parameters,
/// gradients and optimizer state, or this rank's shards of them), and its peak resident memory
/// so far.
fn held(t: &SftTrainer) -> Measured {
    let held = t.core().world.held().expect("the trainer says what it holds");
    Measured {
        step_s: 0.0,
        all_reduce_s: 0.0,
        wait_s: 0.0,
        compute_s: 0.0,
        bytes_per_step: 0.0,
        param_bytes: held.parameters as f64,
        grad_bytes: held.gradients as f64,
        optimizer_bytes: held.optimizer as f64,
        peak_rss_mib: common::status_kib("VmHWM:") / 1024.0,
        peak_rss_all_mib: 0.0,
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
        peak_rss_all_mib: field(|m| m.peak_rss_all_mib),
    }
}
