//! The mixture-of-experts block's forward + backward against transformers' own, and its memory
//! against a physical bound.
//!
//! cargo bench --bench moe -- [--tokens 2048] [--hidden 2048] [--experts 128] [--top-k 8]
//!     [--width 768] [--dtype fp32|bf16] [--pairs 3] [--iters 3]
//!     [--implementations grouped_mm,eager] [--grads none|keep] [--python PATH]
//!
//! Default: a Qwen3-30B-A3B-shaped sparse layer (hidden 2048, 128 experts, top 8, expert width
//! 768) on 2,048 tokens, on the CPU. Both sides draw the router, the fused experts, the input
//! and the output's gradient from libtorch's generator with the same seed, so they run the same
//! block on the same numbers (the checksums of the output and the gradients are compared).
//! treetrain's `SparseMoe` and transformers' `Qwen3MoeSparseMoeBlock` under each of its experts
//! implementations (`scripts/bench/transformers_moe.py`, a process each) run interleaved
//! (`--pairs` rounds: ours, then each of theirs); each side times `--iters` passes after one
//! untimed, and the median over rounds of the per-round ratio against the fastest of theirs is
//! reported. Both set their gradients to `None` between passes, as treetrain's trainers and
//! PyTorch's `zero_grad` do (`--grads keep` keeps them and zeroes them instead on both sides,
//! so both backward passes add into existing gradients); both use libtorch's default thread
//! count.
//! By default theirs is `grouped_mm`, their fastest on the CPU: `eager` (a loop over the
//! experts with a gather and an index-add each) is far slower at this shape
//! (`--implementations eager,grouped_mm` times both), and `batched_mm` gathers an
//! `[hidden x 2 width]` weight for every (token, expert) pair, hundreds of GB here.
//!
//! Time against a physical bound: the pass's expert products as dense GEMMs over all routed
//! rows at libtorch's dense matmul rate (`dense_gemm_s`); each side's fraction of that rate is
//! printed, and the ratio of the two fractions caps what any grouped implementation could gain.
//!
//! Both sides time with glibc keeping freed memory (steady-state speed), then measure one more
//! pass with every large tensor mapped on its own, so resident memory follows live tensors.
//! Memory: each side's resident peak during that pass, above what was resident before
//! its weights were made, against the bound `weights + their gradients + the routed
//! activations` (for each of the `tokens x top_k` pairs: its input row, gate and up outputs,
//! activation and expert output; and the block's input, output and their gradients). A dense
//! `[tokens x experts x hidden]` intermediate would be `experts / top_k` times the routed rows.
//! Under `cargo test` a seconds-long smoke run on a tiny block.

mod common;

use clap::Parser;

use std::process::Command;
use std::time::Instant;

use tch::{Kind, Tensor, nn};
use treetrain::model::moe::{MixtureConfig, SparseMoe};

/// The MoE bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Tokens through the block (a full run).
    #[arg(long, default_value_t = 2048)]
    tokens: i64,
    /// Hidden size.
    #[arg(long, default_value_t = 2048)]
    hidden: i64,
    /// Experts in the layer.
    #[arg(long, default_value_t = 128)]
    experts: i64,
    /// Experts a token.
    #[arg(long = "top-k", default_value_t = 8)]
    top_k: i64,
    /// Each expert's intermediate width (`moe_intermediate_size`).
    #[arg(long, default_value_t = 768)]
    width: i64,
    /// Interleaved rounds.
    #[arg(long, default_value_t = 3)]
    pairs: usize,
    /// Timed passes per side and round.
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// How both sides reset gradients between passes: `none` (freed, as treetrain's trainers
    /// and PyTorch's `zero_grad` do) or `keep` (kept and zeroed).
    #[arg(long, value_parser = ["none", "keep"], default_value = "none")]
    grads: String,
    /// transformers' experts implementations to run, comma-separated.
    #[arg(long, default_value = "grouped_mm")]
    implementations: String,
}

/// The block's shape.
#[derive(Clone, Copy)]
struct Shape {
    tokens: i64,
    hidden: i64,
    experts: i64,
    top_k: i64,
    width: i64,
}

const SEED: i64 = 7;

/// One side's result: median seconds a pass, resident peak (MiB) and checksums.
struct Side {
    seconds: f64,
    peak_mib: f64,
    sums: [f64; 4],
}

fn main() {
    let cli = Cli::parse();
    let args = &cli.common;
    let kind = args.kind();
    let (shape, pairs, iters) = match args.full {
        true => (
            Shape {
                tokens: cli.tokens,
                hidden: cli.hidden,
                experts: cli.experts,
                top_k: cli.top_k,
                width: cli.width,
            },
            cli.pairs,
            cli.iters,
        ),
        false => (
            Shape {
                tokens: 64,
                hidden: 64,
                experts: 8,
                top_k: 2,
                width: 32,
            },
            1,
            1,
        ),
    };
    common::allocator(common::AllocatorMode::Measure);
    let bound = bound_mib(shape, kind);
    println!(
        "MoE block forward + backward: {} tokens, hidden {}, {} experts, top {}, width {}, {:?}; bound {bound:.0} MiB",
        shape.tokens, shape.hidden, shape.experts, shape.top_k, shape.width, kind
    );
    let py = common::python(args.python.clone(), "transformers, torch");
    let implementations: Vec<&str> = cli.implementations.split(',').filter(|s| !s.is_empty()).collect();
    let mut ours = Ours::new(shape, kind, cli.grads == "keep");
    let mut rounds: Vec<(Side, Vec<Option<Side>>)> = Vec::new();
    for round in 0..pairs {
        let mine = ours.run(iters);
        print_side(&format!("round {round}: treetrain"), &mine, bound);
        let theirs: Vec<Option<Side>> = implementations
            .iter()
            .map(|imp| {
                let side = py
                    .as_deref()
                    .and_then(|py| transformers(py, shape, kind, (imp, &cli.grads), iters));
                if let Some(s) = &side {
                    print_side(&format!("round {round}: transformers {imp}"), s, bound);
                    check_sums(&mine, s, kind, imp);
                }
                side
            })
            .collect();
        rounds.push((mine, theirs));
    }
    let gemm_s = dense_gemm_s(shape, kind, iters);
    println!("the pass's products as dense GEMMs: {gemm_s:.3} s");
    report(
        &rounds,
        gemm_s,
        (&implementations, &cli.grads),
        bound,
        args,
        (shape, py.is_some()),
    );
}

/// treetrain's block, its parameters and the pass's input.
struct Ours {
    vs: nn::VarStore,
    block: SparseMoe,
    x0: Tensor,
    dy: Tensor,
    before_kib: f64,
    /// Gradients kept and zeroed between passes instead of freed.
    keep_grads: bool,
}

impl Ours {
    /// Draws the block's weights, the input and the output's gradient in
    /// `transformers_moe.py`'s order from the same seed.
    fn new(s: Shape, kind: Kind, keep_grads: bool) -> Self {
        let before_kib = common::status_kib("VmRSS:");
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let mixture = MixtureConfig {
            num_experts: s.experts,
            experts_per_token: s.top_k,
            expert_size: s.width,
            norm_topk_prob: true,
            sparse_layers: vec![true],
            router_aux_loss_coef: 0.0,
            output_router_logits: false,
            sigmoid: None,
            projection: None,
            load_balancing: true,
        };
        let mut block = SparseMoe::new(vs.root() / "mlp", s.hidden, &mixture);
        tch::manual_seed(SEED);
        let opts = (Kind::Float, tch::Device::Cpu);
        tch::no_grad(|| {
            block
                .router
                .gate
                .weight
                .copy_(&(Tensor::randn([s.experts, s.hidden], opts) * 0.02));
            let gate_up = Tensor::randn([s.experts, 2 * s.width, s.hidden], opts) * 0.02;
            block.experts.gate_up_proj.copy_(&gate_up);
            drop(gate_up);
            let down = Tensor::randn([s.experts, s.hidden, s.width], opts) * 0.02;
            block.experts.down_proj.copy_(&down);
        });
        let x0 = Tensor::randn([1, s.tokens, s.hidden], opts).to_kind(kind);
        let dy = Tensor::randn([1, s.tokens, s.hidden], opts).to_kind(kind);
        vs.set_kind(kind);
        Ours {
            vs,
            block,
            x0,
            dy,
            before_kib,
            keep_grads,
        }
    }

    /// One forward + backward, gradients freed (or zeroed) first: the input with its gradient,
    /// the output.
    fn pass(&mut self) -> (Tensor, Tensor) {
        match self.keep_grads {
            true => {
                for mut g in self.vs.trainable_variables().iter().map(Tensor::grad) {
                    if g.defined() {
                        let _ = g.zero_();
                    }
                }
            }
            false => treetrain::train::zero_grads(&self.vs),
        }
        let x = self.x0.copy().set_requires_grad(true);
        let (y, _) = self.block.forward(&x).expect("forward");
        (&y * &self.dy).sum(Kind::Float).backward();
        (x, y)
    }

    /// Times `iters` passes after an untimed one (freed memory kept by the allocator), then
    /// measures one more pass's resident peak (every large tensor mapped on its own).
    fn run(&mut self, iters: usize) -> Side {
        common::allocator(common::AllocatorMode::Time);
        let _ = self.pass();
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let start = Instant::now();
            let _ = self.pass();
            times.push(start.elapsed().as_secs_f64());
        }
        common::allocator(common::AllocatorMode::Measure);
        common::reset_peak_rss();
        let (x, y) = self.pass();
        let peak_mib = (common::status_kib("VmHWM:") - self.before_kib) / 1024.0;
        let abs_sum = |t: &Tensor| t.to_kind(Kind::Float).abs().sum(Kind::Float).double_value(&[]);
        Side {
            seconds: common::median(&times),
            peak_mib,
            sums: [
                y.to_kind(Kind::Float).sum(Kind::Float).double_value(&[]),
                abs_sum(&x.grad()),
                abs_sum(&self.block.experts.gate_up_proj.grad()),
                abs_sum(&self.block.router.gate.weight.grad()),
            ],
        }
    }
}

/// transformers' block under `implementation`, in its own process; `None` (said) on failure.
fn transformers(py: &str, s: Shape, kind: Kind, (implementation, grads): (&str, &str), iters: usize) -> Option<Side> {
    let spec = serde_json::json!({
        "tokens": s.tokens, "hidden": s.hidden, "experts": s.experts, "top_k": s.top_k,
        "width": s.width, "dtype": treetrain::model::kind_name(kind), "seed": SEED,
        "iters": iters, "implementation": implementation, "grads": grads,
    });
    let script = common::root().join("scripts/bench/transformers_moe.py");
    let out = Command::new(py)
        .arg(&script)
        .arg(spec.to_string())
        .output()
        .expect("run python");
    let text = String::from_utf8_lossy(&out.stdout);
    let Ok(v) = serde_json::from_str::<serde_json::Value>(text.trim()) else {
        let err = String::from_utf8_lossy(&out.stderr);
        println!(
            "transformers {implementation}: failed: {}",
            err.lines().last().unwrap_or("")
        );
        return None;
    };
    let f = |key: &str| v[key].as_f64().unwrap_or(f64::NAN);
    Some(Side {
        seconds: f("seconds"),
        peak_mib: f("peak_mib"),
        sums: [f("y_sum"), f("x_grad_sum"), f("gate_up_grad_sum"), f("router_grad_sum")],
    })
}

/// The physical bound on time: the pass's six expert products (gate-up and down, forward, and
/// into the input and the weights backward) over all `tokens x top_k` routed rows as dense
/// GEMMs of one expert's shape, at libtorch's dense matmul rate on this machine; best of
/// `iters`. No grouped kernel beats the dense one, so `gemm_s / side_s` is the fraction of the
/// attainable rate each side reaches, and their ratio caps any speedup.
fn dense_gemm_s(s: Shape, kind: Kind, iters: usize) -> f64 {
    let opts = (kind, tch::Device::Cpu);
    let rows = s.tokens * s.top_k;
    let x = Tensor::randn([rows, s.hidden], opts);
    let (gate_up, down) = (
        Tensor::randn([s.hidden, 2 * s.width], opts),
        Tensor::randn([s.width, s.hidden], opts),
    );
    let (act, dy) = (
        Tensor::randn([rows, s.width], opts),
        Tensor::randn([rows, s.hidden], opts),
    );
    let d_gate_up = Tensor::randn([rows, 2 * s.width], opts);
    let pass = || {
        let _ = x.matmul(&gate_up);
        let _ = act.matmul(&down);
        let _ = dy.matmul(&down.tr());
        let _ = act.tr().matmul(&dy);
        let _ = d_gate_up.matmul(&gate_up.tr());
        let _ = x.tr().matmul(&d_gate_up);
    };
    pass();
    (0..iters.max(1))
        .map(|_| {
            let start = Instant::now();
            pass();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Weights and their gradients plus the routed activations, in MiB (see the module doc).
fn bound_mib(s: Shape, kind: Kind) -> f64 {
    let elem = kind.elt_size_in_bytes() as f64;
    let params = (s.experts * s.hidden + s.experts * 3 * s.width * s.hidden) as f64;
    let pairs = (s.tokens * s.top_k) as f64;
    let routed = pairs * (2 * s.hidden + 3 * s.width) as f64 + 4.0 * (s.tokens * s.hidden) as f64;
    (2.0 * params + routed) * elem / (1 << 20) as f64
}

fn print_side(label: &str, side: &Side, bound: f64) {
    println!(
        "{label}: {:.3} s a pass, peak {:.0} MiB ({:.2}x the bound)",
        side.seconds,
        side.peak_mib,
        side.peak_mib / bound
    );
}

/// Both sides ran the same block: the output's sum and the gradients' absolute sums agree.
fn check_sums(ours: &Side, theirs: &Side, kind: Kind, implementation: &str) {
    let tol = if kind == Kind::Float { 1e-3 } else { 3e-2 };
    let names = ["output sum", "input grad", "experts grad", "router grad"];
    for ((a, b), name) in ours.sums.iter().zip(&theirs.sums).zip(names) {
        let scale = a.abs().max(b.abs()).max(1e-6);
        // The output's plain sum cancels; its scale is the gradient sums'.
        let scale = if name == "output sum" {
            scale.max(ours.sums[1] * 1e-2)
        } else {
            scale
        };
        assert!(
            (a - b).abs() / scale < tol,
            "{name} differs from transformers {implementation}: {a} vs {b}"
        );
    }
}

/// Prints the medians of the per-round ratios and writes `target/bench/moe.json`.
fn report(
    rounds: &[(Side, Vec<Option<Side>>)],
    gemm_s: f64,
    (implementations, grads): (&[&str], &str),
    bound: f64,
    args: &common::Common,
    (s, compared): (Shape, bool),
) {
    let ours: Vec<f64> = rounds.iter().map(|(m, _)| m.seconds).collect();
    let peak = rounds.iter().map(|(m, _)| m.peak_mib).fold(0.0, f64::max);
    let mut result = serde_json::json!({
        "tokens": s.tokens, "hidden": s.hidden, "experts": s.experts, "top_k": s.top_k,
        "width": s.width, "dtype": treetrain::model::kind_name(args.kind()),
        "treetrain_s": common::median(&ours), "treetrain_peak_mib": peak, "bound_mib": bound,
        "treetrain_peak_over_bound": peak / bound, "threads": tch::get_num_threads(),
        "grads": grads,
    });
    if !compared {
        println!("transformers: skipped (no Python with transformers and torch)");
    }
    let fastest: Vec<Option<f64>> = rounds
        .iter()
        .map(|(_, theirs)| theirs.iter().flatten().map(|t| t.seconds).min_by(f64::total_cmp))
        .collect();
    for (i, imp) in implementations.iter().enumerate() {
        let times: Vec<f64> = rounds
            .iter()
            .filter_map(|(_, t)| t[i].as_ref().map(|t| t.seconds))
            .collect();
        let peaks: Vec<f64> = rounds
            .iter()
            .filter_map(|(_, t)| t[i].as_ref().map(|t| t.peak_mib))
            .collect();
        if times.is_empty() {
            continue;
        }
        let (seconds, of_gemm_rate) = (common::median(&times), gemm_s / common::median(&times));
        println!("transformers {imp}: {of_gemm_rate:.2} of the dense GEMM rate");
        result[format!("{imp}_s")] = seconds.into();
        result[format!("{imp}_of_gemm_rate")] = of_gemm_rate.into();
        result[format!("{imp}_peak_mib")] = peaks.iter().copied().fold(0.0, f64::max).into();
    }
    let ratios: Vec<f64> = rounds
        .iter()
        .zip(&fastest)
        .filter_map(|((m, _), f)| f.map(|f| f / m.seconds))
        .collect();
    let of_gemm_rate = gemm_s / common::median(&ours);
    println!(
        "treetrain: {:.3} s a pass (median of {} rounds), peak {peak:.0} MiB = {:.2}x the bound, {of_gemm_rate:.2} of the dense GEMM rate",
        common::median(&ours),
        ours.len(),
        peak / bound,
    );
    result["dense_gemm_s"] = gemm_s.into();
    result["treetrain_of_gemm_rate"] = of_gemm_rate.into();
    if !ratios.is_empty() {
        let r = common::median(&ratios);
        println!("speedup against transformers' fastest implementation (median of per-round ratios): {r:.2}x");
        result["speedup_vs_fastest"] = r.into();
        result["ratios"] = ratios.into();
    }
    args.write_result("moe", &result);
}
