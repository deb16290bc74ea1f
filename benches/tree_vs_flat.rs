//! Tree vs flat packing, forward + backward of the GRPO loss, on TRL v1.16's release scenarios
//! (4 rollouts of L tokens; shared fraction f; no sharing, shared prompt, nested fork).
//!
//! cargo bench --bench tree_vs_flat -- [--config config.json | --model DIR] [--len 2048]
//!     [--repeats 5] [--warmup 2] [--device cpu|cuda[:N]] [--dtype fp32|bf16] [--json out.json]
//!     [--only NAME] [--checkpointing] [--peak-only flat|tree] [--packer-only] [--parity]
//!
//! Default: the shipped tiny Qwen3 (3.7 M parameters), L = 2048, fp32 on CPU. For the release
//! case: `--config qwen3-1.7b/config.json --len 32768 --device cuda --dtype bf16`.
//! Prints, per scenario, median ms for both packings (timed interleaved: flat, tree, flat, ...,
//! after `--warmup` steps of each), the speedup (median of the pairwise ratios), the packing
//! (token) ratio, the ideal speedup from the config (linear work per token plus causal attention
//! pairs), measured / ideal, peak memory and TRL's published tree peak where the release states
//! one; then the packer's own throughput (`--packer-only`: that alone; skipped when `--only`
//! picks scenarios), against TRL's TreeRow on the same workload when a Python with trl is
//! present (scripts/bench/trl_pack.py). The JSON is rewritten after every scenario, with TRL's
//! published token ratio, speed-up and peaks beside ours. `pairs` is the ratio of causal
//! attention score pairs alone, the bound when attention dominates the step.
//! `--checkpointing` recomputes layer activations in backward (`gradient_checkpointing`) in
//! both packings: the peak-memory columns then show what checkpointing leaves.
//! Peaks: on the CPU the resident-set growth of one more step; on CUDA the caching allocator's
//! peak *allocated* bytes over the timed steps, weights included (TRL's
//! `max_memory_allocated`), read around each step in the timing process
//! (`libtreetrain_cuda_memory.so`).
//! `--peak-only SIDE` skips the timing and measures one step of that packing per scenario.
//! `--parity` skips the timing and sets tree against flat on the run's device and dtype
//! (per-term log-probs, loss, gradient norm, with the tolerances it states) and times the first
//! step at new lengths against its repeat (the kernel plans a new length builds).

mod common;

use clap::Parser;

use std::path::PathBuf;
use std::time::Instant;

use tch::Kind;
use treetrain::device::Device;
use treetrain::grpo::{GrpoLoss, GrpoObjective, TermWeights, grpo_loss_backward};
use treetrain::model::{Activations, HfConfig, LoadOptions, Model};
use treetrain::pack::{PackedRow, PrefixTree, Rollout, pack_flat};
use treetrain::util::SplitMix64;

struct Args {
    config: PathBuf,
    len: usize,
    repeats: usize,
    warmup: usize,
    device: Device,
    dtype: Kind,
    json: PathBuf,
    only: Option<String>,
    smoke: bool,
    activations: Activations,
    peak_only: Option<Side>,
    packer_only: bool,
    parity: bool,
}

/// One packing of the same rollouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Side {
    Flat,
    Tree,
}

/// The tree-vs-flat bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Tokens per rollout (L).
    #[arg(long, default_value_t = 2048)]
    len: usize,
    /// Timed pairs per scenario.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Untimed pairs first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Where the JSON goes (default `target/bench/tree_vs_flat.json`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only the scenarios whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Recompute layer activations in backward, in both packings.
    #[arg(long)]
    checkpointing: bool,
    /// No timing: one step of this packing per scenario, for its peak memory.
    #[arg(long, value_enum)]
    peak_only: Option<Side>,
    /// The packer's throughput alone.
    #[arg(long)]
    packer_only: bool,
    /// No timing pairs: tree against flat on this device and dtype (per-term log-probs, loss,
    /// gradient norm) and the cost of a first step at new lengths (plan builds).
    #[arg(long)]
    parity: bool,
}

/// The run's settings: the flags of a full run (`cargo bench`); under `cargo test`, which
/// passes no `--bench`, a seconds-long smoke run.
fn parse_args() -> Args {
    let root = &common::root();
    let cli = Cli::parse();
    let c = &cli.common;
    let smoke = !c.full;
    let json_name = if smoke {
        "tree_vs_flat_smoke.json"
    } else {
        "tree_vs_flat.json"
    };
    Args {
        config: c.config_file(root.join("datasets/tiny-qwen3/config.json")),
        len: if smoke { 64 } else { cli.len },
        repeats: if smoke { 1 } else { cli.repeats },
        warmup: if smoke { 0 } else { cli.warmup },
        device: if smoke { Device::Cpu } else { c.device() },
        dtype: if smoke { Kind::Float } else { c.kind() },
        json: cli
            .json
            .clone()
            .filter(|_| !smoke)
            .unwrap_or_else(|| root.join("target/bench").join(json_name)),
        only: cli.only.clone().filter(|_| !smoke),
        smoke,
        activations: if cli.checkpointing && !smoke {
            Activations::Recomputed
        } else {
            Activations::Kept
        },
        peak_only: cli.peak_only.filter(|_| !smoke),
        packer_only: cli.packer_only && !smoke,
        parity: cli.parity,
    }
}

/// A rollout whose whole completion (everything after `prompt_len`) is trained.
fn rollout(ids: Vec<i64>, prompt_len: usize, rng: &mut SplitMix64) -> Rollout {
    let n = ids.len();
    Rollout {
        completion_mask: (0..n).map(|i| u8::from(i >= prompt_len)).collect(),
        old_log_probs: (0..n).map(|_| -(rng.next_f64() as f32) * 4.0 - 1.0).collect(),
        input_ids: ids,
        advantage: (rng.next_f64() as f32) * 2.0 - 1.0,
        group_id: "0".into(),
    }
}

fn tokens(n: usize, vocab: i64, rng: &mut SplitMix64) -> Vec<i64> {
    (0..n).map(|_| 3 + rng.below(vocab as u64 - 3) as i64).collect()
}

/// The release scenarios: (name, shared fraction, rollouts).
fn scenarios(len: usize, vocab: i64) -> Vec<(String, f64, Vec<Rollout>)> {
    let mut rng = SplitMix64::new(1016);
    let mut out = Vec::new();
    let rs: Vec<Rollout> = (0..4)
        .map(|_| {
            let ids = tokens(len, vocab, &mut rng);
            rollout(ids, len / 4, &mut rng)
        })
        .collect();
    out.push(("no sharing".to_string(), 0.0, rs));
    for f in [0.25, 0.75, 0.9375] {
        let p = (f * len as f64).round() as usize;
        let prefix = tokens(p, vocab, &mut rng);
        let rs = (0..4)
            .map(|_| {
                let ids = [prefix.clone(), tokens(len - p, vocab, &mut rng)].concat();
                rollout(ids, p, &mut rng)
            })
            .collect();
        out.push((format!("shared prompt f={f}"), f, rs));
    }
    for f in [0.25, 0.75, 0.9375] {
        let p = (f * len as f64).round() as usize;
        let c = len - p;
        let prefix = tokens(p, vocab, &mut rng);
        let mut rs = Vec::new();
        for _ in 0..2 {
            let mid = tokens(c / 2, vocab, &mut rng);
            for _ in 0..2 {
                let ids = [prefix.clone(), mid.clone(), tokens(c - c / 2, vocab, &mut rng)].concat();
                rs.push(rollout(ids, p, &mut rng));
            }
        }
        out.push((format!("nested fork f={f}"), f, rs));
    }
    out
}

/// One forward + backward of the GRPO loss over `row`, in milliseconds (gradients cleared first).
fn step_ms(model: &Model, row: &PackedRow, args: &Args) -> f64 {
    let t = Instant::now();
    let _ = backward_step(model, row, args);
    if let Device::Cuda(i) = args.device {
        tch::Cuda::synchronize(i as i64);
    }
    t.elapsed().as_secs_f64() * 1e3
}

/// The GRPO loss over `row` back-propagated into cleared gradients (the bench's objective:
/// uniform term weights, the run's activation policy).
fn backward_step(model: &Model, row: &PackedRow, args: &Args) -> GrpoLoss {
    let cfg = GrpoObjective {
        activations: args.activations,
        ..GrpoObjective::default()
    };
    let weights = TermWeights::Uniform(1.0 / row.token_index.len().max(1) as f64);
    treetrain::train::zero_grads(&model.vs);
    grpo_loss_backward(&model.lm, row, &cfg, (weights, Default::default()), (None, None)).expect("loss")
}

/// The loss and the gradient norm of one step over `row`.
fn loss_and_grad_norm(model: &Model, row: &PackedRow, args: &Args) -> (f64, f64) {
    let out = backward_step(model, row, args);
    let squares: f64 = model
        .vs
        .trainable_variables()
        .iter()
        .map(|v| v.grad())
        .filter(|g| g.defined())
        .map(|g| g.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]))
        .sum();
    (out.loss.double_value(&[]), squares.sqrt())
}

/// Tree against flat on the run's device and dtype, stated tolerances beside the numbers
/// (bf16: a log-prob carries the rounding of bf16 activations, about 2^-8 relative, through
/// kernels that split the work differently), then the first step at new lengths against its
/// repeat: the cost of the kernel plans (cuDNN's) a new (query, key) length builds.
fn parity(
    model: &Model,
    (name, rs): (&str, &[Rollout]),
    flat: &PackedRow,
    tree: &PackedRow,
    args: &Args,
) -> serde_json::Value {
    let chunks = treetrain::model::LogprobChunks::default();
    let logprobs = |row| tch::no_grad(|| treetrain::pack::row_logprobs(&model.lm, row, chunks)).expect("log-probs");
    let diff = (logprobs(flat) - logprobs(tree)).abs().to_kind(Kind::Double);
    let (max_abs, mean_abs) = (diff.max().double_value(&[]), diff.mean(Kind::Double).double_value(&[]));
    let ((flat_loss, flat_norm), (tree_loss, tree_norm)) = (
        loss_and_grad_norm(model, flat, args),
        loss_and_grad_norm(model, tree, args),
    );
    let rel = |a: f64, b: f64| (a - b).abs() / a.abs().max(b.abs()).max(1e-12);
    let bf16 = args.dtype != Kind::Float;
    let (lp_tol, mean_tol, rel_tol) = if bf16 { (0.125, 0.01, 0.02) } else { (1e-4, 1e-5, 1e-4) };
    // New lengths: the tree of the same scenario a few tokens shorter per rollout.
    let fresh = tree_row(&shortened(rs));
    let first = step_ms(model, &fresh, args);
    let repeat = step_ms(model, &fresh, args);
    let out = serde_json::json!({
        "scenario": name, "dtype": format!("{:?}", args.dtype),
        "logprob_max_abs_diff": max_abs, "logprob_mean_abs_diff": mean_abs,
        "flat_loss": flat_loss, "tree_loss": tree_loss, "loss_rel_diff": rel(flat_loss, tree_loss),
        "flat_grad_norm": flat_norm, "tree_grad_norm": tree_norm, "grad_norm_rel_diff": rel(flat_norm, tree_norm),
        "tolerances": {"logprob_max_abs": lp_tol, "logprob_mean_abs": mean_tol, "relative": rel_tol},
        "ok": max_abs <= lp_tol && mean_abs <= mean_tol && rel(flat_loss, tree_loss) <= rel_tol
            && rel(flat_norm, tree_norm) <= rel_tol,
        "new_lengths_first_step_ms": first, "new_lengths_repeat_ms": repeat,
        "plan_build_ms": first - repeat,
    });
    println!("{name:<24}parity {out}");
    out
}

/// The rollouts `rs` again, each 8 tokens shorter: the same tree shape at lengths no step has
/// run yet.
fn shortened(rs: &[Rollout]) -> Vec<Rollout> {
    rs.iter()
        .cloned()
        .map(|mut r| {
            let n = r.input_ids.len().saturating_sub(8);
            r.input_ids.truncate(n);
            r.completion_mask.truncate(n);
            r.old_log_probs.truncate(n);
            r
        })
        .collect()
}

/// Flat and tree steps timed interleaved (flat, tree, flat, tree, ...) after warm-ups (one step
/// of each packing per warm-up): each side's median milliseconds and the median of the pairwise
/// speedups (flat / tree), so a drift of the machine's speed hits both sides of every pair
/// alike; on CUDA also each side's peak over its timed steps (MiB), read around each step.
fn time_pairs(model: &Model, flat: &PackedRow, tree: &PackedRow, args: &Args) -> Timed {
    for _ in 0..args.warmup {
        step_ms(model, flat, args);
        step_ms(model, tree, args);
    }
    let mut timed = Timed::default();
    let (mut f, mut t, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.repeats {
        let (a, flat_peak) = cuda_peak_around(model, args, || step_ms(model, flat, args));
        let (b, tree_peak) = cuda_peak_around(model, args, || step_ms(model, tree, args));
        f.push(a);
        t.push(b);
        ratios.push(a / b);
        timed.flat_peak_mib = timed.flat_peak_mib.max(flat_peak);
        timed.tree_peak_mib = timed.tree_peak_mib.max(tree_peak);
    }
    timed.flat_ms = common::median(&f);
    timed.tree_ms = common::median(&t);
    timed.speedup = common::median(&ratios);
    timed
}

/// What [`time_pairs`] measured (peaks NaN off CUDA).
struct Timed {
    flat_ms: f64,
    tree_ms: f64,
    speedup: f64,
    flat_peak_mib: f64,
    tree_peak_mib: f64,
}

impl Default for Timed {
    fn default() -> Self {
        Timed {
            flat_ms: f64::NAN,
            tree_ms: f64::NAN,
            speedup: f64::NAN,
            flat_peak_mib: f64::NAN,
            tree_peak_mib: f64::NAN,
        }
    }
}

/// `step()`'s result and, on CUDA, the allocator's peak allocated bytes during it (MiB,
/// weights included); NaN elsewhere or when the statistics cannot be read.
fn cuda_peak_around(model: &Model, args: &Args, step: impl FnOnce() -> f64) -> (f64, f64) {
    let Device::Cuda(i) = args.device else {
        return (step(), f64::NAN);
    };
    // Counted from no gradients, as the first step of a run is (the step would free the last
    // step's only once running).
    treetrain::train::zero_grads(&model.vs);
    if let Err(e) = treetrain::device::reset_cuda_peak(i) {
        eprintln!("no allocator peak: {e}");
        return (step(), f64::NAN);
    }
    let ms = step();
    match treetrain::device::cuda_memory_stats(i) {
        Ok(stats) => (ms, stats.peak_allocated as f64 / (1024.0 * 1024.0)),
        Err(e) => {
            eprintln!("no allocator peak: {e}");
            (ms, f64::NAN)
        }
    }
}

/// The memory peak of one more step (MiB): on the CPU the resident growth above what was in
/// use before it; on CUDA the allocator's peak allocated bytes during it, weights included.
fn peak_mib(model: &Model, row: &PackedRow, args: &Args) -> f64 {
    if let Device::Cuda(_) = args.device {
        return cuda_peak_around(model, args, || step_ms(model, row, args)).1;
    }
    if args.device != Device::Cpu {
        return f64::NAN;
    }
    // Large tensors are then always mmapped and unmapped on free, so resident memory follows
    // live tensors and the peak after a reset is this step's. (Not during timing: mapping every
    // tensor costs page faults.)
    common::allocator(common::AllocatorMode::Measure);
    // The step frees the gradients of the one before it and makes its own: counted from
    // none, as the first step of a run is.
    treetrain::train::zero_grads(&model.vs);
    let base = common::status_kib("VmRSS:");
    common::reset_peak_rss();
    step_ms(model, row, args);
    let peak = (common::status_kib("VmHWM:") - base) / 1024.0;
    common::allocator(common::AllocatorMode::Time);
    peak
}

fn tree_row(rs: &[Rollout]) -> PackedRow {
    let mut t = PrefixTree::new();
    for (i, r) in rs.iter().enumerate() {
        t.add(r.clone(), i).expect("valid rollout");
    }
    t.pack()
}

/// The packer workload: `groups` x 8 rollouts of 4096 tokens, 3/4 shared (64 groups: 2.1 M
/// raw tokens), as `scripts/bench/trl_pack.py` builds it for TRL's TreeRow.
fn packer_workload(groups: usize) -> Vec<Rollout> {
    let mut rng = SplitMix64::new(7);
    let mut rs = Vec::new();
    for _ in 0..groups {
        let prefix = tokens(3072, 150_000, &mut rng);
        for _ in 0..8 {
            let ids = [prefix.clone(), tokens(1024, 150_000, &mut rng)].concat();
            rs.push(rollout(ids, 3072, &mut rng));
        }
    }
    rs
}

/// Best of 3 seconds of `f` run on a fresh copy of `rs` (the copy made outside the clock, as
/// TRL's script makes its tensors beforehand).
fn best_of_3<T>(rs: &[Rollout], mut f: impl FnMut(Vec<Rollout>) -> T) -> (f64, T) {
    let mut best = (f64::INFINITY, None);
    for _ in 0..3 {
        let input = rs.to_vec();
        let t = Instant::now();
        let out = f(input);
        let s = t.elapsed().as_secs_f64();
        if s < best.0 {
            best = (s, Some(out));
        }
    }
    (best.0, best.1.expect("three runs"))
}

/// TRL's TreeRow on the same workload: milliseconds (`None`, said, without a Python with trl).
fn trl_tree_ms(python: Option<&str>, groups: usize) -> Option<f64> {
    let script = common::root().join("scripts/bench/trl_pack.py");
    let out = std::process::Command::new(python?)
        .arg(script)
        .args([groups.to_string(), "8".into(), "3072".into(), "1024".into()])
        .output()
        .ok()?;
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = match serde_json::from_str(line.trim()) {
        Ok(v) => v,
        Err(_) => {
            println!(
                "TRL TreeRow: failed: {}",
                String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
            );
            return None;
        }
    };
    v["tree_ms"].as_f64()
}

/// The packer's throughput: tree build + pack and flat packing of the workload, and TRL's
/// TreeRow on the same shape when a Python with trl is present, interleaved over `pairs`
/// (ours, TRL's, ours, ...), the speedup the median of the pairwise ratios.
fn packer_throughput(groups: usize, pairs: usize, python: Option<&str>) -> serde_json::Value {
    let rs = packer_workload(groups);
    let raw: usize = rs.iter().map(|r| r.input_ids.len()).sum();
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut unique = 0;
    for _ in 0..pairs {
        let (tree_s, row) = best_of_3(&rs, |input| {
            let mut tree = PrefixTree::new();
            for (i, r) in input.into_iter().enumerate() {
                tree.add(r, i).expect("valid");
            }
            tree.pack()
        });
        unique = row.len();
        ours.push(tree_s * 1e3);
        if let Some(trl_ms) = trl_tree_ms(python, groups) {
            theirs.push(trl_ms);
            ratios.push(trl_ms / (tree_s * 1e3));
        }
    }
    let (flat_s, flat) = best_of_3(&rs, |input| pack_flat(&input).expect("valid"));
    assert_eq!(flat.len(), raw);
    let tree_ms = common::median(&ours);
    let rate = |ms: f64| raw as f64 / ms / 1e3;
    println!(
        "\npacker: {raw} raw tokens -> {unique} unique (ratio {:.2}); tree build + pack {tree_ms:.0} ms = {:.1} M tokens/s; flat pack {:.0} ms = {:.1} M tokens/s",
        raw as f64 / unique as f64,
        rate(tree_ms),
        flat_s * 1e3,
        rate(flat_s * 1e3)
    );
    let mut out = serde_json::json!({"raw_tokens": raw, "unique_tokens": unique, "tree_ms": tree_ms,
        "tree_mtokens_per_s": rate(tree_ms), "flat_ms": flat_s * 1e3, "flat_mtokens_per_s": rate(flat_s * 1e3)});
    if !ratios.is_empty() {
        let (trl_ms, speedup) = (common::median(&theirs), common::median(&ratios));
        println!(
            "TRL TreeRow on the same shape: {trl_ms:.0} ms = {:.2} M tokens/s; treetrain {speedup:.1}x (median of {} interleaved pairs)",
            rate(trl_ms),
            ratios.len()
        );
        out["trl_tree_ms"] = trl_ms.into();
        out["trl_mtokens_per_s"] = rate(trl_ms).into();
        out["speedup_vs_trl"] = speedup.into();
        out["pairwise_ratios"] = serde_json::json!(ratios);
    }
    out
}

fn main() {
    let args = parse_args();
    common::require(args.device);
    common::allocator(common::AllocatorMode::Time);
    let hf = HfConfig::from_file(&args.config).expect("config.json");
    // Drawn on the device: a host draw of a billion-parameter config takes a minute.
    let model = Model::drawn(
        hf,
        LoadOptions {
            dtype: Some(args.dtype),
            device: args.device,
        },
        0,
        0.02,
    )
    .expect("model");
    let cfg = model.lm.config.clone();
    println!(
        "tree vs flat, forward + backward of the GRPO loss: {:.1} M-parameter {:?}, 4 rollouts x {} tokens, {:?} {:?}, {} threads, median of {} after {} warm-ups",
        cfg.num_parameters() as f64 / 1e6,
        cfg.arch,
        args.len,
        args.dtype,
        args.device,
        tch::get_num_threads(),
        args.repeats,
        args.warmup
    );
    println!(
        "{:<24}{:>10}{:>10}{:>9}{:>8}{:>8}{:>8}{:>10}{:>10}{:>11}{:>11}{:>10}",
        "scenario",
        "flat ms",
        "tree ms",
        "speedup",
        "ratio",
        "pairs",
        "ideal",
        "sp/ideal",
        "sp/ratio",
        "flat MiB",
        "tree MiB",
        "TRL GiB"
    );
    let kernels = treetrain::model::sdpa_kernels(&cfg, args.device, args.dtype).expect("SDPA kernel choice");
    let kernels: serde_json::Map<String, serde_json::Value> = kernels
        .iter()
        .map(|(call, k)| (call.name().to_string(), k.name().into()))
        .collect();
    println!("SDPA kernels by call: {}", serde_json::Value::Object(kernels.clone()));
    let header = serde_json::json!({
        "config": args.config.display().to_string(), "parameters": cfg.num_parameters(), "len": args.len,
        "dtype": format!("{:?}", args.dtype), "device": format!("{:?}", args.device),
        "threads": tch::get_num_threads(), "repeats": args.repeats, "warmup": args.warmup,
        "activations": format!("{:?}", args.activations),
        "peak_basis": match args.device {
            Device::Cuda(_) => "cuda caching allocator: peak allocated during the step, weights included",
            _ => "resident-set growth of the step above the loaded model",
        },
        "sdpa_kernels": kernels,
    });
    // Rewritten after every scenario, so a run stopped by a time limit keeps what it finished.
    let write = |results: &[serde_json::Value], packer: &serde_json::Value| {
        let mut out = header.clone();
        out["scenarios"] = serde_json::json!(results);
        out["packer"] = packer.clone();
        if let Some(dir) = args.json.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        std::fs::write(&args.json, serde_json::to_string_pretty(&out).expect("json")).expect("write json");
    };
    let results = run_scenarios(&model, &args, &|r| write(r, &serde_json::Value::Null));
    // The packer's throughput belongs to a whole run: a run of chosen scenarios (`--only`, the
    // GPU check's steps) skips it.
    let packer = match args.peak_only.is_some() || args.parity || (args.only.is_some() && !args.packer_only) {
        true => serde_json::Value::Null,
        false => {
            let python = (!args.smoke).then(|| common::python(None, "trl")).flatten();
            packer_throughput(if args.smoke { 2 } else { 64 }, 3, python.as_deref())
        }
    };
    write(&results, &packer);
    println!("wrote {}", args.json.display());
    // A parity run that finds tree and flat apart fails, so a script's status says so.
    if args.parity && results.iter().any(|r| r["ok"] != true) {
        eprintln!(
            "tree and flat differ beyond the stated tolerances: {}",
            args.json.display()
        );
        std::process::exit(1);
    }
}

/// TRL v1.16's published release figures for a scenario (Qwen3-1.7B, 4 x 32,768 tokens, bf16):
/// `(token ratio, time speed-up, tree peak GiB, flat peak GiB)`, where published.
fn trl_release(name: &str) -> Option<(f64, f64, f64, Option<f64>)> {
    match name {
        "shared prompt f=0.9375" => Some((3.37, 8179.0 / 2755.0, 13.6, Some(35.2))),
        "nested fork f=0.9375" => Some((3.56, 3.10, 13.5, None)),
        _ => None,
    }
}

/// Every scenario of the run (all, `--only` ones, none with `--packer-only`): timed pairs and
/// peaks, or one side's peak alone (`--peak-only`); one JSON object each.
fn run_scenarios(model: &Model, args: &Args, written: &dyn Fn(&[serde_json::Value])) -> Vec<serde_json::Value> {
    let cfg = &model.lm.config;
    let mut results = Vec::new();
    for (name, f, rs) in scenarios(args.len, cfg.vocab_size) {
        if args.packer_only || args.only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        let flat = pack_flat(&rs).expect("valid");
        let tree = tree_row(&rs);
        if args.parity {
            results.push(parity(model, (&name, &rs), &flat, &tree, args));
            written(&results);
            continue;
        }
        if let Some(side) = args.peak_only {
            let row = if side == Side::Flat { &flat } else { &tree };
            let mib = peak_mib(model, row, args);
            println!("{name:<24}{side:?} only: one step's peak {mib:.0} MiB above the loaded model");
            results.push(
                serde_json::json!({"scenario": name, "side": format!("{side:?}"), "peak_mib": mib,
                "tokens": row.len()}),
            );
            written(&results);
            continue;
        }
        let timed = time_pairs(model, &flat, &tree, args);
        let (flat_ms, tree_ms, speedup) = (timed.flat_ms, timed.tree_ms, timed.speedup);
        let (flat_mib, tree_mib) = match args.device {
            Device::Cuda(_) => (timed.flat_peak_mib, timed.tree_peak_mib),
            _ => (peak_mib(model, &flat, args), peak_mib(model, &tree, args)),
        };
        let ideal = flat.forward_flops(cfg) / tree.forward_flops(cfg);
        let ratio = tree.packing_ratio();
        let pair_ratio = flat.attention_pairs() as f64 / tree.attention_pairs() as f64;
        let trl = trl_release(&name);
        println!(
            "{name:<24}{flat_ms:>10.1}{tree_ms:>10.1}{speedup:>9.2}{ratio:>8.2}{pair_ratio:>8.2}{ideal:>8.2}{:>10.2}{:>10.2}{flat_mib:>11.0}{tree_mib:>11.0}{:>10}",
            speedup / ideal,
            speedup / ratio,
            trl.map_or("-".to_string(), |t| format!("{:.1}", t.2)),
        );
        results.push(serde_json::json!({
            "scenario": name, "shared_fraction": f, "flat_ms": flat_ms, "tree_ms": tree_ms, "speedup": speedup,
            "packing_ratio": ratio, "pair_ratio": pair_ratio, "ideal_speedup": ideal, "speedup_over_ideal": speedup / ideal,
            "speedup_over_ratio": speedup / ratio, "flat_peak_mib": flat_mib, "tree_peak_mib": tree_mib,
            "flat_tokens": flat.len(), "tree_tokens": tree.len(),
            "flat_pairs": flat.attention_pairs(), "tree_pairs": tree.attention_pairs(),
            "trl_token_ratio": trl.map(|t| t.0), "trl_speedup": trl.map(|t| t.1),
            "trl_tree_peak_gib": trl.map(|t| t.2), "trl_flat_peak_gib": trl.and_then(|t| t.3),
        }));
        written(&results);
    }
    results
}
