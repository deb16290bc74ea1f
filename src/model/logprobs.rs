//! Log-probabilities of target tokens without materialising `[tokens, vocab]` logits.

use tch::{Kind, Tensor};

use super::ModelError;
use crate::device::Device;

/// Token and vocabulary chunk sizes for [`target_logprobs`].
#[derive(Debug, Clone, Copy)]
pub struct LogprobChunks {
    /// Tokens per chunk.
    pub tokens: i64,
    /// Vocabulary rows per chunk.
    pub vocab: i64,
}

impl Default for LogprobChunks {
    fn default() -> Self {
        LogprobChunks {
            tokens: 1024,
            vocab: 16384,
        }
    }
}

/// `log p(target | hidden)` for each row: `hidden` `[n, h]`, `lm_head` `[vocab, h]`, `targets`
/// `[n]` -> `[n]` f32.
///
/// Computed in f32 with an online log-sum-exp over vocabulary chunks, so peak memory is
/// `tokens x vocab` chunk-sized instead of `n x vocab` (at 32K tokens and a 151K vocabulary the
/// full f32 logits would be 19 GiB). Differentiable: under autograd each chunk's graph is kept
/// for backward, so memory savings then apply to the forward peak only.
pub fn target_logprobs(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    chunks: LogprobChunks,
) -> Result<Tensor, ModelError> {
    let (n, vocab) = (hidden.size()[0], lm_head.size()[0]);
    if targets.size() != [n] {
        return Err(ModelError::Input(format!(
            "targets has shape {:?}, expected [{n}]",
            targets.size()
        )));
    }
    if n == 0 {
        return Ok(Device::of(hidden).zeros(&[0], Kind::Float)?);
    }
    let targets = Device::of(hidden).put(targets)?.f_to_kind(Kind::Int64)?;
    let (lo, hi) = (targets.f_min()?.int64_value(&[]), targets.f_max()?.int64_value(&[]));
    if lo < 0 || hi >= vocab {
        return Err(ModelError::Input(format!(
            "target ids must lie in 0..{vocab}, found {}",
            if lo < 0 { lo } else { hi }
        )));
    }
    let w32 = lm_head.to_kind(Kind::Float);
    let (tok_chunk, voc_chunk) = (chunks.tokens.max(1), chunks.vocab.max(1));
    let mut out = Vec::new();
    let mut start = 0;
    while start < n {
        let len = tok_chunk.min(n - start);
        let h = hidden.narrow(0, start, len).to_kind(Kind::Float);
        let t = targets.narrow(0, start, len);
        let target_logit = (&h * w32.index_select(0, &t)).sum_dim_intlist(-1, false, Kind::Float);
        let mut running_max: Option<Tensor> = None;
        let mut running_sum: Option<Tensor> = None;
        let mut v0 = 0;
        while v0 < vocab {
            let vl = voc_chunk.min(vocab - v0);
            let logits = h.matmul(&w32.narrow(0, v0, vl).transpose(0, 1));
            let chunk_max = logits.amax(-1, false);
            let (m, s) = match (running_max.take(), running_sum.take()) {
                (Some(m), Some(s)) => {
                    let m_new = m.maximum(&chunk_max);
                    let s_new = s * (&m - &m_new).exp()
                        + (logits - m_new.unsqueeze(-1))
                            .exp()
                            .sum_dim_intlist(-1, false, Kind::Float);
                    (m_new, s_new)
                }
                _ => {
                    let s = (logits - chunk_max.unsqueeze(-1))
                        .exp()
                        .sum_dim_intlist(-1, false, Kind::Float);
                    (chunk_max, s)
                }
            };
            running_max = Some(m);
            running_sum = Some(s);
            v0 += vl;
        }
        let (m, s) = (running_max.expect("vocab > 0"), running_sum.expect("vocab > 0"));
        out.push(target_logit - (m + s.log()));
        start += len;
    }
    Ok(Tensor::cat(&out, 0))
}

/// `scale * sum_i -log p(targets_i | hidden_i)` back-propagated one token chunk at a time, so
/// that in training too no more than one chunk's logits exist (TRL's chunked NLL): each chunk's
/// LM-head graph is built, back-propagated into a detached copy of `hidden` (and into
/// `lm_head` when it trains) and freed before the next. Returns the NLL sum and a scalar whose
/// backward carries the gathered gradient into `hidden`'s own graph (the layers below); `None`
/// when `hidden` has no graph.
///
/// # Shapes
/// `hidden` `[n, h]`, `lm_head` `[vocab, h]`, `targets` `[n]`.
pub fn nll_backward_chunked(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    scale: f64,
    chunks: LogprobChunks,
) -> Result<(f64, Option<Tensor>), ModelError> {
    let n = hidden.size()[0];
    let leaf = hidden.detach().set_requires_grad(true);
    let (mut total, mut start, step) = (0.0, 0, chunks.tokens.max(1));
    while start < n {
        let len = step.min(n - start);
        let lp = target_logprobs(
            &leaf.narrow(0, start, len),
            lm_head,
            &targets.narrow(0, start, len),
            chunks,
        )?;
        let nll = -lp.sum(Kind::Float);
        total += nll.double_value(&[]);
        (nll * scale).f_backward()?;
        start += len;
    }
    let grad = leaf.grad();
    Ok((
        total,
        (hidden.requires_grad() && grad.defined()).then(|| (hidden * grad).sum(Kind::Float)),
    ))
}
