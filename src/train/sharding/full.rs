//! `fsdp = "full_shard"` (ZeRO-3): the parameters are sharded too. Between uses a unit's
//! parameters hold no bytes (their storage is freed, the tensors and their views stay); before
//! a use every rank's fp32 shard is all-gathered, cast to the parameters' dtype and copied
//! into the refilled storage, without bumping autograd's version counter, so a layer's graph
//! kept from its forward back-propagates once the bytes are back. A layer's gradients are
//! reduce-scattered into the owners' shards as soon as its backward is done and freed.

use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;

use super::ShardedState;
use crate::model::{ModelError, ParamUnit, Phase, Residency};
use crate::train::distributed::{Flat, Pending, World};
use crate::util::ErrBuf;

unsafe extern "C" {
    /// c10d_shim.cpp: the bytes of the tensor's storage.
    fn tt_storage_nbytes(t: *mut std::ffi::c_void) -> i64;
    /// c10d_shim.cpp: the identity of the tensor's storage.
    fn tt_storage_id(t: *mut std::ffi::c_void) -> i64;
    /// c10d_shim.cpp: gives the storage `nbytes` bytes (0 frees them).
    fn tt_storage_resize(t: *mut std::ffi::c_void, nbytes: i64, err: *mut std::ffi::c_char, len: usize) -> i32;
    /// c10d_shim.cpp: `dst.data.copy_(src)`, the version counter untouched.
    fn tt_copy_unversioned(
        dst: *mut std::ffi::c_void,
        src: *mut std::ffi::c_void,
        err: *mut std::ffi::c_char,
        len: usize,
    ) -> i32;
}

/// Runs a shim call with an error buffer; its message as a [`ModelError`].
fn shim(call: impl FnOnce(*mut std::ffi::c_char, usize) -> i32) -> Result<(), ModelError> {
    let mut err = ErrBuf::new();
    match call(err.ptr(), ErrBuf::LEN) {
        0 => Ok(()),
        _ => Err(ModelError::Input(format!("full_shard: {}", err.message()))),
    }
}

/// The bytes `p`'s storage holds.
pub(super) fn storage_nbytes(p: &Tensor) -> i64 {
    // SAFETY: a live tensor; reading its storage's size.
    unsafe { tt_storage_nbytes(p.as_ptr() as *mut _) }
}

/// The identity of `p`'s storage.
fn storage_id(p: &Tensor) -> i64 {
    // SAFETY: a live tensor; reading its storage's address.
    unsafe { tt_storage_id(p.as_ptr() as *mut _) }
}

/// Gives every unit storages of its own: a unit's parameters whose storage holds bytes of
/// anything else (the CPU loader puts all unfused weights of a dtype in one buffer, frozen ones
/// included) get fresh storage, uninitialised (the master shards hold the values), so freeing
/// a unit frees nothing another tensor reads; the shared buffer goes once nothing trained
/// points into it. A layer's fused q/k/v and gate/up buffers hold that layer's weights alone
/// and stay.
pub(super) fn own_storages(units: &[&[Tensor]]) -> Result<(), ModelError> {
    for params in units {
        let mut covered: std::collections::HashMap<i64, i64> = Default::default();
        for p in params.iter() {
            *covered.entry(storage_id(p)).or_default() += (p.numel() * p.kind().elt_size_in_bytes()) as i64;
        }
        for p in params.iter().filter(|p| covered[&storage_id(p)] < storage_nbytes(p)) {
            let fresh = Tensor::f_empty(p.size(), (p.kind(), p.device()))?;
            p.shallow_clone().f_set_data(&fresh)?;
        }
    }
    Ok(())
}

/// Gives `p`'s storage `nbytes` bytes (0 frees them; shared storages once).
fn resize_storage(p: &Tensor, nbytes: i64) -> Result<(), ModelError> {
    // SAFETY: a live tensor; no kernel reads a unit's parameters while it is released (the
    // model gathers a unit before each use, and the optimizer reads its shards).
    shim(|err, len| unsafe { tt_storage_resize(p.as_ptr() as *mut _, nbytes, err, len) })
}

/// Copies `src` into `dst` as `dst.data` would.
fn copy_unversioned(dst: &Tensor, src: &Tensor) -> Result<(), ModelError> {
    // SAFETY: two live tensors of the same shape; `dst`'s storage holds its bytes (refilled).
    shim(|err, len| unsafe { tt_copy_unversioned(dst.as_ptr() as *mut _, src.as_ptr() as *mut _, err, len) })
}

impl ShardedState {
    /// The units `unit` names (absent ones, e.g. frozen layers under LoRA, are none).
    fn indices(&self, unit: ParamUnit) -> Vec<usize> {
        let wanted = |key: (u8, usize)| match unit {
            ParamUnit::Root => key.0 != 1,
            ParamUnit::Layer(i) => key == (1, i),
        };
        (0..self.units.len()).filter(|&u| wanted(self.units[u].key)).collect()
    }

    /// Starts the all-gather of unit `u`'s master shards in the parameters' dtype.
    fn start_gather(&self, u: usize, world: &World) -> Result<InFlight, ModelError> {
        let (unit, kind) = (&self.units[u], self.units[u].params[0].kind());
        let master = self.master[u]
            .as_ref()
            .expect("full_shard keeps every unit's master shard");
        let shard = master.f_to_kind(kind)?;
        let whole = shard.f_new_empty([self.size as i64 * unit.shard], (kind, shard.device()))?;
        let pending = world.start(Flat::AllGather, &shard, &whole).map_err(dist)?;
        Ok(InFlight {
            pending,
            whole,
            _shard: shard,
        })
    }

    /// Starts gathering unit `u` ahead of its use (nothing when whole or already started).
    pub(super) fn prefetch_unit(&mut self, u: usize, world: &World) -> Result<(), ModelError> {
        if !self.gathered[u] && self.inflight[u].is_none() {
            self.inflight[u] = Some(self.start_gather(u, world)?);
        }
        Ok(())
    }

    /// Unit `u`'s parameters whole: every rank's master shard all-gathered in their dtype
    /// (started now, or by a prefetch) and copied into their refilled storage.
    pub(super) fn gather_unit(&mut self, u: usize, world: &World) -> Result<(), ModelError> {
        if self.gathered[u] {
            return Ok(());
        }
        let started = match self.inflight[u].take() {
            Some(f) => f,
            None => self.start_gather(u, world)?,
        };
        world.wait(started.pending).map_err(dist)?;
        let unit = &self.units[u];
        for (p, &n) in unit.params.iter().zip(&unit.nbytes) {
            resize_storage(p, n)?;
        }
        for (p, piece) in unit.params.iter().zip(super::split(unit, &started.whole)?) {
            copy_unversioned(p, &piece)?;
        }
        self.gathered[u] = true;
        Ok(())
    }

    /// Frees unit `u`'s parameter bytes.
    pub(super) fn release_unit(&mut self, u: usize) -> Result<(), ModelError> {
        if self.gathered[u] {
            self.units[u].params.iter().try_for_each(|p| resize_storage(p, 0))?;
            self.gathered[u] = false;
        }
        Ok(())
    }

    /// Starts summing unit `u`'s gradients over the ranks (then freed); the sum joins this
    /// rank's accumulated shard when waited for: at the next layer's reduction (this one
    /// overlaps that layer's backward) or at the step.
    fn reduce_unit(&mut self, u: usize, world: &World) -> Result<(), ModelError> {
        self.finish_reductions(world)?;
        let started = self.start_reduction(u, world).map_err(dist)?;
        self.reducing.push(started);
        Ok(())
    }

    /// Waits for the reductions in flight and adds each into its unit's accumulated shard.
    pub(super) fn finish_reductions(&mut self, world: &World) -> Result<(), ModelError> {
        for r in std::mem::take(&mut self.reducing) {
            let u = r.unit;
            let part = r.finish(world).map_err(dist)?;
            self.acc[u] = Some(match self.acc[u].take() {
                Some(acc) => acc.f_add(&part)?,
                None => part,
            });
        }
        Ok(())
    }

    /// The first parameter (by unit, then name) whose part in this rank's master shards is
    /// not finite.
    pub(crate) fn first_non_finite(&self) -> Result<Option<String>, ModelError> {
        for (unit, master) in self.units.iter().zip(&self.master) {
            let Some(master) = master else { continue };
            let bad = master.f_isfinite()?.f_logical_not()?.f_nonzero()?;
            if bad.size()[0] == 0 {
                continue;
            }
            let mut at = self.rank as i64 * unit.shard + bad.f_int64_value(&[0, 0])?;
            for (name, p) in unit.names.iter().zip(&unit.params) {
                if at < p.numel() as i64 {
                    return Ok(Some(name.clone()));
                }
                at -= p.numel() as i64;
            }
        }
        Ok(None)
    }

    /// Frees every unit's parameter bytes.
    pub(super) fn release_all_units(&mut self) -> Result<(), ModelError> {
        (0..self.units.len()).try_for_each(|u| self.release_unit(u))
    }
}

/// An all-gather of a unit started ahead of its use: the collective, its output and the
/// cast shard it reads (kept alive until it ends).
#[derive(Debug)]
pub(super) struct InFlight {
    pending: Option<Pending>,
    whole: Tensor,
    _shard: Tensor,
}

/// A collective's error as the model's.
fn dist(e: crate::train::distributed::DistError) -> ModelError {
    ModelError::Input(e.to_string())
}

/// The residency of a `full_shard` run: the sharded optimizer state, shared with the
/// optimizer, and the world its collectives run on.
#[derive(Debug)]
pub(crate) struct FullShard {
    pub(crate) state: Arc<Mutex<ShardedState>>,
    pub(crate) world: Arc<World>,
    pub(crate) config: super::FsdpConfig,
}

impl FullShard {
    fn state(&self) -> MutexGuard<'_, ShardedState> {
        // A panic while holding the lock is a bug of ours, not a user's; the state is still
        // consistent at unit granularity.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Residency for FullShard {
    fn gather(&self, unit: ParamUnit) -> Result<(), ModelError> {
        let mut s = self.state();
        for u in s.indices(unit) {
            s.gather_unit(u, &self.world)?;
        }
        Ok(())
    }

    fn prefetch(&self, unit: ParamUnit, phase: Phase) -> Result<(), ModelError> {
        if !self.config.prefetches(phase) {
            return Ok(());
        }
        let mut s = self.state();
        for u in s.indices(unit) {
            s.prefetch_unit(u, &self.world)?;
        }
        Ok(())
    }

    fn release(&self, unit: ParamUnit) -> Result<(), ModelError> {
        let mut s = self.state();
        if s.whole || unit == ParamUnit::Root {
            return Ok(());
        }
        s.indices(unit).into_iter().try_for_each(|u| s.release_unit(u))
    }

    fn reduce(&self, unit: ParamUnit) -> Result<(), ModelError> {
        let mut s = self.state();
        for u in s.indices(unit) {
            s.reduce_unit(u, &self.world)?;
        }
        Ok(())
    }

    fn gather_all(&self) -> Result<(), ModelError> {
        let mut s = self.state();
        s.whole = true;
        (0..s.units.len()).try_for_each(|u| s.gather_unit(u, &self.world))
    }

    fn release_all(&self) -> Result<(), ModelError> {
        let mut s = self.state();
        s.whole = false;
        s.release_all_units()
    }
}
