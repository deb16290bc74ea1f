//! Log-probabilities of target tokens without materialising `[tokens, vocab]` logits.

use tch::{Kind, Tensor};

use super::error::ModelError;
use super::parts::LogitSoftcap;
use crate::device::Device;

/// The LM head: its weight `[vocab, hidden]` and what wraps its products (Muse Spark's
/// softcap). A bare weight converts into a head without one.
#[derive(Debug, Clone, Copy)]
pub struct LmHead<'a> {
    /// `[vocab, hidden]`.
    pub weight: &'a Tensor,
    /// Applied to every logit.
    pub softcap: Option<LogitSoftcap>,
}

impl<'a> From<&'a Tensor> for LmHead<'a> {
    fn from(weight: &'a Tensor) -> Self {
        LmHead { weight, softcap: None }
    }
}

impl LmHead<'_> {
    /// Vocabulary rows.
    pub(crate) fn vocab(&self) -> i64 {
        self.weight.size()[0]
    }

    /// `logits` (f32, the raw products) as the model ends them: `cap * tanh(logits * m / cap)`
    /// where the head has a softcap, as transformers orders the ops.
    pub(crate) fn wrap(&self, logits: Tensor) -> Tensor {
        match self.softcap {
            Some(LogitSoftcap { multiplier, cap }) => ((logits * multiplier) / cap).tanh() * cap,
            None => logits,
        }
    }
}

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
pub fn target_logprobs<'a>(
    hidden: &Tensor,
    lm_head: impl Into<LmHead<'a>>,
    targets: &Tensor,
    chunks: LogprobChunks,
) -> Result<Tensor, ModelError> {
    Ok(head_pass(hidden, lm_head.into(), targets, chunks, Entropy::Skip)?.0)
}

/// [`target_logprobs`] and each row's entropy `-sum_v p_v log p_v` `[n]` (f32, nats, without
/// gradient), both from the same chunks of logits: one pass over the LM head instead of two
/// (GRPO reports the policy's entropy every update, and its `top_entropy_quantile` trains on it).
pub fn target_logprobs_and_entropy<'a>(
    hidden: &Tensor,
    lm_head: impl Into<LmHead<'a>>,
    targets: &Tensor,
    chunks: LogprobChunks,
) -> Result<(Tensor, Tensor), ModelError> {
    let (logprobs, entropy) = head_pass(hidden, lm_head.into(), targets, chunks, Entropy::Compute)?;
    let entropy = match entropy {
        Some(e) => e,
        None => Device::of(hidden).zeros(&[0], Kind::Float)?,
    };
    Ok((logprobs, entropy))
}

/// Whether [`head_pass`] also computes each row's entropy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entropy {
    Skip,
    Compute,
}

/// The log-probs of `targets` and (with [`Entropy::Compute`]) the entropies, token chunk by
/// token chunk; `None` for the entropies of an empty input.
fn head_pass(
    hidden: &Tensor,
    lm_head: LmHead<'_>,
    targets: &Tensor,
    chunks: LogprobChunks,
    entropy: Entropy,
) -> Result<(Tensor, Option<Tensor>), ModelError> {
    let n = hidden.size()[0];
    let targets = checked_targets(hidden, lm_head.vocab(), targets)?;
    if n == 0 {
        return Ok((Device::of(hidden).zeros(&[0], Kind::Float)?, None));
    }
    let (mut logprobs, mut entropies) = (Vec::new(), Vec::new());
    let mut start = 0;
    while start < n {
        let len = chunks.tokens.max(1).min(n - start);
        let h = hidden.narrow(0, start, len).to_kind(Kind::Float);
        let t = targets.narrow(0, start, len);
        let target_rows = lm_head.weight.index_select(0, &t).to_kind(Kind::Float);
        let target_logit = lm_head.wrap((&h * target_rows).sum_dim_intlist(-1, false, Kind::Float));
        let softmax = RunningSoftmax::over_vocabulary(&h, lm_head, chunks.vocab.max(1), entropy);
        logprobs.push(target_logit - softmax.log_normalizer());
        entropies.extend(softmax.entropy());
        start += len;
    }
    let entropies = (!entropies.is_empty()).then(|| Tensor::cat(&entropies, 0));
    Ok((Tensor::cat(&logprobs, 0), entropies))
}

/// `targets` `[n]` as int64 on `hidden`'s device, checked against `hidden` `[n, h]` and the
/// vocabulary `vocab`.
fn checked_targets(hidden: &Tensor, vocab: i64, targets: &Tensor) -> Result<Tensor, ModelError> {
    let n = hidden.size()[0];
    if targets.size() != [n] {
        return Err(ModelError::Input(format!(
            "targets has shape {:?}, expected [{n}]",
            targets.size()
        )));
    }
    let targets = Device::of(hidden).put(targets)?.f_to_kind(Kind::Int64)?;
    if n > 0 {
        let (lo, hi) = (targets.f_min()?.int64_value(&[]), targets.f_max()?.int64_value(&[]));
        if lo < 0 || hi >= vocab {
            return Err(ModelError::Input(format!(
                "target ids must lie in 0..{vocab}, found {}",
                if lo < 0 { lo } else { hi }
            )));
        }
    }
    Ok(targets)
}

/// The softmax normaliser of one token chunk's logits, accumulated over vocabulary chunks
/// (online log-sum-exp), each `[tokens]`: `max` of the logits so far, `sum` of
/// `exp(logit - max)`, and for the entropy `shifted` = sum of `exp(logit - max) (logit - max)`
/// (without gradient). Entropy = `log sum - shifted / sum`: with logits taken relative to their
/// max, a peaked distribution's small entropy does not come from cancelling two large numbers.
struct RunningSoftmax {
    max: Tensor,
    sum: Tensor,
    shifted: Option<Tensor>,
}

impl RunningSoftmax {
    /// Over the f32 logits `h W^T` of `h` `[tokens, hidden]` (f32), `vocab_chunk` rows of `w`
    /// at a time, each converted to f32 on its own (never the whole head at once).
    fn over_vocabulary(h: &Tensor, head: LmHead<'_>, vocab_chunk: i64, entropy: Entropy) -> Self {
        let (w, vocab) = (head.weight, head.vocab());
        let mut running: Option<RunningSoftmax> = None;
        let mut v0 = 0;
        while v0 < vocab {
            let vl = vocab_chunk.min(vocab - v0);
            let logits = head.wrap(h.matmul(&w.narrow(0, v0, vl).to_kind(Kind::Float).transpose(0, 1)));
            running = Some(match running {
                None => RunningSoftmax::first(&logits, entropy),
                Some(r) => r.add(&logits),
            });
            v0 += vl;
        }
        running.expect("a vocabulary of at least one token")
    }

    fn first(logits: &Tensor, entropy: Entropy) -> Self {
        let max = logits.amax(-1, false);
        let shifted_logits = logits - max.unsqueeze(-1);
        let exp = shifted_logits.exp();
        RunningSoftmax {
            sum: exp.sum_dim_intlist(-1, false, Kind::Float),
            shifted: (entropy == Entropy::Compute).then(|| weighted_shift(&exp, &shifted_logits)),
            max,
        }
    }

    /// Adds a further vocabulary chunk's `logits`.
    fn add(self, logits: &Tensor) -> Self {
        let max = self.max.maximum(&logits.amax(-1, false));
        let rescale = (&self.max - &max).exp();
        let shifted_logits = logits - max.unsqueeze(-1);
        let exp = shifted_logits.exp();
        let shifted = self.shifted.map(|old| {
            // Relative to the new max every earlier logit is lower by `max - old max`.
            tch::no_grad(|| {
                let moved = (&self.max - &max).detach() * self.sum.detach();
                (old + moved) * rescale.detach() + weighted_shift(&exp, &shifted_logits)
            })
        });
        RunningSoftmax {
            sum: self.sum * rescale + exp.sum_dim_intlist(-1, false, Kind::Float),
            shifted,
            max,
        }
    }

    /// `log sum_v exp(logit_v)` `[tokens]`.
    fn log_normalizer(&self) -> Tensor {
        &self.max + self.sum.log()
    }

    /// `-sum_v p_v log p_v` `[tokens]`, without gradient, when computed.
    fn entropy(&self) -> Option<Tensor> {
        let shifted = self.shifted.as_ref()?;
        Some(tch::no_grad(|| {
            let sum = self.sum.detach();
            sum.log() - shifted / &sum
        }))
    }
}

/// `sum_v exp_v * shifted_v` `[tokens]` without gradient.
fn weighted_shift(exp: &Tensor, shifted_logits: &Tensor) -> Tensor {
    tch::no_grad(|| (exp.detach() * shifted_logits.detach()).sum_dim_intlist(-1, false, Kind::Float))
}

/// Rows of a head in another dtype converted to f32 at once by [`head_logits`].
const HEAD_SLICE: i64 = 16384;

/// The f32 logits `h W^T` `[rows, vocab]` of `h` `[rows, hidden]` (any float dtype) and the head
/// `lm_head` (`W` `[vocab, hidden]`, its softcap applied): one product for an f32 head;
/// otherwise the head converted [`HEAD_SLICE`] rows at a time, so no f32 copy of a bf16 head
/// (1.2 GB at Qwen3's vocabulary) is made per call. Differentiable.
pub(crate) fn head_logits<'a>(h: &Tensor, lm_head: impl Into<LmHead<'a>>) -> Result<Tensor, tch::TchError> {
    let head = lm_head.into();
    Ok(head.wrap(raw_head_logits(h, head.weight)?))
}

/// [`head_logits`] without the softcap.
fn raw_head_logits(h: &Tensor, lm_head: &Tensor) -> Result<Tensor, tch::TchError> {
    let h = h.f_to_kind(Kind::Float)?;
    if lm_head.kind() == Kind::Float {
        return h.f_matmul(&lm_head.f_tr()?);
    }
    // One split, whose backward joins the slices' gradients once: a slice taken by `narrow`
    // would back-propagate a zero-filled gradient of the whole head for every slice, summed
    // slice by slice (the `tree_vs_flat` bench at a 151,936-token vocabulary).
    let slices = lm_head
        .f_split(HEAD_SLICE, 0)?
        .iter()
        .map(|rows| h.f_matmul(&rows.f_to_kind(Kind::Float)?.f_tr()?))
        .collect::<Result<Vec<_>, _>>()?;
    Tensor::f_cat(&slices, 1)
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
pub fn nll_backward_chunked<'a>(
    hidden: &Tensor,
    lm_head: impl Into<LmHead<'a>>,
    targets: &Tensor,
    scale: f64,
    chunks: LogprobChunks,
) -> Result<(f64, Option<Tensor>), ModelError> {
    let n = hidden.size()[0];
    let lm_head = lm_head.into();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Entropies of `h W^T` in f64 from the full distribution.
    fn reference_entropy(h: &Tensor, w: &Tensor) -> Tensor {
        let logp = h
            .to_kind(Kind::Double)
            .matmul(&w.to_kind(Kind::Double).transpose(0, 1))
            .log_softmax(-1, Kind::Double);
        -(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Double)
    }

    #[test]
    fn entropies_from_vocabulary_chunks_match_the_full_distribution_flat_or_peaked() {
        tch::manual_seed(3);
        let w = Tensor::randn([50, 8], (Kind::Float, tch::Device::Cpu));
        let targets = Tensor::from_slice(&[0i64, 7, 49, 3, 20]);
        // From a near-uniform distribution to a nearly deterministic one (entropy ~1e-6 nats).
        for scale in [0.01, 1.0, 30.0] {
            let h = Tensor::randn([5, 8], (Kind::Float, tch::Device::Cpu)) * scale;
            let want = reference_entropy(&h, &w);
            for chunks in [
                LogprobChunks { tokens: 2, vocab: 7 },
                LogprobChunks { tokens: 5, vocab: 50 },
            ] {
                let (_, got) = target_logprobs_and_entropy(&h, &w, &targets, chunks).unwrap();
                let err = (got.to_kind(Kind::Double) - &want).abs();
                // Absolute f32 rounding, or relative for tiny entropies.
                let bound = want.abs() * 1e-4 + 1e-6;
                assert!(
                    err.le_tensor(&bound).all().int64_value(&[]) == 1,
                    "scale {scale} {chunks:?}: {err} vs {want}"
                );
            }
        }
    }

    #[test]
    fn entropy_of_no_rows_is_empty() {
        let w = Tensor::randn([4, 2], (Kind::Float, tch::Device::Cpu));
        let h = Tensor::zeros([0, 2], (Kind::Float, tch::Device::Cpu));
        let (lp, e) = target_logprobs_and_entropy(
            &h,
            &w,
            &Tensor::zeros([0], (Kind::Int64, tch::Device::Cpu)),
            LogprobChunks::default(),
        )
        .unwrap();
        assert_eq!((lp.size(), e.size()), (vec![0], vec![0]));
    }

    /// A bf16 head's logits, converted slice by slice, equal those of the whole head converted
    /// at once, across slice boundaries, and gradients reach both the hidden states and the head.
    #[test]
    fn bf16_head_logits_by_slices_equal_the_whole_head_in_f32() {
        tch::manual_seed(4);
        let vocab = 2 * super::HEAD_SLICE + 5;
        let w = Tensor::randn([vocab, 8], (Kind::Float, tch::Device::Cpu))
            .to_kind(Kind::BFloat16)
            .set_requires_grad(true);
        let h = Tensor::randn([3, 8], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let got = super::head_logits(&h, &w).unwrap();
        let want = h.matmul(&w.to_kind(Kind::Float).tr());
        assert_eq!(got.kind(), Kind::Float);
        let diff = (&got - &want).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "{diff}");
        got.sum(Kind::Float).backward();
        assert_eq!(w.grad().kind(), Kind::BFloat16);
        let expected_head_grad = h.sum_dim_intlist(0, false, Kind::Float).double_value(&[0]);
        let head_grad = w.grad().get(vocab - 1).to_kind(Kind::Float).double_value(&[0]);
        assert!((head_grad - expected_head_grad).abs() < 1e-2 * (1.0 + expected_head_grad.abs()));
        assert!(h.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }
}
