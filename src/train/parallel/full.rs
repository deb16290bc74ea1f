//! `fsdp = "full_shard"` (ZeRO-3): the parameters are sharded too. Between uses a unit's
//! parameters hold no bytes (their storage is freed, the tensors and their views stay); before
//! a use every rank's fp32 shard is all-gathered, cast to the parameters' dtype and copied
//! into the refilled storage, without bumping autograd's version counter, so a layer's graph
//! kept from its forward back-propagates once the bytes are back. A layer's gradients are
//! reduce-scattered into the owners' shards as soon as its backward is done and freed. The
//! model reaches this state through its hooks (both a [`Residency`] and a [`GradReduction`]);
//! the optimizer step through [`Strategy`]; they share it behind one lock.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Kind, Tensor};

use super::settings::{Fsdp, FsdpConfig};
use super::shards::{Reducing, Shards};
use super::storage::{copy_unversioned, own_storages, resize_storage, storage_nbytes};
use super::units::{UnitKey, units_of};
use super::{HeldState, Strategy};
use crate::distributed::{DistError, Flat, Pending};
use crate::model::{GradReduction, ModelError, ParamUnit, Phase, Residency};
use crate::train::adamw::AdamWConfig;

/// The state of a `full_shard` run, shared by the model's hooks and the optimizer step.
#[derive(Debug)]
pub(crate) struct FullShard {
    state: Mutex<FullState>,
    config: FsdpConfig,
}

#[derive(Debug)]
struct FullState {
    shards: Shards,
    /// Every unit's fp32 master shard: the parameter shard, which updates go to.
    master: Vec<Tensor>,
    /// Bytes of each unit's parameters' storages when whole.
    nbytes: Vec<Vec<i64>>,
    /// Which units' parameters are whole now.
    gathered: Vec<bool>,
    /// Inside a use of the whole model (nothing is released).
    whole: bool,
    /// Each layer's gradient shard summed over this step's passes so far.
    acc: Vec<Option<Tensor>>,
    /// All-gathers started ahead of a unit's use (prefetch).
    inflight: Vec<Option<InFlight>>,
    /// Reduce-scatters started as a layer's backward ended, not yet waited for.
    reducing: Vec<Reducing>,
}

/// An all-gather of a unit started ahead of its use: the collective, its output and the cast
/// shard it reads (kept alive until it ends).
#[derive(Debug)]
struct InFlight {
    pending: Option<Pending>,
    whole: Tensor,
    _shard: Tensor,
}

impl FullShard {
    /// This rank's shards over `params` (by name; the same on every rank): the master shards
    /// take the values, and every parameter's bytes are freed.
    pub(crate) fn new(
        params: &BTreeMap<String, Tensor>,
        world: Arc<crate::distributed::World>,
        (adamw, config): (AdamWConfig, FsdpConfig),
    ) -> Result<Arc<Self>, ModelError> {
        let shards = Shards::new(units_of(params), world, adamw)?;
        let n = shards.units.len();
        let master = (0..n)
            .map(|u| shards.flat(u, &|_, p| p.f_to_kind(Kind::Float)))
            .collect::<Result<Vec<_>, _>>()?;
        // The master shards hold the values now: parameters sharing storage with another unit's
        // get storage of their own, uninitialised, freed next with the rest.
        let units: Vec<&[Tensor]> = shards.units.iter().map(|u| u.params.as_slice()).collect();
        own_storages(&units)?;
        let nbytes = (shards.units.iter())
            .map(|u| u.params.iter().map(storage_nbytes).collect())
            .collect();
        let mut state = FullState {
            shards,
            master,
            nbytes,
            gathered: vec![true; n],
            whole: false,
            acc: (0..n).map(|_| None).collect(),
            inflight: (0..n).map(|_| None).collect(),
            reducing: Vec::new(),
        };
        state.release_all_units()?;
        Ok(Arc::new(FullShard {
            state: Mutex::new(state),
            config,
        }))
    }

    fn state(&self) -> MutexGuard<'_, FullState> {
        // A panic while holding the lock is a bug of ours, not a user's; the state is still
        // consistent at unit granularity.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl FullState {
    /// The units `unit` names (absent ones, e.g. frozen layers under LoRA, are none).
    fn indices(&self, unit: ParamUnit) -> Vec<usize> {
        let units = self.shards.units.iter().enumerate();
        units.filter(|(_, u)| u.key.serves(unit)).map(|(i, _)| i).collect()
    }

    /// Starts the all-gather of unit `u`'s master shards in the parameters' dtype.
    fn start_gather(&self, u: usize) -> Result<InFlight, ModelError> {
        let kind = self.shards.units[u].params[0].kind();
        let shard = self.master[u].f_to_kind(kind)?;
        let size = self.shards.world.size as i64 * self.shards.shard[u];
        let whole = shard.f_new_empty([size], (kind, shard.device()))?;
        let pending = self.shards.world.start(Flat::AllGather, &shard, &whole)?;
        Ok(InFlight {
            pending,
            whole,
            _shard: shard,
        })
    }

    /// Starts gathering unit `u` ahead of its use (nothing when whole or already started).
    fn prefetch_unit(&mut self, u: usize) -> Result<(), ModelError> {
        if !self.gathered[u] && self.inflight[u].is_none() {
            self.inflight[u] = Some(self.start_gather(u)?);
        }
        Ok(())
    }

    /// Unit `u`'s parameters whole: every rank's master shard all-gathered in their dtype
    /// (started now, or by a prefetch) and copied into their refilled storage.
    fn gather_unit(&mut self, u: usize) -> Result<(), ModelError> {
        if self.gathered[u] {
            return Ok(());
        }
        let started = match self.inflight[u].take() {
            Some(f) => f,
            None => self.start_gather(u)?,
        };
        self.shards.world.wait(started.pending)?;
        let unit = &self.shards.units[u];
        for (p, &n) in unit.params.iter().zip(&self.nbytes[u]) {
            resize_storage(p, n)?;
        }
        for (p, piece) in unit.params.iter().zip(unit.split(&started.whole)?) {
            copy_unversioned(p, &piece)?;
        }
        self.gathered[u] = true;
        Ok(())
    }

    /// Frees unit `u`'s parameter bytes.
    fn release_unit(&mut self, u: usize) -> Result<(), ModelError> {
        if self.gathered[u] {
            self.shards.units[u]
                .params
                .iter()
                .try_for_each(|p| resize_storage(p, 0))?;
            self.gathered[u] = false;
        }
        Ok(())
    }

    /// Frees every unit's parameter bytes.
    fn release_all_units(&mut self) -> Result<(), ModelError> {
        (0..self.gathered.len()).try_for_each(|u| self.release_unit(u))
    }

    /// Starts summing unit `u`'s gradients over the ranks (then freed); the sum joins this
    /// rank's accumulated shard when waited for: at the next layer's reduction (this one
    /// overlaps that layer's backward) or at the step.
    fn reduce_unit(&mut self, u: usize) -> Result<(), DistError> {
        self.finish_reductions()?;
        let started = self.shards.start_reduction(u)?;
        self.reducing.push(started);
        Ok(())
    }

    /// Waits for the reductions in flight and adds each into its unit's accumulated shard.
    fn finish_reductions(&mut self) -> Result<(), DistError> {
        let world = self.shards.world.clone();
        for r in std::mem::take(&mut self.reducing) {
            let u = r.unit;
            let part = r.finish(&world)?;
            self.acc[u] = Some(match self.acc[u].take() {
                None => part,
                Some(acc) => acc
                    .f_add(&part)
                    .map_err(|e| DistError::new(world.rank, "reduce_scatter", e.to_string()))?,
            });
        }
        Ok(())
    }

    /// The first parameter (by unit, then name) whose part in this rank's master shards is
    /// not finite.
    fn first_non_finite(&self) -> Result<Option<String>, ModelError> {
        let rank = self.shards.world.rank as i64;
        for (u, master) in self.master.iter().enumerate() {
            let bad = master.f_isfinite()?.f_logical_not()?.f_nonzero()?;
            if bad.size()[0] == 0 {
                continue;
            }
            let mut at = rank * self.shards.shard[u] + bad.f_int64_value(&[0, 0])?;
            for (name, p) in self.shards.units[u].named() {
                if at < p.numel() as i64 {
                    return Ok(Some(name.clone()));
                }
                at -= p.numel() as i64;
            }
        }
        Ok(None)
    }

    fn masters(&self) -> Vec<Option<&Tensor>> {
        self.master.iter().map(Some).collect()
    }
}

impl Residency for FullShard {
    fn gather(&self, unit: ParamUnit) -> Result<(), ModelError> {
        let mut s = self.state();
        s.indices(unit).into_iter().try_for_each(|u| s.gather_unit(u))
    }

    fn prefetch(&self, unit: ParamUnit, phase: Phase) -> Result<(), ModelError> {
        if !self.config.prefetches(phase) {
            return Ok(());
        }
        let mut s = self.state();
        s.indices(unit).into_iter().try_for_each(|u| s.prefetch_unit(u))
    }

    fn release(&self, unit: ParamUnit) -> Result<(), ModelError> {
        let mut s = self.state();
        if s.whole || unit == ParamUnit::Root {
            return Ok(());
        }
        s.indices(unit).into_iter().try_for_each(|u| s.release_unit(u))
    }

    fn gather_all(&self) -> Result<(), ModelError> {
        let mut s = self.state();
        s.whole = true;
        (0..s.gathered.len()).try_for_each(|u| s.gather_unit(u))
    }

    fn release_all(&self) -> Result<(), ModelError> {
        let mut s = self.state();
        s.whole = false;
        s.release_all_units()
    }
}

impl GradReduction for FullShard {
    fn reduce(&self, unit: ParamUnit) -> Result<(), ModelError> {
        let mut s = self.state();
        for u in s.indices(unit) {
            s.reduce_unit(u)?;
        }
        Ok(())
    }
}

impl Strategy for Arc<FullShard> {
    fn updates(&self) -> u64 {
        self.state().shards.step
    }

    /// The layers' shards were summed pass by pass as their backward ended (a layer no pass
    /// reached sums zeros); the root's are reduced now.
    fn reduce_grads(&mut self) -> Result<(), DistError> {
        let mut guard = self.state();
        let s = &mut *guard;
        s.shards.grads.clear();
        s.finish_reductions()?;
        for u in 0..s.master.len() {
            let part = match (s.shards.units[u].key, s.acc[u].take()) {
                (UnitKey::Layer(_), Some(acc)) => acc,
                (UnitKey::Layer(_), None) => s.master[u]
                    .f_zeros_like()
                    .map_err(|e| DistError::new(s.shards.world.rank, "reduce_scatter", e.to_string()))?,
                _ => s.shards.reduced(u)?,
            };
            s.shards.grads.push(part);
        }
        Ok(())
    }

    fn clip(&mut self, max_norm: Option<f64>) -> Result<f64, DistError> {
        self.state().shards.clip(max_norm)
    }

    /// Each master shard updated and its unit freed: its next use gathers the new shards.
    fn update(&mut self, lr: f64) -> Result<(), ModelError> {
        let mut s = self.state();
        let grads = s.shards.begin_update();
        // A gather started before a failed pass would bring the old shards.
        s.inflight.iter_mut().for_each(|f| *f = None);
        for (u, g) in grads.iter().enumerate() {
            s.shards.adam(u, &s.master[u], g, lr)?;
            s.release_unit(u)?;
        }
        Ok(())
    }

    /// Read from this rank's shards; every rank learns whether any rank found one, so all stop.
    fn first_non_finite(&self) -> Result<Option<String>, ModelError> {
        let s = self.state();
        let mut found = s.first_non_finite()?;
        let mut any = [f64::from(u8::from(found.is_some()))];
        s.shards.world.sum(&mut any)?;
        if any[0] > 0.0 && found.is_none() {
            found = Some("a parameter of another rank's shard".into());
        }
        Ok(found)
    }

    fn discard_grads(&mut self) {
        let mut s = self.state();
        s.shards.discard_grads();
        // Dropped unwaited: each is waited for, then freed.
        s.reducing.clear();
        s.acc.iter_mut().for_each(|a| *a = None);
    }

    /// Between steps: the fp32 master shards (which the parameters are gathered from), the
    /// fp32 gradient shards and AdamW's two moment shards.
    fn held(&self) -> HeldState {
        let shard = self.state().shards.shard_bytes();
        HeldState {
            fsdp: Fsdp::FullShard.name(),
            parameters: shard,
            gradients: shard,
            optimizer: 2 * shard,
        }
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let s = self.state();
        let named = s.shards.tensors(&s.masters());
        named.into_iter().map(|(k, t)| (k, t.shallow_clone())).collect()
    }

    fn write_state(&self, dir: &Path) -> Result<(), ModelError> {
        let s = self.state();
        s.shards.write_state(dir, &s.masters())
    }

    fn write_manifest(&self, dir: &Path) -> Result<(), ModelError> {
        self.state().shards.write_manifest(dir)
    }

    /// A unit whose master weights the checkpoint lacks (an fp32 run's) keeps the master shard
    /// made from the checkpoint's weights at load.
    fn load(&mut self, dir: &Path) -> Result<(), ModelError> {
        let mut guard = self.state();
        let s = &mut *guard;
        let masters: Vec<Tensor> = s.master.iter().map(Tensor::shallow_clone).collect();
        let masters: Vec<Option<&Tensor>> = masters.iter().map(Some).collect();
        let Some(named) = s.shards.read_state(dir, &masters)? else {
            return Ok(());
        };
        s.shards.load_moments(&named)?;
        for (u, master) in s.master.iter().enumerate() {
            let key = |name: &str| format!("master.{name}");
            let unit = &s.shards.units[u];
            if unit.names.iter().all(|n| !named.contains_key(&key(n))) {
                continue;
            }
            let pick = |name: &str, _: &Tensor| match named.get(&key(name)) {
                Some(t) => t.f_to_kind(Kind::Float),
                None => Err(tch::TchError::Kind(format!(
                    "{name}: its master weight is not in the checkpoint"
                ))),
            };
            let loaded = s.shards.flat(u, &pick)?;
            tch::no_grad(|| master.shallow_clone().f_copy_(&loaded))?;
        }
        Ok(())
    }
}
