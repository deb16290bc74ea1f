//! LoRA on a mixture's fused expert tensors, as PEFT 0.21's `target_parameters` (its
//! `ParamWrapper`) makes it: one adapter over all `E` experts of a 3-d parameter `W` `[E, out,
//! in]` (transformers' `experts.gate_up_proj` and `experts.down_proj`).
//!
//! - `lora_A.weight` `[r E, in]`: expert `e`'s `A_e` `[r, in]` is rows `e r .. (e + 1) r`.
//! - `lora_B.weight` `[out, r E]`: expert `e`'s `B_e` `[out, r]` is columns `e, E + e, 2E + e,
//!   ...` (rank-major).
//! - The forward uses `W_e + scale * B_e A_e`: in fp32 one `baddbmm` over the experts, as PEFT
//!   folds it; in a half dtype the delta in fp32 added to `W` in fp32, clamped to the dtype's
//!   range and cast back, as PEFT's low-precision path does.
//! - Names: `base_model.model.<experts module>.lora_{A,B}.weight`. When both tensors of one
//!   module are targeted PEFT nests its wrappers in the parameters' declaration order, so
//!   `gate_up_proj`'s adapter sits one level in: `<experts module>.base_layer.lora_{A,B}`.
//! - PEFT refuses dropout on these wrappers, and so does treetrain.

use tch::{Kind, Tensor, nn};

use super::adapter::{kaiming_uniform, path_of};
use super::config::{LoraConfig, target_matches};
use crate::model::{CausalLm, ModelError};
use crate::util::SplitMix64;

/// The adapter of one 3-d expert parameter.
#[derive(Debug)]
pub struct ExpertDelta {
    /// `lora_A.weight` `[r E, in]` (f32).
    pub lora_a: Tensor,
    /// `lora_B.weight` `[out, r E]` (f32).
    pub lora_b: Tensor,
    /// `lora_alpha / r` (rsLoRA: `/ sqrt(r)`).
    pub scale: f64,
    /// Folded into the base parameter: the forward uses it as it is.
    pub merged: bool,
}

impl ExpertDelta {
    /// `(B_e, A_e)` stacked over the experts: `[E, out, r]` and `[E, r, in]`.
    fn factors(&self, experts: i64) -> Result<(Tensor, Tensor), tch::TchError> {
        let out = self.lora_b.size()[0];
        let a = self.lora_a.f_reshape([experts, -1, self.lora_a.size()[1]])?;
        let b = self.lora_b.f_reshape([out, -1, experts])?.f_permute([2, 0, 1])?;
        Ok((b, a))
    }

    /// The weight the experts run with: `base` `[E, out, in]` plus the update (differentiable
    /// in the adapter); `base` itself once merged.
    pub(crate) fn apply(&self, base: &Tensor) -> Result<Tensor, tch::TchError> {
        if self.merged {
            return Ok(base.shallow_clone());
        }
        let experts = base.size()[0];
        if base.kind() == Kind::Float {
            let (b, a) = self.factors(experts)?;
            return base.f_baddbmm(&b, &a, 1.0, self.scale);
        }
        low_precision_add(base, &self.delta(experts)?)
    }

    /// `scale * B_e A_e` `[E, out, in]` in f32: what merging adds to the base parameter.
    pub(crate) fn delta(&self, experts: i64) -> Result<Tensor, tch::TchError> {
        let (b, a) = self.factors(experts)?;
        Ok(b.f_bmm(&a)? * self.scale)
    }
}

/// Declares, under `root`, an adapter on every expert tensor of `lm` that `config`'s
/// `target_parameters` names (A Kaiming-uniform from `rng` when `init`, else zeros; B zeros) and
/// attaches it; returns the adapted parameters' names. A target matching no expert tensor is an
/// error naming it.
pub(super) fn attach(
    lm: &mut CausalLm,
    config: &LoraConfig,
    root: &nn::Path,
    init: bool,
    rng: &mut SplitMix64,
) -> Result<Vec<String>, ModelError> {
    let mut wrapped = Vec::new();
    let mut names = Vec::new();
    for (module, experts) in lm.experts_mut() {
        let wants = |param: &str| {
            let key = format!("{module}.{param}");
            config.target_parameters.iter().any(|t| target_matches(t, &key))
        };
        let (gate_up, down) = (wants("gate_up_proj"), wants("down_proj"));
        names.extend([format!("{module}.gate_up_proj"), format!("{module}.down_proj")]);
        let e = experts.num_experts();
        // `w` `[E, out, in]` (3-d, as `Experts::new` declares it).
        let new = |path: nn::Path, w: &Tensor| {
            let (out, inp) = (w.size()[1], w.size()[2]);
            ExpertDelta {
                lora_a: (&path / "lora_A").var("weight", &[config.r * e, inp], nn::Init::Const(0.0)),
                lora_b: (&path / "lora_B").var("weight", &[out, config.r * e], nn::Init::Const(0.0)),
                scale: config.scale(),
                merged: false,
            }
        };
        // PEFT nests its wrappers in declaration order: gate_up_proj's is the inner one.
        let module_path = path_of(root, &module);
        if gate_up {
            let path = if down {
                &module_path / "base_layer"
            } else {
                module_path.clone()
            };
            experts.gate_up_lora = Some(new(path, &experts.gate_up_proj));
            wrapped.push(format!("{module}.gate_up_proj"));
        }
        if down {
            experts.down_lora = Some(new(module_path.clone(), &experts.down_proj));
            wrapped.push(format!("{module}.down_proj"));
        }
        if init {
            for d in [&experts.gate_up_lora, &experts.down_lora].into_iter().flatten() {
                kaiming_uniform(&d.lora_a, d.lora_a.size()[1], rng)?;
            }
        }
    }
    if let Some(t) = config
        .target_parameters
        .iter()
        .find(|t| !names.iter().any(|n| target_matches(t, n)))
    {
        return Err(ModelError::Adapter {
            place: "`target_parameters`".into(),
            message: format!(
                "names `{t}`, which matches no expert tensor of this model (a mixture's are `experts.gate_up_proj` and `experts.down_proj` of each sparse layer)"
            ),
        });
    }
    Ok(wrapped)
}

/// `w + delta` in f32, clamped to `w`'s dtype's finite range and cast back to it.
pub(crate) fn low_precision_add(w: &Tensor, delta: &Tensor) -> Result<Tensor, tch::TchError> {
    let max = match w.kind() {
        Kind::Half => 65504.0,
        _ => 3.389_531_389_251_535_5e38,
    };
    w.f_to_kind(Kind::Float)?
        .f_add(delta)?
        .f_clamp(-max, max)?
        .f_to_kind(w.kind())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expert `e`'s update is `B[:, e::E] @ A[e r..(e+1) r]`, PEFT's layout.
    #[test]
    fn each_expert_takes_its_rows_of_a_and_its_strided_columns_of_b() {
        let (e, r, out, inp) = (3, 2, 4, 5);
        let opts = (Kind::Float, tch::Device::Cpu);
        let d = ExpertDelta {
            lora_a: Tensor::randn([r * e, inp], opts),
            lora_b: Tensor::randn([out, r * e], opts),
            scale: 0.5,
            merged: false,
        };
        let delta = d.delta(e).unwrap();
        for x in 0..e {
            let a = d.lora_a.narrow(0, x * r, r);
            let cols = Tensor::from_slice(&[x, e + x]);
            let b = d.lora_b.index_select(1, &cols);
            let want = b.matmul(&a) * 0.5;
            assert!(delta.get(x).allclose(&want, 1e-6, 1e-6, false), "expert {x}");
        }
        let w = Tensor::randn([e, out, inp], opts);
        assert!(d.apply(&w).unwrap().allclose(&(&w + &delta), 1e-6, 1e-6, false));
    }
}
