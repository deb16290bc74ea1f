//! The CUDA caching allocator's statistics (`torch.cuda.memory_stats`' allocated and reserved
//! bytes): peaks comparable with TRL's `max_memory_allocated`, which device-wide
//! `cudaMemGetInfo` differences are not (they count the CUDA context, cuDNN's workspaces and the
//! allocator's cache).
//!
//! Read through `cuda_memory.cpp`, a shared library of its own (`libtreetrain_cuda_memory.so`)
//! loaded only into a process that already runs CUDA libtorch, as the CUDA-graph library is.
//! It is found through `TREETRAIN_CUDA_MEMORY_LIB`, beside the running executable (or its
//! parent folder), or where the build put it.

use std::ffi::{c_char, c_int, c_void};

use super::error::DeviceError;
use crate::util::ErrBuf;
use crate::util::runtime_library::LibrarySpec;

/// The environment variable naming the library explicitly.
pub(crate) const MEMORY_LIBRARY_ENV: &str = "TREETRAIN_CUDA_MEMORY_LIB";
/// The library's file name.
pub(crate) const MEMORY_LIBRARY_NAME: &str = "libtreetrain_cuda_memory.so";

const SPEC: LibrarySpec = LibrarySpec {
    env: MEMORY_LIBRARY_ENV,
    name: MEMORY_LIBRARY_NAME,
    built: env!("TREETRAIN_CUDA_MEMORY_LIB_BUILT"),
    needs: "the allocator's statistics need a CUDA libtorch in the process",
};

type StatsFn = unsafe extern "C" fn(c_int, *mut i64, *mut c_char, usize) -> c_int;
type ResetFn = unsafe extern "C" fn(c_int, *mut c_char, usize) -> c_int;

/// Bytes the caching allocator holds on one CUDA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaMemoryStats {
    /// Held by live tensors now (weights included).
    pub allocated: i64,
    /// The most held by live tensors since the last [`reset_cuda_peak`].
    pub peak_allocated: i64,
    /// Reserved from the driver now (live tensors and the allocator's cache).
    pub reserved: i64,
    /// The most reserved since the last reset.
    pub peak_reserved: i64,
}

/// Calls `f` with the library's `name` entry point and an error buffer; its nonzero status
/// becomes an error naming the device.
fn call<F: Copy>(
    device: usize,
    name: &std::ffi::CStr,
    f: impl FnOnce(F, &mut ErrBuf) -> c_int,
) -> Result<(), DeviceError> {
    let fail = |reason: String| DeviceError::UnknownDevice {
        name: format!("cuda:{device}"),
        reason,
    };
    let lib = SPEC.open().map_err(fail)?;
    let symbol = lib.symbol(name).map_err(fail)?;
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: `F` is the extern "C" function pointer type of that entry point of
    // cuda_memory.cpp (a pointer-sized type, checked above).
    let f_ptr: F = unsafe { std::mem::transmute_copy(&symbol) };
    let mut err = ErrBuf::new();
    match f(f_ptr, &mut err) {
        0 => Ok(()),
        _ => Err(fail(err.message())),
    }
}

/// The allocator's statistics for CUDA device `device`.
pub fn cuda_memory_stats(device: usize) -> Result<CudaMemoryStats, DeviceError> {
    let mut out = [0i64; 4];
    call(device, c"tt_cuda_memory_stats", |f: StatsFn, err| {
        // SAFETY: writes four int64 into `out`, or a message into `err`.
        unsafe { f(device as c_int, out.as_mut_ptr(), err.ptr(), ErrBuf::LEN) }
    })?;
    Ok(CudaMemoryStats {
        allocated: out[0],
        peak_allocated: out[1],
        reserved: out[2],
        peak_reserved: out[3],
    })
}

/// Starts the peaks of CUDA device `device` again from what is held now.
pub fn reset_cuda_peak(device: usize) -> Result<(), DeviceError> {
    call(device, c"tt_cuda_memory_reset_peak", |f: ResetFn, err| {
        // SAFETY: resets the allocator's peaks, or writes a message into `err`.
        unsafe { f(device as c_int, err.ptr(), ErrBuf::LEN) }
    })
}
