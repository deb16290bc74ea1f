//! Data parallelism on PyTorch's own c10d: several processes, one training run.
//!
//! A [`World`] is the run's processes as torchrun describes them (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), joined in a c10d `ProcessGroupGloo` through the
//! C++ shim `c10d_shim.cpp` (the same engine `torch.distributed` runs; never a transport of
//! our own). The trainer core uses it so both trainers scale out the same way:
//!
//! - rank 0's starting weights are broadcast to every rank;
//! - batch sizes are per process (TRL's `per_device_train_batch_size`): N ranks with batch `b`
//!   train on global batches of `N x b`, equal to one process with batch `N x b`;
//! - each rank forwards its share of every global batch; losses are normalised over the whole
//!   global window; gradients are summed in flat buckets (`BUCKET_BYTES`), during the
//!   step's last backward as each layer's are done (`overlap`) or after it, and clipped after;
//! - rank 0 alone logs and displays, and writes a checkpoint's model and state (a sharded
//!   optimizer's ranks each write their own shard: `train::checkpoint`).
//!
//! The collectives run on Gloo or, for CUDA runs, on NCCL (`distributed_backend`, [`CommBackend`]:
//! `auto` takes NCCL when the run's device is a GPU and `libtreetrain_nccl.so` loads with the
//! NCCL version it was built for, [`nccl`]). Under Gloo, tensors off the host (CUDA, a
//! PrivateUse1 device) are reduced through host memory, said once in the log.

mod agreement;
mod backend;
mod buckets;
mod error;
mod group;
mod launch;
mod launch_env;
pub mod nccl;
mod world;

pub(crate) use agreement::{Settings, settings_of};
pub(crate) use backend::rank_gpu;
pub use backend::{BackendChoice, CommBackend};
pub(crate) use buckets::GradBuckets;
pub use error::DistError;
pub(crate) use group::built_with_gloo;
pub use group::{Flat, GlooDevice, Pending, ProcessGroup, Reduce, Store};
pub use launch::{LaunchError, LaunchPlan, Nodes, launch};
pub use launch_env::LaunchEnv;
#[cfg(test)]
pub(crate) use world::BUCKET_BYTES;
pub use world::{CommTotals, HeldState, World, bind, share};
