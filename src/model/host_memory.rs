//! Parameters in huge pages: where a model's CPU parameters live so a decode step, which
//! streams every weight from memory once, reads them at the machine's full rate.
//!
//! Linux backs anonymous memory with 4 KiB pages unless the memory is advised otherwise (THP
//! mode `madvise`, the Debian and Ubuntu default), and libtorch advises only under an
//! environment variable a library should not set for its process. Streaming 4 KiB pages costs
//! a TLB miss every 4 KiB (two page walks under a hypervisor). The generation bench's
//! `--pages` times a decode step's weight products over huge pages against the same weights
//! in libtorch's allocation.
//!
//! Every whole 2 MiB of a buffer can be a huge page; a tail under 2 MiB stays in small pages
//! rather than rounding the buffer up, so a small model costs no extra memory.
//!
//! [`gather`] moves tensors into one new buffer, end to end, and re-points each (`set_data`)
//! at its part (the fused q/k/v and gate/up buffers of `model::fused` are made this way):
//! every handle (the var store's, the layers') sees the moved data, and in-place writes
//! (loads, optimizer steps, broadcasts, adapter merges) land in the buffer. On the CPU the
//! buffer is in huge pages ([`huge_page_empty`]); elsewhere it is libtorch's own.

use tch::{Device, Kind, Tensor};

use crate::util::ErrBuf;

type AtTensor = *mut std::ffi::c_void;

unsafe extern "C" {
    fn tt_huge_page_empty(
        numel: i64,
        like: AtTensor,
        out: *mut AtTensor,
        advised: *mut std::ffi::c_int,
        err: *mut std::ffi::c_char,
        len: usize,
    ) -> std::ffi::c_int;
}

/// Where a [`huge_page_empty`] buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// CPU memory advised for transparent huge pages, which the kernel accepted.
    HugePages,
    /// libtorch's allocation: another device, or a system without transparent huge pages.
    Allocator,
}

/// An uninitialised 1-D CPU tensor of `numel` elements of `like`'s dtype, in huge pages where
/// the system has them.
pub fn huge_page_empty(numel: i64, like: &Tensor) -> Result<(Tensor, Placement), tch::TchError> {
    let mut out: AtTensor = std::ptr::null_mut();
    let mut advised: std::ffi::c_int = 0;
    let mut err = ErrBuf::new();
    // SAFETY: `like` is a live tensor; on success the shim hands over a new `at::Tensor*`, which
    // `from_ptr` owns from then on (tch deletes it on drop).
    let rc = unsafe {
        tt_huge_page_empty(
            numel,
            like.as_ptr() as AtTensor,
            &mut out,
            &mut advised,
            err.ptr(),
            ErrBuf::LEN,
        )
    };
    match rc {
        0 => {
            let placement = if advised != 0 {
                Placement::HugePages
            } else {
                Placement::Allocator
            };
            Ok((unsafe { Tensor::from_ptr(out.cast()) }, placement))
        }
        _ => Err(tch::TchError::Torch(err.message())),
    }
}

/// Moves `tensors` (one dtype, one device, each contiguous) into one new 1-D buffer, end to
/// end in order, and points each at its part of it (same shape, same values). Returns the
/// buffer; `None` for no tensors.
pub(crate) fn gather(tensors: &mut [&mut Tensor]) -> Result<Option<Tensor>, tch::TchError> {
    let Some(first) = tensors.first() else {
        return Ok(None);
    };
    let _guard = tch::no_grad_guard();
    let on_cpu = first.device() == Device::Cpu;
    let buffer = if on_cpu {
        let total = tensors.iter().map(|t| t.numel()).sum::<usize>() as i64;
        huge_page_empty(total, first)?.0
    } else {
        // Off the CPU: one concatenation, the op the device backends already run for this.
        let flat: Vec<Tensor> = tensors.iter().map(|t| t.f_reshape([-1])).collect::<Result<_, _>>()?;
        Tensor::f_cat(&flat, 0)?
    };
    let mut offset = 0;
    for t in tensors.iter_mut() {
        let n = t.numel() as i64;
        let mut part = buffer.f_narrow(0, offset, n)?.f_view(t.size().as_slice())?;
        if on_cpu {
            // Copied and re-pointed one at a time: the buffer's pages are committed as they are
            // written and each old storage is freed right after, so the peak is one tensor over.
            part.f_copy_(t)?;
        }
        // set_data keeps the variable (its autograd identity, the var store's handle) and
        // swaps its storage for this part of the buffer: contiguous, as a slice of a 1-D one.
        t.f_set_data(&part)?;
        offset += n;
    }
    Ok(Some(buffer))
}

/// `count` zeroed CPU tensors of `shape` and `kind`, end to end in one buffer in huge pages
/// (a static KV cache's per-layer keys or values, which every decode step reads).
pub(crate) fn zeros_in_one_buffer(count: i64, shape: &[i64], kind: Kind) -> Result<Vec<Tensor>, tch::TchError> {
    let each: i64 = shape.iter().product();
    let like = Tensor::f_empty([0], (kind, Device::Cpu))?;
    let (mut buffer, _) = huge_page_empty(each * count, &like)?;
    let _ = buffer.f_zero_()?;
    (0..count)
        .map(|i| buffer.f_narrow(0, i * each, each)?.f_view(shape))
        .collect()
}

/// Whether `t`'s data lies inside `buffer`'s.
pub(crate) fn lies_in(t: &Tensor, buffer: &Tensor) -> bool {
    let bytes = |x: &Tensor| x.numel() * x.kind().elt_size_in_bytes();
    let (start, end) = (buffer.data_ptr() as usize, buffer.data_ptr() as usize + bytes(buffer));
    let p = t.data_ptr() as usize;
    t.device() == buffer.device() && start <= p && p < end
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `AnonHugePages` of the mapping holding `t`'s data, from /proc/self/smaps (kB).
    fn anon_huge_kb(t: &Tensor) -> Option<u64> {
        let p = t.data_ptr() as u64;
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
            {
                inside = a <= p && p < b;
            } else if inside && let Some(v) = line.strip_prefix("AnonHugePages:") {
                return v.trim().trim_end_matches(" kB").trim().parse().ok();
            }
        }
        None
    }

    #[test]
    fn gathered_tensors_keep_values_shapes_and_handles() {
        let mut a = Tensor::randn([3, 5], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut b = Tensor::randn([7], (Kind::Float, Device::Cpu));
        let (want_a, want_b) = (a.detach().copy(), b.copy());
        let handle = a.shallow_clone();
        let buffer = gather(&mut [&mut a, &mut b]).unwrap().unwrap();
        assert_eq!(buffer.size(), vec![22]);
        assert!(a.equal(&want_a) && b.equal(&want_b));
        assert_eq!((a.size(), b.size()), (vec![3, 5], vec![7]));
        assert!(a.requires_grad(), "still the same variable");
        assert!(lies_in(&a, &buffer) && lies_in(&b, &buffer));
        // Another handle of the variable sees the move, and in-place writes land in the buffer.
        assert!(lies_in(&handle, &buffer));
        tch::no_grad(|| {
            let _ = b.f_fill_(2.0).unwrap();
        });
        assert_eq!(buffer.double_value(&[21]), 2.0);
        assert!(!lies_in(&want_a, &buffer));
        assert!(gather(&mut []).unwrap().is_none());
    }

    #[test]
    fn tensors_in_one_buffer_are_zeroed_and_disjoint() {
        let mut parts = zeros_in_one_buffer(3, &[2, 4], Kind::Float).unwrap();
        assert!(
            parts
                .iter()
                .all(|p| p.size() == vec![2, 4] && p.abs().max().double_value(&[]) == 0.0)
        );
        let _ = parts[1].f_fill_(5.0).unwrap();
        let sums: Vec<f64> = parts.iter().map(|p| p.sum(Kind::Double).double_value(&[])).collect();
        assert_eq!(sums, vec![0.0, 40.0, 0.0]);
        assert_eq!(parts[1].data_ptr() as usize - parts[0].data_ptr() as usize, 32);
    }

    #[test]
    fn a_large_buffer_is_backed_by_huge_pages_where_the_kernel_offers_them() {
        let like = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        // 8 MiB: four huge pages, touched (written) as a load would.
        let (mut t, placement) = huge_page_empty(2 << 20, &like).unwrap();
        let _ = t.f_fill_(1.0).unwrap();
        assert_eq!(t.sum(Kind::Double).double_value(&[]), (2 << 20) as f64);
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if thp.contains("[never]") || thp.is_empty() {
            return; // nothing to check on a kernel without THP
        }
        assert_eq!(placement, Placement::HugePages);
        let kb = anon_huge_kb(&t).expect("the mapping is listed in /proc/self/smaps");
        assert!(kb >= 2048, "at least one huge page backs the buffer: {kb} kB");
    }
}
