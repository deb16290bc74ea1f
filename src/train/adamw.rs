//! AdamW over tch tensors, written out so its state can be saved and restored exactly (tch's C++
//! optimizers cannot export theirs), with weight-decay groups and gradient-norm clipping.

use std::collections::BTreeMap;

use tch::{Kind, Tensor, nn};

use crate::model::ModelError;

mod files;

pub(crate) use files::{MOMENTS_FILE, STEP_FILE, moment_from, read_step, read_whole, write_step};

/// `|g|^2`, accumulated in f64: libtorch's f32 `norm` of a CPU tensor of millions of elements
/// is off in the fifth digit, enough to tell one process from N ranks apart.
pub(crate) fn squared_norm(g: &Tensor) -> f64 {
    (g * g).sum(Kind::Double).double_value(&[])
}

/// One AdamW update, in PyTorch's order of operations, of the fp32 weights `decayed` (weight
/// decay already applied) with the fp32 gradient `g`: the moments `(m, v)` are updated in place
/// and the new weights returned (update number `step`, 1-based, at `lr`). [`AdamW`] and every
/// sharded strategy of `train::parallel` step through it.
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

unsafe extern "C" {
    /// c10d_shim.cpp: resets the tensor's gradient to undefined.
    fn tt_free_grad(t: *mut std::ffi::c_void);
}

/// Frees `p`'s gradient, as `p.grad = None` does: the next backward's gradient becomes it
/// instead of being added into a zeroed one, which saves a pass over every gradient and a
/// gradient-sized temporary at the peak (the `moe` bench).
pub(crate) fn free_grad(p: &Tensor) {
    // SAFETY: a live tensor; resetting its gradient slot is what `p.grad = None` does.
    unsafe { tt_free_grad(p.as_ptr() as *mut std::ffi::c_void) }
}

/// Frees the gradients of every variable of `vs`, PyTorch's `zero_grad()` (`set_to_none`):
/// after a forward/backward that is measured or inspected but not applied.
pub fn zero_grads(vs: &nn::VarStore) {
    vs.variables().values().for_each(free_grad);
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
pub(crate) fn decays(name: &str) -> bool {
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
}

impl AdamW {
    /// An optimizer over every trainable variable of `vs`, updating the variables themselves.
    pub fn new(vs: &nn::VarStore, config: AdamWConfig) -> Self {
        Self::with_master_weights(vs, config, false)
    }

    /// [`AdamW::new`]; with `fp32_master`, half-precision variables get fp32 master copies that
    /// the updates go to (mixed precision: half compute, fp32 master weights and moments).
    pub(crate) fn with_master_weights(vs: &nn::VarStore, config: AdamWConfig, fp32_master: bool) -> Self {
        let params: BTreeMap<String, Tensor> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
        let zeros = |t: &Tensor| Tensor::zeros_like(t).to_kind(Kind::Float);
        let master = params
            .iter()
            .filter(|(_, t)| fp32_master && t.kind() != Kind::Float)
            .map(|(k, t)| (k.clone(), t.detach().to_kind(Kind::Float)))
            .collect();
        AdamW {
            config,
            step: 0,
            exp_avg: params.iter().map(|(k, t)| (k.clone(), zeros(t))).collect(),
            exp_avg_sq: params.iter().map(|(k, t)| (k.clone(), zeros(t))).collect(),
            master,
            params,
        }
    }

    /// Bytes of optimizer state held (moments and master weights).
    pub fn state_bytes(&self) -> u64 {
        self.state_tensors().iter().map(|(_, t)| t.numel() as u64 * 4).sum()
    }

    /// The fp32 master weight of a half-precision parameter, by name (mixed precision).
    pub fn master_weight(&self, name: &str) -> Option<&Tensor> {
        self.master.get(name)
    }

    /// Every state tensor by its name in `optimizer.safetensors` (`exp_avg.<name>`,
    /// `exp_avg_sq.<name>`, `master.<name>`): what lives beside the parameters on their device.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
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

    /// One update at learning rate `lr`, in PyTorch's order of operations.
    pub fn step(&mut self, lr: f64) -> Result<(), ModelError> {
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
    pub(crate) fn first_non_finite(&self) -> Result<Option<&str>, ModelError> {
        first_non_finite(self.params.iter())
    }

    /// Frees every parameter's gradient (PyTorch's `zero_grad()`, `set_to_none`); the step
    /// skips a parameter that then gets none, as PyTorch's AdamW does.
    pub fn zero_grad(&mut self) {
        self.params.values().for_each(free_grad);
    }
}

/// The first of `params` (name, parameter) holding NaN or infinite values, if any.
///
/// Runs after every update, so the common case (all finite) is one reduction and one device
/// sync over all parameters; names are looked up only when something is not.
pub(crate) fn first_non_finite<'a>(
    params: impl Iterator<Item = (&'a String, &'a Tensor)> + Clone,
) -> Result<Option<&'a str>, ModelError> {
    let flags: Vec<Tensor> = params
        .clone()
        .filter(|(_, p)| p.is_floating_point())
        .map(|(_, p)| p.f_isfinite()?.f_all())
        .collect::<Result<_, _>>()?;
    if flags.is_empty() || Tensor::f_stack(&flags, 0)?.f_all()?.int64_value(&[]) != 0 {
        return Ok(None);
    }
    for (name, p) in params {
        if !crate::model::all_finite(p)? {
            return Ok(Some(name));
        }
    }
    Ok(None)
}
