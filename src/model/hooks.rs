//! What a training run's parallel strategy hooks into the model's passes. Two separate hooks,
//! so a strategy implements only what it does:
//!
//! - a [`Residency`] says where parameters live between uses: under `fsdp = "full_shard"`
//!   every rank holds only its shard of each unit's parameters (one unit per decoder layer,
//!   and the root: embeddings, final norm, head); a layer's parameters are gathered from every
//!   rank just before the layer runs and freed after;
//! - a [`GradReduction`] says where a layer's gradients go as soon as its backward is done:
//!   reduce-scattered into the owners' shards (`full_shard`), or joining the buckets that
//!   replicated data parallelism all-reduces during the step's last backward.
//!
//! Both are collectives: every rank must make the same calls in the same order. A rank with
//! less work than the others runs [`CausalLm::idle_pass`] for each pass it lacks, which makes a
//! pass's calls without computing. The strategies themselves live in `train::parallel`.

use std::sync::Arc;

use super::decoder::CausalLm;
use super::error::ModelError;

/// A unit of parameters the model asks for by name; ordered as a pass's forward meets them
/// (the root first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ParamUnit {
    /// The embeddings, the final norm and an untied head: gathered at a pass's start and kept
    /// until the optimizer step (the head and a tied embedding serve both ends of the pass).
    Root,
    /// Decoder layer `i`.
    Layer(usize),
}

impl ParamUnit {
    /// The unit a parameter of this `state_dict` name belongs to: `...layers.<i>....` is
    /// layer `i`, anything else the root.
    pub(crate) fn of(name: &str) -> Self {
        let layer = name
            .split_once("layers.")
            .and_then(|(_, rest)| rest.split('.').next())
            .and_then(|i| i.parse().ok());
        layer.map_or(ParamUnit::Root, ParamUnit::Layer)
    }
}

/// What a pass does, for [`CausalLm::idle_pass`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// A forward only (scoring, evaluation, a log-prob pass).
    Forward,
    /// A forward and its backward (`CausalLm::forward_backward`).
    ForwardBackward,
}

/// Where in a pass the model offers to start the next unit's gather early (the residency's
/// prefetch settings say which it takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Before a layer's forward: the next layer.
    Forward,
    /// Before a layer's backward: the layer back-propagated next.
    BackwardPre,
    /// After a layer's backward: the layer back-propagated next.
    BackwardPost,
}

/// Gathers and frees a sharded model's parameters around their uses.
pub(crate) trait Residency: Send + Sync + std::fmt::Debug {
    /// Makes `unit`'s parameters whole (nothing when they are).
    fn gather(&self, unit: ParamUnit) -> Result<(), ModelError>;
    /// May start gathering `unit`, the next one used, so that it overlaps the compute at
    /// `phase` (nothing when whole or not prefetched at `phase`).
    fn prefetch(&self, unit: ParamUnit, phase: Phase) -> Result<(), ModelError>;
    /// Frees a layer's gathered parameters (the root stays until the step).
    fn release(&self, unit: ParamUnit) -> Result<(), ModelError>;
    /// Every unit whole, for a use outside passes (generation, saving); `release_all` after.
    fn gather_all(&self) -> Result<(), ModelError>;
    /// Frees every gathered unit, the root included.
    fn release_all(&self) -> Result<(), ModelError>;
}

/// Takes each layer's gradients as its backward ends.
pub(crate) trait GradReduction: Send + Sync + std::fmt::Debug {
    /// `unit`'s backward is done: its gradients leave for their reduction.
    fn reduce(&self, unit: ParamUnit) -> Result<(), ModelError>;
    /// The step's coming passes: `backward` of them back-propagate (the same on every rank).
    fn expect_backward_passes(&self, _backward: usize) {}
    /// A `pass` begins.
    fn begin_pass(&self, _pass: Pass) -> Result<(), ModelError> {
        Ok(())
    }
}

/// The hooks a parallel strategy installs ([`CausalLm::set_hooks`]); none by default.
#[derive(Debug, Clone, Default)]
pub(crate) struct PassHooks {
    /// Where sharded parameters are gathered and freed.
    pub(crate) residency: Option<Arc<dyn Residency>>,
    /// Where finished layers' gradients go.
    pub(crate) reduction: Option<Arc<dyn GradReduction>>,
}

impl CausalLm {
    /// Installs a parallel strategy's hooks.
    pub(crate) fn set_hooks(&mut self, hooks: PassHooks) {
        self.hooks = hooks;
    }

    /// Whether the parameters are sharded between uses.
    pub(crate) fn is_sharded(&self) -> bool {
        self.hooks.residency.is_some()
    }

    /// Whether every rank must make the same passes (a hook gathers or reduces during them,
    /// collectives every rank makes), layer by layer.
    pub(crate) fn in_lockstep(&self) -> bool {
        self.hooks.residency.is_some() || self.hooks.reduction.is_some()
    }

    /// Tells the gradient reduction how many passes of this step back-propagate (the same on
    /// every rank: with idle passes counted); under `no_shard` across processes the last one's
    /// backward all-reduces the gradients as they are done. Nothing without one.
    pub(crate) fn expect_backward_passes(&self, backward: usize) {
        if let Some(r) = &self.hooks.reduction {
            r.expect_backward_passes(backward);
        }
    }

    /// A `pass` begins (nothing without a gradient reduction).
    pub(crate) fn begin_pass(&self, pass: Pass) -> Result<(), ModelError> {
        self.hooks.reduction.as_ref().map_or(Ok(()), |r| r.begin_pass(pass))
    }

    /// `unit` whole before its use (nothing unsharded).
    pub(crate) fn gather(&self, unit: ParamUnit) -> Result<(), ModelError> {
        self.hooks.residency.as_ref().map_or(Ok(()), |r| r.gather(unit))
    }

    /// Layer `i`'s gather started early at `phase` (nothing unsharded, or past the ends).
    pub(crate) fn prefetch(&self, i: Option<usize>, phase: Phase) -> Result<(), ModelError> {
        match (&self.hooks.residency, i) {
            (Some(r), Some(i)) if i < self.layers.len() => r.prefetch(ParamUnit::Layer(i), phase),
            _ => Ok(()),
        }
    }

    /// `unit` freed after its use (nothing unsharded).
    pub(crate) fn release(&self, unit: ParamUnit) -> Result<(), ModelError> {
        self.hooks.residency.as_ref().map_or(Ok(()), |r| r.release(unit))
    }

    /// `unit`'s gradients handed to their reduction (nothing without one).
    pub(crate) fn reduce(&self, unit: ParamUnit) -> Result<(), ModelError> {
        self.hooks.reduction.as_ref().map_or(Ok(()), |r| r.reduce(unit))
    }

    /// Every gathered unit freed, the root included (nothing unsharded).
    pub(crate) fn release_all(&self) -> Result<(), ModelError> {
        self.hooks.residency.as_ref().map_or(Ok(()), |r| r.release_all())
    }

    /// `f` with every parameter whole (generation, saving, a weight copy); under `full_shard`
    /// a collective every rank calls, freeing the units again after.
    pub fn with_whole_weights<T, E: From<ModelError>>(&self, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let Some(r) = &self.hooks.residency else { return f() };
        r.gather_all()?;
        let out = f();
        r.release_all()?;
        out
    }

    /// The gathers, reductions and frees of one `pass` of this model, without computing: what
    /// a rank with fewer rows than the others runs so every rank makes the same collectives.
    /// Nothing without hooks.
    pub(crate) fn idle_pass(&self, pass: Pass) -> Result<(), ModelError> {
        if !self.in_lockstep() {
            return Ok(());
        }
        self.begin_pass(pass)?;
        self.gather(ParamUnit::Root)?;
        for i in 0..self.layers.len() {
            self.gather(ParamUnit::Layer(i))?;
            self.prefetch(Some(i + 1), Phase::Forward)?;
            self.release(ParamUnit::Layer(i))?;
        }
        if pass == Pass::ForwardBackward {
            for i in (0..self.layers.len()).rev() {
                self.gather(ParamUnit::Layer(i))?;
                self.prefetch(i.checked_sub(1), Phase::BackwardPre)?;
                self.prefetch(i.checked_sub(1), Phase::BackwardPost)?;
                self.reduce(ParamUnit::Layer(i))?;
                self.release(ParamUnit::Layer(i))?;
            }
        }
        Ok(())
    }
}
