//! The load-balancing loss transformers adds for Qwen3-MoE (Switch Transformer's): over every
//! sparse layer's router, `E * sum_e f_e * P_e`, where `f_e` is the share of (token, slot)
//! choices that went to expert `e` (no gradient) and `P_e` its mean router probability.

use tch::{Kind, Tensor};

use crate::model::error::ModelError;

/// The loss from each sparse layer's router logits `[n, experts]` (in the model's dtype, as the
/// routers returned them) with `top_k` experts a token; `mask` `[n]` (1 = a real token) leaves
/// padding out. Like transformers, the probabilities and the top-k are taken again in the
/// logits' dtype, and the choice counts and probabilities accumulate in fp32. A balanced router
/// gives `top_k`.
pub fn load_balancing_loss(logits: &[Tensor], top_k: i64, mask: Option<&Tensor>) -> Result<Tensor, ModelError> {
    let Some(first) = logits.first() else {
        return Err(ModelError::Input(
            "the load-balancing loss needs a sparse layer's router logits".into(),
        ));
    };
    let (n, experts) = (first.size()[0], first.size()[1]);
    let device = first.device();
    let mask = match mask {
        Some(m) => m.f_to_kind(Kind::Float)?.f_to_device(device)?,
        None => Tensor::f_ones([n], (Kind::Float, device))?,
    };
    let mut chosen = Tensor::f_zeros([experts], (Kind::Float, device))?;
    let mut probs = Tensor::f_zeros([experts], (Kind::Float, device))?;
    for l in logits {
        // 1. Probabilities and top-k in the logits' dtype.
        let p = l.f_softmax(-1, l.kind())?;
        let (_, top) = p.f_topk(top_k, -1, true, true)?;
        // 2. Choices per expert (counted, no gradient) and probability mass, masked.
        let one_hot = Tensor::f_zeros([n, experts], (Kind::Float, device))?.f_scatter_value(1, &top, 1.0)?;
        chosen += (one_hot * mask.unsqueeze(-1)).f_sum_dim_intlist(0, false, Kind::Float)?;
        probs += (p.to_kind(Kind::Float) * mask.unsqueeze(-1)).f_sum_dim_intlist(0, false, Kind::Float)?;
    }
    // 3. Both as shares of the masked token count over all layers.
    let tokens = mask.f_sum(Kind::Float)? * logits.len() as f64;
    let f = chosen.detach() / &tokens;
    let p = probs / &tokens;
    Ok((f * p).f_sum(Kind::Float)? * experts as f64)
}
