//! The `treetrain` command line.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use treetrain::EnvReport;
use treetrain::device::{PadTo, Platform};
use treetrain::display::Rich;
use treetrain::shapes::{PaddingComparison, synthetic_lengths};

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
    },
    /// Log-probability of every token given its prefix, for rows of a JSONL file.
    Score(ScoreArgs),
    /// Load a model and write it back as a Hugging Face folder (e.g. to change its dtype).
    Convert {
        /// A model folder or repo id.
        #[arg(long)]
        model: String,
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Output dtype: fp32, bf16 or fp16 (default: unchanged).
        #[arg(long)]
        dtype: Option<String>,
    },
    /// Supervised fine-tuning from a TOML config (fields of `treetrain::sft::SftConfig`).
    Sft {
        /// The config file.
        #[arg(long)]
        config: PathBuf,
        /// Resume from this checkpoint folder.
        #[arg(long)]
        resume_from: Option<PathBuf>,
    },
    /// GRPO from a TOML config (see datasets/grpo.toml); one line per step, log.jsonl and a
    /// final checkpoint in `output_dir`.
    Grpo {
        /// The config file.
        #[arg(long)]
        config: PathBuf,
        /// Override `max_steps`.
        #[arg(long)]
        max_steps: Option<u64>,
        /// Override `mode` (`sync` or `async`).
        #[arg(long)]
        mode: Option<String>,
        /// Override `packing` (`tree` or `flat`).
        #[arg(long)]
        packing: Option<String>,
        /// Resume from this checkpoint folder.
        #[arg(long)]
        resume_from: Option<PathBuf>,
    },
    /// Generate completions with a static KV cache (one JSON line per completion).
    Generate(GenerateArgs),
    /// Pack GRPO rollouts (JSONL) into rows as TRL v1.16 does; one JSON object per row.
    Pack(PackArgs),
    /// Forecast distinct input shapes (= Neuron compiles) with and without padding.
    Shapes(ShapesArgs),
    /// Regenerate the shipped datasets and tiny model files from their seeds (maintainers).
    #[command(hide = true)]
    MakeShippedData {
        /// Target folder (the repository's datasets/).
        #[arg(long, default_value = "datasets")]
        out: PathBuf,
    },
    /// The main job on the shipped defaults: everything treetrain can show on this machine.
    Demo {
        /// Folder for the demo's outputs (report.html, shapes.svg, summary.json).
        #[arg(long, default_value = "demo-out")]
        out: PathBuf,
    },
}

#[derive(clap::Args)]
struct ScoreArgs {
    /// A model folder or a Hugging Face repo id (org/name[@revision]) in the local cache.
    #[arg(long)]
    model: String,
    /// JSONL input: `{"input_ids": [...]}` or `{"text": "..."}` per line (`-` for stdin).
    #[arg(long)]
    input: PathBuf,
    /// Parameter dtype: fp32, bf16 or fp16 (default: the checkpoint's).
    #[arg(long)]
    dtype: Option<String>,
    /// none: one forward per row; flat: rows laid end to end in shared forwards; tree: shared
    /// prefixes forwarded once. All give the same numbers.
    #[arg(long, default_value = "none", value_parser = ["none", "flat", "tree"])]
    packing: String,
    /// Token budget of one packed forward (flat packing).
    #[arg(long, default_value_t = 8192)]
    max_tokens: usize,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A model folder or a Hugging Face repo id (org/name[@revision]) in the local cache.
    #[arg(long)]
    model: String,
    /// JSONL: `{"input_ids": [...]}`, `{"prompt": "..."}` or `{"messages": [...]}` per line.
    #[arg(long)]
    input: PathBuf,
    /// Render `prompt` lines as a user message through the chat template (`messages` always are).
    #[arg(long)]
    chat: bool,
    /// Most new tokens per completion.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Greedy decoding (otherwise sampling).
    #[arg(long)]
    greedy: bool,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Nucleus sampling threshold.
    #[arg(long)]
    top_p: Option<f64>,
    /// Keep the k most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep tokens with at least this fraction of the top token's probability.
    #[arg(long)]
    min_p: Option<f64>,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f64,
    /// Completions per prompt; the prompt is prefilled once and shared.
    #[arg(long, default_value_t = 1)]
    num_generations: usize,
    /// Seed of the sampling draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop strings (each also ends a completion).
    #[arg(long)]
    stop: Vec<String>,
    /// Prefill chunk (prompts are left-padded to a multiple of it).
    #[arg(long, default_value_t = 128)]
    prefill_chunk_size: i64,
    /// Static cache capacity (default: padded prompt + max new tokens).
    #[arg(long)]
    max_cache_len: Option<i64>,
    /// Parameter dtype: fp32, bf16 or fp16 (default: the checkpoint's).
    #[arg(long)]
    dtype: Option<String>,
}

#[derive(clap::Args)]
struct PackArgs {
    /// JSONL: `{"input_ids", "completion_mask", "old_log_probs", "advantage", "group_id"}` per line.
    #[arg(long)]
    input: PathBuf,
    /// Unique-token budget per row; without it every rollout goes into one row, in input order.
    #[arg(long)]
    budget: Option<usize>,
    /// Flat sequence packing instead of the prefix tree.
    #[arg(long)]
    flat: bool,
}

#[derive(clap::Args)]
struct ShapesArgs {
    /// A file of sequence lengths (one integer per line, or JSON lines with "length" or
    /// "input_ids"). Without it, a seeded synthetic chat-length distribution is used.
    #[arg(long)]
    lengths: Option<PathBuf>,
    /// Synthetic sequences when no file is given.
    #[arg(long, default_value_t = 2000)]
    synthetic: usize,
    /// Rows per batch.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// pad_to_multiple_of: auto, none, or a number.
    #[arg(long, default_value = "auto")]
    pad: String,
    /// Platform the policy is resolved for (cpu, cuda, mps, neuron).
    #[arg(long, default_value = "neuron")]
    platform: String,
    /// Seconds one compile costs.
    #[arg(long, default_value_t = 60.0)]
    seconds_per_compile: f64,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Env { json } => {
            let report = EnvReport::collect();
            if json {
                println!("{}", serde_json::to_string_pretty(&report.to_json())?);
            } else {
                print!("{}", report.text());
            }
        }
        Command::Score(args) => score(&args)?,
        Command::Pack(args) => pack(&args)?,
        Command::Generate(args) => generate(&args)?,
        Command::Sft { config, resume_from } => sft(&config, resume_from.as_deref())?,
        Command::Grpo {
            config,
            max_steps,
            mode,
            packing,
            resume_from,
        } => grpo(
            &config,
            max_steps,
            mode.as_deref(),
            packing.as_deref(),
            resume_from.as_deref(),
        )?,
        Command::Convert { model, out, dtype } => {
            let (dir, m) = load_model(&model, dtype.as_deref())?;
            m.save(&out, Some(&dir))?;
            println!("wrote {} ({:?})", out.display(), m.kind());
        }
        Command::Shapes(args) => print!("{}", shapes(&args)?.text()),
        Command::Demo { out } => demo(&out)?,
        Command::MakeShippedData { out } => {
            treetrain::shipped::datasets::write_all(&out).map_err(anyhow::Error::msg)?;
            treetrain::shipped::tiny_model::write_model_files(&out.join("tiny-qwen3")).map_err(anyhow::Error::msg)?;
            println!("wrote {}", out.display());
        }
    }
    Ok(())
}

/// A model folder or cached repo id, loaded on CPU in `dtype` (default: the checkpoint's).
fn load_model(spec: &str, dtype: Option<&str>) -> Result<(PathBuf, treetrain::model::Model)> {
    let dir = treetrain::hub::HubCache::from_env().model_dir(spec)?;
    let dtype = dtype.map(treetrain::model::parse_kind).transpose()?;
    let opts = treetrain::model::LoadOptions {
        dtype,
        device: tch::Device::Cpu,
    };
    let model = treetrain::model::Model::load(&dir, opts)?;
    Ok((dir, model))
}

fn score(args: &ScoreArgs) -> Result<()> {
    use std::io::{BufRead, Write};
    let (dir, model) = load_model(&args.model, args.dtype.as_deref())?;
    let tokenizer = dir
        .join("tokenizer.json")
        .exists()
        .then(|| treetrain::tokenizer::Tokenizer::from_dir(&dir))
        .transpose()?;
    let reader: Box<dyn BufRead> = if args.input.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::io::BufReader::new(
            std::fs::File::open(&args.input).with_context(|| format!("opening {}", args.input.display()))?,
        ))
    };
    let mut rows: Vec<Vec<i64>> = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let where_ = || format!("{}:{}", args.input.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(&line).with_context(|| format!("{}: not JSON", where_()))?;
        let ids: Vec<i64> = if let Some(ids) = v.get("input_ids") {
            serde_json::from_value(ids.clone())
                .with_context(|| format!("{}: input_ids must be a list of integers", where_()))?
        } else if let Some(text) = v.get("text").and_then(|t| t.as_str()) {
            let tok = tokenizer
                .as_ref()
                .with_context(|| format!("{}: a text row needs tokenizer.json in {}", where_(), dir.display()))?;
            tok.encode(text, true)?.into_iter().map(i64::from).collect()
        } else {
            bail!("{}: expected an \"input_ids\" or \"text\" field", where_());
        };
        rows.push(ids);
    }
    let scored: Vec<Vec<f32>> = if args.packing == "tree" {
        score_tree(&model, &rows, args.max_tokens)?
    } else if args.packing == "flat" {
        let mut out = Vec::with_capacity(rows.len());
        let mut start = 0;
        while start < rows.len() {
            let mut end = start + 1;
            let mut tokens = rows[start].len();
            while end < rows.len() && tokens + rows[end].len() <= args.max_tokens {
                tokens += rows[end].len();
                end += 1;
            }
            let batch: Vec<&[i64]> = rows[start..end].iter().map(Vec::as_slice).collect();
            out.extend(
                model
                    .score_packed(&batch)
                    .with_context(|| format!("rows {}..{}", start + 1, end))?,
            );
            start = end;
        }
        out
    } else {
        rows.iter()
            .enumerate()
            .map(|(i, r)| model.score(r).with_context(|| format!("row {}", i + 1)))
            .collect::<Result<_>>()?
    };
    let mut stdout = std::io::stdout().lock();
    for lp in scored {
        writeln!(stdout, "{}", serde_json::json!({ "logprobs": lp }))?;
    }
    Ok(())
}

/// Scores rows through tree packing: every token after the first is a loss term; rows are
/// planned into packed forwards of at most `max_tokens` unique tokens.
fn score_tree(model: &treetrain::model::Model, rows: &[Vec<i64>], max_tokens: usize) -> Result<Vec<Vec<f32>>> {
    use treetrain::pack::{Rollout, plan, row_logprobs};
    let rollouts: Vec<Rollout> = rows
        .iter()
        .enumerate()
        .map(|(i, ids)| Rollout {
            input_ids: ids.clone(),
            completion_mask: (0..ids.len()).map(|p| u8::from(p > 0)).collect(),
            old_log_probs: vec![0.0; ids.len()],
            advantage: 0.0,
            // Distinct groups: the planner then places each row where it adds fewest tokens.
            group_id: i.to_string(),
        })
        .collect();
    let mut out = vec![Vec::new(); rows.len()];
    for tree in plan(rollouts, max_tokens, 1)?.rows() {
        let row = tree.pack();
        let lp = tch::no_grad(|| row_logprobs(&model.lm, &row, Default::default()))?;
        let values = Vec::<f32>::try_from(&lp)?;
        for (v, &seg) in values.iter().zip(&row.segment_id) {
            let original: usize = tree.rollouts()[seg as usize].group_id.parse()?;
            out[original].push(*v);
        }
    }
    Ok(out)
}

fn sft(config: &Path, resume_from: Option<&Path>) -> Result<()> {
    use treetrain::sft::{SftConfig, SftTrainer};
    let cfg = SftConfig::from_toml_file(config)?;
    let mut t = match resume_from {
        Some(ckpt) => SftTrainer::resume_from(cfg, ckpt)?,
        None => SftTrainer::new(cfg)?,
    };
    eprintln!(
        "{} training rows ({} skipped), {} steps",
        t.num_train_rows(),
        t.state.skipped_rows,
        t.state.total_steps
    );
    let bar = indicatif::ProgressBar::new(t.state.total_steps);
    bar.set_position(t.state.global_step);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    while t.state.global_step < t.state.total_steps {
        let m = t.step()?;
        bar.set_position(m.step);
        bar.set_message(format!("loss {:.4} lr {:.2e} grad {:.2}", m.loss, m.lr, m.grad_norm));
        if t.config.eval_steps.is_some_and(|n| m.step % n == 0) {
            bar.println(format!("step {}: eval loss {:.4}", m.step, t.evaluate()?));
        }
        if t.config.save_steps.is_some_and(|n| m.step % n == 0) && t.config.output_dir.is_some() {
            bar.println(format!("saved {}", t.save_checkpoint()?.display()));
        }
    }
    bar.finish();
    if t.config.output_dir.is_some() {
        println!("saved {}", t.save_checkpoint()?.display());
    }
    print!("{}", treetrain::display::Rich::text(&t.state));
    Ok(())
}

fn grpo(
    config: &Path,
    max_steps: Option<u64>,
    mode: Option<&str>,
    packing: Option<&str>,
    resume_from: Option<&Path>,
) -> Result<()> {
    use treetrain::grpo::{GrpoConfig, GrpoTrainer};
    let mut cfg = GrpoConfig::from_toml_file(config)?;
    fn parse<T: serde::de::DeserializeOwned>(field: &str, v: &str) -> Result<T> {
        serde_json::from_value(serde_json::Value::String(v.into())).with_context(|| format!("--{field} {v}"))
    }
    if let Some(n) = max_steps {
        cfg.max_steps = n;
    }
    if let Some(m) = mode {
        cfg.mode = parse("mode", m)?;
    }
    if let Some(p) = packing {
        cfg.packing = parse("packing", p)?;
    }
    let mut t = match resume_from {
        Some(ckpt) => GrpoTrainer::resume_from(cfg, ckpt)?,
        None => GrpoTrainer::new(cfg)?,
    };
    eprintln!(
        "{} prompts ({} skipped), {} steps of {} prompts x {} completions, {:?} rollouts, {:?} packing",
        t.prompts.prompts.len(),
        t.state.skipped_prompts,
        t.state.total_steps,
        t.config.prompts_per_step,
        t.config.num_generations,
        t.config.mode,
        t.config.packing
    );
    let held_out = t.config.eval_dataset.clone().map(|p| t.load_prompts(&p)).transpose()?;
    let evaluate = |t: &GrpoTrainer| -> Result<()> {
        if let Some(prompts) = &held_out {
            let e = t.evaluate(prompts, t.config.eval_samples, t.config.seed ^ 0xe7a1)?;
            let per_fn: Vec<String> = e
                .per_function
                .iter()
                .map(|r| format!("{} {:.3}", r.name, r.mean))
                .collect();
            println!(
                "eval at step {}: reward {:.3} over {} completions ({})",
                e.step,
                e.reward_mean,
                e.completions,
                per_fn.join(", ")
            );
        }
        Ok(())
    };
    evaluate(&t)?;
    while t.state.global_step < t.state.total_steps {
        let m = t.step()?;
        if t.config.eval_steps.is_some_and(|n| m.step % n == 0) {
            evaluate(&t)?;
        }
        let per_fn: Vec<String> = m.rewards.iter().map(|r| format!("{} {:.2}", r.name, r.mean)).collect();
        println!(
            "step {:>4}: reward {:.3} ({}) len {:.1} loss {:+.4} clip {:.3} kl~ {:.1e} ent {:.2} pack {:.2}x stale {} | gen {:.2}s fwd/bwd {:.2}s",
            m.step,
            m.reward_mean,
            per_fn.join(", "),
            m.completion_length,
            m.loss,
            m.clip_ratio,
            m.approx_kl,
            m.entropy,
            m.packing_ratio,
            m.staleness,
            m.generation_s,
            m.forward_backward_s
        );
        if t.config.save_steps.is_some_and(|n| m.step % n == 0) && t.config.output_dir.is_some() {
            println!("saved {}", t.save_checkpoint()?.display());
        }
    }
    if t.config.output_dir.is_some() {
        println!("saved {}", t.save_checkpoint()?.display());
    }
    print!("{}", treetrain::display::Rich::text(&t.state));
    Ok(())
}

fn generate(args: &GenerateArgs) -> Result<()> {
    use std::io::{BufRead, Write};
    use treetrain::generate::{GenerationConfig, Generator, SamplingConfig};
    use treetrain::tokenizer::{ChatOptions, Tokenizer};
    let (dir, model) = load_model(&args.model, args.dtype.as_deref())?;
    let tok = dir
        .join("tokenizer.json")
        .exists()
        .then(|| Tokenizer::from_dir(&dir))
        .transpose()?;
    let file = std::fs::File::open(&args.input).with_context(|| format!("opening {}", args.input.display()))?;
    let mut prompts: Vec<Vec<i64>> = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", args.input.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(&line).with_context(|| format!("{}: not JSON", at()))?;
        let need_tok = || {
            tok.as_ref()
                .with_context(|| format!("{}: text prompts need tokenizer.json in {}", at(), dir.display()))
        };
        let chat = |messages: &serde_json::Value| -> Result<Vec<i64>> {
            let opts = ChatOptions {
                add_generation_prompt: true,
                ..Default::default()
            };
            let ids = need_tok()?.tokenize_chat(messages, &opts).with_context(at)?.input_ids;
            Ok(ids.into_iter().map(i64::from).collect())
        };
        let ids: Vec<i64> = if let Some(ids) = v.get("input_ids") {
            serde_json::from_value(ids.clone()).with_context(|| format!("{}: input_ids must be integers", at()))?
        } else if let Some(m) = v.get("messages") {
            chat(m)?
        } else if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
            if args.chat {
                chat(&serde_json::json!([{"role": "user", "content": p}]))?
            } else {
                need_tok()?.encode(p, true)?.into_iter().map(i64::from).collect()
            }
        } else {
            bail!("{}: expected \"input_ids\", \"prompt\" or \"messages\"", at());
        };
        prompts.push(ids);
    }
    let mut eos = model.lm.config.eos_token_ids.clone();
    if let Some(e) = tok.as_ref().and_then(|t| t.eos_token_id()) {
        eos.push(i64::from(e));
    }
    let pad = tok
        .as_ref()
        .and_then(|t| t.pad_token_id())
        .map(i64::from)
        .or(model.lm.config.pad_token_id)
        .unwrap_or(0);
    let stop_sequences = match &tok {
        Some(t) => args
            .stop
            .iter()
            .map(|s| Ok(t.encode(s, false)?.into_iter().map(i64::from).collect()))
            .collect::<Result<Vec<Vec<i64>>>>()?,
        None if args.stop.is_empty() => Vec::new(),
        None => bail!("--stop needs the model's tokenizer"),
    };
    let cfg = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        eos_token_ids: eos,
        stop_sequences,
        pad_token_id: pad,
        prefill_chunk_size: args.prefill_chunk_size,
        max_cache_len: args.max_cache_len,
        sampling: SamplingConfig {
            do_sample: !args.greedy,
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            seed: args.seed,
        },
    };
    let mut generator = Generator::new();
    let completions = if args.num_generations > 1 {
        generator.generate_groups(&model.lm, &prompts, args.num_generations, &cfg)?
    } else {
        generator.generate(&model.lm, &prompts, &cfg)?
    };
    let mut stdout = std::io::stdout().lock();
    for c in &completions {
        let mut line = serde_json::json!({
            "prompt_index": c.prompt_index,
            "output_ids": c.output_ids,
            "logprobs": c.logprobs,
            "untruncated_logprobs": c.untruncated_logprobs,
            "finish_reason": c.finish_reason.as_str(),
        });
        if let Some(t) = &tok {
            let ids: Vec<u32> = c.output_ids.iter().map(|&i| i as u32).collect();
            line["text"] = t.decode(&ids, true)?.into();
        }
        writeln!(stdout, "{line}")?;
    }
    Ok(())
}

fn pack(args: &PackArgs) -> Result<()> {
    use std::io::{BufRead, Write};
    use treetrain::pack::{Rollout, pack_flat, plan};
    let file = std::fs::File::open(&args.input).with_context(|| format!("opening {}", args.input.display()))?;
    let mut rollouts = Vec::new();
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let r: Rollout = serde_json::from_str(&line).with_context(|| {
            format!(
                "{}:{}: not a rollout (input_ids, completion_mask, old_log_probs, advantage, group_id)",
                args.input.display(),
                i + 1
            )
        })?;
        r.validate(rollouts.len())
            .with_context(|| format!("{}:{}", args.input.display(), i + 1))?;
        rollouts.push(r);
    }
    let groups: Vec<Vec<Rollout>> = match args.budget {
        None => vec![rollouts],
        Some(b) => plan(rollouts, b, 1)?.rows().map(|t| t.rollouts().to_vec()).collect(),
    };
    let mut stdout = std::io::stdout().lock();
    for rs in groups {
        let row = if args.flat {
            pack_flat(&rs)?
        } else {
            let mut t = treetrain::pack::PrefixTree::new();
            for (i, r) in rs.into_iter().enumerate() {
                t.add(r, i)?;
            }
            t.pack()
        };
        writeln!(stdout, "{}", row.to_json())?;
    }
    Ok(())
}

fn shapes(args: &ShapesArgs) -> Result<PaddingComparison> {
    let lengths = match &args.lengths {
        Some(path) => read_lengths(path)?,
        None => synthetic_lengths(args.synthetic, 350.0, 0.7, 8, 4096, 0),
    };
    let pad: PadTo = args.pad.parse()?;
    let platform: Platform = args.platform.parse()?;
    Ok(PaddingComparison::new(
        &lengths,
        args.batch_size,
        pad,
        platform,
        args.seconds_per_compile,
    )?)
}

fn read_lengths(path: &Path) -> Result<Vec<usize>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lengths = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line = line.trim();
        let len = if let Ok(n) = line.parse::<usize>() {
            n
        } else {
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: neither an integer nor JSON", path.display(), i + 1))?;
            if let Some(n) = v.get("length").and_then(|n| n.as_u64()) {
                n as usize
            } else if let Some(ids) = v.get("input_ids").and_then(|a| a.as_array()) {
                ids.len()
            } else {
                bail!(
                    "{}:{}: expected a \"length\" or \"input_ids\" field",
                    path.display(),
                    i + 1
                );
            }
        };
        lengths.push(len);
    }
    Ok(lengths)
}

fn demo(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    println!("== 1. Environment\n");
    let report = EnvReport::collect();
    print!("{}", report.text());

    println!("\n== 2. Shapes: what 2000 chat-length sequences cost in Neuron compiles\n");
    let lengths = synthetic_lengths(2000, 350.0, 0.7, 8, 4096, 0);
    let comparison = PaddingComparison::new(&lengths, 8, PadTo::Auto, Platform::Neuron, 60.0)?;
    print!("{}", comparison.text());

    println!("\n== 3. The shipped tiny Qwen3 scores the shipped conversations\n");
    let dir = treetrain::shipped::tiny_model_dir()?;
    let model = treetrain::model::Model::load(&dir, treetrain::model::LoadOptions::default())?;
    let tok = treetrain::tokenizer::Tokenizer::from_dir(&dir)?;
    print!("{}", model.text());
    let (mut total, mut trained_tokens) = (0f64, 0usize);
    for (messages, _) in treetrain::shipped::datasets::sft_conversations(16, 1) {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        let chat = tok.tokenize_chat(&serde_json::Value::Array(messages), &Default::default())?;
        let ids: Vec<i64> = chat.input_ids.iter().map(|&i| i64::from(i)).collect();
        let lp = model.score(&ids)?;
        // Assistant-only: token t+1 is trained when its mask is 1.
        for (t, v) in lp.iter().enumerate() {
            if chat.assistant_masks[t + 1] == 1 {
                total += f64::from(*v);
                trained_tokens += 1;
            }
        }
    }
    let nll = -total / trained_tokens as f64;
    println!(
        "assistant tokens of 16 conversations: {trained_tokens}, mean NLL {nll:.3} (perplexity {:.1}; uniform over the vocabulary would be {:.1})",
        nll.exp(),
        model.lm.config.vocab_size
    );

    println!("\n== 4. SFT: 30 steps of the tiny model on the shipped conversations (bfd packing)\n");
    let sft_config = treetrain::sft::SftConfig {
        model: dir.display().to_string(),
        dataset: treetrain::shipped::datasets_dir().join("sft/train.parquet"),
        tokenize: treetrain::sft::TokenizeOptions {
            max_length: 256,
            ..Default::default()
        },
        packing: Some("bfd".into()),
        learning_rate: 2e-3,
        warmup_ratio: 0.05,
        max_steps: Some(30),
        ..Default::default()
    };
    let mut sft = treetrain::sft::SftTrainer::new(sft_config)?;
    let sft_before = sft.evaluate()?;
    sft.train_for(30)?;
    let sft_after = sft.evaluate()?;
    println!("held-out loss per assistant token: {sft_before:.3} -> {sft_after:.3}");
    print!("{}", sft.state.text());
    std::fs::write(out.join("sft_curves.svg"), {
        let pts = |f: fn(&treetrain::sft::StepMetrics) -> f64| {
            sft.state.history.iter().map(|m| (m.step as f64, f(m))).collect()
        };
        treetrain::display::LineChart::new("SFT loss", "step", "loss per token")
            .with_series("train", pts(|m| m.loss))
            .to_svg()
    })?;
    drop(sft);
    // GRPO starts from the committed SFT model (360 steps), which speaks the reply format.
    println!(
        "\n== 5. GRPO of the shipped SFT model on the shipped prompts (datasets/grpo.toml), tree-packed updates\n"
    );
    let root = treetrain::shipped::datasets_dir();
    let mut grpo_cfg = treetrain::grpo::GrpoConfig::from_toml_file(&root.join("grpo.toml"))?;
    grpo_cfg.output_dir = Some(out.join("grpo"));
    let _ = std::fs::remove_file(out.join("grpo/log.jsonl"));
    let mut grpo = treetrain::grpo::GrpoTrainer::new(grpo_cfg)?;
    let held_out = grpo.load_prompts(&root.join("grpo/test.parquet"))?;
    let eval_seed = 99;
    let before = grpo.evaluate(&held_out, 8, eval_seed)?;
    let steps = grpo.state.total_steps;
    let t = std::time::Instant::now();
    // The latest batch that carried a learning signal (some non-zero advantage), for section 6.
    let mut shown = None;
    while grpo.state.global_step < steps {
        let m = grpo.step()?;
        if let Some(b) = grpo
            .last_batch
            .as_ref()
            .filter(|b| b.rollouts().iter().any(|r| r.advantage != 0.0))
        {
            shown = Some(b.clone());
        }
        if m.step % 10 == 0 || m.step == 1 {
            println!(
                "step {:>3}: reward {:.3}, completion {:.1} tokens, entropy {:.2}, update packing {:.1}x, {:.2} s",
                m.step, m.reward_mean, m.completion_length, m.entropy, m.packing_ratio, m.step_s
            );
        }
    }
    let grpo_s = t.elapsed().as_secs_f64();
    let after = grpo.evaluate(&held_out, 8, eval_seed)?;
    let per_fn = |e: &treetrain::grpo::EvalResult| {
        e.per_function
            .iter()
            .map(|r| format!("{} {:.3}", r.name, r.mean))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "held-out reward ({} completions: 8 per test prompt): {:.3} ({}) -> {:.3} ({}) after {steps} steps in {grpo_s:.1} s",
        after.completions,
        before.reward_mean,
        per_fn(&before),
        after.reward_mean,
        per_fn(&after)
    );
    print!("{}", grpo.state.text());
    std::fs::write(out.join("grpo_curves.svg"), grpo.state.reward_chart().to_svg())?;
    let checkpoint = grpo.save_checkpoint()?;

    println!("\n== 6. The last informative step's rollouts: tree vs flat packing of the update (forward + backward)\n");
    let batch = shown.or_else(|| grpo.last_batch.clone()).context("no GRPO batch")?;
    let rollouts = batch.rollouts();
    let loss_cfg = grpo.loss_config();
    let budget = grpo.config.token_budget;
    let time_update = |packing: treetrain::grpo::UpdatePacking| -> Result<(f64, treetrain::grpo::UpdateStats)> {
        let rows = treetrain::grpo::pack_rollouts(rollouts.clone(), packing, budget)?;
        let mut best = f64::INFINITY;
        let mut stats = None;
        for _ in 0..3 {
            let s = treetrain::grpo::accumulate_gradients(&grpo.model.lm, None, &rows, &loss_cfg)?;
            best = best.min(s.forward_backward_s * 1e3);
            stats = Some(s);
        }
        Ok((best, stats.context("no update")?))
    };
    let (tree_ms, tree_stats) = time_update(treetrain::grpo::UpdatePacking::Tree)?;
    let (flat_ms, flat_stats) = time_update(treetrain::grpo::UpdatePacking::Flat)?;
    // Only timing: the gradients accumulated here are never applied.
    treetrain::train::zero_grads(&grpo.model.vs);
    println!(
        "step {}, {} rollouts: {} tokens flat, {} forwarded as prefix trees (packing ratio {:.2}); update {flat_ms:.0} ms flat, {tree_ms:.0} ms tree ({:.2}x); loss {:.6} vs {:.6}",
        batch.version + 1,
        rollouts.len(),
        flat_stats.forwarded_tokens,
        tree_stats.forwarded_tokens,
        tree_stats.packing_ratio(),
        flat_ms / tree_ms,
        tree_stats.loss,
        flat_stats.loss
    );
    let completions: Vec<treetrain::generate::Completion> = batch
        .groups
        .iter()
        .flat_map(|g| g.completions.iter().take(2).cloned())
        .collect();
    let prompts: Vec<Vec<i64>> = batch.groups.iter().map(|g| g.prompt_ids.clone()).collect();
    let completions: Vec<treetrain::generate::Completion> = completions
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            c.prompt_index = i / 2;
            c
        })
        .collect();
    let new_tokens = batch.generated_tokens;
    let gen_s = batch.generation_s;
    let generator_shapes = grpo.generation_shapes().map_or(0, |l| l.total_distinct());

    let html = format!(
        "<!doctype html><meta charset=\"utf-8\"><title>treetrain demo</title>{}{}{}{}{}",
        report.html(),
        comparison.html(),
        model.html(),
        treetrain::generate::Completions::new(completions.clone(), &prompts, Some(&tok)).html(),
        grpo.html()
    );
    std::fs::write(out.join("report.html"), html)?;
    std::fs::write(out.join("shapes.svg"), comparison.chart().to_svg())?;
    let summary = serde_json::json!({
        "env": report.to_json(),
        "shapes": {
            "sequences": comparison.sequences,
            "batch_size": comparison.batch_size,
            "platform": comparison.platform.to_string(),
            "compiles_without_padding": comparison.without.compiles(),
            "compiles_with_auto_padding": comparison.with.compiles(),
            "padding_fraction_with_auto": comparison.with.padding_fraction(),
            "compile_minutes_saved": comparison.seconds_saved() / 60.0,
        },
        "tiny_model": {
            "parameters": model.lm.config.num_parameters(),
            "assistant_tokens_scored": trained_tokens,
            "mean_nll": nll,
        },
        "sft": {
            "steps": 30,
            "held_out_loss_before": sft_before,
            "held_out_loss_after": sft_after,
        },
        "grpo": {
            "steps": steps,
            "seconds": grpo_s,
            "held_out_reward_before": before.reward_mean,
            "held_out_reward_after": after.reward_mean,
            "held_out_before": before,
            "held_out_after": after,
            "train_reward_first_step": grpo.state.history.first().map(|m| m.reward_mean),
            "train_reward_last_step": grpo.state.history.last().map(|m| m.reward_mean),
            "generated_tokens_last_step": new_tokens,
            "generation_tokens_per_s_last_step": new_tokens as f64 / gen_s.max(1e-9),
            "generation_distinct_shapes": generator_shapes,
        },
        "tree_packing": {
            "rollouts": rollouts.len(),
            "flat_tokens": flat_stats.forwarded_tokens,
            "tree_tokens": tree_stats.forwarded_tokens,
            "packing_ratio": tree_stats.packing_ratio(),
            "flat_update_ms": flat_ms,
            "tree_update_ms": tree_ms,
            "tree_speedup": flat_ms / tree_ms,
            "loss_tree": tree_stats.loss,
            "loss_flat": flat_stats.loss,
        }
    });
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    println!(
        "\nWrote {0}/report.html, {0}/shapes.svg, {0}/sft_curves.svg, {0}/grpo_curves.svg, {0}/grpo/log.jsonl, {1}, {0}/summary.json",
        out.display(),
        checkpoint.display()
    );
    Ok(())
}
