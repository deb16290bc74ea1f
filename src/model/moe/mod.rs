//! Mixture-of-experts feed-forward blocks (Qwen3-MoE; Muse Spark's sigmoid-routed experts),
//! exact against transformers 5.23's `modeling_qwen3_moe.py` and `modeling_muse_spark.py`.
//!
//! - [`MixtureConfig`]: the mixture fields of `config.json`, which layers are sparse.
//! - [`SparseMoe`]: a sparse layer's `mlp`, the [`Router`] (fp32 softmax over every expert, top
//!   k, `norm_topk_prob`) and the [`Experts`] in transformers 5's fused layout, run grouped by
//!   expert.
//! - [`load_balancing_loss`]: the router's auxiliary loss as transformers computes it;
//!   [`RouterLoss`]: what a training pass adds of it.
//! - [`ExpertLoad`]: how scored tokens spread over the experts, drawn as a heatmap.
//! - [`RoutingTrace`], [`RecordedRouting`]: the routing the generator recorded, replayed or
//!   compared in a training forward (GRPO's routing replay).
//! - Checkpoints in the hub's per-expert layout load into the fused parameters
//!   (`checkpoint`); saves write the fused layout.
//!
//! The parameters of a layer's experts live under `model.layers.{i}.mlp`, so every `fsdp` mode
//! gathers, shards and reduces them with their layer. Expert parallelism (experts split across
//! ranks) would route tokens to the rank that holds their expert; it is not implemented.

mod aux_loss;
mod block;
pub(crate) mod checkpoint;
mod config;
mod experts;
mod load;
mod replay;
mod router;

pub(crate) use aux_loss::RouterTally;
pub use aux_loss::{RouterLoss, load_balancing_loss};
pub use block::{ExpertProjections, SparseMoe};
pub use config::{ExpertProjection, MixtureConfig, SigmoidRouting};
pub use experts::Experts;
pub use load::ExpertLoad;
pub use replay::{RecordedRouting, RoutingTrace};
pub use router::{Router, Routing};
