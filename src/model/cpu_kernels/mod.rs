//! CPU kernels for the decode step, where libtorch's ops cost more than their arithmetic.
//!
//! - [`product`]: `y = x W^T (+ b)` for a few rows of `x` (one per sequence) and a large
//!   weight `W` `[out, in]` (`product.cpp`).
//! - [`rms_norm`], [`qk_norm_rope`], [`decode_attention`], [`swiglu`]: the small ops of a
//!   layer, one pass each (`decode_ops.cpp`).
//!
//! They run in generation's cached forwards only ([`CpuOps::Kernels`], chosen by
//! [`super::KeyValues::Cache`]); every other forward uses libtorch's ops, so a forward without
//! autograd (activation checkpointing's first pass, old and reference log-probs) computes
//! exactly what the same forward with autograd does. Each answers `None` (or `false`) where it
//! does not apply, and the caller runs libtorch's ops: off the CPU, other dtypes than f32,
//! where autograd records a graph, on CPUs without AVX2 + FMA. They are tested against those
//! libtorch ops (values to f32 rounding).
//!
//! A weight product at these shapes should be bound by reading `W` once from memory. MKL's
//! sgemm copies (packs) `W` on every call; the kernel instead streams each thread's block of
//! weight rows once, in tiles of a few rows against the input rows held in registers,
//! prefetching the next tile. At a batch of 8 in f32 the multiply-adds can take as long as the
//! read (where loads and multiply-adds share a core's issue slots), so the kernel keeps the
//! arithmetic dense too. The generation bench
//! (`--split`, `--product-sweep`) sets both against their bounds; `benches/README.md` has the
//! current numbers. It runs where no autograd graph is recorded, on contiguous f32 CPU
//! tensors, on CPUs with AVX-512 or AVX2 + FMA. Sums are taken in another order than MKL's, so
//! values agree to f32 rounding (~1e-6 relative), not bit for bit.

use tch::{Kind, Tensor};

/// Inputs of at most this many rows go through the kernel: above it the product is
/// compute-bound and MKL's packing pays for itself. Placed where libtorch's `linear` overtakes
/// the kernel in the generation bench's `--product-sweep`.
pub const KERNEL_ROWS: i64 = 128;

mod ops;

pub use ops::decode_attention;
pub(crate) use ops::{QkvShape, qk_norm_rope, rms_norm, swiglu};

unsafe extern "C" {
    fn tt_grad_enabled() -> std::ffi::c_int;
    fn tt_skinny_isa() -> std::ffi::c_int;
    fn tt_skinny_linear(
        x: *const f32,
        m: i64,
        k: i64,
        w: *const f32,
        n: i64,
        bias: *const f32,
        y: *mut f32,
    ) -> std::ffi::c_int;
}

/// Which implementation a forward's CPU ops use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuOps {
    /// libtorch's ops: the same arithmetic with and without autograd.
    #[default]
    Libtorch,
    /// This module's kernels where they apply (generation's cached forwards), else libtorch's.
    Kernels,
}

impl CpuOps {
    /// What `kernel` answers under [`CpuOps::Kernels`] (`None`: it does not apply), `None`
    /// under [`CpuOps::Libtorch`] without running it.
    pub fn kernel<T>(self, kernel: impl FnOnce() -> Option<T>) -> Option<T> {
        match self {
            CpuOps::Libtorch => None,
            CpuOps::Kernels => kernel(),
        }
    }
}

/// The instruction set the kernel uses on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelIsa {
    /// 16-float vectors.
    Avx512,
    /// 8-float vectors with fused multiply-add.
    Avx2Fma,
    /// None: libtorch's product is used.
    Unsupported,
}

/// Whether autograd records operations on this thread now (`c10::GradMode`): false inside
/// [`tch::no_grad`].
pub(crate) fn grad_enabled() -> bool {
    // SAFETY: reads libtorch's thread-local grad mode flag.
    unsafe { tt_grad_enabled() != 0 }
}

/// Whether an op on `inputs` would be recorded for backward: one of them requires grad and
/// grad mode is on.
pub(crate) fn records_graph(inputs: &[&Tensor]) -> bool {
    inputs.iter().any(|t| t.requires_grad()) && grad_enabled()
}

/// Whether the kernels can run on `tensors`: all f32 on the CPU, no graph recorded, a CPU
/// with a kernel.
pub(crate) fn applies(tensors: &[&Tensor]) -> bool {
    tensors
        .iter()
        .all(|t| t.device() == tch::Device::Cpu && t.kind() == Kind::Float)
        && !records_graph(tensors)
        && kernel_isa() != KernelIsa::Unsupported
}

/// What this CPU runs.
pub fn kernel_isa() -> KernelIsa {
    // SAFETY: reads the CPU's feature bits, nothing else.
    match unsafe { tt_skinny_isa() } {
        2 => KernelIsa::Avx512,
        1 => KernelIsa::Avx2Fma,
        _ => KernelIsa::Unsupported,
    }
}

/// `x W^T + bias` through the kernel, for `x` `[rows, in]`, `weight` `[out, in]`, `bias`
/// `[out]`; `None` when the kernel does not apply (see the module doc), the caller then uses
/// libtorch. `x` is made contiguous here; the weight must already be (a row block of a fused
/// buffer is).
pub(crate) fn product(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Option<Tensor> {
    product_up_to(x, weight, bias, KERNEL_ROWS)
}

/// The decode product (`cpu_kernels::product`) for inputs of up to `max_rows` rows instead of [`KERNEL_ROWS`]: what the
/// generation bench's `--product-sweep` times against libtorch to place that limit.
pub fn product_up_to(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>, max_rows: i64) -> Option<Tensor> {
    let [rows, input] = x.size()[..] else { return None };
    let [out, w_input] = weight.size()[..] else { return None };
    let mut inputs = vec![x, weight];
    inputs.extend(bias);
    let fits = (1..=max_rows).contains(&rows)
        && input == w_input
        && input > 0
        && weight.is_contiguous()
        && bias.is_none_or(|b| b.is_contiguous() && b.size() == [out])
        && applies(&inputs);
    if !fits {
        return None;
    }
    let x = x.contiguous();
    let y = Tensor::empty([rows, out], (Kind::Float, tch::Device::Cpu));
    let bias_ptr = bias.map_or(std::ptr::null(), |b| b.data_ptr() as *const f32);
    // SAFETY: every pointer is the start of a contiguous f32 CPU buffer of the size passed (x
    // [rows, input], weight [out, input], bias [out], y [rows, out]), checked above; the kernel
    // reads x, weight and bias and writes y only, and the tensors outlive the call.
    let status = unsafe {
        tt_skinny_linear(
            x.data_ptr() as *const f32,
            rows,
            input,
            weight.data_ptr() as *const f32,
            out,
            bias_ptr,
            y.data_ptr() as *mut f32,
        )
    };
    (status == 0).then_some(y)
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;

    #[test]
    fn the_kernel_equals_libtorch_at_every_tile_remainder() {
        if kernel_isa() == KernelIsa::Unsupported {
            eprintln!("no AVX2/AVX-512 here: the kernel is not used");
            return;
        }
        tch::manual_seed(11);
        // Rows: every tile split (8, 4, 2, 1 and their sums); outputs and inputs off the tile
        // and vector widths.
        for (rows, out, input) in [
            (1, 7, 5),
            (3, 9, 33),
            (8, 64, 576),
            (11, 101, 250),
            (16, 4099, 1040),
            (13, 3, 17),
            (100, 37, 64),
        ] {
            let x = Tensor::randn([rows, input], (Kind::Float, Device::Cpu));
            let w = Tensor::randn([out, input], (Kind::Float, Device::Cpu));
            let b = Tensor::randn([out], (Kind::Float, Device::Cpu));
            let want = x.linear(&w, Some(&b));
            let got = product(&x, &w, Some(&b)).expect("the kernel applies");
            let scale = (input as f64).sqrt();
            assert!(
                got.allclose(&want, 1e-5, 1e-5 * scale, false),
                "{rows}x{input} by {out}: max diff {}",
                (&got - &want).abs().max().double_value(&[])
            );
            let unbiased = product(&x, &w, None).unwrap();
            assert!(unbiased.allclose(&x.linear(&w, None::<&Tensor>), 1e-5, 1e-5 * scale, false));
        }
    }

    #[test]
    fn the_kernel_leaves_what_it_cannot_do_to_libtorch() {
        let w = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
        let too_many = Tensor::randn([KERNEL_ROWS + 1, 4], (Kind::Float, Device::Cpu));
        assert!(product(&too_many, &w, None).is_none());
        assert!(product(&x.to_kind(Kind::Double), &w.to_kind(Kind::Double), None).is_none());
        assert!(product(&x, &w.tr(), None).is_none(), "a non-contiguous weight");
        let trained = w.copy().set_requires_grad(true);
        assert!(product(&x, &trained, None).is_none(), "a weight that records a graph");
        if kernel_isa() != KernelIsa::Unsupported {
            assert!(
                tch::no_grad(|| product(&x, &trained, None)).is_some(),
                "a trainable weight outside grad mode"
            );
        }
        // A non-contiguous input is copied, not refused.
        if kernel_isa() != KernelIsa::Unsupported {
            let xt = Tensor::randn([4, 2], (Kind::Float, Device::Cpu)).tr();
            let got = product(&xt, &w, None).unwrap();
            assert!(got.allclose(&xt.linear(&w, None::<&Tensor>), 1e-5, 1e-5, false));
        }
    }
}
