//! treetrain: language-model training in Rust over libtorch ([`tch`]), used cell by cell from
//! evcxr Jupyter notebooks, with prefix-tree packing for GRPO, static shapes for AWS Trainium
//! and rich notebook displays.
//!
//! # Why tree packing
//!
//! GRPO samples G completions of each prompt. Packed flat, every rollout forwards the whole
//! prompt again. Packed as a prefix tree ([`pack`]), each shared token is forwarded once and
//! each segment attends only to its root-to-segment path, so every rollout's log-probs and
//! gradients are exactly those of a separate forward, at a fraction of the work.
//!
//! # Quick start
//!
//! Three rollouts of one prompt, packed as a tree and scored by the shipped tiny model: the
//! tree forwards the prompt once, and every trained token's log-prob equals a separate
//! forward of its rollout.
//!
//! ```
//! use treetrain::model::{LoadOptions, Model};
//! use treetrain::pack::{PrefixTree, Rollout, row_logprobs};
//!
//! let model = Model::load(&treetrain::shipped::tiny_model_dir()?, LoadOptions::default())?;
//! let prompt = [11, 12, 13, 14, 15, 16];
//! let completions: [&[i64]; 3] = [&[21, 22, 23], &[21, 22, 31], &[41, 42]];
//! let rollouts: Vec<Rollout> = completions
//!     .iter()
//!     .map(|c| {
//!         let ids: Vec<i64> = prompt.iter().chain(c.iter()).copied().collect();
//!         Rollout {
//!             completion_mask: (0..ids.len()).map(|i| u8::from(i >= prompt.len())).collect(),
//!             old_log_probs: vec![0.0; ids.len()],
//!             input_ids: ids,
//!             advantage: 1.0,
//!             group_id: "prompt 0".into(),
//!         }
//!     })
//!     .collect();
//! let mut tree = PrefixTree::new();
//! for (i, r) in rollouts.iter().enumerate() {
//!     tree.add(r.clone(), i)?;
//! }
//! let row = tree.pack();
//! assert!(row.len() < row.raw_tokens); // the prompt is forwarded once, not three times
//!
//! let packed = tch::no_grad(|| row_logprobs(&model.lm, &row, Default::default()))?;
//! let packed = Vec::<f32>::try_from(&packed)?;
//! let mut separate = Vec::new();
//! for r in &rollouts {
//!     let lp = model.score(&r.input_ids)?; // log p(token | prefix), one forward per rollout
//!     separate.extend((prompt.len()..r.input_ids.len()).map(|p| lp[p - 1]));
//! }
//! for (a, b) in packed.iter().zip(&separate) {
//!     assert!((a - b).abs() < 1e-5);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Training is one more step: [`grpo::GrpoTrainer`] generates, scores, tree-packs and updates
//! (its module shows a step on the shipped data), [`sft::SftTrainer`] fine-tunes on
//! conversations, and both run from a TOML file with the `treetrain` CLI.
//!
//! # Architecture
//!
//! Layers, each using only the ones below it (`tests/layers.rs` reads every `crate::` path and
//! fails on one that runs up):
//!
//! ```text
//! demo, guide                       the main job as a function; the guides
//! shipped, validation, env_report   shipped tasks, the rules, `treetrain env`
//! sft, grpo                         the trainers
//! train                             config, core, optimizer, parallel strategies, checkpoints
//! pack, generate                    packed rows and layouts; the generator
//! model                             decoders, LoRA, loading and saving
//! data, tokenizer                   dataset formats; tokenizers, chat templates
//! shapes, hub, distributed          the shape ledger; the Hugging Face cache; c10d processes
//! device                            devices, policies, dtypes, PrivateUse1
//! util, display                     helpers; pure HTML / text renderers
//! ```
//!
//! - [`device`]: treetrain's [`device::Device`] (tch's devices plus PyTorch's PrivateUse1 slot,
//!   where Neuron lives), detection, per-platform policies ([`device::PadTo`], the preferred
//!   [`device::Dtype`]).
//! - [`shapes`]: every distinct shape is a Neuron compile; the ledger counts them and forecasts
//!   what padding saves. [`hub`]: repo ids resolved in the local Hugging Face cache.
//!   [`distributed`]: a run's processes joined on PyTorch's c10d (Gloo, NCCL), their
//!   collectives, and `treetrain launch`.
//! - [`data`]: Parquet, Arrow and JSON-lines datasets read as TRL's row formats.
//!   [`tokenizer`]: `tokenizer.json` and chat templates with assistant masks.
//! - [`model`]: [`model::HfConfig`] mirrors `config.json`; [`model::CausalLm`] runs one forward
//!   for every [`model::AttentionLayout`] (padded, packed, tree segments) and KV caches;
//!   [`model::lora`] adapters in PEFT's format.
//! - [`pack`]: TRL's packed-row contract ([`pack::PackedRow`]), prefix trees and flat rows
//!   behind one token-budget planner. [`generate`]: the static-cache generator and samplers.
//! - [`train`]: [`train::TrainConfig`], [`train::TrainCore`], AdamW and schedules, checkpoints,
//!   [`train::Trainer`] with its provided `train_for` loop, and the parallel strategy of a
//!   multi-process run (one per `fsdp` mode, chosen once).
//! - [`sft`] and [`grpo`]: the two trainers (TRL's `SFTTrainer` and `GRPOTrainer`).
//! - [`display`]: every type a notebook user holds renders itself through [`display::Rich`].
//!
//! The CLI (`src/main.rs`, `src/cli/`: one file per subcommand) sits on top and drives any
//! [`train::Trainer`] through one run loop.
//!
//! # Guides
//!
//! [`guide`] holds the stories that cross modules: [CUDA](guide::cuda),
//! [Trainium](guide::neuron), [memory and precision](guide::memory_and_precision),
//! [LoRA](guide::lora), [data parallelism](guide::data_parallelism),
//! [watching runs](guide::watching_runs) and [notebooks](guide::notebooks).
#![warn(missing_docs)]
#![warn(unreachable_pub)]

#[doc(hidden)]
pub mod bench_support;
pub mod data;
pub mod demo;
pub mod device;
pub mod display;
pub mod distributed;
mod env_report;
pub mod generate;
pub mod grpo;
pub mod guide;
pub mod hub;
pub mod model;
pub mod pack;
pub mod sft;
pub mod shapes;
pub mod shipped;
pub mod tokenizer;
pub mod train;
pub mod util;
pub mod validation;

/// Re-exported so a tool's argument struct derives its schema with the same schemars
/// (`#[schemars(crate = "treetrain::schemars")]`) without another `:dep`.
pub use schemars;
/// Re-exported so notebooks can build messages with `treetrain::serde_json::json!` without another `:dep`.
pub use serde_json;
/// Re-exported so notebooks use the same tch as treetrain without another `:dep`.
pub use tch;

pub use env_report::{EnvReport, TCH_VERSION};

// What a notebook user holds, at the crate root (`use treetrain::{GrpoTrainer, Trainer};`).
pub use data::Dataset;
pub use device::Device;
pub use generate::{GenerationConfig, Generator};
pub use grpo::{GrpoConfig, GrpoTrainer, RewardFn};
pub use model::{LoadOptions, Model};
pub use pack::{PackedRow, PrefixTree, Rollout};
pub use sft::{SftConfig, SftTrainer};
pub use tokenizer::Tokenizer;
pub use train::{TrainConfig, Trainer};
