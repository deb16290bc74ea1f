//! Guides: the longer stories that cross modules. Each page is a markdown file beside this
//! one, rendered here by rustdoc; the reference of each concept is in its module's docs.
//!
//! - [`cuda`]: running on NVIDIA GPUs (libtorch's CUDA libraries at run time, the GPU check).
//! - [`neuron`]: AWS Trainium through PyTorch's PrivateUse1 slot, static shapes, padding.
//! - [`memory_and_precision`]: gradient checkpointing, the chunked LM head, bf16 mixed
//!   precision.
//! - [`lora`]: LoRA adapters in PEFT's format, in both trainers and on the command line.
//! - [`mixtures`]: mixture-of-experts models (Qwen3-MoE): the router, the experts, the
//!   load-balancing loss, the expert load.
//! - [`data_parallelism`]: one run on several processes over c10d, under `treetrain launch` or
//!   `torchrun`.
//! - [`watching_runs`]: TensorBoard and CSV logs, checkpoint rotation, resuming from the latest.
//! - [`notebooks`]: treetrain in evcxr Jupyter notebooks, and what the displays show.

#[doc = include_str!("cuda.md")]
pub mod cuda {}
#[doc = include_str!("neuron.md")]
pub mod neuron {}
#[doc = include_str!("memory_and_precision.md")]
pub mod memory_and_precision {}
#[doc = include_str!("lora.md")]
pub mod lora {}
#[doc = include_str!("mixtures.md")]
pub mod mixtures {}
#[doc = include_str!("data_parallelism.md")]
pub mod data_parallelism {}
#[doc = include_str!("watching_runs.md")]
pub mod watching_runs {}
#[doc = include_str!("notebooks.md")]
pub mod notebooks {}
