//! `treetrain score`: the log-probability of every token given its prefix, per row.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use treetrain::model::{Dtype, Model};
use treetrain::pack::{FlatRow, PrefixTree, Rollout, RowBuilder, plan_rows, row_logprobs};

/// How rows are forwarded (all give the same numbers).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ScorePacking {
    /// One forward per row.
    None,
    /// Rows laid end to end in shared forwards.
    Flat,
    /// Shared prefixes forwarded once.
    Tree,
}

/// Arguments of `score`.
#[derive(clap::Args)]
pub(crate) struct ScoreArgs {
    /// A model folder or a Hugging Face repo id (org/name[@revision]) in the local cache.
    #[arg(long)]
    model: String,
    /// A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) for the
    /// model, applied (computed beside the base weights, as PEFT does).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Where the model runs: cpu, cuda, cuda:N, mps, neuron, neuron:N (a PrivateUse1 backend
    /// loaded from TREETRAIN_PRIVATEUSE1_LIB) or auto.
    #[arg(long, default_value = "cpu")]
    device: treetrain::device::DeviceSpec,
    /// JSONL input: `{"input_ids": [...]}` or `{"text": "..."}` per line (`-` for stdin).
    #[arg(long)]
    input: PathBuf,
    /// Parameter dtype: fp32, bf16 or fp16 (default: the checkpoint's).
    #[arg(long, value_parser = super::choice::<Dtype>("--dtype"))]
    dtype: Option<Dtype>,
    /// none: one forward per row; flat: rows laid end to end in shared forwards; tree: shared
    /// prefixes forwarded once. All give the same numbers.
    #[arg(long, default_value = "none", value_parser = super::choice::<ScorePacking>("--packing"))]
    packing: ScorePacking,
    /// Token budget of one packed forward (a longer row is forwarded alone).
    #[arg(long, default_value_t = 8192)]
    max_tokens: usize,
}

/// Runs `score`.
pub(crate) fn run(args: &ScoreArgs) -> Result<()> {
    let (dir, model) = super::load_model(&super::ModelSpec {
        model: &args.model,
        dtype: args.dtype,
        device: args.device,
        adapter: args.adapter.as_deref(),
        adapter_use: super::AdapterUse::Attached,
    })?;
    let tokenizer = super::tokenizer_of(&dir)?;
    let (mut rows, mut ats): (Vec<Vec<i64>>, Vec<String>) = (Vec::new(), Vec::new());
    for line in super::jsonl::read(&args.input)? {
        let ids: Vec<i64> = if let Some(ids) = line.value.get("input_ids") {
            serde_json::from_value(ids.clone())
                .with_context(|| format!("{}: input_ids must be a list of integers", line.at))?
        } else if let Some(text) = line.value.get("text").and_then(|t| t.as_str()) {
            let tok = tokenizer
                .as_ref()
                .with_context(|| format!("{}: a text row needs tokenizer.json in {}", line.at, dir.display()))?;
            tok.encode(text, true)?.into_iter().map(i64::from).collect()
        } else {
            bail!("{}: expected an \"input_ids\" or \"text\" field", line.at);
        };
        check_row(&model.lm.config, &ids).with_context(|| line.at.clone())?;
        rows.push(ids);
        ats.push(line.at);
    }
    let scored: Vec<Vec<f32>> = match args.packing {
        ScorePacking::None => rows
            .iter()
            .enumerate()
            .map(|(i, r)| model.score(r).with_context(|| ats[i].clone()))
            .collect::<Result<_>>()?,
        ScorePacking::Flat => score_packed::<FlatRow>(&model, &rows, args.max_tokens)?,
        ScorePacking::Tree => score_packed::<PrefixTree>(&model, &rows, args.max_tokens)?,
    };
    // NaN or infinite log-probs are a broken model or device, never a result to write.
    if let Some((row, at)) = scored
        .iter()
        .enumerate()
        .find_map(|(r, lp)| lp.iter().position(|x| !x.is_finite()).map(|p| (r, p)))
    {
        bail!(
            "{}: the log-prob of token {} is {} on device {}: the model or the device computes garbage",
            ats[row],
            at + 1,
            scored[row][at],
            model.device()
        );
    }
    super::jsonl::write(scored.into_iter().map(|lp| serde_json::json!({ "logprobs": lp })))
}

/// A row every packing can score: ids in the vocabulary, no longer than the model's positions
/// (checked before any forward, so no mode fails half-way or runs out of memory on it).
fn check_row(config: &treetrain::model::ModelConfig, ids: &[i64]) -> Result<()> {
    anyhow::ensure!(!ids.is_empty(), "the row has no tokens");
    if let Some((i, t)) = ids
        .iter()
        .enumerate()
        .find(|(_, t)| !(0..config.vocab_size).contains(*t))
    {
        bail!("token {i} is {t}, outside the vocabulary 0..{}", config.vocab_size);
    }
    config
        .check_positions(ids.len(), "the row")
        .map_err(anyhow::Error::msg)?;
    // Without a position limit in the config, a forward's attention scores (heads x t x t,
    // f32) bound what fits.
    let attention = config.num_heads as u128 * (ids.len() as u128).pow(2) * 4;
    match treetrain::device::host_shortfall(attention) {
        Some(free) => bail!(
            "a row of {} tokens needs {:.1} GB of attention scores; {:.1} GB of memory is available",
            ids.len(),
            attention as f64 / 1e9,
            free as f64 / 1e9
        ),
        None => Ok(()),
    }
}

/// Scores rows through the packing planner: every token after the first is a loss term; rows
/// are planned into packed forwards of at most `max_tokens` tokens (a longer row alone).
fn score_packed<R: RowBuilder>(model: &Model, rows: &[Vec<i64>], max_tokens: usize) -> Result<Vec<Vec<f32>>> {
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
    let budget = rows.iter().map(Vec::len).max().unwrap_or(1).max(max_tokens);
    let mut out = vec![Vec::new(); rows.len()];
    for planned in plan_rows::<R>(rollouts, budget, 1)?.rows() {
        let row = planned.pack();
        let lp = tch::no_grad(|| row_logprobs(&model.lm, &row, Default::default()))?;
        let values = Vec::<f32>::try_from(&lp)?;
        for (v, &seg) in values.iter().zip(&row.segment_id) {
            out[planned.sources()[seg as usize]].push(*v);
        }
    }
    Ok(out)
}
