//! The sampler where the logits are: the same choice as [`super::choose`] for every row of a
//! batch at once, in tensor ops on the logits' device, so a decode step sends back only the
//! chosen ids and their two log-probabilities (`3 x batch` numbers) instead of the whole
//! `[batch, vocab]` logits (78 MB a step for 128 rows of Qwen3's 151,936-token vocabulary).
//!
//! The randomness stays treetrain's own: one uniform per sampling row and step from the row's
//! [`SamplingConfig::row_stream`], as the host sampler draws, and the token is found by
//! inverse CDF over the kept distribution in vocabulary order, as the host sampler walks it.
//! Both compute in f64, so on the CPU the same seed gives the same tokens (the sums are taken
//! in another order, which can move a token only when a uniform falls within ~1e-15 of a
//! boundary).
//!
//! On the CPU, f32 logits go to the CPU sampler instead (`cpu_sampler.rs`: the same rule in
//! one pass per row, where these tensor ops make tens of passes over the vocabulary); this
//! module serves every other device and dtype.

use tch::{Kind, Tensor};

use super::sampling::SamplingConfig;
use crate::device::Device;
use crate::model::Truncation;

/// The chosen token of every row of a batch and its log-probabilities (see
/// [`super::Choice`] for what each means).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BatchChoice {
    /// Token id per row.
    pub tokens: Vec<i64>,
    /// Log-probability under the distribution sampled from (truncated, renormalised).
    pub logprobs: Vec<f32>,
    /// Log-probability under `softmax(logits / temperature)`, untruncated.
    pub untruncated_logprobs: Vec<f32>,
}

/// A `[batch, vocab]` presence mask of the tokens each row has seen (prompt and completion so
/// far), for the repetition penalty: transformers' penalty applies once per distinct token.
///
/// # Shapes
/// `rows[r]` are row `r`'s tokens; the mask is `[rows.len(), vocab]` bool on `device`.
pub(crate) fn seen_mask(rows: &[Vec<i64>], vocab: i64, device: Device) -> Result<Tensor, tch::TchError> {
    let mask = device.zeros(&[rows.len() as i64, vocab], Kind::Bool)?;
    for (r, ids) in rows.iter().enumerate() {
        if !ids.is_empty() {
            let index = device.from_slice(ids)?;
            let _ = mask.f_get(r as i64)?.f_index_fill_(0, &index, 1)?;
        }
    }
    Ok(mask)
}

/// [`super::choose_rows`] in tensor ops on the logits' device: what runs off the CPU (and is tested
/// on the CPU against the host sampler like the CPU kernel).
pub(crate) fn choose_rows_with_tensors(
    logits: &Tensor,
    seen: Option<&Tensor>,
    cfg: &SamplingConfig,
    uniforms: &[f64],
) -> Result<BatchChoice, tch::TchError> {
    let temperature = if cfg.do_sample { cfg.temperature.max(1e-6) } else { 1.0 };
    // 1. Scores in f64, as the host sampler computes: raw = logits / T.
    let raw = logits.f_to_kind(Kind::Double)?.f_div_scalar(temperature)?;
    let log_z = raw.f_logsumexp([-1], true)?;
    // 2. The repetition penalty (transformers' rule) on the tokens seen; ids past `token_limit`
    //    score -inf.
    let mut scores = match seen.filter(|_| cfg.repetition_penalty != 1.0) {
        Some(seen) => penalised(&raw, seen, cfg.repetition_penalty)?,
        None => raw.shallow_clone(),
    };
    let vocab = raw.size().last().copied().unwrap_or(0);
    let limit = cfg.token_limit.map(|l| l as i64).filter(|&l| l < vocab);
    if let Some(limit) = limit {
        let beyond = Device::of(&raw).arange(vocab, Kind::Int64)?.f_ge(limit)?;
        scores = scores.f_masked_fill(&beyond.f_view([1, vocab])?, f64::NEG_INFINITY)?;
    }
    // 3. The token: argmax (first of ties), or an inverse-CDF draw from the kept distribution.
    let (token, logprob) = if cfg.do_sample {
        let lp = scores.f_log_softmax(-1, Kind::Double)?;
        // The ids past the limit are already -inf in `lp`, which `kept` leaves out.
        let keep = Truncation {
            token_limit: None,
            ..cfg.truncation()
        }
        .kept(&lp)?;
        let renorm = lp
            .f_masked_fill(&keep.f_logical_not()?, f64::NEG_INFINITY)?
            .f_log_softmax(-1, Kind::Double)?;
        let token = inverse_cdf(&renorm, &keep, uniforms)?;
        let logprob = renorm.f_gather(-1, &token, false)?;
        (token, logprob)
    } else {
        let token = scores.f_argmax(-1, true)?;
        let logprob = raw.f_gather(-1, &token, false)?.f_sub(&log_z)?;
        (token, logprob)
    };
    let untruncated = raw.f_gather(-1, &token, false)?.f_sub(&log_z)?;
    // 4. One transfer back: [batch, 3] of (token, logprob, untruncated logprob).
    let packed = Tensor::f_cat(&[token.f_to_kind(Kind::Double)?, logprob, untruncated], 1)?;
    let host = Vec::<f64>::try_from(Device::to_host(&packed)?.f_contiguous()?.f_view([-1])?)?;
    let column = |c: usize| host.iter().skip(c).step_by(3).copied();
    Ok(BatchChoice {
        tokens: column(0).map(|t| t as i64).collect(),
        logprobs: column(1).map(|l| l as f32).collect(),
        untruncated_logprobs: column(2).map(|l| l as f32).collect(),
    })
}

/// transformers' repetition penalty: a seen token's positive score divided by `penalty`, a
/// negative one multiplied; once per distinct token.
fn penalised(raw: &Tensor, seen: &Tensor, penalty: f64) -> Result<Tensor, tch::TchError> {
    let positive = raw.f_gt(0.0)?;
    let penalty_applied = raw
        .f_div_scalar(penalty)?
        .f_where_self(&positive, &raw.f_mul_scalar(penalty)?)?;
    penalty_applied.f_where_self(seen, raw)
}

/// The first token whose cumulative probability (vocabulary order) exceeds the row's uniform,
/// or the last kept token when rounding leaves the sum short of it.
///
/// # Shapes
/// `renorm`, `keep`: `[batch, vocab]`; returns `[batch, 1]` int64.
fn inverse_cdf(renorm: &Tensor, keep: &Tensor, uniforms: &[f64]) -> Result<Tensor, tch::TchError> {
    let (batch, vocab) = renorm.size2()?;
    let device = Device::of(renorm);
    let mut u = uniforms.to_vec();
    u.resize(batch as usize, 0.0);
    let u = device.from_slice(&u)?.f_view([batch, 1])?;
    let cdf = renorm.f_exp()?.f_cumsum(-1, Kind::Double)?;
    let below = cdf
        .f_le_tensor(&u)?
        .f_sum_dim_intlist([-1i64].as_slice(), true, Kind::Int64)?;
    let index = device.arange(vocab, Kind::Int64)?.f_view([1, vocab])?;
    let last_kept = index
        .f_where_self(keep, &device.put(&Tensor::from(-1i64))?)?
        .f_amax([-1], true)?;
    below.f_minimum(&last_kept)
}
