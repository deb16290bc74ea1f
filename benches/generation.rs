//! Generation throughput: static cache vs growing cache vs no cache, prefix-shared group
//! generation vs prefilling every member, and treetrain vs transformers' static-cache
//! `generate` on the same checkpoint (when a Python with transformers is available).
//!
//! cargo bench --bench generation -- [--prompts 8] [--new 64] [--python PATH]
//!     [--config config.json | --model DIR] [--pairs 3] [--device cpu|cuda] [--dtype fp32|bf16]
//!     [--static-only] [--split] [--pages] [--product-sweep] [--cuda-graph] [--bound-pairs 3]
//!
//! Greedy, fp32, CPU (or `--device`, `--dtype`), the shipped tiny Qwen3, or with `--config` a
//! random model of a published config (e.g. `benches/configs/smollm2-135m.json`). treetrain's static cache and
//! transformers' run interleaved (`--pairs` times: ours, theirs, ours, ...) and the median of
//! the pairwise ratios is reported, with the memory-bandwidth bound of a decode step (every
//! weight read once per step, at this machine's read bandwidth measured next to each decode
//! timing in `--bound-pairs` interleaved pairs, 3 by default; also shown with the KV cache's reads)
//! and, on the CPU, the arithmetic bound (the weight products' FLOPs at the f32 matmul rate
//! measured in each pair) with the decode against the slower of the two.
//! `--static-only` skips the other modes (growing cache, no cache, groups). `--split` splits a
//! decode step into its weight products and the rest, and times the same multiply-adds with
//! the weights in cache (the kernel's arithmetic alone) and, of the rest, the attention over the
//! cache alone (every layer, all slots); `--pages` times those products over the
//! model's weights (in huge pages) and over copies in libtorch's allocation; `--product-sweep` times those products
//! through the CPU kernel and through libtorch at 1-256 rows; `--cuda-graph` (CUDA) compares the decode
//! steps replayed as a CUDA graph with the same steps run eagerly. Without `--bench` (under `cargo test`) it runs a seconds-long smoke version. Python: `--python`, else `$TREETRAIN_BENCH_PYTHON`, else the
//! fixture venv made by scripts/fixtures/venv.sh; skipped with a message when none works.

mod common;

use clap::Parser;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use treetrain::generate::{GenerationConfig, Generator};
use treetrain::model::CpuOps;
use treetrain::model::{AttentionLayout, CausalLm, LoadOptions, Model};
use treetrain::util::SplitMix64;

fn prompts(n: usize, vocab: u64, seed: u64) -> Vec<Vec<i64>> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            (0..32 + rng.below(64))
                .map(|_| 3 + rng.below(vocab - 3) as i64)
                .collect()
        })
        .collect()
}

fn median_s(mut f: impl FnMut(), repeats: usize) -> f64 {
    f();
    let mut t: Vec<f64> = (0..repeats)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// Greedy decoding by recomputing the padded batch every step (no cache at all).
fn no_cache(lm: &CausalLm, prompts: &[Vec<i64>], new: usize) {
    let b = prompts.len() as i64;
    let mut rows: Vec<Vec<i64>> = prompts.to_vec();
    let mut pads: Vec<usize> = Vec::new();
    for _ in 0..new {
        let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
        let (mut ids, mut mask, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        pads.clear();
        for r in &rows {
            let pad = longest - r.len();
            pads.push(pad);
            ids.extend(std::iter::repeat_n(0, pad).chain(r.iter().copied()));
            mask.extend(std::iter::repeat_n(0i64, pad).chain(std::iter::repeat_n(1, r.len())));
            pos.extend(std::iter::repeat_n(0i64, pad).chain(0..r.len() as i64));
        }
        let t = longest as i64;
        let on_device = |v: &[i64]| lm.device().from_slice(v).expect("on the device").view([b, t]);
        let layout = AttentionLayout::Padded {
            attention_mask: on_device(&mask),
        };
        let h = tch::no_grad(|| lm.forward_hidden(&on_device(&ids), &on_device(&pos), &layout)).expect("forward");
        let next = lm.logits(&h.select(1, t - 1)).argmax(-1, false);
        let next = Vec::<i64>::try_from(&next).expect("ids");
        for (r, n) in rows.iter_mut().zip(next) {
            r.push(n);
        }
    }
}

/// The generation bench's flags.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    common: common::Common,
    /// Prompts (the batch) of a full run.
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    /// New tokens per prompt in a full run.
    #[arg(long, default_value_t = 64)]
    new: usize,
    /// Interleaved treetrain / transformers pairs.
    #[arg(long, default_value_t = 3)]
    pairs: usize,
    /// Interleaved decode / bandwidth-bound pairs (default 3; 1 in a smoke run).
    #[arg(long)]
    bound_pairs: Option<usize>,
    /// Only the static cache (no growing cache, no recomputation, no groups).
    #[arg(long)]
    static_only: bool,
    /// A decode step split into its weight products, their arithmetic in cache and the
    /// attention over the cache.
    #[arg(long)]
    split: bool,
    /// The step's products over huge pages against copies in libtorch's allocation.
    #[arg(long)]
    pages: bool,
    /// The products through the CPU kernel and through libtorch at 1-256 rows.
    #[arg(long)]
    product_sweep: bool,
    /// (CUDA) decode steps replayed as a CUDA graph against the same steps run eagerly.
    #[arg(long)]
    cuda_graph: bool,
}

fn main() {
    let cli = Cli::parse();
    let args = &cli.common;
    let full = args.full;
    let (n_prompts, new, repeats) = if full { (cli.prompts, cli.new, 3) } else { (2, 4, 1) };
    common::require(args.device());
    let dir = args.model_dir(treetrain::shipped::tiny_model_dir().expect("tiny model"));
    let (device, kind) = (args.device(), args.kind());
    let model = Model::load(
        &dir,
        LoadOptions {
            dtype: Some(kind),
            device,
        },
    )
    .expect("model");
    let lm = &model.lm;
    let ps = prompts(n_prompts, 1700, 11);
    let cfg = GenerationConfig {
        max_new_tokens: new,
        prefill_chunk_size: 32,
        ..Default::default()
    };
    println!(
        "greedy generation, {n_prompts} prompts of 32-95 tokens, {new} new tokens each, {} ({:.1} M parameters) {} on {device:?}, {} threads, median of {repeats}",
        dir.file_name().map_or("?".into(), |f| f.to_string_lossy().into_owned()),
        lm.config.num_parameters() as f64 / 1e6,
        treetrain::model::kind_name(kind),
        tch::get_num_threads()
    );
    let mut g = Generator::new();
    let ours = rates(&mut g, lm, &ps, &cfg, repeats);
    println!("{:<36}{:>12}", "mode", "tokens/s");
    println!(
        "{:<36}{:>12.1}   (decode steps alone: {:.1} tokens/s)",
        "static cache", ours.end_to_end, ours.decode
    );
    let mut results = serde_json::json!({
        "prompts": n_prompts, "new_tokens": new, "threads": tch::get_num_threads(),
        "model": dir.display().to_string(), "device": format!("{device:?}"), "dtype": treetrain::model::kind_name(kind),
        "static_tokens_per_s": ours.end_to_end, "static_decode_tokens_per_s": ours.decode,
    });
    if full && cli.cuda_graph {
        results["cuda_graph"] = graph_comparison(&mut g, lm, &ps, &cfg, repeats);
    }
    if full && cli.split {
        results["decode_split"] = decode_split(lm, n_prompts as i64);
    }
    if full && cli.pages {
        results["pages"] = page_comparison(lm, n_prompts as i64);
    }
    if full && cli.product_sweep {
        results["product_sweep"] = product_sweep(lm);
    }
    // `--static-only`: at real sizes the recomputing baseline alone takes many minutes.
    if !(full && cli.static_only) {
        other_modes(lm, &mut g, &ps, &cfg, (full, repeats), &mut results);
    }
    let pairs = cli.bound_pairs.unwrap_or(if full { 3 } else { 1 });
    let bound = Bound::of(&model, &ps, new);
    bound.report(&mut g, lm, (&ps, &cfg), (repeats, pairs), &mut results);
    if full {
        against_transformers(&cli, &mut g, lm, (&ps, &cfg), &dir, &mut results);
    }
    args.write_result("generation", &results);
}

/// treetrain's static cache against transformers' on the same checkpoint and prompts, in
/// `--pairs` interleaved pairs (skipped with a message without a Python that has both).
fn against_transformers(
    cli: &Cli,
    g: &mut Generator,
    lm: &CausalLm,
    (ps, cfg): (&[Vec<i64>], &GenerationConfig),
    dir: &Path,
    results: &mut serde_json::Value,
) {
    let Some(py) = common::python(cli.common.python.clone(), "transformers, torch") else {
        println!("transformers: skipped (no Python with torch + transformers; see scripts/fixtures/venv.sh)");
        return;
    };
    let (device, kind, new, repeats) = (cli.common.device(), cli.common.kind(), cfg.max_new_tokens, 3);
    let tmp = std::env::temp_dir().join(format!("treetrain-bench-prompts-{}.json", std::process::id()));
    std::fs::write(&tmp, serde_json::to_string(&ps).expect("json")).expect("write prompts");
    let ours = g.generate(lm, ps, cfg).expect("generate");
    let (mut ratios, mut decode_ratios, mut theirs, mut mine, mut same) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), true);
    for _ in 0..cli.pairs {
        let r = rates(g, lm, ps, cfg, repeats);
        let Some((tf, outputs)) = transformers_static(&py, dir, &tmp, new, device, kind) else {
            break;
        };
        same &= outputs
            .iter()
            .zip(&ours)
            .all(|(r, c)| serde_json::json!(c.output_ids) == *r);
        ratios.push(r.end_to_end / tf.end_to_end);
        decode_ratios.push(r.decode / tf.decode);
        mine.push(r);
        theirs.push(tf);
    }
    if ratios.is_empty() {
        return;
    }
    let median_of = |v: &[Rates], f: fn(&Rates) -> f64| common::median(&v.iter().map(f).collect::<Vec<_>>());
    let (tf, ratio) = (median_of(&theirs, |r| r.end_to_end), common::median(&ratios));
    let (tf_decode, decode_ratio) = (median_of(&theirs, |r| r.decode), common::median(&decode_ratios));
    println!(
        "{:<36}{tf:>12.1}   treetrain static is {ratio:.2}x end to end, {decode_ratio:.2}x in decode steps ({tf_decode:.1} tokens/s there); median of {} interleaved pairs (treetrain {:.1}, decode {:.1}); same tokens: {same}",
        "transformers static cache",
        ratios.len(),
        median_of(&mine, |r| r.end_to_end),
        median_of(&mine, |r| r.decode),
    );
    results["transformers_static_tokens_per_s"] = tf.into();
    results["transformers_decode_tokens_per_s"] = tf_decode.into();
    results["speedup_vs_transformers"] = ratio.into();
    results["decode_speedup_vs_transformers"] = decode_ratio.into();
    results["pairwise_ratios"] = serde_json::json!(ratios);
    results["pairwise_decode_ratios"] = serde_json::json!(decode_ratios);
    results["same_tokens_as_transformers"] = same.into();
}

/// The decode steps replayed as a CUDA graph (`--cuda-graph`, CUDA only) against the same
/// generator without one, interleaved in 3 pairs: tokens/s of both, and whether every token
/// is the same.
fn graph_comparison(
    g: &mut Generator,
    lm: &CausalLm,
    ps: &[Vec<i64>],
    cfg: &GenerationConfig,
    repeats: usize,
) -> serde_json::Value {
    let graphed = GenerationConfig {
        cuda_graph: true,
        ..cfg.clone()
    };
    let plain_out = g.generate(lm, ps, cfg).expect("generate");
    let graph_out = match g.generate(lm, ps, &graphed) {
        Ok(out) => out,
        Err(e) => {
            println!("cuda graph: failed: {e}");
            return serde_json::json!({"error": e.to_string()});
        }
    };
    let same = plain_out
        .iter()
        .zip(&graph_out)
        .all(|(a, b)| a.output_ids == b.output_ids);
    let (mut plain, mut graph, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        let p = rates(g, lm, ps, cfg, repeats);
        let q = rates(g, lm, ps, &graphed, repeats);
        ratios.push(q.decode / p.decode);
        plain.push(p.decode);
        graph.push(q.decode);
    }
    let ratio = common::median(&ratios);
    println!(
        "{:<36}{:>12.1}   decode steps {ratio:.2}x without the graph ({:.1} tokens/s); same tokens: {same}",
        "static cache, CUDA graph (decode)",
        common::median(&graph),
        common::median(&plain)
    );
    serde_json::json!({"decode_tokens_per_s": common::median(&graph), "without_decode_tokens_per_s": common::median(&plain),
        "speedup": ratio, "pairwise": ratios, "same_tokens": same})
}

/// One decode step of `batch` rows at a time over a static cache of `slots` slots, kept between
/// `start` and `slots` filled (rolled back when full): the forward and the LM head.
fn decode_step(lm: &CausalLm, batch: i64, slots: i64, start: i64) -> impl FnMut() + '_ {
    use treetrain::model::{KvCache, StaticCache};
    let device = lm.device();
    let mut cache = StaticCache::new(&lm.config, batch, slots, lm.kind(), device).expect("cache");
    let ids = device.zeros(&[batch, 1], tch::Kind::Int64).expect("ids");
    let mask = device.ones(&[batch, 1, 1, slots], tch::Kind::Bool).expect("mask");
    move || {
        if cache.len() + 1 >= slots || cache.len() < start {
            cache.rollback(0).expect("rollback");
            for _ in 0..start {
                cache.advance(1);
            }
        }
        let pos = (device.zeros(&[batch, 1], tch::Kind::Int64).expect("pos") + cache.len()).to_kind(tch::Kind::Int64);
        let h = lm.forward_cached(&ids, &pos, &mut cache, &mask).expect("step");
        let _ = lm
            .decode_logits(&h.select(1, 0))
            .to_kind(tch::Kind::Float)
            .double_value(&[0, 0]);
    }
}

/// Where a decode step's time goes (`--split`): the model's decode step for `batch` rows over a
/// static cache of 160 slots (forward and LM head, medians of 20 steps) against the weight
/// products it runs, each timed alone on the same shapes (every weight read once, as the step
/// reads it), so the rest is the step's other ops: norms, RoPE, cache writes, attention. The
/// same products at one input row read the same bytes with an eighth of the multiply-adds: the
/// kernel's own read rate over these tensors, which the `batch`-row products are held against.
fn decode_split(lm: &CausalLm, batch: i64) -> serde_json::Value {
    let slots = 160;
    let mut step = decode_step(lm, batch, slots, 96);
    let maps = products_at(lm, batch);
    let one_row = products_at(lm, 1);
    // The products' own bound, measured next to them: libtorch's sum of the same weight tensors
    // (one read of each, the same tensors and calls as the products). The step, the products
    // and the sums take turns, so each median comes from the same stretch of the machine's
    // memory bandwidth, which can move when the memory is shared.
    let products = || run_products(&maps);
    let sums = || run_sums(&maps);
    let (in_cache, cache_scale) = in_cache_products(&maps);
    let attention = CacheAttention::new(lm, batch, slots);
    let time_attention = || attention.as_ref().map_or(0.0, |a| median_s(|| a.run(), 1));
    let (mut step_t, mut products_t, mut sums_t, mut cached_t) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut attention_t, mut one_row_t) = (Vec::new(), Vec::new());
    tch::no_grad(|| {
        for _ in 0..20 {
            step_t.push(median_s(&mut step, 1));
            products_t.push(median_s(products, 1));
            one_row_t.push(median_s(|| run_products(&one_row), 1));
            sums_t.push(median_s(sums, 1));
            cached_t.push(median_s(|| run_products(&in_cache), 1) * cache_scale);
            attention_t.push(time_attention());
        }
    });
    let [step_s, products_s, sums_s, cached_s, attention_s, one_row_s] =
        [step_t, products_t, sums_t, cached_t, attention_t, one_row_t].map(|t| common::median(&t));
    let bytes = weight_bytes(&maps);
    let (gbs, sum_gbs) = (bytes / products_s / 1e9, bytes / sums_s / 1e9);
    println!(
        "decode step split (batch {batch}): step {:.2} ms = weight products {:.2} ms ({:.0}%; weights read at {gbs:.1} GB/s, {:.2} of a sum of the same tensors next to them at {sum_gbs:.1}) + the rest {:.2} ms",
        step_s * 1e3,
        products_s * 1e3,
        100.0 * products_s / step_s,
        gbs / sum_gbs,
        (step_s - products_s) * 1e3
    );
    println!(
        "  the same multiply-adds with the weights in cache: {:.2} ms ({:.1} GB/s of weights; {:.1} GFLOP/s): the kernel's arithmetic alone",
        cached_s * 1e3,
        bytes / cached_s / 1e9,
        2.0 * batch as f64 * maps.iter().map(|(m, _)| m.weight.numel() as f64).sum::<f64>() / cached_s / 1e9
    );
    println!(
        "  the same products at 1 row: {:.2} ms ({:.1} GB/s of weights); {batch} rows take {:.2}x that",
        one_row_s * 1e3,
        bytes / one_row_s / 1e9,
        products_s / one_row_s
    );
    let mut split = serde_json::json!({"batch": batch, "step_ms": step_s * 1e3, "products_ms": products_s * 1e3, "products_read_gbs": gbs, "same_tensors_sum_gbs": sum_gbs, "products_in_cache_ms": cached_s * 1e3, "products_one_row_ms": one_row_s * 1e3});
    if let Some(attention) = &attention {
        let kv_gbs = attention.bytes / attention_s / 1e9;
        println!(
            "  of the rest, attention over all {slots} cache slots: {:.2} ms ({:.0} MB of keys and values read at {kv_gbs:.1} GB/s, {:.2} of the weights' sum rate)",
            attention_s * 1e3,
            attention.bytes / 1e6,
            kv_gbs / sum_gbs
        );
        split["attention_ms"] = (attention_s * 1e3).into();
        split["attention_read_gbs"] = kv_gbs.into();
    }
    split
}

/// A decode step's attention alone through the CPU kernel: every layer's query `[batch, heads,
/// 1, d]` over all `slots` of a static cache of its own (zeros; in huge pages like the step's).
/// `None` where the kernel does not apply (off the CPU, other dtypes than f32).
struct CacheAttention {
    q: tch::Tensor,
    keys_values: Vec<(tch::Tensor, tch::Tensor)>,
    valid: tch::Tensor,
    scale: f64,
    bytes: f64,
}

impl CacheAttention {
    fn new(lm: &CausalLm, batch: i64, slots: i64) -> Option<Self> {
        use treetrain::model::{KernelIsa, kernel_isa};
        use treetrain::model::{KvCache, StaticCache};
        let applies = lm.device() == treetrain::device::Device::Cpu
            && lm.kind() == tch::Kind::Float
            && kernel_isa() != KernelIsa::Unsupported;
        if !applies {
            return None;
        }
        let c = &lm.config;
        let device = lm.device();
        let mut cache = StaticCache::new(c, batch, slots, lm.kind(), device).expect("cache");
        let new = tch::Tensor::zeros([batch, c.num_kv_heads, 1, c.head_dim], (lm.kind(), tch::Device::Cpu));
        let keys_values: Vec<_> = (0..c.num_layers as usize)
            .map(|layer| cache.store(layer, &new, &new).expect("store"))
            .collect();
        let bytes = keys_values
            .iter()
            .map(|(k, v)| ((k.numel() + v.numel()) * k.kind().elt_size_in_bytes()) as f64)
            .sum();
        Some(CacheAttention {
            q: tch::Tensor::randn([batch, c.num_heads, 1, c.head_dim], (lm.kind(), tch::Device::Cpu)),
            keys_values,
            valid: tch::Tensor::ones([batch, 1, 1, slots], (tch::Kind::Bool, tch::Device::Cpu)),
            scale: (c.head_dim as f64).powf(-0.5),
            bytes,
        })
    }

    fn run(&self) {
        for (k, v) in &self.keys_values {
            let out = treetrain::bench_support::decode_attention(&self.q, k, v, &self.valid, self.scale);
            assert!(out.is_some(), "the attention kernel applies to f32 CPU tensors");
        }
    }
}

/// The products of `maps` with the weights in cache: each weight's first rows (a block of
/// about 1.5 MiB, split among the threads so that each core's share can stay in its L2; where
/// a core's L2 is smaller than its share, the block is read from L3), run as many times as the
/// whole weight has such blocks, and the factor that scales their time to the full products'
/// multiply-adds. The extra calls add OpenMP fork/joins, so this slightly overstates the
/// arithmetic's time.
fn in_cache_products(
    maps: &[(treetrain::model::Linear, tch::Tensor)],
) -> (Vec<(treetrain::model::Linear, tch::Tensor)>, f64) {
    let (mut blocks, mut full, mut cached) = (Vec::new(), 0.0, 0.0);
    for (map, x) in maps {
        let [out, input] = map.weight.size()[..] else {
            unreachable!("a 2-d weight")
        };
        let rows = ((3 << 19) / (4 * input)).clamp(16, out);
        let block = map.weight.narrow(0, 0, rows);
        for _ in 0..(out + rows / 2) / rows {
            let map = treetrain::model::Linear {
                weight: block.shallow_clone(),
                bias: None,
                adapter: None,
            };
            blocks.push((map, x.shallow_clone()));
            cached += (rows * input) as f64;
        }
        full += (out * input) as f64;
    }
    (blocks, full / cached)
}

/// The weights one decode step multiplies by, in its order (fused q/k/v, o, fused gate/up,
/// down per layer, then the head).
fn step_weights(lm: &CausalLm) -> Vec<tch::Tensor> {
    use treetrain::model::Projections;
    // A projection's shared buffer when tied (its bias left out), else each map's weight.
    fn projection<const N: usize>(p: &Projections<N>) -> Vec<tch::Tensor> {
        match p.buffers() {
            Some((weight, _)) => vec![weight.shallow_clone()],
            None => p.maps().iter().map(|l| l.weight.shallow_clone()).collect(),
        }
    }
    let mut weights: Vec<tch::Tensor> = Vec::new();
    for layer in &lm.layers {
        weights.extend(projection(&layer.self_attn.qkv));
        weights.push(layer.self_attn.o_proj.weight.shallow_clone());
        // The decode bench's models are dense (a mixture's experts are not weights it streams).
        if let Some(mlp) = layer.mlp.dense() {
            weights.extend(projection(&mlp.gate_up));
            weights.push(mlp.down_proj.weight.shallow_clone());
        }
    }
    weights.push(lm.lm_head_weight().shallow_clone());
    weights
}

/// The weight products of one decode step at `batch` rows ([`step_weights`]), each with a
/// random input `[batch, 1, in]`.
fn products_at(lm: &CausalLm, batch: i64) -> Vec<(treetrain::model::Linear, tch::Tensor)> {
    let device = lm.device();
    step_weights(lm)
        .into_iter()
        .map(|w| {
            let x = tch::Tensor::randn([batch, 1, w.size()[1]], (lm.kind(), tch::Device::Cpu));
            let x = device.put(&x).expect("x");
            let map = treetrain::model::Linear {
                weight: w,
                bias: None,
                adapter: None,
            };
            (map, x)
        })
        .collect()
}

/// Every product of `maps` through the decode kernels, as a decode step runs them.
fn run_products(maps: &[(treetrain::model::Linear, tch::Tensor)]) {
    for (map, x) in maps {
        let _ = map.forward_with(x, CpuOps::Kernels);
    }
}

/// One libtorch sum over each weight of `maps`: one read of each, in the products' calls.
fn run_sums(maps: &[(treetrain::model::Linear, tch::Tensor)]) {
    for (map, _) in maps {
        let _ = map.weight.sum(tch::Kind::Float).double_value(&[]);
    }
}

fn weight_bytes(maps: &[(treetrain::model::Linear, tch::Tensor)]) -> f64 {
    maps.iter()
        .map(|(m, _)| (m.weight.numel() * m.weight.kind().elt_size_in_bytes()) as f64)
        .sum()
}

/// The page size's share (`--pages`, f32 CPU): a decode step's weight products at `batch` rows
/// over the model's weights (in huge pages, `treetrain::bench_support::huge_page_empty`) and over copies of
/// them in libtorch's own allocation (4 KiB pages where the THP mode is `madvise`), and a sum of
/// each set, in 20 interleaved rounds; medians of the pairwise time ratios.
fn page_comparison(lm: &CausalLm, batch: i64) -> serde_json::Value {
    let huge = products_at(lm, batch);
    let small: Vec<(treetrain::model::Linear, tch::Tensor)> = huge
        .iter()
        .map(|(m, x)| {
            let map = treetrain::model::Linear {
                weight: m.weight.copy(),
                bias: None,
                adapter: None,
            };
            (map, x.shallow_clone())
        })
        .collect();
    let products = |maps: &[(treetrain::model::Linear, tch::Tensor)]| median_s(|| run_products(maps), 1);
    let sums = |maps: &[(treetrain::model::Linear, tch::Tensor)]| median_s(|| run_sums(maps), 1);
    let (mut p_ratio, mut s_ratio, mut p_ms) = (Vec::new(), Vec::new(), [Vec::new(), Vec::new()]);
    tch::no_grad(|| {
        for round in 0..20 {
            // Alternate which goes first.
            let (ph, ps) = if round % 2 == 0 {
                (products(&huge), products(&small))
            } else {
                let ps = products(&small);
                (products(&huge), ps)
            };
            p_ratio.push(ps / ph);
            p_ms[0].push(ph * 1e3);
            p_ms[1].push(ps * 1e3);
            let (sh, ss) = (sums(&huge), sums(&small));
            s_ratio.push(ss / sh);
        }
    });
    let (pr, sr) = (common::median(&p_ratio), common::median(&s_ratio));
    let (h_ms, s_ms) = (common::median(&p_ms[0]), common::median(&p_ms[1]));
    println!(
        "page size (batch {batch}, 20 interleaved rounds): weight products {h_ms:.2} ms over huge pages, {s_ms:.2} ms over libtorch's allocation: {pr:.2}x (pairwise median); sums of the same tensors {sr:.2}x"
    );
    serde_json::json!({"batch": batch, "products_huge_ms": h_ms, "products_allocator_ms": s_ms, "products_allocator_over_huge": pr, "pairwise_products": p_ratio, "sums_allocator_over_huge": sr, "pairwise_sums": s_ratio})
}

/// Where the weight-product kernel stops paying (`--product-sweep`, f32 CPU): a decode step's
/// products at each row count through the kernel and through libtorch's `linear` (MKL), the
/// two interleaved (kernel, libtorch, ... 5 times, medians of 3 each), the ratio per row count.
/// This is what places `bench_support::KERNEL_ROWS`.
fn product_sweep(lm: &CausalLm) -> serde_json::Value {
    use treetrain::bench_support::product_up_to;
    let mut rows_out = Vec::new();
    println!("weight products of a decode step: kernel vs libtorch (MKL) per row count");
    for rows in [1i64, 8, 32, 64, 128, 192, 256] {
        let maps: Vec<(tch::Tensor, tch::Tensor)> = products_at(lm, rows)
            .into_iter()
            .map(|(m, x)| (m.weight, x.view([rows, -1])))
            .collect();
        let kernel = || {
            for (w, x) in &maps {
                let _ = product_up_to(x, w, None, i64::MAX).expect("the kernel applies (f32 CPU, AVX2 or AVX-512)");
            }
        };
        let libtorch = || {
            for (w, x) in &maps {
                let _ = x.linear(w, None::<&tch::Tensor>);
            }
        };
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        tch::no_grad(|| {
            for _ in 0..5 {
                ours.push(median_s(kernel, 3));
                theirs.push(median_s(libtorch, 3));
            }
        });
        let ratios: Vec<f64> = ours.iter().zip(&theirs).map(|(o, t)| t / o).collect();
        let (k_ms, l_ms, ratio) = (
            common::median(&ours) * 1e3,
            common::median(&theirs) * 1e3,
            common::median(&ratios),
        );
        println!("  {rows:>4} rows: kernel {k_ms:>8.2} ms, libtorch {l_ms:>8.2} ms, libtorch / kernel {ratio:.2}x");
        rows_out.push(serde_json::json!({"rows": rows, "kernel_ms": k_ms, "libtorch_ms": l_ms, "speedup": ratio, "pairwise": ratios}));
    }
    serde_json::Value::Array(rows_out)
}

/// Tokens/s of a generate call end to end (prefill included) and of its decode steps alone.
#[derive(Debug, Clone, Copy)]
struct Rates {
    end_to_end: f64,
    decode: f64,
}

/// What a decode step must read from memory: every weight once, and the KV cache up to each
/// row's position (the CPU attention kernel reads a row's valid slots only; SDPA on other
/// devices reads every slot, so there the cache term is a lower bound).
struct Bound {
    weight_bytes: f64,
    /// Mean over the decode steps of the cache bytes a step reads.
    cache_bytes: f64,
    /// Multiply-adds of a step's weight products: rows x the elements of every weight a
    /// product reads (the layers' linears and the head).
    multiply_adds: f64,
    rows: f64,
    device: treetrain::device::Device,
}

impl Bound {
    fn of(model: &Model, ps: &[Vec<i64>], new: usize) -> Bound {
        let weight_bytes: f64 = model
            .vs
            .variables()
            .values()
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as f64)
            .sum();
        let c = &model.lm.config;
        let elt = model.lm.kind().elt_size_in_bytes() as f64;
        // Keys and values of every layer and kv head, per cached token.
        let per_token = (c.num_layers * 2 * c.num_kv_heads * c.head_dim) as f64 * elt;
        let mean_tokens: f64 = ps.iter().map(|p| p.len() as f64 + new as f64 / 2.0).sum();
        let product_elements: f64 = step_weights(&model.lm).iter().map(|w| w.numel() as f64).sum();
        Bound {
            weight_bytes,
            cache_bytes: per_token * mean_tokens,
            multiply_adds: ps.len() as f64 * product_elements,
            rows: ps.len() as f64,
            device: model.lm.device(),
        }
    }

    /// Tokens/s if a step took only the time to read `bytes` at `gbs`.
    fn tokens_per_s(&self, bytes: f64, gbs: f64) -> f64 {
        self.rows * gbs * 1e9 / bytes
    }

    /// Decode tokens/s against the bound, in `pairs` interleaved (decode, bandwidth) pairs: a
    /// machine's bandwidth can move between runs (where its memory is shared), so each decode
    /// timing is set against a bandwidth measured right after it, and the medians of the pairwise
    /// fractions are reported.
    fn report(
        &self,
        g: &mut Generator,
        lm: &CausalLm,
        (ps, cfg): (&[Vec<i64>], &GenerationConfig),
        (repeats, pairs): (usize, usize),
        results: &mut serde_json::Value,
    ) {
        let (mut fractions, mut with_cache, mut end_to_end, mut bandwidths) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut small_pages, mut matmul_rates, mut of_roofline) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..pairs.max(1) {
            let r = rates(g, lm, ps, cfg, repeats);
            let gbs = common::device_read_bandwidth_gbs(self.device);
            if self.device == treetrain::device::Device::Cpu {
                small_pages.push(common::allocator_read_bandwidth_gbs());
                // The step's products also need their multiply-adds: at the machine's matmul
                // rate, measured in the same pair, they can take as long as the read or longer
                // at small batches in f32 on few cores.
                let gflops = common::matmul_gflops();
                let step_s = (self.weight_bytes / (gbs * 1e9)).max(2.0 * self.multiply_adds / (gflops * 1e9));
                of_roofline.push(r.decode / (self.rows / step_s));
                matmul_rates.push(gflops);
            }
            let bound = self.tokens_per_s(self.weight_bytes, gbs);
            fractions.push(r.decode / bound);
            end_to_end.push(r.end_to_end / bound);
            with_cache.push(r.decode / self.tokens_per_s(self.weight_bytes + self.cache_bytes, gbs));
            bandwidths.push(gbs);
        }
        let gbs = common::median(&bandwidths);
        let bound = self.tokens_per_s(self.weight_bytes, gbs);
        let (fraction, fraction_with_cache) = (common::median(&fractions), common::median(&with_cache));
        println!(
            "{:<36}{bound:>12.1}   ({:.0} MB of weights a step at {gbs:.1} GB/s read; treetrain's decode steps at {fraction:.2} of it, median of {} interleaved pairs {fractions:.2?}; {fraction_with_cache:.2} of the bound with the {:.0} MB of KV cache a step reads on average)",
            "memory-bandwidth bound",
            self.weight_bytes / 1e6,
            fractions.len(),
            self.cache_bytes / 1e6,
        );
        if !small_pages.is_empty() {
            println!(
                "{:<36}{:>12.1}   (GB/s: the same 1 GiB sum over libtorch's allocation, right after each of the above {small_pages:.1?}; the bound's sums are over huge pages {bandwidths:.1?})",
                "  read over libtorch's allocation",
                common::median(&small_pages),
            );
            results["allocator_read_bandwidths_gbs"] = serde_json::json!(small_pages);
            let gflops = common::median(&matmul_rates);
            let arithmetic = self.rows * gflops * 1e9 / (2.0 * self.multiply_adds);
            println!(
                "{:<36}{arithmetic:>12.1}   ({:.2} GFLOP of weight products a step at the matmul rate measured after each pair {matmul_rates:.1?} GFLOP/s; treetrain's decode steps at {:.2} of the slower of the two bounds in each pair {of_roofline:.2?})",
                "arithmetic bound",
                2.0 * self.multiply_adds / 1e9,
                common::median(&of_roofline),
            );
            results["arithmetic_bound_tokens_per_s"] = arithmetic.into();
            results["matmul_gflops"] = serde_json::json!(matmul_rates);
            results["decode_over_roofline"] = common::median(&of_roofline).into();
            results["pairwise_decode_over_roofline"] = serde_json::json!(of_roofline);
        }
        results["bandwidth_bound_tokens_per_s"] = bound.into();
        results["read_bandwidth_gbs"] = gbs.into();
        results["read_bandwidths_gbs"] = serde_json::json!(bandwidths);
        results["static_over_bound"] = common::median(&end_to_end).into();
        results["decode_over_bound"] = fraction.into();
        results["pairwise_decode_over_bound"] = serde_json::json!(fractions);
        results["kv_cache_bytes_per_step"] = self.cache_bytes.into();
        results["decode_over_bound_with_cache"] = fraction_with_cache.into();
    }
}

/// Static-cache [`Rates`]: medians of `repeats` calls with `cfg`'s new tokens and of calls with
/// one new token (prefill and the first choice); decode = the rest of the tokens over the rest
/// of the time.
fn rates(g: &mut Generator, lm: &CausalLm, ps: &[Vec<i64>], cfg: &GenerationConfig, repeats: usize) -> Rates {
    let one = GenerationConfig {
        max_new_tokens: 1,
        ..cfg.clone()
    };
    let full_s = median_s(|| drop(g.generate(lm, ps, cfg).expect("generate")), repeats);
    let first_s = median_s(|| drop(g.generate(lm, ps, &one).expect("generate")), repeats);
    let b = ps.len() as f64;
    Rates {
        end_to_end: b * cfg.max_new_tokens as f64 / full_s,
        decode: b * (cfg.max_new_tokens as f64 - 1.0) / (full_s - first_s).max(1e-9),
    }
}

/// The other decode modes on the same prompts, added to `results`: growing (dynamic) cache, no
/// cache (the padded batch recomputed every step), and GRPO-style groups (4 prompts x G
/// completions) with the prefix shared vs every member prefilled.
fn other_modes(
    lm: &CausalLm,
    g: &mut Generator,
    ps: &[Vec<i64>],
    cfg: &GenerationConfig,
    (full, repeats): (bool, usize),
    results: &mut serde_json::Value,
) {
    let (total, new) = ((ps.len() * cfg.max_new_tokens) as f64, cfg.max_new_tokens);
    let dynamic_s = median_s(|| drop(g.generate_dynamic(lm, ps, cfg).expect("generate")), repeats);
    let none_s = median_s(|| no_cache(lm, ps, new), repeats);
    for (name, s) in [("dynamic cache", dynamic_s), ("no cache (recompute)", none_s)] {
        println!("{name:<36}{:>12.1}", total / s);
    }
    let group = if full { 8 } else { 2 };
    let gp = prompts(4, 1700, 12);
    let shared_s = median_s(
        || drop(g.generate_groups(lm, &gp, group, cfg).expect("groups")),
        repeats,
    );
    let repeated: Vec<Vec<i64>> = gp.iter().flat_map(|p| std::iter::repeat_n(p.clone(), group)).collect();
    let separate_s = median_s(|| drop(g.generate(lm, &repeated, cfg).expect("generate")), repeats);
    let gtotal = (4 * group * new) as f64;
    println!(
        "{:<36}{:>12.1}",
        format!("groups 4x{group}, prefix shared"),
        gtotal / shared_s
    );
    println!(
        "{:<36}{:>12.1}",
        format!("groups 4x{group}, each member prefilled"),
        gtotal / separate_s
    );
    for (key, value) in [
        ("dynamic_tokens_per_s", total / dynamic_s),
        ("no_cache_tokens_per_s", total / none_s),
        ("group_shared_tokens_per_s", gtotal / shared_s),
        ("group_separate_tokens_per_s", gtotal / separate_s),
    ] {
        results[key] = value.into();
    }
    results["group"] = group.into();
}

/// transformers' static-cache greedy `generate` on `dir` for the prompts in `prompts_file`:
/// tokens/s (its median of 3) and the generated ids; `None` (said) when Python fails.
fn transformers_static(
    py: &str,
    dir: &Path,
    prompts_file: &Path,
    new: usize,
    device: treetrain::device::Device,
    kind: tch::Kind,
) -> Option<(Rates, Vec<serde_json::Value>)> {
    let script = common::root().join("scripts/bench/transformers_generate.py");
    let out = Command::new(py)
        .arg(&script)
        .arg(dir)
        .arg(prompts_file)
        .arg(new.to_string())
        .arg("static")
        .arg(match device {
            treetrain::device::Device::Cuda(i) => format!("cuda:{i}"),
            _ => "cpu".into(),
        })
        .arg(treetrain::model::kind_name(kind))
        .output()
        .expect("run python");
    let line = String::from_utf8_lossy(&out.stdout);
    match serde_json::from_str::<serde_json::Value>(line.trim()) {
        Ok(v) => Some((
            Rates {
                end_to_end: v["tokens_per_s"].as_f64().unwrap_or(f64::NAN),
                decode: v["decode_tokens_per_s"].as_f64().unwrap_or(f64::NAN),
            },
            v["outputs"].as_array().cloned().unwrap_or_default(),
        )),
        Err(_) => {
            println!(
                "transformers: failed: {}",
                String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
            );
            None
        }
    }
}
