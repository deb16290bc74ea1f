//! Log-probabilities of a packed row's loss terms: one forward of the row, then the LM head only
//! at the distinct predicting positions.

use tch::{Kind, Tensor};

use super::row::PackedRow;
use crate::device::Device;
use crate::model::Truncation;
use crate::model::{
    CausalLm, LmHead, LogprobChunks, ModelError, head_logits, target_logprobs, target_logprobs_and_entropy,
};

/// The distinct `(position, target)` pairs of a row's loss terms. A token trained in several
/// rollouts that share it in the tree is several terms with one hidden state and one target, so
/// its log-prob (and the LM head's work for it) is computed once and fanned out.
pub(crate) struct DistinctTerms {
    /// `[U]` hidden states at the pairs' positions, divided by the temperature (so that
    /// `h W^T = logits / temperature`).
    pub hidden: Tensor,
    /// `[U]` targets.
    pub targets: Tensor,
    /// `[M]` the pair of each loss term.
    pub of_term: Tensor,
    /// `[U]` terms per pair (f64, for weighting per-pair statistics).
    pub counts: Vec<f64>,
}

pub(crate) fn distinct_terms(model: &CausalLm, row: &PackedRow, temperature: f64) -> Result<DistinctTerms, ModelError> {
    let pairs = TermPairs::of(row)?;
    let (ids, pos, layout) = row.layout(model.device())?;
    let hidden = model.forward_hidden(&ids, &pos, &layout)?;
    Ok(pairs.select(&hidden, temperature)?)
}

/// The distinct `(position, target)` pairs of a row's terms, before any forward.
pub(crate) struct TermPairs {
    positions: Vec<i64>,
    targets: Vec<i64>,
    of_term: Vec<i64>,
    counts: Vec<f64>,
}

impl TermPairs {
    /// The pairs of `row` (checked first: rows are public data, and a hand-made one must fail
    /// with a message, not an index panic).
    pub(crate) fn of(row: &PackedRow) -> Result<Self, ModelError> {
        row.check().map_err(|e| ModelError::Input(format!("packed row: {e}")))?;
        let mut seen: std::collections::HashMap<(i64, i64), i64> = std::collections::HashMap::new();
        let mut pairs = TermPairs {
            positions: Vec::new(),
            targets: Vec::new(),
            of_term: Vec::new(),
            counts: Vec::new(),
        };
        for (&p, &t) in row.token_index.iter().zip(&row.targets()) {
            let id = *seen.entry((p, t)).or_insert_with(|| {
                pairs.positions.push(p);
                pairs.targets.push(t);
                pairs.counts.push(0.0);
                pairs.positions.len() as i64 - 1
            });
            pairs.counts[id as usize] += 1.0;
            pairs.of_term.push(id);
        }
        Ok(pairs)
    }

    /// The pairs' hidden states from the row's forward `hidden` `[1, n, hidden]`.
    pub(crate) fn select(self, hidden: &Tensor, temperature: f64) -> Result<DistinctTerms, tch::TchError> {
        let device = Device::of(hidden);
        let h = hidden
            .f_squeeze_dim(0)?
            .f_index_select(0, &device.from_slice(&self.positions)?)?;
        Ok(DistinctTerms {
            hidden: if temperature == 1.0 { h } else { h / temperature },
            targets: Tensor::from_slice(&self.targets),
            of_term: device.from_slice(&self.of_term)?,
            counts: self.counts,
        })
    }
}

impl DistinctTerms {
    /// Log-prob of every loss term `[M]` under the distribution the sampler drew from:
    /// `softmax(logits / T)` with `truncation` replayed ([`Truncation::logprobs`]).
    pub(crate) fn logprobs(
        &self,
        lm_head: LmHead<'_>,
        chunks: LogprobChunks,
        truncation: &Truncation,
    ) -> Result<Tensor, ModelError> {
        let per_pair = match truncation.truncates(lm_head.vocab()) {
            true => self.truncated_pass(lm_head, chunks, truncation)?.0,
            false => target_logprobs(&self.hidden, lm_head, &self.targets, chunks)?,
        };
        Ok(per_pair.f_index_select(0, &self.of_term)?)
    }

    /// The policy's entropy at every pair `[U]` (f32) with its gradient, for an entropy bonus:
    /// each chunk's full logits are kept until backward, as a plain `log_softmax` over the
    /// vocabulary keeps them.
    pub(crate) fn entropies_with_grad(&self, lm_head: LmHead<'_>, chunks: LogprobChunks) -> Result<Tensor, ModelError> {
        let mut out = Vec::new();
        self.for_each_logit_chunk(lm_head, chunks, |_, logits| {
            out.push(entropy_of(&logits.f_log_softmax(-1, Kind::Float)?)?);
            Ok(())
        })?;
        if out.is_empty() {
            return Ok(Device::of(&self.hidden).zeros(&[0], Kind::Float)?);
        }
        Ok(Tensor::f_cat(&out, 0)?)
    }

    /// Log-prob of every loss term `[M]` (as [`DistinctTerms::logprobs`]) and the policy's
    /// untruncated entropy at every pair `[U]` (f32, without gradient), from one pass over the
    /// LM head.
    pub(crate) fn logprobs_and_entropies(
        &self,
        lm_head: LmHead<'_>,
        chunks: LogprobChunks,
        truncation: &Truncation,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let (per_pair, entropies) = match truncation.truncates(lm_head.vocab()) {
            true => self.truncated_pass(lm_head, chunks, truncation)?,
            false => target_logprobs_and_entropy(&self.hidden, lm_head, &self.targets, chunks)?,
        };
        Ok((per_pair.f_index_select(0, &self.of_term)?, entropies))
    }

    /// Per pair `[U]`, the truncated log-probs and the entropies, from whole rows of logits
    /// (the kept set depends on the whole row).
    fn truncated_pass(
        &self,
        lm_head: LmHead<'_>,
        chunks: LogprobChunks,
        truncation: &Truncation,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let device = Device::of(&self.hidden);
        if self.hidden.size()[0] == 0 {
            return Ok((device.zeros(&[0], Kind::Float)?, device.zeros(&[0], Kind::Float)?));
        }
        let targets = device.put(&self.targets)?;
        let (mut logprobs, mut entropies) = (Vec::new(), Vec::new());
        self.for_each_logit_chunk(lm_head, chunks, |start, logits| {
            let log_probs = tch::no_grad(|| logits.f_log_softmax(-1, Kind::Float))?;
            let t = targets.f_narrow(0, start, logits.size()[0])?;
            logprobs.push(truncation.logprobs_with(logits, &log_probs, &t)?);
            entropies.push(entropy_of(&log_probs)?);
            Ok(())
        })?;
        Ok((Tensor::f_cat(&logprobs, 0)?, Tensor::f_cat(&entropies, 0)?))
    }

    /// Calls `f(start, logits)` on consecutive chunks of whole rows of logits `h W^T` (f32
    /// `[len, vocab]`, rows `start..start + len`), as many rows as `chunks.tokens x
    /// chunks.vocab` logits hold.
    fn for_each_logit_chunk(
        &self,
        lm_head: LmHead<'_>,
        chunks: LogprobChunks,
        mut f: impl FnMut(i64, &Tensor) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let (n, vocab) = (self.hidden.size()[0], lm_head.vocab());
        let rows = (chunks.tokens.max(1) * chunks.vocab.max(1) / vocab.max(1)).clamp(1, chunks.tokens.max(1));
        let mut start = 0;
        while start < n {
            let len = rows.min(n - start);
            let logits = head_logits(&self.hidden.f_narrow(0, start, len)?, lm_head)?;
            f(start, &logits)?;
            start += len;
        }
        Ok(())
    }
}

/// `-sum_v p_v log p_v` `[n]` of each row of log-probs `log_probs` `[n, vocab]`.
fn entropy_of(log_probs: &Tensor) -> Result<Tensor, tch::TchError> {
    log_probs
        .f_exp()?
        .f_mul(log_probs)?
        .f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)?
        .f_neg()
}

impl DistinctTerms {
    /// The same pairs over a leaf copy of the hidden states (no graph to the model; its
    /// `grad()` collects what [`DistinctTerms::backward_head`] back-propagates).
    pub(crate) fn detached_leaf(&self) -> DistinctTerms {
        DistinctTerms {
            hidden: self.hidden.detach().set_requires_grad(true),
            targets: self.targets.shallow_clone(),
            of_term: self.of_term.shallow_clone(),
            counts: self.counts.clone(),
        }
    }

    /// Back-propagates `sum_u grad_logprobs[u] logprob_u (+ grad_entropies[u] entropy_u)` over
    /// the pairs `[U]` into the hidden states and into `lm_head` when it trains, one chunk of
    /// whole logit rows at a time (as many rows as `chunks.tokens x chunks.vocab` logits hold):
    /// each chunk's graph is freed before the next is built. The log-probs are those of
    /// [`DistinctTerms::logprobs`] under `truncation`, the entropies untruncated.
    pub(crate) fn backward_head(
        &self,
        lm_head: LmHead<'_>,
        chunks: LogprobChunks,
        truncation: &Truncation,
        grad_logprobs: &Tensor,
        grad_entropies: Option<&Tensor>,
    ) -> Result<(), ModelError> {
        let truncates = truncation.truncates(lm_head.vocab());
        let targets = Device::of(&self.hidden).put(&self.targets)?;
        let grad_entropies = grad_entropies.filter(|g| g.defined());
        self.for_each_logit_chunk(lm_head, chunks, |start, logits| {
            let len = logits.size()[0];
            let t = targets.f_narrow(0, start, len)?;
            let log_probs = logits.f_log_softmax(-1, Kind::Float)?;
            let logprobs = match truncates {
                true => truncation.logprobs_with(logits, &log_probs, &t)?,
                false => log_probs.f_gather(-1, &t.f_view([-1, 1])?, false)?.f_squeeze_dim(-1)?,
            };
            let mut surrogate = logprobs
                .f_mul(&grad_logprobs.f_narrow(0, start, len)?)?
                .f_sum(Kind::Float)?;
            if let Some(g) = grad_entropies {
                let entropy = entropy_of(&log_probs)?;
                surrogate = surrogate.f_add(&entropy.f_mul(&g.f_narrow(0, start, len)?)?.f_sum(Kind::Float)?)?;
            }
            Ok(surrogate.f_backward()?)
        })
    }
}

/// Log-prob under `model` of every loss term of `row` `[M]`: one forward of the packed row,
/// then the LM head only at the predicting positions.
pub fn row_logprobs(model: &CausalLm, row: &PackedRow, chunks: LogprobChunks) -> Result<Tensor, ModelError> {
    row_logprobs_at(model, row, chunks, 1.0, &Truncation::default())
}

/// [`row_logprobs`] under the distribution a sampler with `temperature` and `truncation` draws
/// from (the truncation replayed: [`Truncation::logprobs`]).
pub(crate) fn row_logprobs_at(
    model: &CausalLm,
    row: &PackedRow,
    chunks: LogprobChunks,
    temperature: f64,
    truncation: &Truncation,
) -> Result<Tensor, ModelError> {
    distinct_terms(model, row, temperature)?.logprobs(model.head(), chunks, truncation)
}

/// `sum_i weights[i] * entropy_i` of per-pair entropies `[U]`.
pub(crate) fn weighted_sum(entropies: &Tensor, weights: &[f64]) -> Result<f64, tch::TchError> {
    let weights = Device::of(entropies).put(&Tensor::f_from_slice(weights)?.f_to_kind(Kind::Float)?)?;
    entropies.f_mul(&weights)?.f_sum(Kind::Float)?.f_double_value(&[])
}
