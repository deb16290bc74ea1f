//! LoRA adapters in PEFT's format.
//!
//! The contract, whole:
//! - A [`LoraConfig`] names the linear layers to wrap (`target_modules`: names matched as PEFT
//!   does, whole or as the dotted tail, or `all-linear`, which leaves out `lm_head`), the rank
//!   `r`, `lora_alpha`, `lora_dropout`, rsLoRA and `modules_to_save`.
//! - `target_parameters` names a mixture's fused expert tensors instead, adapted as PEFT's
//!   `ParamWrapper` adapts them ([`ExpertDelta`]: one adapter over all experts of a tensor).
//! - A wrapped layer computes `W x + b + scale * B (A (dropout(x)))` with `A` `[r, in]`, `B`
//!   `[out, r]`, `scale = lora_alpha / r` (`/ sqrt(r)` with rsLoRA). `A` starts
//!   Kaiming-uniform, `B` at zero, so a new adapter leaves the model's outputs unchanged. The
//!   adapter tensors are f32 (PEFT's default), the delta is cast to the layer's dtype.
//! - The adapter's tensors live in their own var store, named as PEFT saves them
//!   (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`); while it is attached
//!   the base var store is frozen, so gradients and optimizer state exist for adapter tensors
//!   only.
//! - A folder with `adapter_config.json` and `adapter_model.safetensors` is the interchange:
//!   PEFT's `PeftModel.from_pretrained` loads what [`LoraAdapter::save`] writes, and
//!   [`LoraAdapter::load`] loads what PEFT's `save_pretrained` writes. PEFT options treetrain
//!   does not implement (DoRA, biases, per-layer ranks, ...) and tensors that do not fit the
//!   model are errors naming the field or tensor, never skipped.
//! - [`CausalLm::base_view`](crate::model::CausalLm::base_view) is the model with adapters
//!   off, sharing the base tensors: the reference of GRPO's KL term costs no weight copy.

mod adapter;
mod config;
mod delta;
mod experts;
mod view;

pub(crate) use adapter::ADAPTER_CONFIG;
pub use adapter::LoraAdapter;
pub use config::{LoraConfig, TargetModules};
pub(crate) use delta::DropoutStream;
pub use delta::LoraDelta;
pub use experts::ExpertDelta;
