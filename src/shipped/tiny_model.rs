//! The shipped tiny Qwen3: its config, a byte-level BPE tokenizer trained on the shipped text,
//! a Qwen-style chat template, and weights made from a seed on first use.

use std::path::{Path, PathBuf};

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, DecoderWrapper, ModelWrapper, PostProcessorWrapper, PreTokenizerWrapper};

use super::datasets::corpus;
use crate::model::{LoadOptions, Model, ModelError, SEED_FILE};

/// Vocabulary size of the tiny tokenizer and model.
pub(crate) const VOCAB_SIZE: usize = 2048;
/// Seed of the initial weights.
pub(crate) const WEIGHT_SEED: u64 = 20261015;
/// Std of the initial weights (transformers' default `initializer_range`).
pub(crate) const WEIGHT_STD: f64 = 0.02;

/// Special tokens, in id order after training (ids 0, 1, 2).
pub(crate) const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The chat template: ChatML turns; assistant replies wrapped in `{% generation %}` so
/// assistant-only loss masks come from the template itself. With `tools` (transformers'
/// `tools=`), a system turn lists their schemas (one JSON object a line) after the system
/// prompt and says how to call one: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
/// in the assistant's reply, the form structured `tool_calls` render in too. Tool results come
/// back in a user turn as `<tool_response>...</tool_response>`, as Qwen's templates do.
/// Conversations without tools render as they always did.
pub(crate) const CHAT_TEMPLATE: &str = "{%- if tools %}\n\
{{- '<|im_start|>system\\n' }}\n\
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n\
{{- '# Tools\\nTo call one: <tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call>' }}\n\
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n\
{{- '<|im_end|>\\n' }}\n\
{%- endif %}\n\
{%- for message in messages %}\n\
{%- if tools and loop.first and message.role == 'system' %}\n\
{%- elif message.role == 'assistant' %}\n\
{{- '<|im_start|>assistant\\n' }}\n\
{%- generation %}\n\
{{- message.content or '' }}\n\
{%- for call in message.tool_calls or [] %}\n\
{%- set f = call.function or call %}\n\
{%- set args = f.arguments if f.arguments is string else (f.arguments | tojson) %}\n\
{{- '<tool_call>{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' + args + '}</tool_call>' }}\n\
{%- endfor %}\n\
{{- '<|im_end|>' }}\n\
{%- endgeneration %}\n\
{{- '\\n' }}\n\
{%- elif message.role == 'tool' %}\n\
{{- '<|im_start|>user\\n<tool_response>' + message.content + '</tool_response><|im_end|>\\n' }}\n\
{%- else %}\n\
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n\
{%- endif %}\n\
{%- endfor %}\n\
{%- if add_generation_prompt %}\n\
{{- '<|im_start|>assistant\\n' }}\n\
{%- endif %}";

/// Trains the byte-level BPE tokenizer on the shipped corpus (deterministic).
pub(crate) fn train_tokenizer() -> Result<tokenizers::Tokenizer, String> {
    let mut tok = tokenizers::Tokenizer::new(ModelWrapper::BPE(BPE::default()));
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true))));
    tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
    tok.with_post_processor(Some(PostProcessorWrapper::ByteLevel(ByteLevel::new(
        false, false, true,
    ))));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS.iter().map(|s| AddedToken::from(*s, true)).collect();
    let mut trainer = TrainerWrapper::BpeTrainer(
        BpeTrainer::builder()
            .vocab_size(VOCAB_SIZE)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(specials)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build(),
    );
    let mut texts = corpus();
    // Role names appear in every rendered chat.
    texts.extend(["system\n", "user\n", "assistant\n"].iter().map(|s| s.repeat(50)));
    tok.train(&mut trainer, texts.iter()).map_err(|e| e.to_string())?;
    // Markup the template and the model write whole: one token each (as in Qwen's vocabulary),
    // not the many pieces the task text's BPE would split them into.
    tok.add_tokens(vec![
        AddedToken::from("<think>", false),
        AddedToken::from("</think>", false),
        AddedToken::from("<tool_call>", false),
        AddedToken::from("</tool_call>", false),
        AddedToken::from("<tool_response>", false),
        AddedToken::from("</tool_response>", false),
    ])
    .map_err(|e| e.to_string())?;
    Ok(tok)
}

/// `config.json` of the tiny model (3.7 M parameters, tied embeddings, GQA 4/2).
pub fn config(eos_id: i64, pad_id: i64) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "attention_bias": false,
        "tie_word_embeddings": true,
        "use_sliding_window": false,
        "bos_token_id": null,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
        "initializer_range": WEIGHT_STD,
    })
}

/// `tokenizer_config.json` of the tiny model.
pub fn tokenizer_config() -> serde_json::Value {
    serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": null,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": false,
        "chat_template": CHAT_TEMPLATE,
    })
}

/// Writes config, tokenizer and templates of the tiny model into `dir` (not the weights:
/// `ensure_weights` makes those on first use).
pub fn write_model_files(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let tok = train_tokenizer()?;
    let id = |t: &str| {
        tok.token_to_id(t)
            .map(i64::from)
            .ok_or_else(|| format!("{t} missing from the vocabulary"))
    };
    let pretty = |v: &serde_json::Value| {
        serde_json::to_string_pretty(v)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string())
    };
    std::fs::write(
        dir.join("config.json"),
        pretty(&config(id("<|im_end|>")?, id("<|endoftext|>")?))?,
    )
    .map_err(|e| e.to_string())?;
    std::fs::write(dir.join("tokenizer_config.json"), pretty(&tokenizer_config())?).map_err(|e| e.to_string())?;
    tok.save(dir.join("tokenizer.json"), true).map_err(|e| e.to_string())?;
    let init = serde_json::json!({"seed": WEIGHT_SEED, "std": WEIGHT_STD});
    std::fs::write(dir.join(SEED_FILE), pretty(&init)?).map_err(|e| e.to_string())?;
    Ok(())
}

/// The settings that make the tiny model a mixture of experts (`tiny-qwen3-moe`): Qwen3-MoE
/// with 8 experts of width 128, 2 a token, in layers 1 to 3 (layer 0 dense, from
/// `mlp_only_layers`); attention, tokenizer and seed as the tiny model's.
pub fn mixture_config(eos_id: i64, pad_id: i64) -> serde_json::Value {
    let mut config = config(eos_id, pad_id);
    let mixture = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "norm_topk_prob": true,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": false,
    });
    for (key, value) in mixture.as_object().into_iter().flatten() {
        config[key] = value.clone();
    }
    config
}

/// Writes the tiny mixture's files into `dir`: the tiny model's, with [`mixture_config`].
pub fn write_mixture_files(dir: &Path) -> Result<(), String> {
    write_variant_files(dir, mixture_config)
}

/// Writes the tiny model's files into `dir` with the `config.json` that `config` makes of its
/// EOS and padding ids.
fn write_variant_files(dir: &Path, config: fn(i64, i64) -> serde_json::Value) -> Result<(), String> {
    write_model_files(dir)?;
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    let id = |key: &str| base[key].as_i64().ok_or_else(|| format!("config.json lacks {key}"));
    let text =
        serde_json::to_string_pretty(&config(id("eos_token_id")?, id("pad_token_id")?)).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("config.json"), text + "\n").map_err(|e| e.to_string())
}

/// `config.json` of the tiny Muse Spark (`tiny-muse-spark`): Muse Spark's text decoder at the
/// tiny model's attention sizes, a window of 32 positions on layers 0 to 2 (layer 3 full and
/// without RoPE, as the released checkpoint's every fourth), layer 0 dense and layers 1 to 3
/// with 8 sigmoid-routed experts of width 128, 2 a token, at a width of 128 between the
/// projections. The towers' placeholder ids are the released checkpoint's, outside this
/// vocabulary; no tower is configured (treetrain loads none).
pub fn muse_spark_config(eos_id: i64, pad_id: i64) -> serde_json::Value {
    let base = config(eos_id, pad_id);
    let mut text = serde_json::json!({
        "model_type": "muse_spark_text",
        "sliding_window": 32,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "moe_hidden_size": 128,
        "routed_scaling_factor": 1.0,
        "output_multiplier": 0.5,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": false,
        "bos_token_id": null,
    });
    for key in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
    ] {
        text[key] = base[key].clone();
    }
    serde_json::json!({
        "architectures": ["MuseSparkForConditionalGeneration"],
        "model_type": "muse_spark",
        "text_config": text,
        "tie_word_embeddings": false,
        "dtype": "float32",
    })
}

/// Writes the tiny Muse Spark's files into `dir`: the tiny model's, with [`muse_spark_config`].
pub fn write_muse_spark_files(dir: &Path) -> Result<(), String> {
    write_variant_files(dir, muse_spark_config)
}

/// The tiny model's folder, checked loadable (its weights are made from the seed in
/// `treetrain_init.json` on first load).
pub(crate) fn ensure_weights(dir: &Path) -> Result<PathBuf, ModelError> {
    if !dir.join("model.safetensors").exists() {
        Model::load(dir, LoadOptions::default())?;
    }
    Ok(dir.to_path_buf())
}
