//! Decoder-only language models (Qwen3, Qwen2/2.5, Llama, Qwen3-MoE, Muse Spark's text decoder)
//! in tch, loaded from Hugging Face checkpoints.
//!
//! - [`HfConfig`] mirrors `config.json`; [`HfConfig::validate`] turns it into a [`ModelConfig`]
//!   or an error naming the unsupported field.
//! - [`CausalLm`] holds parameters under their PyTorch `state_dict` names
//!   (`model.layers.0.self_attn.q_proj.weight`, ...) and runs one forward for every
//!   [`AttentionLayout`] (padded batch, packed rows, explicit masks).
//! - [`Model`] ties the two to a var store: load (sharded safetensors, dtype conversion),
//!   seeded initialisation, save as a folder transformers loads unchanged.
//! - [`target_logprobs`] scores tokens through a chunked LM head.
//! - [`lora`]: LoRA adapters in PEFT's format, attached with [`Model::add_lora`] or
//!   [`Model::load_adapter`].
//! - [`FeedForward`]: a layer's feed-forward block, dense or a [`moe`] mixture of experts,
//!   chosen per layer from the config.
//! - [`DecoderParts`]: everything else that differs between families (q/k norms, norm and
//!   residual kinds, sliding windows and NoPE layers, the embedding's norm, the logits'
//!   softcap), chosen once from the config; [`Norm`], [`Residual`] and the windowed masks
//!   (`window`) are its parts.
//!
//! # What is supported, and how it is checked
//!
//! Qwen3 (q/k RMSNorm), Qwen2/2.5 (q/k/v bias), Llama (RoPE scaling `llama3` and `linear`) and
//! Qwen3-MoE (Qwen3's attention, routed experts in the sparse layers), Muse Spark Open's text
//! decoder (`muse_spark`: its `text_config`, the towers skipped at load and carried through
//! saves), grouped-query attention, tied or untied embeddings. [`HfConfig`] reads transformers 4 and 5
//! spellings (`rope_theta` / `rope_scaling` or `rope_parameters`, `torch_dtype` or `dtype`,
//! `eos_token_id` int or list); anything unsupported (sliding windows outside Muse Spark, other RoPE types, other
//! activations) is an error naming the field. Sharded safetensors load through
//! `model.safetensors.index.json`; pickle weights are refused.
//!
//! Checked against transformers 5.23 on tiny random checkpoints it saved itself
//! (`tests/fixtures/models`, made by `scripts/fixtures/make_model_fixtures.py`): logits within 1e-4
//! in fp32 for Qwen3, Qwen3 tied with GQA (a bf16 file), Qwen2 (sharded), Llama 3 scaling (a v4
//! config) and Llama linear scaling with biases; Qwen3-MoE's logits, greedy generation,
//! load-balancing loss and gradients in both checkpoint layouts (`tests/moe.rs`, fixtures made
//! by `scripts/fixtures/make_moe_fixtures.py`); Muse Spark's log-probs, greedy generation past
//! its window, gradients and PEFT adapters (`tests/muse_spark.rs`, fixtures made by
//! `scripts/fixtures/make_muse_fixtures.py`). A checkpoint saved by treetrain loads in
//! transformers with no missing or unexpected weights and the same log-probs
//! (`tests/model_save.rs`).

mod attention;
mod cache;
mod config;
pub(crate) mod cpu_kernels;
mod decoder;
mod device_check;
mod error;
mod feed_forward;
mod gqa;
mod hooks;
pub(crate) mod host_memory;
mod layers;
mod layout;
mod loaded;
mod logprobs;
pub mod lora;
mod mlp;
pub mod moe;
mod muse_spark;
mod norm;
mod parts;
mod passthrough;
mod projection;
mod recompute;
mod residual;
mod rope;
mod safetensors_out;
mod save;
mod sdpa;
mod seeded;
mod special;
mod truncation;
mod view;
mod weights;
mod window;

pub(crate) use crate::device::parse_kind;
pub use crate::device::{Dtype, DtypeSetting, UnknownDtype};
pub use attention::{Attention, KeyValues, OutputGate};
pub(crate) use cache::DynamicCache;
pub use cache::{KvCache, StaticCache};
pub use config::{Architecture, HfConfig, ModelConfig, OneOrMany, RopeScaling};
pub use cpu_kernels::{CpuOps, KernelIsa, kernel_isa};
pub use decoder::{CausalLm, DecoderLayer};
pub(crate) use device_check::device_check_enabled;
pub use device_check::{DEVICE_CHECK_ENV, DeviceCheck, check_device};
pub use error::ModelError;
pub use feed_forward::FeedForward;
pub(crate) use hooks::{GradReduction, ParamUnit, Pass, PassHooks, Phase, Residency};
pub use layers::{Linear, LinearAdapter, RmsNorm};
pub use layout::{AttentionLayout, KeySource, QUERY_BLOCK, QueryBlock, SegmentAttention, SegmentBatch, SegmentLayout};
pub use loaded::{LoadOptions, Model, TrainingMode};
pub(crate) use logprobs::head_logits;
pub use logprobs::{LmHead, LogprobChunks, nll_backward_chunked, target_logprobs, target_logprobs_and_entropy};
pub use mlp::Mlp;
pub use norm::Norm;
pub use parts::{DecoderParts, LayerAttention, LayerNorms, LogitSoftcap, QkNorm};
pub use projection::{Projected, Projections};
pub use recompute::{Activations, Inputs};
pub use residual::Residual;
pub(crate) use safetensors_out::SafetensorsOut;
pub use save::{kind_name, refuse_overlap};
pub use sdpa::{AttentionCall, SdpaKernel, sdpa_kernels};
pub(crate) use seeded::SEED_FILE;
pub use special::SpecialTokens;
pub use truncation::Truncation;
pub use weights::write_safetensors;
pub(crate) use weights::{all_finite, load_into, weights_fingerprint, write_json};
pub use window::Masked;
