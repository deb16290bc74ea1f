//! Generation for online training: a static KV cache (fixed shapes: one prefill-chunk shape and
//! one decode shape per call), batched prompts of any lengths, sampling with the log-probs GRPO
//! needs, prefix-shared group generation (prefill a prompt once, fork its cache into G slots)
//! and multi-turn conversations continued from their cache ([`Conversations`]).
//! Tokens are chosen on the model's device ([`choose_rows`]); [`choose`] is the same rule for
//! one row of host logits.

mod conversation;
mod cpu_sampler;
pub mod cuda_graph;
mod device_sampling;
mod generator;
mod sampling;
mod view;

pub use conversation::Conversations;
pub use device_sampling::{BatchChoice, choose_rows, choose_rows_with_tensors, seen_mask};
pub use generator::{Completion, FinishReason, GenerateError, GenerationConfig, Generator, available_host_bytes};
pub use sampling::{Choice, SamplingConfig, choose};
pub use view::Completions;
