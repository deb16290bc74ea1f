//! The sampler of a decode step on the CPU (`cpu_sampler.cpp`): the host sampler's choice for
//! every row in f64, one exp pass over the vocabulary per row, top-k / top-p over the head of
//! the distribution only. [`super::choose_rows`] takes it for f32 logits on the CPU (on a CPU
//! with AVX2 + FMA); the tensor-op path serves every other device.
//!
//! It equals the host sampler ([`super::choose`]) up to the order of its f64 sums and SLEEF's
//! 1-ulp exp: a token can differ only when a uniform falls within ~1e-15 of a boundary of the
//! cumulative distribution.

use tch::{Kind, Tensor};

use super::device_sampling::BatchChoice;
use super::sampling::SamplingConfig;
use crate::model::cpu_kernels::{KernelIsa, kernel_isa};

unsafe extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn tt_choose_rows(
        logits: *const f32,
        rows: i64,
        vocab: i64,
        seen: *const bool,
        sample: std::ffi::c_int,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        min_p: f64,
        penalty: f64,
        allowed: i64,
        uniforms: *const f64,
        tokens: *mut i64,
        logprob: *mut f64,
        untruncated: *mut f64,
    );
}

/// Every row's choice from `logits` `[rows, vocab]` (f32 on the CPU), or `None` when this
/// sampler does not apply (another device or dtype, no AVX2 + FMA): the caller then uses the
/// tensor ops. Shapes as [`super::choose_rows`].
pub fn choose_rows(
    logits: &Tensor,
    seen: Option<&Tensor>,
    cfg: &SamplingConfig,
    uniforms: &[f64],
) -> Option<BatchChoice> {
    let [rows, vocab] = logits.size()[..] else { return None };
    let on_cpu = |t: &Tensor| t.device() == tch::Device::Cpu;
    let seen = seen.filter(|_| cfg.repetition_penalty != 1.0);
    let fits = on_cpu(logits)
        && logits.kind() == Kind::Float
        && vocab > 0
        && seen.is_none_or(|s| on_cpu(s) && s.kind() == Kind::Bool && s.size() == [rows, vocab])
        && kernel_isa() != KernelIsa::Unsupported;
    if !fits {
        return None;
    }
    let logits = logits.contiguous();
    let seen = seen.map(Tensor::contiguous);
    let n = rows as usize;
    let mut u = uniforms.to_vec();
    u.resize(n, 0.0);
    let (mut tokens, mut logprob, mut untruncated) = (vec![0i64; n], vec![0f64; n], vec![0f64; n]);
    // SAFETY: logits is contiguous f32 [rows, vocab] and seen (when given) contiguous bool of the
    // same shape, both on the CPU (checked); u and the three outputs hold `rows` values each; the
    // kernel reads the inputs and writes one value per row into each output.
    unsafe {
        tt_choose_rows(
            logits.data_ptr() as *const f32,
            rows,
            vocab,
            seen.as_ref().map_or(std::ptr::null(), |s| s.data_ptr() as *const bool),
            i32::from(cfg.do_sample),
            cfg.temperature,
            cfg.top_k.map_or(0, |k| k as i64),
            cfg.top_p.unwrap_or(1.0),
            cfg.min_p.unwrap_or(0.0),
            cfg.repetition_penalty,
            cfg.token_limit.map_or(vocab, |l| (l as i64).min(vocab)),
            u.as_ptr(),
            tokens.as_mut_ptr(),
            logprob.as_mut_ptr(),
            untruncated.as_mut_ptr(),
        )
    };
    Some(BatchChoice {
        tokens,
        logprobs: logprob.into_iter().map(|l| l as f32).collect(),
        untruncated_logprobs: untruncated.into_iter().map(|l| l as f32).collect(),
    })
}
