//! Sharded optimizer state (`fsdp = "shard_grad_op"`, ZeRO-2): every rank keeps the whole
//! parameters but only its shard of both AdamW moments (and of the fp32 master weights of a
//! half-precision model), and receives only its shard of the summed gradients; the whole
//! gradients are freed once reduce-scattered.
//!
//! The unit of sharding is FSDP's: one flat buffer per decoder layer, one for the embeddings
//! and one for the rest (final norm, untied head), each split evenly over the ranks (the last
//! shard padded with zeros). A step reduce-scatters each unit's gradients (the sum over ranks
//! of this rank's part), clips by the global norm (shard norms summed over ranks), applies
//! AdamW to the shard in PyTorch's order of operations, and all-gathers the updated shards
//! into every rank's parameters. Elementwise, that is the replicated update: one process and
//! N ranks agree up to the summation order of the gradients. `full_shard` (module `full`)
//! shards the parameters too, on the same units and state.

mod files;
mod full;
mod settings;

pub(crate) use files::{MANIFEST_FILE, Manifest};
pub(crate) use full::FullShard;
pub use settings::{BackwardPrefetch, Fsdp, FsdpConfig};

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use super::adamw::{AdamWConfig, adam_update, decays, squared_norm};
use super::distributed::{DistError, Flat, Pending, World};
use crate::model::{ModelError, ParamUnit};

unsafe extern "C" {
    /// c10d_shim.cpp: resets the tensor's gradient to undefined.
    fn tt_free_grad(t: *mut std::ffi::c_void);
}

/// Frees `p`'s gradient (the next backward allocates a new one).
fn free_grad(p: &Tensor) {
    // SAFETY: a live tensor; resetting its gradient slot is what `p.grad = None` does.
    unsafe { tt_free_grad(p.as_ptr() as *mut std::ffi::c_void) }
}

/// One unit of sharding: parameters flattened in name order into `size * shard` elements.
#[derive(Debug)]
struct Unit {
    /// Which unit ([`unit_key`]).
    key: (u8, usize),
    names: Vec<String>,
    params: Vec<Tensor>,
    /// Bytes of each parameter's storage when whole (`full_shard` frees and refills them).
    nbytes: Vec<i64>,
    /// Real elements (the rest of the last shard is padding).
    total: i64,
    /// Elements per rank.
    shard: i64,
}

/// This rank's shards of the optimizer state.
#[derive(Debug)]
pub(crate) struct ShardedState {
    rank: usize,
    size: usize,
    units: Vec<Unit>,
    /// fp32 master shard of each unit whose parameters are not fp32 (mixed precision), and of
    /// every unit under `full_shard`: the weights the updates go to. Otherwise an fp32 unit's
    /// shard is read from its parameters.
    master: Vec<Option<Tensor>>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// Where weight decay applies in each shard: `(start, len)` element ranges.
    decay: Vec<Vec<(i64, i64)>>,
    /// This step's summed gradient shards, fp32, between the reduce-scatter and the update.
    grads: Vec<Tensor>,
    /// `full_shard`: parameters sharded too (every unit has a master shard).
    full: bool,
    /// `full_shard`: which units' parameters are whole now.
    gathered: Vec<bool>,
    /// `full_shard`: inside a use of the whole model (nothing is released).
    whole: bool,
    /// `full_shard`: each layer's gradient shard summed over this step's passes so far.
    acc: Vec<Option<Tensor>>,
    /// `full_shard`: all-gathers started ahead of a unit's use (prefetch).
    inflight: Vec<Option<full::InFlight>>,
    /// `full_shard`: reduce-scatters started as a layer's backward ended, not yet waited for.
    reducing: Vec<Reducing>,
}

/// The unit a parameter belongs to: `(0, 0)` the embeddings, `(1, i)` decoder layer `i`,
/// `(2, 0)` the rest, so units run in the model's order.
fn unit_key(name: &str) -> (u8, usize) {
    match ParamUnit::of(name) {
        ParamUnit::Layer(i) => (1, i),
        ParamUnit::Root if name.contains("embed_tokens") => (0, 0),
        ParamUnit::Root => (2, 0),
    }
}

/// The element ranges of the shard starting at `from` of `unit`'s flattened parameters whose
/// parameter takes weight decay (adjacent ones merged).
fn decay_ranges(unit: &Unit, from: i64) -> Vec<(i64, i64)> {
    let mut ranges: Vec<(i64, i64)> = Vec::new();
    let mut at = 0;
    for (name, p) in unit.names.iter().zip(&unit.params) {
        let (start, end) = (at.max(from), (at + p.numel() as i64).min(from + unit.shard));
        at += p.numel() as i64;
        if start >= end || !decays(name) {
            continue;
        }
        match ranges.last_mut() {
            Some(last) if last.0 + last.1 == start - from => last.1 += end - start,
            _ => ranges.push((start - from, end - start)),
        }
    }
    ranges
}

/// `whole` `[size * shard]`, a unit's parameters flattened, split into one view per parameter
/// in its shape.
fn split(unit: &Unit, whole: &Tensor) -> Result<Vec<Tensor>, ModelError> {
    let mut at = 0;
    let mut pieces = Vec::with_capacity(unit.params.len());
    for p in &unit.params {
        let n = p.numel() as i64;
        pieces.push(whole.f_narrow(0, at, n)?.f_view(p.size().as_slice())?);
        at += n;
    }
    Ok(pieces)
}

/// A unit's gradient reduce-scatter in flight: its flat input (kept alive until it ends) and
/// this rank's part of the sum.
#[derive(Debug)]
struct Reducing {
    unit: usize,
    pending: Option<Pending>,
    _flat: Tensor,
    part: Tensor,
}

impl Reducing {
    /// Waits for the sum; this rank's part as fp32.
    fn finish(self, world: &World) -> Result<Tensor, DistError> {
        world.wait(self.pending)?;
        (self.part.f_to_kind(Kind::Float)).map_err(|e| DistError::new(world.rank, "reduce_scatter", e.to_string()))
    }
}

impl ShardedState {
    /// The shards of rank `rank` of `size` over `params` (by name; the same on every rank),
    /// master weights from `masters` where given (mixed precision), else the parameters.
    /// With `full` (`full_shard`) the parameters are sharded too: every unit keeps an fp32
    /// master shard and the parameters' bytes are freed.
    pub(crate) fn new(
        params: &BTreeMap<String, Tensor>,
        masters: &BTreeMap<String, Tensor>,
        (rank, size): (usize, usize),
        full: bool,
    ) -> Result<Self, ModelError> {
        let mut grouped: BTreeMap<(u8, usize), Vec<&String>> = BTreeMap::new();
        for name in params.keys() {
            grouped.entry(unit_key(name)).or_default().push(name);
        }
        let mut state = ShardedState {
            rank,
            size,
            units: Vec::new(),
            master: Vec::new(),
            exp_avg: Vec::new(),
            exp_avg_sq: Vec::new(),
            decay: Vec::new(),
            grads: Vec::new(),
            full,
            gathered: Vec::new(),
            whole: false,
            acc: Vec::new(),
            inflight: Vec::new(),
            reducing: Vec::new(),
        };
        for (key, names) in grouped {
            let tensors: Vec<Tensor> = names.iter().map(|n| params[*n].shallow_clone()).collect();
            let total: i64 = tensors.iter().map(|t| t.numel() as i64).sum();
            let unit = Unit {
                key,
                names: names.into_iter().cloned().collect(),
                nbytes: Vec::new(),
                params: tensors,
                total,
                shard: (total + size as i64 - 1) / size as i64,
            };
            let flat = |f: &dyn Fn(&str, &Tensor) -> Result<Tensor, tch::TchError>| state.flat(&unit, f);
            let half = unit.params.iter().any(|p| p.kind() != Kind::Float);
            let master = match half || full {
                true => Some(flat(&|n, p| masters.get(n).unwrap_or(p).f_to_kind(Kind::Float))?),
                false => None,
            };
            let device = unit.params[0].device();
            state
                .exp_avg
                .push(Tensor::f_zeros([unit.shard], (Kind::Float, device))?);
            state
                .exp_avg_sq
                .push(Tensor::f_zeros([unit.shard], (Kind::Float, device))?);
            state.master.push(master);
            state.decay.push(decay_ranges(&unit, rank as i64 * unit.shard));
            state.units.push(unit);
            state.gathered.push(true);
            state.acc.push(None);
            state.inflight.push(None);
        }
        if full {
            // The master shards hold the values now: parameters sharing storage with another
            // unit's get storage of their own, uninitialised, freed next with the rest.
            let units: Vec<&[Tensor]> = state.units.iter().map(|u| u.params.as_slice()).collect();
            full::own_storages(&units)?;
        }
        for unit in &mut state.units {
            unit.nbytes = unit.params.iter().map(full::storage_nbytes).collect();
        }
        if full {
            state.release_all_units()?;
        }
        Ok(state)
    }

    /// This rank's shard `[shard]` of the unit's parameters mapped by `f` (name, parameter)
    /// and flattened in order, zero padded.
    fn flat(
        &self,
        unit: &Unit,
        f: &dyn Fn(&str, &Tensor) -> Result<Tensor, tch::TchError>,
    ) -> Result<Tensor, tch::TchError> {
        let whole = self.padded(unit, f)?;
        whole
            .f_narrow(0, self.rank as i64 * unit.shard, unit.shard)?
            .f_contiguous()
    }

    /// The unit's parameters mapped by `f`, flattened, zero padded to `size * shard`.
    fn padded(
        &self,
        unit: &Unit,
        f: &dyn Fn(&str, &Tensor) -> Result<Tensor, tch::TchError>,
    ) -> Result<Tensor, tch::TchError> {
        let mut parts = unit
            .names
            .iter()
            .zip(&unit.params)
            .map(|(n, p)| f(n, p)?.f_reshape([-1]))
            .collect::<Result<Vec<_>, _>>()?;
        let pad = self.size as i64 * unit.shard - unit.total;
        if pad > 0 {
            let like = &parts[0];
            parts.push(like.f_new_zeros([pad], (like.kind(), like.device()))?);
        }
        Tensor::f_cat(&parts, 0)
    }

    /// Sums every unit's gradients over the ranks into this rank's fp32 shards (a parameter
    /// without a gradient takes part with zeros), then frees the parameters' gradients. Under
    /// `full_shard` a layer's shard was summed pass by pass as its backward ended.
    pub(crate) fn reduce_grads(&mut self, world: &World) -> Result<(), DistError> {
        self.grads.clear();
        self.finish_reductions(world)
            .map_err(|e| DistError::new(world.rank, "reduce_scatter", e.to_string()))?;
        for u in 0..self.units.len() {
            let part = match (self.full && self.units[u].key.0 == 1, self.acc[u].take()) {
                (true, Some(acc)) => acc,
                (true, None) => Tensor::f_zeros([self.units[u].shard], (Kind::Float, self.exp_avg[u].device()))
                    .map_err(|e| DistError::new(world.rank, "reduce_scatter", e.to_string()))?,
                (false, _) => self.reduced_shard(u, world)?,
            };
            self.grads.push(part);
        }
        Ok(())
    }

    /// Unit `u`'s gradients summed over the ranks, this rank's part as fp32 `[shard]`; the
    /// parameters' gradients are freed.
    fn reduced_shard(&self, u: usize, world: &World) -> Result<Tensor, DistError> {
        self.start_reduction(u, world)?.finish(world)
    }

    /// Starts summing unit `u`'s gradients over the ranks (flattened, zeros for a parameter
    /// without one); the parameters' gradients are freed.
    fn start_reduction(&self, u: usize, world: &World) -> Result<Reducing, DistError> {
        let fail = |e: tch::TchError| DistError::new(world.rank, "reduce_scatter", e.to_string());
        let unit = &self.units[u];
        let grad = |_: &str, p: &Tensor| {
            let g = p.grad();
            if g.defined() { Ok(g) } else { p.f_zeros_like() }
        };
        let flat = tch::no_grad(|| self.padded(unit, &grad)).map_err(fail)?;
        unit.params.iter().for_each(free_grad);
        let part = flat
            .f_new_empty([unit.shard], (flat.kind(), flat.device()))
            .map_err(fail)?;
        let pending = world.start(Flat::ReduceScatter, &flat, &part)?;
        Ok(Reducing {
            unit: u,
            pending,
            _flat: flat,
            part,
        })
    }

    /// Drops the gradient shards of a step that will not be applied, and any gradients.
    pub(crate) fn discard_grads(&mut self) {
        self.grads.clear();
        // Dropped unwaited: each is waited for, then freed.
        self.reducing.clear();
        self.acc.iter_mut().for_each(|a| *a = None);
        self.units.iter().flat_map(|u| &u.params).for_each(free_grad);
    }

    /// The global L2 norm of the summed gradients; above `max_norm` the shards are scaled
    /// down to it (`clip_grad_norm_`'s coefficient `max_norm / (norm + 1e-6)`).
    pub(crate) fn clip(&self, max_norm: Option<f64>, world: &World) -> Result<f64, DistError> {
        let fail = |e: tch::TchError| DistError::new(world.rank, "clip", e.to_string());
        let mut squares = [self.grads.iter().map(squared_norm).sum::<f64>()];
        world.sum(&mut squares)?;
        let total = squares[0].sqrt();
        if let Some(max) = max_norm {
            let coef = max / (total + 1e-6);
            if coef < 1.0 {
                for g in &self.grads {
                    let _ = tch::no_grad(|| g.shallow_clone().f_mul_scalar_(coef)).map_err(fail)?;
                }
            }
        }
        Ok(total)
    }

    /// One AdamW update of every shard at `lr` (update number `step`, 1-based), then the
    /// updated shards all-gathered into every rank's parameters (`full_shard`: the gathered
    /// units freed; their next use gathers the new shards).
    pub(crate) fn step(&mut self, lr: f64, step: u64, c: AdamWConfig, world: &World) -> Result<(), ModelError> {
        let grads = std::mem::take(&mut self.grads);
        // A gather started before a failed pass would bring the old shards.
        self.inflight.iter_mut().for_each(|f| *f = None);
        for (u, g) in grads.iter().enumerate() {
            let p = match &self.master[u] {
                Some(master) => master.shallow_clone(),
                None => self.flat(&self.units[u], &|_, p| p.f_to_kind(Kind::Float))?,
            };
            tch::no_grad(|| -> Result<(), tch::TchError> {
                // `p * (1 - lr * weight_decay)` where decay applies, as the replicated step.
                let decayed = p.f_mul_scalar(1.0)?;
                for &(start, len) in self.decay[u].iter().filter(|_| c.weight_decay != 0.0) {
                    let _ = decayed
                        .f_narrow(0, start, len)?
                        .f_mul_scalar_(1.0 - lr * c.weight_decay)?;
                }
                let moments = (&self.exp_avg[u], &self.exp_avg_sq[u]);
                p.shallow_clone()
                    .f_copy_(&adam_update(&decayed, g, moments, lr, step, &c)?)
            })?;
            match self.full {
                // The next use gathers the updated shards.
                true => self.release_unit(u)?,
                false => self.gather_into_params(&self.units[u], &p, world)?,
            }
        }
        Ok(())
    }

    /// Every rank's master shard of `unit` (in the parameters' dtype) copied into the
    /// parameters.
    fn gather_into_params(&self, unit: &Unit, master: &Tensor, world: &World) -> Result<(), ModelError> {
        let kind = unit.params[0].kind();
        let pieces = self.gather_pieces(unit, &master.f_to_kind(kind)?, world)?;
        tch::no_grad(|| -> Result<(), tch::TchError> {
            for (p, piece) in unit.params.iter().zip(&pieces) {
                p.shallow_clone().f_copy_(&piece.f_to_kind(p.kind())?)?;
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Every rank's `shard` of `unit` all-gathered (in the shard's dtype) and split into one
    /// view per parameter, in the parameter's shape.
    fn gather_pieces(&self, unit: &Unit, shard: &Tensor, world: &World) -> Result<Vec<Tensor>, ModelError> {
        let whole = shard.f_new_zeros([self.size as i64 * unit.shard], (shard.kind(), shard.device()))?;
        world
            .all_gather_into(shard, &whole)
            .map_err(|e| ModelError::Input(e.to_string()))?;
        split(unit, &whole)
    }

    /// The shards, by `<kind>.<unit index>`: what lives beside the parameters on their device.
    pub(crate) fn tensors(&self) -> Vec<(String, &Tensor)> {
        let masters = self.master.iter().enumerate();
        let masters = masters.filter_map(|(i, t)| Some((format!("master.unit{i}"), t.as_ref()?)));
        [("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)]
            .into_iter()
            .flat_map(|(prefix, v)| v.iter().enumerate().map(move |(i, t)| (format!("{prefix}.unit{i}"), t)))
            .chain(masters)
            .collect()
    }

    /// Bytes of the gradient shards (fp32).
    pub(crate) fn grad_bytes(&self) -> u64 {
        self.grads.iter().map(|t| t.numel() as u64 * 4).sum()
    }

    /// Whether the parameters are sharded too (`full_shard`).
    pub(crate) fn is_full(&self) -> bool {
        self.full
    }

    /// `full_shard`: the bytes this rank holds between steps of parameters (the fp32 master
    /// shards, which the parameters are gathered from), of gradients (fp32 shards) and of
    /// AdamW's moments; `None` when the parameters are not sharded.
    pub(crate) fn held_full(&self) -> Option<(u64, u64, u64)> {
        let shard: u64 = self.units.iter().map(|u| u.shard as u64 * 4).sum();
        self.full.then_some((shard, shard, 2 * shard))
    }

    /// Bytes of optimizer state this rank holds (moments and master shards).
    pub(crate) fn bytes(&self) -> u64 {
        self.tensors().iter().map(|(_, t)| t.numel() as u64 * 4).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tch::{Kind, Tensor, nn};

    use super::super::{AdamW, AdamWConfig};
    use super::*;

    /// A little model's variables: an embedding, two layers of odd sizes (shards end
    /// mid-tensor, the last one padded) and a final norm.
    fn variables(vs: &nn::VarStore, rank: usize) {
        let p = vs.root();
        let init = |shape: &[i64], seed: f64| {
            let n: i64 = shape.iter().product();
            let t = Tensor::arange(n, (Kind::Float, tch::Device::Cpu))
                .f_mul_scalar(0.37)
                .unwrap();
            (t + seed).sin().view(shape)
        };
        let var = |name: &str, t: &Tensor| {
            let (path, last) = name.rsplit_once('.').unwrap();
            let at = path.split('.').fold(p.clone(), |at, part| at / part);
            let _ = at.var_copy(last, t);
        };
        var("model.embed_tokens.weight", &init(&[7, 3], 0.1));
        var("model.layers.0.mlp.up_proj.weight", &init(&[5, 3], 0.2));
        var("model.layers.0.input_layernorm.weight", &init(&[3], 0.3));
        var("model.layers.1.mlp.up_proj.weight", &init(&[4, 3], 0.4));
        var("model.norm.weight", &init(&[3], 0.5));
        // Each rank's own gradients.
        let sorted: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
        for (i, v) in sorted.values().enumerate() {
            let g = (v.detach() * (rank as f64 + 1.0) + i as f64).cos();
            (v * g).sum(Kind::Float).backward();
        }
    }

    /// Two ranks (threads on a file store) step the sharded state and write it rank by rank;
    /// one replicated optimizer steps on the sum of their gradients: the same norms, the same
    /// parameters; the state read back by a replicated optimizer (assembled from both files)
    /// equals the replicated one, and each rank of a new sharded run reads its own file back.
    #[test]
    fn sharded_steps_equal_the_replicated_update() {
        let dir = std::env::temp_dir().join(format!("treetrain-shard-{}", std::process::id()));
        let ckpt = dir.join("checkpoint");
        std::fs::create_dir_all(&ckpt).unwrap();
        let store = dir.join("store");
        let _ = std::fs::remove_file(&store);
        let config = AdamWConfig {
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let run = |rank: usize| {
            let (store, ckpt) = (store.clone(), ckpt.clone());
            std::thread::spawn(move || {
                let world = World::with_file_store(&store, rank, 2, Duration::from_secs(30)).unwrap();
                let world = std::sync::Arc::new(world);
                let sharded = |vs: &nn::VarStore| {
                    variables(vs, rank);
                    let mut adamw = AdamW::new(vs, config);
                    adamw.shard(&world, None).unwrap();
                    adamw
                };
                let vs = nn::VarStore::new(tch::Device::Cpu);
                let mut adamw = sharded(&vs);
                adamw.reduce_grads(&world).unwrap();
                let norm = adamw.clip_in(Some(1.0), &world).unwrap();
                adamw.step_in(1e-2, &world).unwrap();
                adamw.write_state(&ckpt, &world).unwrap();
                world.barrier().unwrap();
                if rank == 0 {
                    adamw.write_manifest(&ckpt).unwrap();
                }
                world.barrier().unwrap();
                let mut again = sharded(&nn::VarStore::new(tch::Device::Cpu));
                again.load(&ckpt).unwrap();
                assert_eq!(again.step, 1);
                for ((k, a), (_, b)) in adamw.state_tensors().iter().zip(again.state_tensors()) {
                    assert!(a.equal(&b), "rank {rank} read its {k} back changed");
                }
                let params: BTreeMap<String, Tensor> = vs.variables().into_iter().collect();
                (norm, params)
            })
        };
        let (a, b) = (run(0), run(1));
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        // The replicated reference: the summed gradients in one process.
        let vs = nn::VarStore::new(tch::Device::Cpu);
        variables(&vs, 0);
        let other = nn::VarStore::new(tch::Device::Cpu);
        variables(&other, 1);
        let theirs = other.variables();
        for (name, v) in vs.variables() {
            let mut g = v.grad();
            let _ = g.f_add_(&theirs[&name].grad()).unwrap();
        }
        let mut adamw = AdamW::new(&vs, config);
        let norm = adamw.clip_grad_norm(Some(1.0));
        adamw.step(1e-2).unwrap();
        for (got_norm, params) in [a, b] {
            assert!((got_norm - norm).abs() <= 1e-6 * norm, "{got_norm} vs {norm}");
            for (name, v) in vs.variables() {
                let diff = (&params[&name] - &v).abs().max().double_value(&[]);
                assert!(diff <= 1e-7, "{name}: {diff}");
            }
        }
        let fresh = nn::VarStore::new(tch::Device::Cpu);
        variables(&fresh, 0);
        let mut whole = AdamW::new(&fresh, config);
        whole.load(&ckpt).unwrap();
        assert_eq!(whole.step, 1);
        // A shard file cut short (a copy interrupted) is named, not read.
        let file = ckpt.join("optimizer.shard-1-of-2.safetensors");
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 1]).unwrap();
        let err = AdamW::new(&fresh, config).load(&ckpt).unwrap_err().to_string();
        assert!(
            err.contains("shard-1-of-2") && err.contains("the manifest says"),
            "{err}"
        );
        let want = adamw.state_tensors();
        let got: BTreeMap<String, Tensor> = whole.state_tensors().into_iter().collect();
        assert_eq!(got.len(), want.len());
        for (key, t) in want {
            let diff = (&got[&key] - t).abs().max().double_value(&[]);
            assert!(diff <= 1e-7, "{key}: {diff}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
