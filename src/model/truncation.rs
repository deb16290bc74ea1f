//! The sampler's truncation replayed on a trainer's logits, so that an importance ratio
//! compares the distribution a token was drawn from with the same distribution under the
//! current weights. (Here, below both the generator and the packed scoring that use it; a
//! sampling config gives its own with `generate::SamplingConfig::truncation`.)
//!
//! With `top_k`, `top_p`, `min_p` or a `token_limit`, a token is drawn from the truncated,
//! renormalised `q(x) = p(x) / sum_{y in K} p(y)` over the kept set `K`, not from
//! `p = softmax(logits / T)`. An estimate `q_θ(x) / q_old(x) * A(x)` over draws `x ~ q_old`
//! has the expectation `sum_{x in K} q_θ(x) A(x)` (where `K` holds `q_θ`'s support), and its
//! gradient is the gradient of the expected reward of the policy as it samples. Taking the
//! ratio of the untruncated `p_θ / p_old` instead weights every kept token by the constant
//! `1 / p_old(K)` and leaves out the gradient through the kept mass: biased, the more so the
//! more mass truncation drops (`tests/truncated_sampling.rs` measures both).
//!
//! The kept set is recomputed from the trainer's own logits with the sampler's rules
//! ([`Truncation::kept`]). The sampled token itself is always kept: under bf16 a token the
//! sampler kept just inside the top-p or min-p boundary may fall just outside it on the
//! trainer, and its log-prob would be `-inf` (an infinite loss) instead of a slightly
//! different finite one.

use tch::{Kind, Tensor};

use crate::device::Device;

/// What a sampler leaves out of `softmax(logits / T)`; nothing when sampling is greedy.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Truncation {
    /// Ids at or above this are never drawn (the tokenizer's vocabulary size).
    pub token_limit: Option<usize>,
    /// Only the k most likely tokens are kept.
    pub top_k: Option<usize>,
    /// Nucleus: the most likely tokens until their probability reaches p.
    pub top_p: Option<f64>,
    /// Tokens at least `min_p` times as likely as the most likely one.
    pub min_p: Option<f64>,
}

impl Truncation {
    /// Whether anything of a `vocab`-row distribution is left out.
    pub fn truncates(&self, vocab: i64) -> bool {
        self.top_k.is_some_and(|k| (k as i64) < vocab)
            || self.top_p.is_some()
            || self.min_p.is_some()
            || self.token_limit.is_some_and(|l| (l as i64) < vocab)
    }

    /// The kept set `[n, vocab]` (bool) of the rows of `lp` `[n, vocab]`, log-probs under
    /// `softmax(logits / T)`: ids past `token_limit` out, then top-k, top-p over the survivors
    /// (most likely first, the first always stays), min-p, judged on the distribution
    /// renormalised over the ids below the limit, as the sampler judges them.
    pub fn kept(&self, lp: &Tensor) -> Result<Tensor, tch::TchError> {
        let (n, vocab) = lp.size2()?;
        let device = Device::of(lp);
        let lp = match self.token_limit.map(|l| l as i64).filter(|&l| l < vocab) {
            Some(limit) => {
                let beyond = device.arange(vocab, Kind::Int64)?.f_ge(limit)?.f_view([1, vocab])?;
                lp.f_masked_fill(&beyond, f64::NEG_INFINITY)?
                    .f_log_softmax(-1, lp.kind())?
            }
            None => lp.shallow_clone(),
        };
        let mut keep = lp.f_isfinite()?;
        if self.top_k.is_some() || self.top_p.is_some() {
            let (sorted, order) = lp.f_sort(-1, true)?;
            let rank = device.arange(vocab, Kind::Int64)?.f_view([1, vocab])?;
            let mut kept = device.ones(&[n, vocab], Kind::Bool)?;
            if let Some(k) = self.top_k {
                kept = kept.f_logical_and(&rank.f_lt(k as i64)?)?;
            }
            if let Some(p) = self.top_p {
                let probs = sorted.f_exp()?.f_masked_fill(&kept.f_logical_not()?, 0.0)?;
                let before = probs.f_cumsum(-1, Kind::Double)?.f_sub(&probs)?;
                kept = kept.f_logical_and(&before.f_lt(p)?.f_logical_or(&rank.f_eq(0)?)?)?;
            }
            keep = keep.f_logical_and(&device.zeros(&[n, vocab], Kind::Bool)?.f_scatter(-1, &order, &kept)?)?;
        }
        if let Some(min_p) = self.min_p {
            let floor = lp.f_amax([-1], true)?.f_add_scalar(min_p.ln())?;
            keep = keep.f_logical_and(&lp.f_ge_tensor(&floor)?)?;
        }
        Ok(keep)
    }

    /// `log q(target)` `[n]` of each row of `logits` `[n, vocab]` (already divided by the
    /// temperature; differentiable): the target's log-prob under the distribution renormalised
    /// over the kept set, the target always counted in it (see the module docs).
    pub fn logprobs(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor, tch::TchError> {
        let log_probs = tch::no_grad(|| logits.f_to_kind(Kind::Float)?.f_log_softmax(-1, Kind::Float))?;
        self.logprobs_with(logits, &log_probs, targets)
    }

    /// [`Truncation::logprobs`] given the rows' `log_softmax` `log_probs` already at hand (only
    /// its values are read, to find the kept set).
    pub(crate) fn logprobs_with(
        &self,
        logits: &Tensor,
        log_probs: &Tensor,
        targets: &Tensor,
    ) -> Result<Tensor, tch::TchError> {
        let logits = logits.f_to_kind(Kind::Float)?;
        let targets = targets.f_to_kind(Kind::Int64)?.f_view([-1, 1])?;
        let keep = tch::no_grad(|| self.kept(&log_probs.detach())?.f_scatter_value(-1, &targets, 1))?;
        let masked = logits.f_masked_fill(&keep.f_logical_not()?, f64::NEG_INFINITY)?;
        let target = logits.f_gather(-1, &targets, false)?.f_squeeze_dim(-1)?;
        target.f_sub(&masked.f_logsumexp([-1], false)?)
    }
}

impl std::fmt::Display for Truncation {
    /// The settings that truncate, as `top_k = 20, token_limit = 1760`; `none` without any.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = [
            self.top_k.map(|k| format!("top_k = {k}")),
            self.top_p.map(|p| format!("top_p = {p}")),
            self.min_p.map(|m| format!("min_p = {m}")),
            self.token_limit.map(|l| format!("token_limit = {l}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        match parts.is_empty() {
            true => f.write_str("none"),
            false => f.write_str(&parts.join(", ")),
        }
    }
}
