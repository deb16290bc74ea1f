//! How a run's processes share its state: one strategy, chosen once by [`choose`] from
//! `fsdp`, `fsdp_config` and `overlap_grad_reduce`, and held once, by
//! [`super::Optimization`]. Every strategy works over the same description of the trained
//! parameters ([`units`]: the embeddings, each decoder layer, the rest) and does two kinds of
//! work:
//!
//! - at a step's end and at a checkpoint, through [`Strategy`]: sum the gradients over the
//!   ranks, clip by the global norm, update, write and read its optimizer state;
//! - during the model's passes, through the model's two hooks (`model::Residency`: gather a
//!   unit before its use and free it after; `model::GradReduction`: take a layer's gradients
//!   as its backward ends), installed only by a strategy that does that work.
//!
//! The strategies, one file each:
//!
//! | `fsdp` | file | parameters | gradients | AdamW state | hooks |
//! |---|---|---|---|---|---|
//! | `no_shard` | `replicated` | whole | all-reduced, in buckets during the last backward (`overlap`) or after it | whole | gradient reduction (overlapped) |
//! | `shard_grad_op` | `grad_op` | whole | reduce-scattered after backward | this rank's shard | none |
//! | `full_shard` | `full` | this rank's shard, gathered around each use | reduce-scattered as each layer's backward ends | this rank's shard | both |
//!
//! `shards` holds what both sharded strategies keep (the moment shards, weight-decay ranges,
//! the AdamW kernel on a shard), `files` their checkpoint files (a file per rank and a
//! manifest; any strategy reads any other's), `storage` the storage calls that free and refill
//! a parameter's bytes.
//!
//! Where the next dimensions go:
//!
//! - **Expert parallelism** (`ep_size`): a mixture layer's experts form units of their own,
//!   each owned by one rank of an expert-parallel group; a strategy's [`choose`] arm builds
//!   those units from [`units`], its `Residency` leaves expert units in place (tokens travel to
//!   them by all-to-all inside the layer instead), and its `GradReduction` reduces an expert
//!   unit's gradients only among the ranks that hold the same experts.
//! - **Hybrid sharding** (`dp_replicate_size`): the sharded strategies' collectives run on a
//!   group of the ranks of one host (a sub-`World`), and a replica group's all-reduce follows
//!   each reduce-scatter; `shards` is unchanged, cut by the shard group's size.

mod files;
mod full;
mod grad_op;
mod overlap;
mod replicated;
mod settings;
mod shards;
mod storage;
mod units;

pub(crate) use files::MANIFEST_FILE;
pub use settings::{BackwardPrefetch, Fsdp, FsdpConfig};

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tch::Tensor;

use super::{AdamW, TrainConfig};
use crate::distributed::{DistError, HeldState, World};
use crate::model::{Model, ModelError, PassHooks};

/// What a data-parallel strategy does at a step's end and at a checkpoint. Each works on the
/// state its mode keeps, and nothing else can be held.
pub(crate) trait Strategy: Send + std::fmt::Debug {
    /// Updates done.
    fn updates(&self) -> u64;
    /// Sums the step's gradients over the ranks (each rank its shard, when sharded).
    fn reduce_grads(&mut self) -> Result<(), DistError>;
    /// The global L2 norm of the summed gradients; above `max_norm` they are scaled down to it
    /// (`clip_grad_norm_`'s coefficient `max_norm / (norm + 1e-6)`).
    fn clip(&mut self, max_norm: Option<f64>) -> Result<f64, DistError>;
    /// One AdamW update at `lr` of the summed, clipped gradients.
    fn update(&mut self, lr: f64) -> Result<(), ModelError>;
    /// The first trained parameter holding NaN or infinite values (every rank agrees).
    fn first_non_finite(&self) -> Result<Option<String>, ModelError>;
    /// Drops the step's gradients, whatever their state (a failed or skipped step).
    fn discard_grads(&mut self);
    /// What this rank holds of the run's state between steps, in bytes.
    fn held(&self) -> HeldState;
    /// The state tensors by their names in this strategy's optimizer file.
    fn state_tensors(&self) -> Vec<(String, Tensor)>;
    /// The whole fp32 master weight of a half-precision parameter, when this rank holds one.
    fn master_weight(&self, _name: &str) -> Option<Tensor> {
        None
    }
    /// This rank's part of the optimizer state in the checkpoint folder `dir`.
    fn write_state(&self, dir: &Path) -> Result<(), ModelError>;
    /// Rank 0, once every rank's part is written: the file naming the parts (if any).
    fn write_manifest(&self, _dir: &Path) -> Result<(), ModelError> {
        Ok(())
    }
    /// The optimizer state of a checkpoint folder, written by any strategy of the same world
    /// size.
    fn load(&mut self, dir: &Path) -> Result<(), ModelError>;
}

/// The strategy of `config` for `model` in `world`, its hooks installed in the model. One
/// process shards nothing (said once when `fsdp` asks for sharding).
pub(crate) fn choose(
    config: &TrainConfig,
    world: &Arc<World>,
    model: &mut Model,
) -> Result<Box<dyn Strategy>, ModelError> {
    let params: BTreeMap<String, Tensor> = (model.trainable().variables().into_iter())
        .filter(|(_, t)| t.requires_grad())
        .collect();
    let fsdp = match world.is_distributed() {
        true => config.parallel.fsdp,
        false => {
            if config.parallel.fsdp != Fsdp::NoShard {
                eprintln!(
                    "treetrain: fsdp = \"{}\" with one process: nothing to shard",
                    config.parallel.fsdp.name()
                );
            }
            Fsdp::NoShard
        }
    };
    let world = world.clone();
    Ok(match fsdp {
        Fsdp::NoShard => {
            let adamw = AdamW::with_master_weights(
                model.trainable(),
                config.optimizer.adamw,
                config.precision.mixed_precision,
            );
            let reduction = match world.is_distributed() && config.parallel.overlap_grad_reduce {
                true => {
                    let reducer = Arc::new(overlap::OverlappedReduce::new(&units::units_of(&params), world.clone()));
                    model.lm.set_hooks(PassHooks {
                        residency: None,
                        reduction: Some(reducer.clone()),
                    });
                    replicated::Reduction::Overlapped(reducer)
                }
                false => replicated::Reduction::AfterBackward,
            };
            Box::new(replicated::Replicated::new(adamw, world, reduction))
        }
        Fsdp::ShardGradOp => Box::new(grad_op::ShardGradOp::new(&params, world, config.optimizer.adamw)?),
        Fsdp::FullShard => {
            let full = full::FullShard::new(&params, world, (config.optimizer.adamw, config.parallel.fsdp_config))?;
            model.lm.set_hooks(PassHooks {
                residency: Some(full.clone()),
                reduction: Some(full.clone()),
            });
            Box::new(full)
        }
    })
}
