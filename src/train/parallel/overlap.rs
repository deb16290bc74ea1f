//! `fsdp = "no_shard"` across processes with `overlap_grad_reduce` (the default): gradients are
//! all-reduced in buckets during the step's last backward as each layer's are done, as DDP's
//! reducer does, instead of all after it. Earlier passes of the step (gradient accumulation,
//! GRPO's packed rows) only accumulate: the trainer says how many passes back-propagate
//! ([`crate::model::CausalLm::expect_backward_passes`]), every rank makes as many (idle passes
//! for ranks with fewer rows), so every rank starts the same buckets in the same order.
//!
//! Buckets fill with whole layers, last layer first, and start once they hold
//! `distributed::BUCKET_BYTES` or more; at most [`IN_FLIGHT`] are left running (each holds a flat
//! copy of its gradients), the oldest waited for first. The root (embeddings, final norm, head)
//! and anything a pass did not reach are reduced when the step ends, then every bucket is
//! waited for. A step whose passes were not announced reduces everything then, as without
//! overlap.

use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;

use super::units::{Unit, UnitKey};
use crate::distributed::{DistError, GradBuckets, World};
use crate::model::{GradReduction, ModelError, ParamUnit, Pass};

/// Buckets left running before the oldest is waited for.
const IN_FLIGHT: usize = 8;

/// The reducer a `no_shard` model calls back into (its [`GradReduction`]).
#[derive(Debug)]
pub(crate) struct OverlappedReduce {
    world: Arc<World>,
    state: Mutex<Buckets>,
}

#[derive(Debug)]
struct Buckets {
    /// Each decoder layer's trained parameters, and the rest's (the root).
    layers: Vec<Vec<Tensor>>,
    root: Vec<Tensor>,
    /// Backward passes the step makes, once announced.
    expected: Option<usize>,
    /// Backward passes begun since.
    begun: usize,
    /// Layers whose gradients left this step.
    reduced: Vec<bool>,
    buckets: GradBuckets,
}

impl OverlappedReduce {
    /// The reducer of `units` (the same on every rank).
    pub(crate) fn new(units: &[Unit], world: Arc<World>) -> Self {
        let mut layers: Vec<Vec<Tensor>> = Vec::new();
        let mut root = Vec::new();
        for unit in units {
            let params = unit.params.iter().map(Tensor::shallow_clone);
            match unit.key {
                UnitKey::Layer(i) => {
                    if layers.len() <= i {
                        layers.resize_with(i + 1, Vec::new);
                    }
                    layers[i].extend(params);
                }
                UnitKey::Embeddings | UnitKey::Rest => root.extend(params),
            }
        }
        let reduced = vec![false; layers.len()];
        let state = Buckets {
            layers,
            root,
            expected: None,
            begun: 0,
            reduced,
            buckets: GradBuckets::new(IN_FLIGHT),
        };
        OverlappedReduce {
            world,
            state: Mutex::new(state),
        }
    }

    fn state(&self) -> MutexGuard<'_, Buckets> {
        // Poisoned only by a panic of ours; the buckets are whole still.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The step's end: whatever the passes did not reduce (the root, layers of an unannounced
    /// step) is, then every bucket is waited for; the gradients hold the sums over the ranks.
    pub(crate) fn finish(&self) -> Result<(), DistError> {
        let mut guard = self.state();
        let s = &mut *guard;
        let pending: Vec<&Tensor> = (s.layers.iter().zip(&s.reduced))
            .filter(|(_, reduced)| !**reduced)
            .flat_map(|(layer, _)| layer)
            .chain(&s.root)
            .collect();
        let done = s.buckets.add_all(&pending, &self.world);
        s.reset();
        done
    }

    /// Drops the step's reductions (a failed step): running buckets are waited for, their
    /// sums ignored.
    pub(crate) fn discard(&self) {
        let mut s = self.state();
        s.buckets.discard();
        s.reset();
    }
}

impl Buckets {
    fn reset(&mut self) {
        self.expected = None;
        self.begun = 0;
        self.reduced.iter_mut().for_each(|r| *r = false);
    }

    /// Whether the pass running now is the step's last backward.
    fn in_last_pass(&self) -> bool {
        self.expected.is_some_and(|n| n > 0 && self.begun == n)
    }
}

impl GradReduction for OverlappedReduce {
    fn expect_backward_passes(&self, backward: usize) {
        let mut s = self.state();
        s.expected = Some(backward);
        s.begun = 0;
    }

    fn begin_pass(&self, pass: Pass) -> Result<(), ModelError> {
        let mut s = self.state();
        if pass == Pass::ForwardBackward && s.expected.is_some() {
            s.begun += 1;
        }
        Ok(())
    }

    /// Layer `i`'s gradients are done: in the step's last backward they join the filling
    /// bucket.
    fn reduce(&self, unit: ParamUnit) -> Result<(), ModelError> {
        let mut guard = self.state();
        let s = &mut *guard;
        let ParamUnit::Layer(i) = unit else { return Ok(()) };
        if !s.in_last_pass() || s.reduced.get(i).is_none_or(|r| *r) {
            return Ok(());
        }
        s.reduced[i] = true;
        s.layers[i].iter().try_for_each(|p| s.buckets.add(p, &self.world))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use tch::{Device, Kind};

    use super::super::units::units_of;
    use super::*;
    use crate::distributed::BUCKET_BYTES;

    /// Two ranks (threads on a file store) over two layers of a bucket's size and a root: a
    /// step of two backward passes starts nothing in its first, starts each layer's bucket as
    /// the last pass reduces it (bytes move before the step ends), and the step's end leaves
    /// every gradient summed over the ranks, the first pass's included; an unannounced step
    /// moves everything at its end.
    #[test]
    fn the_last_backward_starts_the_buckets_and_the_sums_are_whole() {
        let dir = std::env::temp_dir().join(format!("treetrain-overlap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = dir.join("store");
        let _ = std::fs::remove_file(&store);
        let run = |rank: usize| {
            let store = store.clone();
            std::thread::spawn(move || {
                let world = Arc::new(World::with_file_store(&store, rank, 2, Duration::from_secs(30)).unwrap());
                let names = ["model.layers.0.w", "model.layers.1.w", "model.embed_tokens.weight"];
                let params: BTreeMap<String, Tensor> = names
                    .iter()
                    .map(|n| {
                        (
                            n.to_string(),
                            Tensor::zeros([n_of(n)], (Kind::Float, Device::Cpu)).set_requires_grad(true),
                        )
                    })
                    .collect();
                fn n_of(name: &str) -> i64 {
                    if name.contains("layers") {
                        (BUCKET_BYTES / 4) as i64
                    } else {
                        5
                    }
                }
                let r = OverlappedReduce::new(&units_of(&params), world.clone());
                // Each pass adds (rank + 1) * (pass + 1) to every gradient.
                let pass = |k: usize| {
                    r.begin_pass(Pass::ForwardBackward).unwrap();
                    for (name, p) in &params {
                        (p * ((rank + 1) * (k + 1)) as f64).sum(Kind::Float).backward();
                        if let ParamUnit::Layer(i) = ParamUnit::of(name) {
                            r.reduce(ParamUnit::Layer(i)).unwrap();
                        }
                    }
                };
                r.expect_backward_passes(2);
                pass(0);
                let after_first = world.comm_totals().bytes;
                pass(1);
                let after_last = world.comm_totals().bytes;
                r.finish().unwrap();
                let grads: Vec<f64> = params
                    .values()
                    .map(|p| p.grad().mean(Kind::Double).double_value(&[]))
                    .collect();
                // An unannounced step: nothing moves until its end.
                params.values().for_each(|p| drop(p.grad().zero_()));
                pass(0);
                let idle = world.comm_totals().bytes;
                r.finish().unwrap();
                (after_first, after_last, grads, idle)
            })
        };
        let (a, b) = (run(0), run(1));
        for (after_first, after_last, grads, idle) in [a.join().unwrap(), b.join().unwrap()] {
            assert_eq!(after_first, 0, "the first of two passes started a bucket");
            assert_eq!(
                after_last,
                2 * BUCKET_BYTES as u64,
                "the last pass started both layers' buckets"
            );
            // Ranks 1 and 2 times passes 1 and 2: (1 + 2) * (1 + 2).
            assert_eq!(grads, vec![9.0; 3]);
            // The first step's end moved the root alone; the unannounced pass moved nothing.
            assert_eq!(idle, after_last + 5 * 4);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
