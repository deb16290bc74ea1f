//! A parameter's storage, reached below tch: the bytes `full_shard` frees between a unit's uses
//! and refills when it is gathered, without touching the tensors, their views or autograd's
//! version counters.

use tch::Tensor;

use crate::model::ModelError;
use crate::util::ErrBuf;

unsafe extern "C" {
    /// c10d_shim.cpp: the bytes of the tensor's storage.
    fn tt_storage_nbytes(t: *mut std::ffi::c_void) -> i64;
    /// c10d_shim.cpp: the identity of the tensor's storage.
    fn tt_storage_id(t: *mut std::ffi::c_void) -> i64;
    /// c10d_shim.cpp: gives the storage `nbytes` bytes (0 frees them).
    fn tt_storage_resize(t: *mut std::ffi::c_void, nbytes: i64, err: *mut std::ffi::c_char, len: usize) -> i32;
    /// c10d_shim.cpp: `dst.data.copy_(src)`, the version counter untouched.
    fn tt_copy_unversioned(
        dst: *mut std::ffi::c_void,
        src: *mut std::ffi::c_void,
        err: *mut std::ffi::c_char,
        len: usize,
    ) -> i32;
}

/// Runs a shim call with an error buffer; its message as a [`ModelError`].
fn shim(call: impl FnOnce(*mut std::ffi::c_char, usize) -> i32) -> Result<(), ModelError> {
    let mut err = ErrBuf::new();
    match call(err.ptr(), ErrBuf::LEN) {
        0 => Ok(()),
        _ => Err(ModelError::Torch(tch::TchError::Torch(format!(
            "full_shard: {}",
            err.message()
        )))),
    }
}

/// The bytes `p`'s storage holds.
pub(crate) fn storage_nbytes(p: &Tensor) -> i64 {
    // SAFETY: a live tensor; reading its storage's size.
    unsafe { tt_storage_nbytes(p.as_ptr() as *mut _) }
}

/// The identity of `p`'s storage.
fn storage_id(p: &Tensor) -> i64 {
    // SAFETY: a live tensor; reading its storage's address.
    unsafe { tt_storage_id(p.as_ptr() as *mut _) }
}

/// Gives every unit storages of its own: a unit's parameters whose storage holds bytes of
/// anything else (the CPU loader puts all unfused weights of a dtype in one buffer, frozen ones
/// included) get fresh storage, uninitialised (the master shards hold the values), so freeing
/// a unit frees nothing another tensor reads; the shared buffer goes once nothing trained
/// points into it. A layer's fused q/k/v and gate/up buffers hold that layer's weights alone
/// and stay.
pub(crate) fn own_storages(units: &[&[Tensor]]) -> Result<(), ModelError> {
    for params in units {
        let mut covered: std::collections::HashMap<i64, i64> = Default::default();
        for p in params.iter() {
            *covered.entry(storage_id(p)).or_default() += (p.numel() * p.kind().elt_size_in_bytes()) as i64;
        }
        for p in params.iter().filter(|p| covered[&storage_id(p)] < storage_nbytes(p)) {
            let fresh = Tensor::f_empty(p.size(), (p.kind(), p.device()))?;
            p.shallow_clone().f_set_data(&fresh)?;
        }
    }
    Ok(())
}

/// Gives `p`'s storage `nbytes` bytes (0 frees them; shared storages once).
pub(crate) fn resize_storage(p: &Tensor, nbytes: i64) -> Result<(), ModelError> {
    // SAFETY: a live tensor; no kernel reads a unit's parameters while it is released (the
    // model gathers a unit before each use, and the optimizer reads its shards).
    shim(|err, len| unsafe { tt_storage_resize(p.as_ptr() as *mut _, nbytes, err, len) })
}

/// Copies `src` into `dst` as `dst.data` would.
pub(crate) fn copy_unversioned(dst: &Tensor, src: &Tensor) -> Result<(), ModelError> {
    // SAFETY: two live tensors of the same shape; `dst`'s storage holds its bytes (refilled).
    shim(|err, len| unsafe { tt_copy_unversioned(dst.as_ptr() as *mut _, src.as_ptr() as *mut _, err, len) })
}
