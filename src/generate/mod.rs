//! Generation for online training: a static KV cache (fixed shapes: one prefill-chunk shape and
//! one decode shape per call), batched prompts of any lengths, sampling with the log-probs GRPO
//! needs, prefix-shared group generation (prefill a prompt once, fork its cache into G slots)
//! and multi-turn conversations continued from their cache ([`Conversations`]).
//! Tokens are chosen on the model's device (`choose_rows`); [`choose`] is the same rule for
//! one row of host logits.
//!
//! # Shapes, sampling, log-probs
//!
//! - [`StaticCache`](crate::model::StaticCache) preallocates per layer `[batch, kv_heads, max_cache_len, head_dim]` in the
//!   model's dtype (overflow is an error; snapshot, rollback, fork). Prompts are left-padded to a
//!   multiple of `prefill_chunk_size` and prefilled chunk by chunk, and every decode step attends
//!   over the whole cache with a mask: one `generate` call uses exactly two shapes, recorded in
//!   the generator's shape ledger.
//! - Sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty (once per distinct
//!   seen token, as transformers applies it), seeded (no global RNG), EOS ids and stop sequences.
//!   A decode step sends back only `3 x batch` numbers (ids and two log-probs), not the logits.
//! - Each token's `logprobs` are under the distribution actually sampled from (after
//!   truncation), `untruncated_logprobs` under `softmax(logits / temperature)`. GRPO trains
//!   with the former and replays the truncation on its own logits ([`Truncation`]).
//! - `generate_groups` prefills a prompt once and forks its cache rows into G slots;
//!   `generate_dynamic` (a growing cache) is the comparison baseline.
//! - The decode step does little besides reading the weights: q/k/v and gate/up run as one
//!   product each where no graph is built, and on the CPU (f32, AVX2 + FMA or AVX-512) cached
//!   forwards run treetrain's own kernels, while training and scoring forwards keep libtorch's
//!   ops. On CUDA the step can be captured as a CUDA graph ([`crate::guide::cuda`]).
//!
//! Tested (`tests/generation.rs`): greedy output equals full recomputation token for token (fp32)
//! and transformers' greedy `generate` on the committed checkpoints; on random logits every
//! sampling setting picks the host sampler's token with its log-probs (1e-5); a fixed logits
//! vector sampled 40,000 times matches the kept distribution within 5 standard errors.
//! Throughput against transformers and against the memory bound: `cargo bench --bench
//! generation` (`benches/README.md`).

mod completion;
mod config;
mod conversation;
mod cpu_sampler;
pub mod cuda_graph;
mod decoding;
mod device_sampling;
mod generator;
mod sampling;
mod stop;
mod view;

pub use crate::model::Truncation;
pub use completion::{Completion, FinishReason};
pub use config::{GenerateError, GenerationConfig};
pub use conversation::Conversations;
pub(crate) use conversation::common_prefix;
pub use generator::Generator;
pub use sampling::{Choice, SamplingConfig, choose};
pub use stop::StopStrings;
pub use view::Completions;
