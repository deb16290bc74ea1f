//! `treetrain generate`: completions with a static KV cache, one JSON line each.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use treetrain::generate::{FinishReason, GenerationConfig, Generator, SamplingConfig, StopStrings};
use treetrain::model::{Dtype, SpecialTokens};
use treetrain::tokenizer::{ChatOptions, Tokenizer};

/// Arguments of `generate`.
#[derive(clap::Args)]
pub(crate) struct GenerateArgs {
    /// A model folder or a Hugging Face repo id (org/name[@revision]) in the local cache.
    #[arg(long)]
    model: String,
    /// A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) for the
    /// model, applied (merged into the weights for speed).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Where the model runs: cpu, cuda, cuda:N, mps, neuron, neuron:N (a PrivateUse1 backend
    /// loaded from TREETRAIN_PRIVATEUSE1_LIB) or auto.
    #[arg(long, default_value = "cpu")]
    device: treetrain::device::DeviceSpec,
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
    /// Stop strings, matched on the text (across tokens or inside one); the completion's text
    /// ends with the string.
    #[arg(long)]
    stop: Vec<String>,
    /// Prefill chunk (prompts are left-padded to a multiple of it).
    #[arg(long, default_value_t = 128)]
    prefill_chunk_size: i64,
    /// Static cache capacity (default: padded prompt + max new tokens).
    #[arg(long)]
    max_cache_len: Option<i64>,
    /// Parameter dtype: fp32, bf16 or fp16 (default: the checkpoint's).
    #[arg(long, value_parser = super::choice::<Dtype>("--dtype"))]
    dtype: Option<Dtype>,
    /// On CUDA: replay the decode step as a captured CUDA graph.
    #[arg(long)]
    cuda_graph: bool,
}

/// Runs `generate`.
pub(crate) fn run(args: &GenerateArgs) -> Result<()> {
    anyhow::ensure!(args.num_generations >= 1, "--num-generations 0: must be at least 1");
    let (dir, model) = super::load_model(&super::ModelSpec {
        model: &args.model,
        dtype: args.dtype,
        device: args.device,
        adapter: args.adapter.as_deref(),
        adapter_use: super::AdapterUse::Merged,
    })?;
    let tok = super::tokenizer_of(&dir)?.map(std::sync::Arc::new);
    let prompts = read_prompts(args, tok.as_deref(), &dir)?;
    let cfg = generation_config(args, tok.clone(), &model.lm.config)?;
    let mut generator = Generator::new();
    let completions = if args.num_generations > 1 {
        generator.generate_groups(&model.lm, &prompts, args.num_generations, &cfg)?
    } else {
        generator.generate(&model.lm, &prompts, &cfg)?
    };
    super::jsonl::write(completions.iter().map(|c| {
        let mut line = serde_json::json!({
            "prompt_index": c.prompt_index,
            "output_ids": c.output_ids,
            "logprobs": c.logprobs,
            "untruncated_logprobs": c.untruncated_logprobs,
            "finish_reason": c.finish_reason.as_str(),
        });
        if let Some(t) = &tok {
            let ids: Vec<u32> = c.output_ids.iter().map(|&i| i as u32).collect();
            match t.decode(&ids, true) {
                // A stop string may end inside the last token: the text ends with it.
                Ok(text) => match (&cfg.stop_strings, c.finish_reason) {
                    (Some(stops), FinishReason::Stop) => line["text"] = stops.cut(&text).into(),
                    _ => line["text"] = text.into(),
                },
                Err(e) => line["decode_error"] = e.to_string().into(),
            }
        }
        line
    }))
}

/// The prompt ids of every input line.
fn read_prompts(args: &GenerateArgs, tok: Option<&Tokenizer>, dir: &std::path::Path) -> Result<Vec<Vec<i64>>> {
    let mut prompts = Vec::new();
    for line in super::jsonl::read(&args.input)? {
        let at = line.at.as_str();
        let need_tok = || tok.with_context(|| format!("{at}: text prompts need tokenizer.json in {}", dir.display()));
        let chat = |messages: &serde_json::Value| -> Result<Vec<i64>> {
            let opts = ChatOptions {
                add_generation_prompt: true,
                ..Default::default()
            };
            let ids = need_tok()?
                .tokenize_chat(messages, &opts)
                .context(at.to_string())?
                .input_ids;
            Ok(ids.into_iter().map(i64::from).collect())
        };
        let v = &line.value;
        let ids: Vec<i64> = if let Some(ids) = v.get("input_ids") {
            serde_json::from_value(ids.clone()).with_context(|| format!("{at}: input_ids must be integers"))?
        } else if let Some(m) = v.get("messages") {
            chat(m)?
        } else if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
            if args.chat {
                chat(&serde_json::json!([{"role": "user", "content": p}]))?
            } else {
                need_tok()?.encode(p, true)?.into_iter().map(i64::from).collect()
            }
        } else {
            bail!("{at}: expected \"input_ids\", \"prompt\" or \"messages\"");
        };
        prompts.push(ids);
    }
    Ok(prompts)
}

fn generation_config(
    args: &GenerateArgs,
    tok: Option<std::sync::Arc<Tokenizer>>,
    model: &treetrain::model::ModelConfig,
) -> Result<GenerationConfig> {
    let special = SpecialTokens::resolve(tok.as_deref(), model);
    let stop_strings = match tok {
        _ if args.stop.is_empty() => None,
        Some(t) => Some(StopStrings::new(args.stop.clone(), t)),
        None => bail!("--stop needs the model's tokenizer (stop strings are matched on the text)"),
    };
    Ok(GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        eos_token_ids: special.eos,
        stop_sequences: Vec::new(),
        stop_strings,
        pad_token_id: special.pad,
        prefill_chunk_size: args.prefill_chunk_size,
        max_cache_len: args.max_cache_len,
        cuda_graph: args.cuda_graph,
        sampling: SamplingConfig {
            do_sample: !args.greedy,
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            token_limit: special.token_limit,
            seed: args.seed,
            first_row: 0,
        },
    })
}
