//! AdamW over tch tensors, written out so its state can be saved and restored exactly (tch's C++
//! optimizers cannot export theirs), with weight-decay groups and gradient-norm clipping.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tch::{Kind, Tensor, nn};

use super::distributed::{DistError, HeldState, OverlappedReduce, World};
use super::sharding::{FullShard, ShardedState};
use crate::model::ModelError;

mod files;

pub use files::OptimizerSnapshot;
pub(crate) use files::{MOMENTS_FILE, STEP_FILE, moment_from};

/// `|g|^2`, accumulated in f64: libtorch's f32 `norm` of a CPU tensor of millions of elements
/// is off in the fifth digit, enough to tell one process from N ranks apart.
pub(crate) fn squared_norm(g: &Tensor) -> f64 {
    (g * g).sum(Kind::Double).double_value(&[])
}

/// One AdamW update, in PyTorch's order of operations, of the fp32 weights `decayed` (weight
/// decay already applied) with the fp32 gradient `g`: the moments `(m, v)` are updated in place
/// and the new weights returned (update number `step`, 1-based, at `lr`). The replicated and
/// the sharded optimizer both step through it.
pub(crate) fn adam_update(
    decayed: &Tensor,
    g: &Tensor,
    (m, v): (&Tensor, &Tensor),
    lr: f64,
    step: u64,
    c: &AdamWConfig,
) -> Result<Tensor, tch::TchError> {
    let bias1 = 1.0 - c.beta1.powi(step as i32);
    let bias2 = 1.0 - c.beta2.powi(step as i32);
    // torch: exp_avg.lerp_(grad, 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    let _ = m.shallow_clone().f_lerp_(g, 1.0 - c.beta1)?;
    let _ = v
        .shallow_clone()
        .f_mul_scalar_(c.beta2)?
        .f_add_(&g.f_mul_scalar(1.0 - c.beta2)?.f_mul(g)?)?;
    let denom = v.f_sqrt()?.f_div_scalar(bias2.sqrt())?.f_add_scalar(c.eps)?;
    decayed.f_sub(&m.f_div(&denom)?.f_mul_scalar(lr / bias1)?)
}

/// Zeroes the gradient of every tensor that has one.
fn clear_grads<'a>(params: impl IntoIterator<Item = &'a Tensor>) {
    for p in params {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// Zeroes the gradients of every variable of `vs` (after a forward/backward that is measured or
/// inspected but not applied).
pub fn zero_grads(vs: &nn::VarStore) {
    clear_grads(vs.variables().values());
}

/// AdamW hyper-parameters (PyTorch's defaults except the learning rate, which the schedule sets).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct AdamWConfig {
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices only (not to biases and norm weights, as
    /// transformers' Trainer groups them).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl AdamWConfig {
    /// β1 and β2 in [0, 1), ε finite and > 0, weight decay finite and >= 0 (PyTorch's checks).
    pub fn validate(&self) -> Result<(), super::TrainError> {
        let bad = |field: &'static str, v: f64, range: &str| {
            Err(super::TrainError::config(field, format!("is {v}; must be {range}")))
        };
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("adamw.beta1", self.beta1, "in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("adamw.beta2", self.beta2, "in [0, 1)");
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("adamw.eps", self.eps, "finite and > 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("adamw.weight_decay", self.weight_decay, "finite and >= 0");
        }
        Ok(())
    }
}

/// Whether a parameter of this name gets weight decay.
pub fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.contains("norm"))
}

/// Optimizer state: per parameter (by `state_dict` name) the first and second moments.
#[derive(Debug)]
pub struct AdamW {
    /// Hyper-parameters.
    pub config: AdamWConfig,
    /// Updates done.
    pub step: u64,
    params: BTreeMap<String, Tensor>,
    exp_avg: BTreeMap<String, Tensor>,
    exp_avg_sq: BTreeMap<String, Tensor>,
    /// fp32 master copies of the half-precision parameters (mixed precision): the update is
    /// applied to these and the parameters get their rounded values, so updates smaller than a
    /// bf16 step are not lost.
    master: BTreeMap<String, Tensor>,
    /// Under `fsdp = "shard_grad_op"`: this rank's shards of the moments and master weights
    /// (the three maps above are then empty).
    /// Shared with the model's residency under `full_shard`.
    sharded: Option<Arc<Mutex<ShardedState>>>,
    /// Under `fsdp = "no_shard"` across processes with `overlap_grad_reduce`: the reducer the
    /// model's last backward of a step starts gradient buckets through.
    overlap: Option<Arc<OverlappedReduce>>,
}

impl AdamW {
    /// An optimizer over every trainable variable of `vs`, updating the variables themselves.
    pub fn new(vs: &nn::VarStore, config: AdamWConfig) -> Self {
        Self::with_master_weights(vs, config, false)
    }

    /// [`AdamW::new`]; with `fp32_master`, half-precision variables get fp32 master copies that
    /// the updates go to (mixed precision: half compute, fp32 master weights and moments).
    pub fn with_master_weights(vs: &nn::VarStore, config: AdamWConfig, fp32_master: bool) -> Self {
        Self::with_state(vs, config, fp32_master, true)
    }

    /// [`AdamW::with_master_weights`], the whole moments and master weights made only when
    /// `whole` (a run about to [`AdamW::shard`] makes only its shards, never the whole state).
    pub(crate) fn with_state(vs: &nn::VarStore, config: AdamWConfig, fp32_master: bool, whole: bool) -> Self {
        let params: BTreeMap<String, Tensor> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        let zeros = |t: &Tensor| Tensor::zeros_like(t).to_kind(Kind::Float);
        let kept = || params.iter().filter(|_| whole);
        let master = kept()
            .filter(|(_, t)| fp32_master && t.kind() != Kind::Float)
            .map(|(k, t)| (k.clone(), t.detach().to_kind(Kind::Float)))
            .collect();
        AdamW {
            config,
            step: 0,
            exp_avg: kept().map(|(k, t)| (k.clone(), zeros(t))).collect(),
            exp_avg_sq: kept().map(|(k, t)| (k.clone(), zeros(t))).collect(),
            master,
            params,
            sharded: None,
            overlap: None,
        }
    }

    /// Keeps only this rank's shards of the moments and master weights from now on
    /// (`fsdp = "shard_grad_op"`, or with `full` `"full_shard"`, whose parameters are sharded
    /// too; see `train::sharding`); the full ones are freed. Under `full_shard` the returned
    /// residency goes to the model, which gathers units through it.
    pub(crate) fn shard(
        &mut self,
        world: &Arc<World>,
        full: Option<super::FsdpConfig>,
    ) -> Result<Option<Arc<dyn crate::model::Residency>>, ModelError> {
        if world.size < 2 || self.sharded.is_some() {
            return Ok(None);
        }
        let state = ShardedState::new(&self.params, &self.master, (world.rank, world.size), full.is_some())?;
        let state = Arc::new(Mutex::new(state));
        self.sharded = Some(state.clone());
        self.exp_avg.clear();
        self.exp_avg_sq.clear();
        self.master.clear();
        Ok(full.map(|config| {
            let world = world.clone();
            Arc::new(FullShard { state, world, config }) as Arc<dyn crate::model::Residency>
        }))
    }

    /// All-reduces the replicated gradients in buckets during the step's last backward from
    /// now on (`no_shard` across processes): the returned residency goes to the model, which
    /// calls it as each layer's gradients are done. `None` for one process.
    pub(crate) fn overlap(&mut self, world: &Arc<World>) -> Option<Arc<dyn crate::model::Residency>> {
        if world.size < 2 || self.sharded.is_some() {
            return None;
        }
        let reducer = Arc::new(OverlappedReduce::new(&self.params, world.clone()));
        self.overlap = Some(reducer.clone());
        Some(reducer as Arc<dyn crate::model::Residency>)
    }

    /// The sharded state, locked.
    fn sharded(&self) -> Option<MutexGuard<'_, ShardedState>> {
        // Poisoned only by a panic of ours mid-update; the shards are whole tensors still.
        self.sharded
            .as_ref()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether the state is sharded over the ranks.
    pub fn is_sharded(&self) -> bool {
        self.sharded.is_some()
    }

    /// Bytes of optimizer state this rank holds (moments and master weights).
    pub fn state_bytes(&self) -> u64 {
        match self.sharded() {
            Some(s) => s.bytes(),
            None => self.state_tensors().iter().map(|(_, t)| t.numel() as u64 * 4).sum(),
        }
    }

    /// What this rank holds under `fsdp` of trained parameters of `parameters` bytes whole.
    pub(crate) fn held(&self, fsdp: super::Fsdp, parameters: u64) -> HeldState {
        let Some(s) = self.sharded() else {
            return HeldState {
                fsdp: super::Fsdp::NoShard.name(),
                parameters,
                gradients: parameters,
                optimizer: self.state_bytes(),
            };
        };
        let (parameters, gradients, optimizer) = s.held_full().unwrap_or((parameters, parameters, s.bytes()));
        HeldState {
            fsdp: fsdp.name(),
            parameters,
            gradients,
            optimizer,
        }
    }

    /// Bytes of the fp32 gradient shards a sharded optimizer holds (0 replicated).
    pub fn gradient_shard_bytes(&self) -> u64 {
        self.sharded().map_or(0, |s| s.grad_bytes())
    }

    /// Sums the gradients over `world`'s ranks: whole (replicated), or each rank its shard.
    pub(crate) fn reduce_grads(&mut self, world: &World) -> Result<(), DistError> {
        match self.sharded() {
            Some(mut s) => s.reduce_grads(world),
            None => match &self.overlap {
                Some(o) => o.finish(),
                None => world.all_reduce_grads(&self.parameters()),
            },
        }
    }

    /// [`AdamW::clip_grad_norm`] of the reduced gradients, whole or sharded over `world`.
    pub(crate) fn clip_in(&self, max_norm: Option<f64>, world: &World) -> Result<f64, DistError> {
        match self.sharded() {
            Some(s) => s.clip(max_norm, world),
            None => Ok(self.clip_grad_norm(max_norm)),
        }
    }

    /// [`AdamW::step`] of the reduced gradients; sharded, each rank updates its shard and the
    /// shards are all-gathered into the parameters.
    pub(crate) fn step_in(&mut self, lr: f64, world: &World) -> Result<(), ModelError> {
        match self.sharded.clone() {
            Some(s) => {
                self.step += 1;
                let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
                s.step(lr, self.step, self.config, world)
            }
            None => self.step(lr),
        }
    }

    /// The fp32 master weight of a half-precision parameter, by name (mixed precision).
    pub fn master_weight(&self, name: &str) -> Option<&Tensor> {
        self.master.get(name)
    }

    /// Every state tensor by its name in `optimizer.safetensors` (`exp_avg.<name>`,
    /// `exp_avg_sq.<name>`, `master.<name>`): what lives beside the parameters on their device.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        if let Some(s) = self.sharded() {
            return s.tensors().into_iter().map(|(k, t)| (k, t.shallow_clone())).collect();
        }
        [
            ("exp_avg", &self.exp_avg),
            ("exp_avg_sq", &self.exp_avg_sq),
            ("master", &self.master),
        ]
        .into_iter()
        .flat_map(|(prefix, map)| {
            map.iter()
                .map(move |(k, t)| (format!("{prefix}.{k}"), t.shallow_clone()))
        })
        .collect()
    }

    /// The optimized parameters, in `state_dict`-name order (the same on every rank).
    pub fn parameters(&self) -> Vec<&Tensor> {
        self.params.values().collect()
    }

    /// Global L2 norm of the gradients; when above `max_norm`, scales them down to it
    /// (`clip_grad_norm_` semantics, coefficient `max_norm / (norm + 1e-6)`). Returns the norm
    /// before clipping (NaN or inf when a gradient is not finite).
    pub fn clip_grad_norm(&self, max_norm: Option<f64>) -> f64 {
        tch::no_grad(|| {
            let norms: Vec<f64> = self
                .params
                .values()
                .map(|p| p.grad())
                .filter(|g| g.defined())
                .map(|g| squared_norm(&g))
                .collect();
            if norms.is_empty() {
                return 0.0;
            }
            let total = norms.iter().sum::<f64>().sqrt();
            if let Some(max) = max_norm {
                let coef = max / (total + 1e-6);
                if coef < 1.0 {
                    for p in self.params.values() {
                        let mut g = p.grad();
                        if g.defined() {
                            let _ = g.f_mul_(&Tensor::from(coef)).map(|_| ());
                        }
                    }
                }
            }
            total
        })
    }

    /// One update at learning rate `lr`, in PyTorch's order of operations (replicated state;
    /// a sharded one updates through the trainer, which knows its world).
    pub fn step(&mut self, lr: f64) -> Result<(), ModelError> {
        if self.sharded.is_some() {
            return Err(ModelError::Input(
                "a sharded optimizer steps with its world (fsdp)".into(),
            ));
        }
        self.step += 1;
        let c = self.config;
        tch::no_grad(|| -> Result<(), ModelError> {
            for (name, p) in &self.params {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let g = g.to_kind(Kind::Float);
                let master = self.master.get(name);
                let current = master.map_or_else(|| p.to_kind(Kind::Float), Tensor::shallow_clone);
                let p32 = if c.weight_decay != 0.0 && decays(name) {
                    current * (1.0 - lr * c.weight_decay)
                } else {
                    current
                };
                let moments = (&self.exp_avg[name], &self.exp_avg_sq[name]);
                let updated = adam_update(&p32, &g, moments, lr, self.step, &c)?;
                if let Some(master) = master {
                    master.shallow_clone().f_copy_(&updated)?;
                }
                p.shallow_clone().f_copy_(&updated)?;
            }
            Ok(())
        })
    }

    /// The first parameter (by name) holding NaN or infinite values, if any.
    ///
    /// Runs after every update, so the common case (all finite) is one reduction and one
    /// device sync over all parameters; names are looked up only when something is not.
    pub fn first_non_finite(&self) -> Result<Option<&str>, ModelError> {
        let flags: Vec<Tensor> = self
            .params
            .values()
            .filter(|p| p.is_floating_point())
            .map(|p| p.f_isfinite()?.f_all())
            .collect::<Result<_, _>>()?;
        if flags.is_empty() || Tensor::f_stack(&flags, 0)?.f_all()?.int64_value(&[]) != 0 {
            return Ok(None);
        }
        for (name, p) in &self.params {
            if !crate::model::all_finite(p)? {
                return Ok(Some(name));
            }
        }
        Ok(None)
    }

    /// [`AdamW::first_non_finite`] over `world`: under `full_shard` the parameters are read
    /// from this rank's shards and every rank learns whether any rank found one (so all stop).
    pub(crate) fn first_non_finite_in(&self, world: &World) -> Result<Option<String>, ModelError> {
        let Some(found) = self.sharded().filter(|s| s.is_full()).map(|s| s.first_non_finite()) else {
            return Ok(self.first_non_finite()?.map(str::to_string));
        };
        let mut found = found?;
        let mut any = [f64::from(u8::from(found.is_some()))];
        world.sum(&mut any).map_err(|e| ModelError::Input(e.to_string()))?;
        if any[0] > 0.0 && found.is_none() {
            found = Some("a parameter of another rank's shard".into());
        }
        Ok(found)
    }

    /// Zeroes the parameters' gradients, whatever their state (a failed forward or backward).
    pub fn clear_param_grads(&self) {
        if let Some(mut s) = self.sharded() {
            s.discard_grads();
        }
        if let Some(o) = &self.overlap {
            o.discard();
        }
        clear_grads(self.params.values());
    }

    /// Clears every parameter's gradient (a sharded optimizer also drops its gradient shards
    /// and frees the gradients).
    pub fn zero_grad(&mut self) {
        if let Some(o) = &self.overlap {
            o.discard();
        }
        match self.sharded() {
            Some(mut s) => s.discard_grads(),
            None => clear_grads(self.params.values()),
        }
    }
}
