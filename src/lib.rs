//! treetrain: language-model training in Rust over libtorch (tch), with prefix-tree packing,
//! static shapes for Neuron and rich evcxr notebook displays.
//!
//! Start with [`EnvReport::collect`] in a notebook cell to see what the process runs on, and
//! [`shapes::PaddingComparison`] to see what a length distribution costs in Neuron compiles.
#![warn(missing_docs)]

pub mod data;
pub mod demo;
pub mod device;
pub mod display;
mod env_report;
pub mod generate;
pub mod grpo;
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

/// Re-exported so notebooks can build messages with `treetrain::serde_json::json!` without another `:dep`.
pub use serde_json;
/// Re-exported so notebooks use the same tch as treetrain without another `:dep`.
pub use tch;

pub use env_report::{EnvReport, TCH_VERSION};
