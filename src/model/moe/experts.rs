//! The routed experts of a sparse layer in transformers 5's fused layout, run grouped: the
//! (token, slot) pairs sorted by expert, one product per expert over its rows, so no
//! `[tokens x experts x hidden]` tensor is ever made.

use tch::{Kind, Tensor, nn};

use crate::model::error::ModelError;

/// `mlp.experts`: every expert's SwiGLU weights stacked.
#[derive(Debug)]
pub struct Experts {
    /// `gate_up_proj` `[experts, 2 x expert_size, hidden]`: each expert's gate rows, then its
    /// up rows.
    pub gate_up_proj: Tensor,
    /// `down_proj` `[experts, hidden, expert_size]`.
    pub down_proj: Tensor,
}

impl Experts {
    /// Declares `{path}.gate_up_proj` and `{path}.down_proj`.
    pub(crate) fn new(path: nn::Path, experts: i64, hidden: i64, expert_size: i64) -> Self {
        Experts {
            gate_up_proj: path.var(
                "gate_up_proj",
                &[experts, 2 * expert_size, hidden],
                nn::Init::Const(0.0),
            ),
            down_proj: path.var("down_proj", &[experts, hidden, expert_size], nn::Init::Const(0.0)),
        }
    }

    /// The same tensors (shared, not copied).
    pub(crate) fn base_view(&self) -> Experts {
        Experts {
            gate_up_proj: self.gate_up_proj.shallow_clone(),
            down_proj: self.down_proj.shallow_clone(),
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
        let (n, hidden) = (x.size()[0], x.size()[1]);
        let k = experts.size()[1];
        if n == 0 {
            return Ok(x.zeros_like());
        }
        // 1. Pairs sorted by expert (stable: by token within an expert); rows per expert.
        let flat = experts.reshape([-1]);
        let order = flat.f_argsort_stable(true, 0, false)?;
        let counts = Vec::<i64>::try_from(flat.f_bincount(None::<Tensor>, self.num_experts())?)?;
        // 2. Each pair's token, `[n k, hidden]` in expert order.
        let rows = x.f_index_select(0, &order.f_floor_divide_scalar(k)?)?;
        // 3. One SwiGLU per expert over its contiguous rows.
        let mut outs = Vec::with_capacity(counts.len());
        let mut at = 0;
        for (e, &count) in counts.iter().enumerate().filter(|(_, c)| **c > 0) {
            let part = rows.narrow(0, at, count);
            let gate_up = part.f_matmul(&self.gate_up_proj.get(e as i64).tr())?;
            let [gate, up] = <[Tensor; 2]>::try_from(gate_up.chunk(2, -1)).expect("two halves");
            outs.push((gate.silu() * up).f_matmul(&self.down_proj.get(e as i64).tr())?);
            at += count;
        }
        // 4. Back to (token, slot) order; weighted and summed over the slots.
        let inverse = order.f_argsort_stable(true, 0, false)?;
        let out = Tensor::f_cat(&outs, 0)?
            .f_index_select(0, &inverse)?
            .f_view([n, k, hidden])?;
        let weighted = out * weights.unsqueeze(-1);
        Ok(weighted.f_sum_dim_intlist(1, false, None::<Kind>)?)
    }
}
