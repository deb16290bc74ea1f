//! Gradients summed over the ranks in flat buckets: the all-reduce of replicated data
//! parallelism, after backward ([`World::all_reduce_grads`]) or started bucket by bucket as a
//! backward finishes layers (`train::parallel`'s overlapped reducer).

use std::collections::VecDeque;

use tch::Tensor;

use super::error::DistError;
use super::group::Pending;
use super::world::{BUCKET_BYTES, World};

/// Gradients summed over the ranks in flat buckets of one dtype and about [`BUCKET_BYTES`]:
/// parameters are added in an order every rank shares, a full bucket's all-reduce starts at
/// once, and past `limit` running the oldest is waited for (each holds a flat copy of its
/// gradients). A limit of 0 waits for each bucket before the next fills (one copy at a time).
#[derive(Debug)]
pub(crate) struct GradBuckets {
    limit: usize,
    /// Parameters of the bucket filling now.
    filling: Vec<Tensor>,
    filling_bytes: usize,
    in_flight: VecDeque<Pending>,
}

impl GradBuckets {
    /// Buckets of which at most `limit` run at once.
    pub(crate) fn new(limit: usize) -> Self {
        GradBuckets {
            limit,
            filling: Vec::new(),
            filling_bytes: 0,
            in_flight: VecDeque::new(),
        }
    }

    /// Adds `p` to the filling bucket, starting it once full (or before a parameter of another
    /// dtype: a flat bucket has one).
    pub(crate) fn add(&mut self, p: &Tensor, world: &World) -> Result<(), DistError> {
        if self.filling.first().is_some_and(|f| f.kind() != p.kind()) {
            self.start(world)?;
        }
        self.filling_bytes += p.numel() * p.kind().elt_size_in_bytes();
        self.filling.push(p.shallow_clone());
        if self.filling_bytes >= BUCKET_BYTES {
            self.start(world)?;
        }
        Ok(())
    }

    /// Adds `params`, then starts what is filling and waits for every bucket: the gradients
    /// hold the sums (also on an error, no bucket is left running).
    pub(crate) fn add_all(&mut self, params: &[&Tensor], world: &World) -> Result<(), DistError> {
        let done = params.iter().try_for_each(|p| self.add(p, world));
        let done = done.and_then(|()| self.start(world));
        let waited = self.wait_all(world);
        self.discard();
        done.and(waited)
    }

    /// Drops the filling bucket, and the running ones (each waited for, its sum ignored).
    pub(crate) fn discard(&mut self) {
        self.in_flight.clear();
        self.filling.clear();
        self.filling_bytes = 0;
    }

    /// Starts the filling bucket's all-reduce; past `limit` running, waits for the oldest.
    fn start(&mut self, world: &World) -> Result<(), DistError> {
        if self.filling.is_empty() {
            return Ok(());
        }
        let params = std::mem::take(&mut self.filling);
        self.filling_bytes = 0;
        let refs: Vec<&Tensor> = params.iter().collect();
        if let Some(pending) = world.start_grads(&refs)? {
            self.in_flight.push_back(pending);
        }
        while self.in_flight.len() > self.limit {
            world.wait(self.in_flight.pop_front())?;
        }
        Ok(())
    }

    fn wait_all(&mut self, world: &World) -> Result<(), DistError> {
        while let Some(p) = self.in_flight.pop_front() {
            world.wait(Some(p))?;
        }
        Ok(())
    }
}
