//! The routed experts of a sparse layer in transformers 5's fused layout, run grouped: the
//! (token, slot) pairs sorted by expert, each expert's SwiGLU over its contiguous rows, so no
//! `[tokens x experts x hidden]` tensor is ever made. On the CPU the products are libtorch's
//! grouped matmul (one kernel over every expert, whose backward writes the weights' gradients
//! once); elsewhere one product per expert ([`Products`]). The `moe` bench times the CPU's
//! against transformers; the per-expert path is checked equal to it, not timed.

use tch::{Kind, Tensor, nn};

use crate::model::error::ModelError;
use crate::model::lora::ExpertDelta;
use crate::model::norm::{Norm, NormKind};

/// `mlp.experts`: every expert's SwiGLU weights stacked.
#[derive(Debug)]
pub struct Experts {
    /// `gate_up_proj` `[experts, 2 x expert_size, hidden]`: each expert's gate rows, then its
    /// up rows.
    pub gate_up_proj: Tensor,
    /// `down_proj` `[experts, hidden, expert_size]`.
    pub down_proj: Tensor,
    /// `post_expert_norm`: one input-scaled norm over every expert's output, before its
    /// weighting (Muse Spark).
    pub post_norm: Option<Norm>,
    /// LoRA on `gate_up_proj` (PEFT's `target_parameters`).
    pub gate_up_lora: Option<ExpertDelta>,
    /// LoRA on `down_proj`.
    pub down_lora: Option<ExpertDelta>,
}

impl Experts {
    /// Declares `{path}.gate_up_proj` and `{path}.down_proj` (and `{path}.post_expert_norm`
    /// when `post_norm_eps` is given).
    pub(crate) fn new(path: nn::Path, experts: i64, hidden: i64, expert_size: i64, post_norm_eps: Option<f64>) -> Self {
        Experts {
            post_norm: post_norm_eps
                .map(|eps| Norm::new(NormKind::InputScaled, &path / "post_expert_norm", hidden, eps)),
            gate_up_lora: None,
            down_lora: None,
            gate_up_proj: path.var(
                "gate_up_proj",
                &[experts, 2 * expert_size, hidden],
                nn::Init::Const(0.0),
            ),
            down_proj: path.var("down_proj", &[experts, hidden, expert_size], nn::Init::Const(0.0)),
        }
    }

    /// The same tensors (shared, not copied), without adapters.
    pub(crate) fn base_view(&self) -> Experts {
        Experts {
            gate_up_proj: self.gate_up_proj.shallow_clone(),
            down_proj: self.down_proj.shallow_clone(),
            post_norm: self.post_norm.as_ref().map(Norm::base_view),
            gate_up_lora: None,
            down_lora: None,
        }
    }

    /// Experts in the layer.
    pub fn num_experts(&self) -> i64 {
        self.gate_up_proj.size()[0]
    }

    /// `sum_j weights[t, j] * expert_{experts[t, j]}(x_t)` for `x` `[n, hidden]`, `experts`
    /// and `weights` `[n, k]`: `[n, hidden]` in `x`'s dtype, each slot weighted in that dtype
    /// and the `k` slots summed once, in slot order.
    pub fn forward(&self, x: &Tensor, experts: &Tensor, weights: &Tensor) -> Result<Tensor, ModelError> {
        let (n, hidden, k) = self.check_inputs(x, experts, weights)?;
        if n == 0 {
            return Ok(x.zeros_like());
        }
        // 1. Pairs sorted by expert (stable: by token within an expert); rows per expert.
        let flat = experts.reshape([-1]);
        let order = flat.f_argsort_stable(true, 0, false)?;
        // An id past the last expert lengthens the count (a negative one fails in bincount).
        let counts = Vec::<i64>::try_from(flat.f_bincount(None::<Tensor>, self.num_experts())?)?;
        if counts.len() as i64 > self.num_experts() {
            return Err(ModelError::Input(format!(
                "experts: expert id {} in a layer of {} experts",
                counts.len() - 1,
                self.num_experts()
            )));
        }
        // 2. Each pair's token, `[n k, hidden]` in expert order.
        let rows = x.f_index_select(0, &order.f_floor_divide_scalar(k)?)?;
        // 3. Each expert's SwiGLU over its contiguous rows, `[n k, hidden]`.
        let widths = [hidden, self.down_proj.size()[2]];
        let out = match Products::choose(x.device(), n * k, widths, x.kind()) {
            Products::Grouped => Self::grouped(&self.weights()?, &rows, &counts)?,
            Products::PerExpert => Self::per_expert(&self.weights()?, &rows, &counts)?,
        };
        // 4. Each output normed where the layer has a post-expert norm.
        let out = match &self.post_norm {
            Some(norm) => norm.forward(&out),
            None => out,
        };
        // 5. Back to (token, slot) order; weighted (in the weights' dtype, then `x`'s, as
        //    transformers casts each expert's share) and summed over the slots.
        let inverse = order.f_argsort_stable(true, 0, false)?;
        let out = out.f_index_select(0, &inverse)?.f_view([n, k, hidden])?;
        let weighted = (out * weights.unsqueeze(-1)).f_to_kind(x.kind())?;
        Ok(weighted.f_sum_dim_intlist(1, false, None::<Kind>)?)
    }

    /// `(tokens, hidden, k)` of `x` `[tokens, hidden]` with `experts` and `weights` `[tokens,
    /// k]`; a typed error naming the mismatch otherwise. (Expert ids are checked by the count
    /// in `forward`, which reads them anyway.)
    fn check_inputs(&self, x: &Tensor, experts: &Tensor, weights: &Tensor) -> Result<(i64, i64, i64), ModelError> {
        let h = self.gate_up_proj.size()[2];
        let bad = |what: String| Err(ModelError::Input(format!("experts: {what}")));
        let (n, k) = match (&x.size()[..], &experts.size()[..]) {
            ([n, hx], [ne, k]) if *hx == h && ne == n => (*n, *k),
            (xs, es) => {
                return bad(format!(
                    "input {xs:?} and choices {es:?}; want [tokens, {h}] and [tokens, k]"
                ));
            }
        };
        if weights.size() != [n, k] {
            return bad(format!("weights {:?}; want [{n}, {k}]", weights.size()));
        }
        Ok((n, h, k))
    }

    /// `[gate_up, down]` as the experts run with them: each base tensor with its adapter's
    /// update, where one is attached (differentiable in the adapter).
    fn weights(&self) -> Result<[Tensor; 2], ModelError> {
        let with = |base: &Tensor, lora: &Option<ExpertDelta>| match lora {
            Some(d) => d.apply(base),
            None => Ok(base.shallow_clone()),
        };
        Ok([
            with(&self.gate_up_proj, &self.gate_up_lora)?,
            with(&self.down_proj, &self.down_lora)?,
        ])
    }

    /// The experts' SwiGLU with weights `[gate_up, down]` over `rows` sorted by expert (`counts` rows each) by libtorch's
    /// grouped matmul.
    fn grouped([gate_up_w, down_w]: &[Tensor; 2], rows: &Tensor, counts: &[i64]) -> Result<Tensor, ModelError> {
        let ends: Vec<i32> = counts
            .iter()
            .scan(0i64, |at, c| {
                *at += c;
                Some(i32::try_from(*at).map_err(|_| ModelError::Input("experts: over 2^31 routed rows".into())))
            })
            .collect::<Result<_, _>>()?;
        let offs = Tensor::from_slice(&ends).f_to_device(rows.device())?;
        let gate_up = rows.f_internal_grouped_mm(&gate_up_w.f_transpose(-2, -1)?, Some(&offs), None, None)?;
        let [gate, up] = <[Tensor; 2]>::try_from(gate_up.chunk(2, -1)).expect("two halves");
        let down = down_w.f_transpose(-2, -1)?;
        Ok((gate.silu() * up).f_internal_grouped_mm(&down, Some(&offs), None, None)?)
    }

    /// The same, one product per expert. Rows and weights are split into per-expert views by
    /// one op each, whose backward joins the pieces' gradients once; a view taken per expert
    /// (`narrow`, `get`) would build a whole-size gradient for every expert.
    fn per_expert([gate_up_w, down_w]: &[Tensor; 2], rows: &Tensor, counts: &[i64]) -> Result<Tensor, ModelError> {
        let parts = rows.f_split_with_sizes(counts, 0)?;
        let (gate_up_w, down_w) = (gate_up_w.unbind(0), down_w.unbind(0));
        let mut outs = Vec::with_capacity(counts.len());
        for (e, part) in parts.iter().enumerate().filter(|(e, _)| counts[*e] > 0) {
            let gate_up = part.f_matmul(&gate_up_w[e].tr())?;
            let [gate, up] = <[Tensor; 2]>::try_from(gate_up.chunk(2, -1)).expect("two halves");
            outs.push((gate.silu() * up).f_matmul(&down_w[e].tr())?);
        }
        Ok(Tensor::f_cat(&outs, 0)?)
    }
}

/// How the experts' products run: libtorch's grouped matmul has a kernel on the CPU (checked
/// against transformers here); on other devices its dtype and architecture limits differ, so
/// they take one product per expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Products {
    Grouped,
    PerExpert,
}

impl Products {
    /// Grouped on the CPU where the kernel takes the block: `rows` routed rows within its int32
    /// offsets, and `widths` (hidden, expert) whose rows are multiples of 16 bytes in `kind`.
    pub(crate) fn choose(device: tch::Device, rows: i64, widths: [i64; 2], kind: Kind) -> Self {
        let aligned = widths.iter().all(|w| w * kind.elt_size_in_bytes() as i64 % 16 == 0);
        match (device, aligned && rows <= i64::from(i32::MAX)) {
            (tch::Device::Cpu, true) => Products::Grouped,
            _ => Products::PerExpert,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The grouped matmul and the per-expert products give the same outputs and gradients,
    /// an expert left without rows included.
    #[test]
    fn grouped_and_per_expert_products_agree() {
        tch::manual_seed(3);
        let (e, h, i, n) = (4, 16, 8, 10);
        let opts = (Kind::Float, tch::Device::Cpu);
        let experts = Experts {
            gate_up_proj: Tensor::randn([e, 2 * i, h], opts).set_requires_grad(true),
            down_proj: Tensor::randn([e, h, i], opts).set_requires_grad(true),
            post_norm: None,
            gate_up_lora: None,
            down_lora: None,
        };
        let rows = Tensor::randn([n, h], opts).set_requires_grad(true);
        let counts = [3, 0, 5, 2];
        let run = |products: Products| {
            for t in [&experts.gate_up_proj, &experts.down_proj, &rows] {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            let out = match products {
                Products::Grouped => Experts::grouped(&experts.weights().unwrap(), &rows, &counts),
                Products::PerExpert => Experts::per_expert(&experts.weights().unwrap(), &rows, &counts),
            }
            .expect("products");
            (&out * &out).sum(Kind::Float).backward();
            let grads = [&experts.gate_up_proj, &experts.down_proj, &rows].map(|t| t.grad().copy());
            (out.detach(), grads)
        };
        let (a, ga) = run(Products::Grouped);
        let (b, gb) = run(Products::PerExpert);
        let close = |x: &Tensor, y: &Tensor| {
            (x - y).abs().max().double_value(&[]) <= 1e-5 * (1.0 + y.abs().max().double_value(&[]))
        };
        assert!(close(&a, &b), "outputs differ");
        for (x, y) in ga.iter().zip(&gb) {
            assert!(close(x, y), "gradients differ");
        }
        // The expert without rows gets a zero gradient.
        assert_eq!(ga[0].get(1).abs().sum(Kind::Float).double_value(&[]), 0.0);
    }

    /// Choices naming an expert the layer does not have, or of the wrong shape, are typed
    /// errors, not panics; widths the grouped kernel cannot take (6 floats) run per expert.
    #[test]
    fn bad_choices_are_errors() {
        let opts = (Kind::Float, tch::Device::Cpu);
        let experts = Experts {
            gate_up_proj: Tensor::zeros([4, 8, 6], opts),
            down_proj: Tensor::zeros([4, 6, 4], opts),
            post_norm: None,
            gate_up_lora: None,
            down_lora: None,
        };
        let x = Tensor::zeros([2, 6], opts);
        let w = Tensor::ones([2, 2], opts);
        let ids = |v: [i64; 4]| Tensor::from_slice(&v).view([2, 2]);
        let e = experts.forward(&x, &ids([0, 4, 1, 2]), &w).unwrap_err().to_string();
        assert!(e.contains("expert id 4") && e.contains("4 experts"), "{e}");
        assert!(experts.forward(&x, &ids([0, -1, 1, 2]), &w).is_err());
        let e = experts
            .forward(&x, &ids([0, 1, 1, 2]), &Tensor::ones([2, 3], opts))
            .unwrap_err()
            .to_string();
        assert!(e.contains("weights"), "{e}");
        assert_eq!(experts.forward(&x, &ids([0, 1, 1, 2]), &w).unwrap().size(), [2, 6]);
    }
}
