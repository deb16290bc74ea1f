//! The small ops of a decode step as one kernel call each (`decode_ops.cpp`); see the module
//! above for when they apply.

use tch::{Kind, Tensor};

use super::applies;

unsafe extern "C" {
    fn tt_rms_norm(x: *const f32, rows: i64, dim: i64, weight: *const f32, eps: f64, y: *mut f32);
    fn tt_qk_norm_rope(
        qkv: *mut f32,
        rows: i64,
        heads: i64,
        kv_heads: i64,
        d: i64,
        cos: *const f32,
        sin: *const f32,
        q_norm: *const f32,
        k_norm: *const f32,
        eps: f64,
    ) -> std::ffi::c_int;
    #[allow(clippy::too_many_arguments)]
    fn tt_decode_attention(
        q: *const f32,
        q_row: i64,
        k: *const f32,
        v: *const f32,
        valid: *const bool,
        batch: i64,
        heads: i64,
        kv_heads: i64,
        slots: i64,
        d: i64,
        scale: f64,
        out: *mut f32,
    );
    fn tt_swiglu(gate_up: *const f32, rows: i64, inter: i64, y: *mut f32);
}

fn f32_ptr(t: &Tensor) -> *const f32 {
    t.data_ptr() as *const f32
}

/// RMSNorm of `x` `[..., dim]` with `weight` `[dim]`: `weight * (x / sqrt(mean(x^2) + eps))`
/// in f32, as [`crate::model::RmsNorm`] computes it.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Option<Tensor> {
    let dim = *x.size().last()?;
    if dim == 0 || weight.size() != [dim] || !weight.is_contiguous() || !applies(&[x, weight]) {
        return None;
    }
    let x = x.contiguous();
    let rows = x.numel() as i64 / dim;
    let y = x.empty_like();
    // SAFETY: x and y are contiguous f32 [rows, dim], weight contiguous f32 [dim] (checked);
    // the kernel reads x and weight and writes y.
    unsafe { tt_rms_norm(f32_ptr(&x), rows, dim, f32_ptr(weight), eps, y.data_ptr() as *mut f32) };
    Some(y)
}

/// The per-head norms and shapes of [`qk_norm_rope`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct QkvShape {
    /// Query heads.
    pub heads: i64,
    /// Key/value heads.
    pub kv_heads: i64,
    /// Head dimension.
    pub head_dim: i64,
}

/// In place on the fused q/k/v product `qkv` `[batch, t, (heads + 2 kv_heads) * d]`: every q
/// and k head normed by `norms` (Qwen3's `q_norm`, `k_norm` weights `[d]`, with `eps`) when
/// given, then rotated by RoPE's `cos`, `sin` `[batch, t, d]`; v is left alone. False (nothing
/// written) where the kernel does not apply.
pub(crate) fn qk_norm_rope(
    qkv: &Tensor,
    shape: QkvShape,
    cos: &Tensor,
    sin: &Tensor,
    norms: Option<(&Tensor, &Tensor, f64)>,
) -> bool {
    let QkvShape {
        heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let size = qkv.size();
    let width = (heads + 2 * kv_heads) * d;
    let [b, t, w] = size[..] else { return false };
    let rows_of = |x: &Tensor| x.size() == [b, t, d] && x.is_contiguous();
    let mut tensors = vec![qkv, cos, sin];
    if let Some((q, k, _)) = norms {
        if q.size() != [d] || k.size() != [d] || !q.is_contiguous() || !k.is_contiguous() {
            return false;
        }
        tensors.extend([q, k]);
    }
    if w != width || !qkv.is_contiguous() || !rows_of(cos) || !rows_of(sin) || !applies(&tensors) {
        return false;
    }
    let (q_norm, k_norm, eps) = norms.map_or((std::ptr::null(), std::ptr::null(), 0.0), |(q, k, eps)| {
        (f32_ptr(q), f32_ptr(k), eps)
    });
    // SAFETY: qkv is contiguous f32 [b * t, width], cos and sin [b * t, d], the norms [d] or
    // null (checked above); the kernel writes the q and k columns of qkv only.
    let status = unsafe {
        tt_qk_norm_rope(
            qkv.data_ptr() as *mut f32,
            b * t,
            heads,
            kv_heads,
            d,
            f32_ptr(cos),
            f32_ptr(sin),
            q_norm,
            k_norm,
            eps,
        )
    };
    status == 0
}

/// Attention of one new token per row over a KV cache, grouped-query, merged to the layout
/// `o_proj` reads.
///
/// # Shapes
/// - `q`: `[batch, heads, 1, d]` whose rows and heads sit at strides `(q_row, d, _, 1)` (a
///   contiguous tensor, or the head view of a fused q/k/v product).
/// - `k`, `v`: `[batch, kv_heads, slots, d]` contiguous (a static cache's buffers).
/// - `valid`: `[batch, 1, 1, slots]` bool, contiguous (true = attend).
/// - returns `[batch, 1, heads * d]`: `softmax(q k^T * scale) v` over the valid slots (zeros
///   for a row with none).
pub fn decode_attention(q: &Tensor, k: &Tensor, v: &Tensor, valid: &Tensor, scale: f64) -> Option<Tensor> {
    let [b, heads, one, d] = q.size()[..] else { return None };
    let [kb, kv_heads, slots, kd] = k.size()[..] else {
        return None;
    };
    let stride = q.stride();
    let fits = one == 1
        && kb == b
        && kd == d
        && kv_heads > 0
        && heads % kv_heads == 0
        && stride[1] == d
        && stride[3] == 1
        && v.size() == k.size()
        && k.is_contiguous()
        && v.is_contiguous()
        && valid.size() == [b, 1, 1, slots]
        && valid.kind() == Kind::Bool
        && valid.is_contiguous()
        && valid.device() == tch::Device::Cpu
        && applies(&[q, k, v]);
    if !fits {
        return None;
    }
    let out = Tensor::empty([b, 1, heads * d], (Kind::Float, tch::Device::Cpu));
    // SAFETY: q is read at q + row * stride[0] + head * d + i for row < b, head < heads, i < d,
    // inside its storage (its strides and sizes, checked); k, v are contiguous f32 [b, kv_heads,
    // slots, d], valid contiguous bool [b, slots], out contiguous f32 [b, heads * d].
    unsafe {
        tt_decode_attention(
            f32_ptr(q),
            stride[0],
            f32_ptr(k),
            f32_ptr(v),
            valid.data_ptr() as *const bool,
            b,
            heads,
            kv_heads,
            slots,
            d,
            scale,
            out.data_ptr() as *mut f32,
        )
    };
    Some(out)
}

/// `silu(gate) * up` of a fused gate/up product `[..., 2 inter]` (gate first) -> `[..., inter]`.
pub(crate) fn swiglu(gate_up: &Tensor) -> Option<Tensor> {
    let size = gate_up.size();
    let width = *size.last()?;
    if width == 0 || width % 2 != 0 || !gate_up.is_contiguous() || !applies(&[gate_up]) {
        return None;
    }
    let rows = gate_up.numel() as i64 / width;
    let mut out_size = size.clone();
    *out_size.last_mut()? = width / 2;
    let y = Tensor::empty(out_size.as_slice(), (Kind::Float, tch::Device::Cpu));
    // SAFETY: gate_up is contiguous f32 [rows, width], y contiguous f32 [rows, width / 2].
    unsafe { tt_swiglu(f32_ptr(gate_up), rows, width / 2, y.data_ptr() as *mut f32) };
    Some(y)
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::model::cpu_kernels::{KernelIsa, kernel_isa};

    fn close(got: &Tensor, want: &Tensor, what: &str) {
        let diff = (got - want).abs().max().double_value(&[]);
        assert!(got.allclose(want, 1e-5, 1e-5, false), "{what}: max diff {diff}");
    }

    fn randn(shape: &[i64]) -> Tensor {
        Tensor::randn(shape, (Kind::Float, Device::Cpu))
    }

    /// RMSNorm over the last dimension in libtorch ops, eps 1e-6 (the reference).
    fn rms(x: &Tensor, w: &Tensor) -> Tensor {
        w * (x * (x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float) + 1e-6).rsqrt())
    }

    fn skip() -> bool {
        kernel_isa() == KernelIsa::Unsupported
    }

    #[test]
    fn rms_norm_and_swiglu_equal_libtorch() {
        if skip() {
            return;
        }
        tch::manual_seed(1);
        for (rows, dim) in [(1, 5), (8, 576), (3, 1027)] {
            let x = randn(&[rows, 1, dim]);
            let w = randn(&[dim]);
            close(&rms_norm(&x, &w, 1e-6).unwrap(), &rms(&x, &w), "rms_norm");
            let gate_up = randn(&[rows, 1, 2 * dim]);
            let parts = gate_up.split_with_sizes([dim, dim].as_slice(), -1);
            close(&swiglu(&gate_up).unwrap(), &(parts[0].silu() * &parts[1]), "swiglu");
        }
    }

    #[test]
    fn qk_norm_rope_equals_the_model_s_own_ops() {
        if skip() {
            return;
        }
        tch::manual_seed(2);
        let (b, t, heads, kv_heads, d) = (3, 2, 6, 2, 16);
        let shape = QkvShape {
            heads,
            kv_heads,
            head_dim: d,
        };
        let qkv = randn(&[b, t, (heads + 2 * kv_heads) * d]);
        let (cos, sin) = (randn(&[b, t, d]), randn(&[b, t, d]));
        let (qn, kn) = (randn(&[d]), randn(&[d]));
        for norms in [None, Some((&qn, &kn, 1e-6))] {
            let parts = qkv.split_with_sizes([heads * d, kv_heads * d, kv_heads * d].as_slice(), -1);
            let head = |x: &Tensor, h: i64, w: Option<&Tensor>| {
                let x = x.reshape([b, t, h, d]);
                let x = w.map_or(x.shallow_clone(), |w| rms(&x, w));
                crate::model::rope::apply(&x.transpose(1, 2), &cos, &sin)
            };
            let want_q = head(&parts[0], heads, norms.map(|n| n.0));
            let want_k = head(&parts[1], kv_heads, norms.map(|n| n.1));
            let got = qkv.copy();
            assert!(qk_norm_rope(&got, shape, &cos, &sin, norms));
            let got_parts = got.split_with_sizes([heads * d, kv_heads * d, kv_heads * d].as_slice(), -1);
            let as_heads = |x: &Tensor, h: i64| x.reshape([b, t, h, d]).transpose(1, 2);
            if norms.is_none() {
                assert!(as_heads(&got_parts[0], heads).equal(&want_q), "RoPE alone is bit-exact");
            }
            close(&as_heads(&got_parts[0], heads), &want_q, "q");
            close(&as_heads(&got_parts[1], kv_heads), &want_k, "k");
            assert!(got_parts[2].equal(&parts[2]), "v untouched");
        }
    }

    #[test]
    fn decode_attention_equals_sdpa_with_grouped_heads() {
        if skip() {
            return;
        }
        tch::manual_seed(3);
        // Head widths below, at and off the kernel's 64-column blocks (SmolLM2's 64, Qwen3's
        // 128); slot counts off its 8-key blocks and past its prefetch distance.
        for (slots, d) in [(19, 16), (37, 64), (29, 72), (45, 128)] {
            let (b, heads, kv_heads) = (4, 6, 2);
            let k = randn(&[b, kv_heads, slots, d]);
            let v = randn(&[b, kv_heads, slots, d]);
            let valid = Tensor::rand([b, 1, 1, slots], (Kind::Float, Device::Cpu)).gt(0.4);
            let _ = valid.narrow(3, 0, 1).fill_(1); // every row sees at least one slot
            // q as the head view of a wider fused buffer: rows at stride 10 d, heads at d.
            let fused = randn(&[b, 1, 10 * d]);
            let q = fused.narrow(2, 0, heads * d).view([b, 1, heads, d]).transpose(1, 2);
            let scale = (d as f64).powf(-0.5);
            let want = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(&valid), 0.0, false, scale, true)
                .transpose(1, 2)
                .reshape([b, 1, heads * d]);
            let got = decode_attention(&q, &k, &v, &valid, scale).unwrap();
            close(&got, &want, &format!("attention, {slots} slots of {d}"));
        }
        let (b, heads, kv_heads, slots, d) = (4, 6, 2, 19, 16);
        let k = randn(&[b, kv_heads, slots, d]);
        let v = randn(&[b, kv_heads, slots, d]);
        let valid = Tensor::ones([b, 1, 1, slots], (Kind::Bool, Device::Cpu));
        let scale = (d as f64).powf(-0.5);
        // Not one token per row: left to SDPA.
        let q2 = randn(&[b, heads, 2, d]);
        assert!(decode_attention(&q2, &k, &v, &valid, scale).is_none());
    }
}
