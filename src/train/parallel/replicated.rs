//! `fsdp = "no_shard"` (DDP), and every one-process run: each rank holds the parameters,
//! gradients and AdamW state whole. The gradients are summed over the ranks before clipping:
//! in buckets during the step's last backward (`overlap_grad_reduce`, the default across
//! processes: [`OverlappedReduce`]) or all after it. One process sums nothing.

use std::path::Path;
use std::sync::Arc;

use tch::Tensor;

use super::files::{MANIFEST_FILE, Manifest};
use super::overlap::OverlappedReduce;
use super::settings::Fsdp;
use super::{HeldState, Strategy};
use crate::distributed::{DistError, World};
use crate::model::ModelError;
use crate::train::AdamW;
use crate::train::adamw::{read_step, read_whole};

/// When the replicated gradients are summed over the ranks.
#[derive(Debug)]
pub(crate) enum Reduction {
    /// At the step's end, in buckets waited for one by one (the identity for one process).
    AfterBackward,
    /// Layer by layer during the step's last backward, the rest at its end.
    Overlapped(Arc<OverlappedReduce>),
}

/// The state of a replicated run.
#[derive(Debug)]
pub(crate) struct Replicated {
    pub(crate) adamw: AdamW,
    world: Arc<World>,
    reduction: Reduction,
}

impl Replicated {
    /// AdamW over the run's trained parameters, its gradients summed over `world` by
    /// `reduction`.
    pub(crate) fn new(adamw: AdamW, world: Arc<World>, reduction: Reduction) -> Self {
        Replicated {
            adamw,
            world,
            reduction,
        }
    }
}

impl Strategy for Replicated {
    fn updates(&self) -> u64 {
        self.adamw.step
    }

    fn reduce_grads(&mut self) -> Result<(), DistError> {
        match &self.reduction {
            Reduction::AfterBackward => self.world.all_reduce_grads(&self.adamw.parameters()),
            Reduction::Overlapped(o) => o.finish(),
        }
    }

    fn clip(&mut self, max_norm: Option<f64>) -> Result<f64, DistError> {
        Ok(self.adamw.clip_grad_norm(max_norm))
    }

    fn update(&mut self, lr: f64) -> Result<(), ModelError> {
        self.adamw.step(lr)
    }

    fn first_non_finite(&self) -> Result<Option<String>, ModelError> {
        Ok(self.adamw.first_non_finite()?.map(str::to_string))
    }

    fn discard_grads(&mut self) {
        if let Reduction::Overlapped(o) = &self.reduction {
            o.discard();
        }
        self.adamw.zero_grad();
    }

    fn held(&self) -> HeldState {
        let params = self.adamw.parameters().into_iter();
        let parameters = params.map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
        HeldState {
            fsdp: Fsdp::NoShard.name(),
            parameters,
            gradients: parameters,
            optimizer: self.adamw.state_bytes(),
        }
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.adamw.state_tensors()
    }

    fn master_weight(&self, name: &str) -> Option<Tensor> {
        self.adamw.master_weight(name).map(Tensor::shallow_clone)
    }

    /// Rank 0 writes the whole state.
    fn write_state(&self, dir: &Path) -> Result<(), ModelError> {
        match self.world.is_main() {
            true => self.adamw.save(dir),
            false => Ok(()),
        }
    }

    /// The whole state, or a sharded run's assembled from every rank's file.
    fn load(&mut self, dir: &Path) -> Result<(), ModelError> {
        let step = read_step(dir)?;
        let wanted = self.adamw.named_shapes();
        let read = match dir.join(MANIFEST_FILE).is_file() {
            true => Manifest::read(dir)?.assemble(dir, step, &wanted)?,
            false => read_whole(dir, &wanted)?,
        };
        self.adamw.restore(step, &read)
    }
}
