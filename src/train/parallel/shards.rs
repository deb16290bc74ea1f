//! What both sharded modes keep (ZeRO's optimizer-state partitioning): each unit's parameters
//! flattened in name order into `size * shard` elements (the last shard padded with zeros), and
//! per rank its `[shard]` of both AdamW moments, the element ranges of it that take weight
//! decay, and this step's summed gradient shard. The update is AdamW's kernel on each shard, so
//! one process and N ranks agree elementwise up to the summation order of the gradients. The
//! fp32 master shards, which the update goes to, are the mode's: `shard_grad_op` keeps them for
//! half-precision units only, `full_shard` for every unit (they are its parameter shards).

use std::sync::Arc;

use tch::{Kind, Tensor};

use super::units::Unit;
use crate::distributed::{DistError, Flat, Pending, World};
use crate::model::ModelError;
use crate::train::adamw::{AdamWConfig, adam_update, decays, free_grad, squared_norm};

/// A mapping of a unit's parameters (name, parameter) to the tensors to flatten.
pub(crate) type PerParam<'a> = &'a dyn Fn(&str, &Tensor) -> Result<Tensor, tch::TchError>;

/// This rank's shards of every unit's optimizer state.
#[derive(Debug)]
pub(crate) struct Shards {
    pub(crate) world: Arc<World>,
    pub(crate) units: Vec<Unit>,
    /// Elements per rank of each unit.
    pub(crate) shard: Vec<i64>,
    pub(crate) exp_avg: Vec<Tensor>,
    pub(crate) exp_avg_sq: Vec<Tensor>,
    /// Where weight decay applies in each shard: `(start, len)` element ranges.
    decay: Vec<Vec<(i64, i64)>>,
    /// This step's summed gradient shards, fp32, between the reduction and the update.
    pub(crate) grads: Vec<Tensor>,
    pub(crate) config: AdamWConfig,
    /// Updates done.
    pub(crate) step: u64,
}

/// A unit's gradient reduce-scatter in flight: its flat input (kept alive until it ends) and
/// this rank's part of the sum.
#[derive(Debug)]
pub(crate) struct Reducing {
    pub(crate) unit: usize,
    pending: Option<Pending>,
    _flat: Tensor,
    part: Tensor,
}

impl Reducing {
    /// Waits for the sum; this rank's part as fp32.
    pub(crate) fn finish(self, world: &World) -> Result<Tensor, DistError> {
        world.wait(self.pending)?;
        (self.part.f_to_kind(Kind::Float)).map_err(|e| DistError::new(world.rank, "reduce_scatter", e.to_string()))
    }
}

impl Shards {
    /// Zero moments for this rank of `world` over `units`.
    pub(crate) fn new(units: Vec<Unit>, world: Arc<World>, config: AdamWConfig) -> Result<Self, ModelError> {
        let size = world.size as i64;
        let shard: Vec<i64> = units.iter().map(|u| (u.total + size - 1) / size).collect();
        let zeros = |u: usize| Tensor::f_zeros([shard[u]], (Kind::Float, units[u].params[0].device()));
        let n = units.len();
        Ok(Shards {
            exp_avg: (0..n).map(zeros).collect::<Result<_, _>>()?,
            exp_avg_sq: (0..n).map(zeros).collect::<Result<_, _>>()?,
            decay: (0..n)
                .map(|u| decay_ranges(&units[u], world.rank as i64 * shard[u], shard[u]))
                .collect(),
            grads: Vec::new(),
            units,
            shard,
            world,
            config,
            step: 0,
        })
    }

    /// This rank's shard `[shard]` of unit `u`'s parameters mapped by `f` and flattened in
    /// order, zero padded.
    pub(crate) fn flat(&self, u: usize, f: PerParam<'_>) -> Result<Tensor, tch::TchError> {
        let whole = self.padded(u, f)?;
        let shard = self.shard[u];
        whole.f_narrow(0, self.world.rank as i64 * shard, shard)?.f_contiguous()
    }

    /// Unit `u`'s parameters mapped by `f`, flattened, zero padded to `size * shard`.
    fn padded(&self, u: usize, f: PerParam<'_>) -> Result<Tensor, tch::TchError> {
        let unit = &self.units[u];
        let mut parts = (unit.named())
            .map(|(n, p)| f(n, p)?.f_reshape([-1]))
            .collect::<Result<Vec<_>, _>>()?;
        let pad = self.world.size as i64 * self.shard[u] - unit.total;
        if pad > 0 {
            let like = &parts[0];
            parts.push(like.f_new_zeros([pad], (like.kind(), like.device()))?);
        }
        Tensor::f_cat(&parts, 0)
    }

    /// Starts summing unit `u`'s gradients over the ranks (flattened, zeros for a parameter
    /// without one); the parameters' gradients are freed.
    pub(crate) fn start_reduction(&self, u: usize) -> Result<Reducing, DistError> {
        let world = &self.world;
        let fail = |e: tch::TchError| DistError::new(world.rank, "reduce_scatter", e.to_string());
        let grad = |_: &str, p: &Tensor| {
            let g = p.grad();
            if g.defined() { Ok(g) } else { p.f_zeros_like() }
        };
        let flat = tch::no_grad(|| self.padded(u, &grad)).map_err(fail)?;
        self.units[u].params.iter().for_each(free_grad);
        let part = flat
            .f_new_empty([self.shard[u]], (flat.kind(), flat.device()))
            .map_err(fail)?;
        let pending = world.start(Flat::ReduceScatter, &flat, &part)?;
        Ok(Reducing {
            unit: u,
            pending,
            _flat: flat,
            part,
        })
    }

    /// Unit `u`'s gradients summed over the ranks now, this rank's part as fp32 `[shard]`.
    pub(crate) fn reduced(&self, u: usize) -> Result<Tensor, DistError> {
        self.start_reduction(u)?.finish(&self.world)
    }

    /// The global L2 norm of the summed gradient shards; above `max_norm` they are scaled down
    /// to it (`clip_grad_norm_`'s coefficient `max_norm / (norm + 1e-6)`).
    pub(crate) fn clip(&self, max_norm: Option<f64>) -> Result<f64, DistError> {
        let fail = |e: tch::TchError| DistError::new(self.world.rank, "clip", e.to_string());
        let mut squares = [self.grads.iter().map(squared_norm).sum::<f64>()];
        self.world.sum(&mut squares)?;
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

    /// Starts an update: counts it and hands out the gradient shards.
    pub(crate) fn begin_update(&mut self) -> Vec<Tensor> {
        self.step += 1;
        std::mem::take(&mut self.grads)
    }

    /// One AdamW update at `lr` of unit `u`'s fp32 shard `p` (in place) with the summed
    /// gradient shard `g`, weight decay where it applies, as the replicated step.
    pub(crate) fn adam(&self, u: usize, p: &Tensor, g: &Tensor, lr: f64) -> Result<(), tch::TchError> {
        let c = &self.config;
        tch::no_grad(|| {
            let decayed = p.f_mul_scalar(1.0)?;
            for &(start, len) in self.decay[u].iter().filter(|_| c.weight_decay != 0.0) {
                let _ = decayed
                    .f_narrow(0, start, len)?
                    .f_mul_scalar_(1.0 - lr * c.weight_decay)?;
            }
            let moments = (&self.exp_avg[u], &self.exp_avg_sq[u]);
            p.shallow_clone()
                .f_copy_(&adam_update(&decayed, g, moments, lr, self.step, c)?)
                .map(|_| ())
        })
    }

    /// Every rank's `shard` of unit `u` all-gathered (in the shard's dtype) and split into one
    /// view per parameter, in the parameter's shape.
    pub(crate) fn gather_pieces(&self, u: usize, shard: &Tensor) -> Result<Vec<Tensor>, ModelError> {
        let whole = shard.f_new_zeros([self.world.size as i64 * self.shard[u]], (shard.kind(), shard.device()))?;
        self.world.all_gather_into(shard, &whole)?;
        Ok(self.units[u].split(&whole)?)
    }

    /// Drops the gradient shards of a step that will not be applied, and any gradients.
    pub(crate) fn discard_grads(&mut self) {
        self.grads.clear();
        self.units.iter().flat_map(|u| &u.params).for_each(free_grad);
    }

    /// The shards, by `<kind>.unit<i>`, the master shards `masters` holds among them: what
    /// lives beside the parameters on their device.
    pub(crate) fn tensors<'a>(&'a self, masters: &[Option<&'a Tensor>]) -> Vec<(String, &'a Tensor)> {
        let masters = masters.iter().enumerate();
        let masters = masters.filter_map(|(i, t)| Some((format!("master.unit{i}"), (*t)?)));
        [("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)]
            .into_iter()
            .flat_map(|(prefix, v)| v.iter().enumerate().map(move |(i, t)| (format!("{prefix}.unit{i}"), t)))
            .chain(masters)
            .collect()
    }

    /// Bytes of the moment shards and `masters`.
    pub(crate) fn state_bytes(&self, masters: &[Option<&Tensor>]) -> u64 {
        self.tensors(masters).iter().map(|(_, t)| t.numel() as u64 * 4).sum()
    }

    /// Bytes of one fp32 value per element of every shard.
    pub(crate) fn shard_bytes(&self) -> u64 {
        self.shard.iter().map(|&s| s as u64 * 4).sum()
    }

    /// Bytes of the whole trained parameters.
    pub(crate) fn parameter_bytes(&self) -> u64 {
        let units = self.units.iter().flat_map(|u| &u.params);
        units.map(|p| (p.numel() * p.kind().elt_size_in_bytes()) as u64).sum()
    }
}

/// The element ranges of the shard `[from, from + shard)` of `unit`'s flattened parameters
/// whose parameter takes weight decay (adjacent ones merged).
fn decay_ranges(unit: &Unit, from: i64, shard: i64) -> Vec<(i64, i64)> {
    let mut ranges: Vec<(i64, i64)> = Vec::new();
    let mut at = 0;
    for (name, p) in unit.named() {
        let (start, end) = (at.max(from), (at + p.numel() as i64).min(from + shard));
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
