//! The GRPO loss of a packed row through the model: one forward, the LM head at the loss
//! terms' distinct positions only, then the objective on the log-probs
//! ([`grpo_loss_of_logprobs`]).
//!
//! The LM head is fused by default ([`LmHead::Fused`]): (1) every term's log-prob and entropy
//! are taken chunk by chunk without a graph; (2) the objective runs on leaves standing for them,
//! and its backward gives the gradient in each; (3) each chunk's logits are computed again and
//! back-propagated with that gradient into the hidden states (and the head, when it trains), one
//! chunk at a time. No `[terms, vocab]` activation outlives its chunk, so the memory of an
//! update grows with tokens x hidden, not terms x vocab (at Qwen3's vocabulary a kept head
//! holds about a megabyte per term), for a second pass over the head. [`LmHead::Kept`] keeps
//! every chunk's graph until backward: the plain autograd path, the fused head's reference
//! (`tests/fused_head.rs`; memory and time in `cargo bench --bench grpo_head`).

use tch::{Kind, Tensor};

use super::objective::{GrpoObjective, LmHead};
use super::row_terms::{GrpoLoss, TermEntropies, TermLogprobs, TermWeights, grpo_loss_of_logprobs};
use crate::device::Device;
use crate::model::moe::{RecordedRouting, RouterLoss};
use crate::model::{CausalLm, Inputs, ModelError};
use crate::pack::{DistinctTerms, PackedRow, TermPairs, distinct_terms, weighted_sum};

/// The clipped GRPO surrogate over a packed row:
/// `ratio = exp(logp - old_logp)`, per term `-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`,
/// summed and divided by `normalizer` (the number of loss terms of the whole accumulation window;
/// defaults to this row's). Identical for tree and flat packing of the same rollouts.
pub fn grpo_loss(
    model: &CausalLm,
    row: &PackedRow,
    cfg: &GrpoObjective,
    normalizer: Option<f64>,
) -> Result<GrpoLoss, ModelError> {
    let norm = normalizer.unwrap_or(row.token_index.len().max(1) as f64);
    grpo_loss_with_reference(
        model,
        row,
        cfg,
        TermWeights::Uniform(1.0 / norm),
        TermLogprobs::default(),
    )
}

/// The clipped surrogate with per-term `weights`, plus `beta * k3(policy, reference)` per term
/// when `reference` holds the frozen reference model's log-probs of the row's terms `[M]` and
/// `cfg.beta > 0`: `loss = sum_t weight_t * term_t`, differentiable (the LM head kept).
pub(crate) fn grpo_loss_with_reference(
    model: &CausalLm,
    row: &PackedRow,
    cfg: &GrpoObjective,
    weights: TermWeights,
    other: TermLogprobs<'_>,
) -> Result<GrpoLoss, ModelError> {
    let terms = distinct_terms(model, row, cfg.temperature)?;
    kept_head_loss(model, row, &terms, cfg, weights, other)
}

/// `grpo_loss_with_reference`, back-propagated into the policy's gradients (accumulated;
/// layer activations kept or recomputed as `cfg.activations` says, the LM head as
/// `cfg.lm_head`), with `router`'s load-balancing loss of a mixture model added. Under
/// `tch::no_grad` only the loss and its statistics are computed. `recorded`: the routing the
/// generator recorded for the row's tokens, replayed or compared (GRPO's routing replay).
pub fn grpo_loss_backward(
    model: &CausalLm,
    row: &PackedRow,
    cfg: &GrpoObjective,
    (weights, other): (TermWeights, TermLogprobs<'_>),
    (router, recorded): (Option<&RouterLoss>, Option<&RecordedRouting>),
) -> Result<GrpoLoss, ModelError> {
    let pairs = TermPairs::of(row)?;
    let (ids, pos, layout) = row.layout(model.device())?;
    let inputs = Inputs {
        input_ids: &ids,
        position_ids: &pos,
        layout: &layout,
        routing: recorded,
    };
    let (mut out, aux) = model.forward_backward_routed(inputs, cfg.activations, router, |hidden| {
        let terms = pairs.select(hidden, cfg.temperature)?;
        match cfg.lm_head {
            LmHead::Kept => {
                let out = kept_head_loss(model, row, &terms, cfg, weights, other)?;
                Ok((Some(out.loss.shallow_clone()), out))
            }
            LmHead::Fused => fused_head_loss(model, row, &terms, cfg, weights, other),
        }
    })?;
    out.aux_loss = aux;
    Ok(out)
}

/// The load-balancing loss a GRPO row adds: `coef` x its share of the step's rollouts, each
/// token counted once for every rollout through it (the loss of the row's rollouts as one
/// padded batch).
pub(crate) fn row_router_loss(row: &PackedRow, coef: f64, step_rollouts: usize) -> Option<RouterLoss> {
    (coef > 0.0).then(|| RouterLoss {
        coef: coef * row.rollouts as f64 / step_rollouts.max(1) as f64,
        token_weights: Tensor::from_slice(&row.token_rollouts()),
    })
}

/// The loss of a row's `terms` (its distinct pairs' hidden states from the policy's forward),
/// every LM-head chunk's graph kept.
fn kept_head_loss(
    model: &CausalLm,
    row: &PackedRow,
    terms: &DistinctTerms,
    cfg: &GrpoObjective,
    weights: TermWeights,
    other: TermLogprobs<'_>,
) -> Result<GrpoLoss, ModelError> {
    // The policy's log-probs `[M]`; the entropies ride the same pass over the LM head. The
    // step's entropy floor was taken from the same function (`update::term_entropies`), so a
    // term compares its own bits.
    let head = model.head();
    let (logprobs, entropies) = terms.logprobs_and_entropies(head, cfg.chunks, &cfg.truncation)?;
    // The bonus trains on the entropies themselves: then they come with their gradient too.
    let differentiable = match cfg.entropy_coef != 0.0 {
        true => Some(terms.entropies_with_grad(head, cfg.chunks)?),
        false => None,
    };
    let on = PolicyTerms {
        logprobs,
        entropies: &entropies,
        differentiable: differentiable.as_ref(),
    };
    objective_on(row, terms, on, cfg, weights, other)
}

/// What the objective is taken on: the policy's log-prob of each loss term `[M]` and its
/// entropy at each pair `[U]`, measured and (for the entropy bonus) differentiable.
struct PolicyTerms<'a> {
    logprobs: Tensor,
    entropies: &'a Tensor,
    differentiable: Option<&'a Tensor>,
}

/// The objective on `on`, the pairs' entropies fanned out to the terms of `terms`.
fn objective_on(
    row: &PackedRow,
    terms: &DistinctTerms,
    on: PolicyTerms<'_>,
    cfg: &GrpoObjective,
    weights: TermWeights,
    other: TermLogprobs<'_>,
) -> Result<GrpoLoss, ModelError> {
    let measured = on.entropies.f_index_select(0, &terms.of_term)?;
    let differentiable = on
        .differentiable
        .map(|e| e.f_index_select(0, &terms.of_term))
        .transpose()?;
    let term_entropies = TermEntropies {
        measured: &measured,
        differentiable: differentiable.as_ref(),
    };
    let mut out = grpo_loss_of_logprobs(row, on.logprobs, Some(term_entropies), cfg, weights, other)?;
    out.entropy_sum = weighted_sum(on.entropies, &terms.counts)?;
    Ok(out)
}

/// The loss of a row's `terms` with the LM head fused (module docs): the loss and, when it
/// has a gradient, the scalar whose backward carries the head's gradient into the layers.
fn fused_head_loss(
    model: &CausalLm,
    row: &PackedRow,
    terms: &DistinctTerms,
    cfg: &GrpoObjective,
    weights: TermWeights,
    other: TermLogprobs<'_>,
) -> Result<(Option<Tensor>, GrpoLoss), ModelError> {
    let head = model.head();
    // 1. Log-probs `[M]` and entropies `[U]` without a graph (the function the entropy floor
    //    was measured with).
    let (logprobs, entropies) = tch::no_grad(|| terms.logprobs_and_entropies(head, cfg.chunks, &cfg.truncation))?;
    // 2. The objective on leaves standing for them.
    let lp_leaf = logprobs.detach().set_requires_grad(true);
    let entropy_leaf = (cfg.entropy_coef != 0.0).then(|| entropies.detach().set_requires_grad(true));
    let on = PolicyTerms {
        logprobs: lp_leaf.shallow_clone(),
        entropies: &entropies,
        differentiable: entropy_leaf.as_ref(),
    };
    let out = objective_on(row, terms, on, cfg, weights, other)?;
    if !out.loss.requires_grad() || !terms.hidden.requires_grad() {
        return Ok((None, out));
    }
    out.loss.f_backward()?;
    // 3. Each chunk of the head again, back-propagated with the gradient of its pairs: the
    //    terms' gradients summed per pair.
    let per_pair = Device::of(&entropies)
        .zeros(&entropies.size(), Kind::Float)?
        .f_index_add(0, &terms.of_term, &lp_leaf.grad())?;
    let leaf = terms.detached_leaf();
    let entropy_grad = entropy_leaf.as_ref().map(Tensor::grad);
    leaf.backward_head(head, cfg.chunks, &cfg.truncation, &per_pair, entropy_grad.as_ref())?;
    let surrogate = terms.hidden.f_mul(&leaf.hidden.grad())?.f_sum(Kind::Float)?;
    Ok((Some(surrogate), out))
}
