//! Grouped-query attention in one SDPA call: how the query heads that share a key head meet
//! their keys without copying the keys and values once per query head.
//!
//! An unmasked call (a causal row) and the CPU's flash kernel take grouped heads themselves
//! (`enable_gqa`). On CUDA, `enable_gqa` with a mask falls back to the math kernel, which is
//! why transformers repeats K/V whenever there is a mask; repeated K/V are `heads / kv_heads`
//! copies of every key a query block reads, and SDPA keeps them for backward. A tree's branch
//! attends in blocks of [`QUERY_BLOCK`](super::layout::QUERY_BLOCK) queries over its whole
//! root-to-branch path, so those copies would cost a path's K/V per block per head. Instead
//! the `rep` query heads of each key head are folded into the query length
//! (`[b, kv_heads, rep * q_len, d]`) and the mask repeated `rep` times along the queries: the
//! keys and values stay at `kv_heads`, once per segment, and the kernel is a masked one
//! without grouping (memory-efficient attention on CUDA).

use tch::Tensor;

/// How a masked call groups the query heads of a key head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MaskedGrouping {
    /// `enable_gqa` inside the kernel (the CPU's flash kernel takes it under a mask).
    Kernel,
    /// Query heads folded into the query length, the mask repeated along it.
    FoldedQueries,
}

impl MaskedGrouping {
    /// The grouping for a masked call on `device`.
    pub(crate) fn on(device: tch::Device) -> Self {
        match device {
            tch::Device::Cpu => MaskedGrouping::Kernel,
            _ => MaskedGrouping::FoldedQueries,
        }
    }
}

/// Masked attention of `q` `[b, heads, q_len, d]` over `k`, `v` `[b, kv_heads, k_len, d]`
/// under `mask` `[b or 1, 1, q_len, k_len]` (true = attend): `[b, heads, q_len, d]`, keys
/// and values never repeated per head.
pub(crate) fn attend_masked(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, scale: f64) -> Tensor {
    attend_masked_with(q, k, v, mask, scale, MaskedGrouping::on(q.device()))
}

/// [`attend_masked`] with the grouping chosen by the caller (tests set one against the other).
pub(crate) fn attend_masked_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    grouping: MaskedGrouping,
) -> Tensor {
    let (heads, kv_heads) = (q.size()[1], k.size()[1]);
    let rep = heads / kv_heads;
    if rep == 1 || grouping == MaskedGrouping::Kernel {
        return Tensor::scaled_dot_product_attention(q, k, v, Some(mask), 0.0, false, scale, rep != 1);
    }
    let [b, _, q_len, d] = q.size()[..] else {
        unreachable!("q is [b, heads, q_len, d]")
    };
    // Query head `g * rep + j` reads key head `g`: `[b, kv, rep, q_len, d]` -> `[b, kv, rep * q_len, d]`.
    let folded = q.reshape([b, kv_heads, rep * q_len, d]);
    let mask = mask.repeat([1, 1, rep, 1]);
    let out = Tensor::scaled_dot_product_attention(&folded, k, v, Some(&mask), 0.0, false, scale, false);
    out.reshape([b, heads, q_len, d])
}

/// Keys or values `t` `[.., kv_heads, len, d]` as one SDPA call over the whole sequence takes
/// them (`rep` query heads per key head), and whether that call groups the query heads itself
/// (`enable_gqa`). For the layouts that pass a `[seq, seq]` mask (padded, packed, dense), where
/// folding the queries would repeat a mask as large as the scores: unmasked calls and every
/// call on the CPU keep `kv_heads`; a masked call elsewhere gets them repeated to `heads`.
pub(super) fn grouped_keys(t: &Tensor, rep: i64, masked: bool) -> (Tensor, bool) {
    if rep == 1 || !masked || t.device() == tch::Device::Cpu {
        return (t.shallow_clone(), rep != 1);
    }
    (t.repeat_interleave_self_int(rep, 1, None), false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Folding the query heads into the query length gives what the kernel's own grouping and
    /// explicitly repeated K/V give, forward and backward, with a bottom-right mask over a path
    /// longer than the block (2-D, as a path block passes it) and a batch's mask with padding
    /// rows.
    #[test]
    fn folded_queries_equal_the_kernels_grouping_and_repeated_keys() {
        tch::manual_seed(7);
        let (b, heads, kv, q_len, k_len, d) = (2, 6, 2, 5, 9, 4);
        let leaf = |shape: &[i64]| Tensor::randn(shape, (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let (q, k, v) = (
            leaf(&[b, heads, q_len, d]),
            leaf(&[b, kv, k_len, d]),
            leaf(&[b, kv, k_len, d]),
        );
        let mask = Tensor::ones([b, 1, q_len, k_len], (Kind::Bool, Device::Cpu)).tril(k_len - q_len);
        // The second row's last query sees only its first key (a padding slot).
        let _ = mask.get(1).get(0).get(q_len - 1).narrow(0, 1, k_len - 1).fill_(0);
        let upstream = Tensor::randn([b, heads, q_len, d], (Kind::Double, Device::Cpu));
        let run = |f: &dyn Fn() -> Tensor| {
            for t in [&q, &k, &v] {
                let mut g = t.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            let out = f();
            (out * &upstream).sum(Kind::Double).backward();
            (f().detach(), q.grad().copy(), k.grad().copy(), v.grad().copy())
        };
        let scale = 0.5;
        // A batch's mask `[b, 1, q, k]`, and a path block's `[q, k]` (broadcast over the batch).
        let block = Tensor::ones([q_len, k_len], (Kind::Bool, Device::Cpu)).tril(k_len - q_len);
        for mask in [&mask, &block] {
            let folded = run(&|| attend_masked_with(&q, &k, &v, mask, scale, MaskedGrouping::FoldedQueries));
            let kernel = run(&|| attend_masked_with(&q, &k, &v, mask, scale, MaskedGrouping::Kernel));
            let repeated = run(&|| {
                let (kr, vr) = (
                    k.repeat_interleave_self_int(3, 1, None),
                    v.repeat_interleave_self_int(3, 1, None),
                );
                Tensor::scaled_dot_product_attention(&q, &kr, &vr, Some(mask), 0.0, false, scale, false)
            });
            for reference in [&kernel, &repeated] {
                for (a, r) in [
                    (&folded.0, &reference.0),
                    (&folded.1, &reference.1),
                    (&folded.2, &reference.2),
                    (&folded.3, &reference.3),
                ] {
                    let diff = (a - r).abs().max().double_value(&[]);
                    assert!(diff < 1e-12, "{diff}");
                }
            }
        }
    }

    #[test]
    fn the_cpu_groups_inside_the_kernel_and_other_devices_fold() {
        assert_eq!(MaskedGrouping::on(Device::Cpu), MaskedGrouping::Kernel);
        assert_eq!(MaskedGrouping::on(Device::Cuda(0)), MaskedGrouping::FoldedQueries);
    }
}
