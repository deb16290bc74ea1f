//! PyTorch's `PrivateUse1` device slot: where TorchNeuron puts Trainium (as `neuron`) and where
//! any out-of-tree backend registers itself.
//!
//! A backend is a shared library whose static initialisers register it with libtorch when it
//! is loaded (what `import torch_neuronx` does in Python). treetrain loads the libraries named
//! by [`LIBRARY_ENV`] (paths separated by `:`), then asks libtorch what was registered: the
//! backend's name (`c10::get_privateuse1_backend()`) and its device count (the backend's hooks,
//! else its device guard). tch cannot name such a device, so tensors reach it through
//! `privateuse1_shim.cpp`, which takes tch's own tensor pointers.
//!
//! Loading is idempotent (the dynamic loader keeps one copy of a library and its
//! registrations run once), so every entry point may call [`load_from_env`]; nothing is kept
//! in Rust statics.

use std::ffi::{CString, c_char, c_int};
use std::path::{Path, PathBuf};

use tch::Tensor;

use super::error::DeviceError;
use super::place::Device;
use crate::display::{self, Rich};
use crate::util::ErrBuf;

/// The environment variable naming the backend libraries to load (`:`-separated paths).
pub const LIBRARY_ENV: &str = "TREETRAIN_PRIVATEUSE1_LIB";

type AtTensor = *mut std::ffi::c_void;

unsafe extern "C" {
    fn tt_pu1_load(path: *const c_char, err: *mut c_char, len: usize) -> c_int;
    fn tt_pu1_registered() -> c_int;
    fn tt_pu1_name(buf: *mut c_char, len: usize, err: *mut c_char, errlen: usize) -> c_int;
    fn tt_pu1_device_count(out: *mut c_int, err: *mut c_char, len: usize) -> c_int;
    fn tt_pu1_library(buf: *mut c_char, len: usize, err: *mut c_char, errlen: usize) -> c_int;
    fn tt_pu1_to(t: AtTensor, index: c_int, out: *mut AtTensor, err: *mut c_char, len: usize) -> c_int;
    fn tt_pu1_move_into(var: AtTensor, index: c_int, err: *mut c_char, len: usize) -> c_int;
    fn tt_pu1_index_of(t: AtTensor) -> c_int;
}

/// The PrivateUse1 backend registered in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    /// The libraries loaded for it: those treetrain was asked to load, or (when something
    /// else loaded it) the one the dynamic loader says registered its device guard.
    pub libraries: Vec<PathBuf>,
    /// Its registered name, e.g. `neuron`.
    pub name: String,
    /// How many devices it has.
    pub device_count: usize,
}

impl Backend {
    /// The libraries as one line, for messages (`"(loaded by the host program)"` when none).
    pub(crate) fn library_list(&self) -> String {
        match self.libraries.as_slice() {
            [] => "(loaded by the host program)".into(),
            libs => libs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(":"),
        }
    }
}

/// Loads each library in `paths` (in order) and returns the backend they registered. A file
/// that is missing or not a loadable library, or libraries that register no PrivateUse1
/// backend, are errors naming the file.
pub fn load(paths: &[PathBuf]) -> Result<Backend, DeviceError> {
    for path in paths {
        load_one(path)?;
    }
    match registered()? {
        Some(backend) => Ok(Backend {
            libraries: paths.to_vec(),
            ..backend
        }),
        None => Err(DeviceError::Load {
            path: paths.last().cloned().unwrap_or_default(),
            reason: "loaded, but no PrivateUse1 backend is registered (neither c10::register_privateuse1_backend \
                     nor a PrivateUse1 device guard)"
                .into(),
        }),
    }
}

fn load_one(path: &Path) -> Result<(), DeviceError> {
    let load_error = |reason: String| DeviceError::Load {
        path: path.to_path_buf(),
        reason,
    };
    if !path.is_file() {
        return Err(load_error(format!("no such file (named by {LIBRARY_ENV})")));
    }
    let c_path =
        CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| load_error("path holds a NUL byte".into()))?;
    let mut err = ErrBuf::new();
    // SAFETY: a valid C string and error buffer; dlopen runs the library's initialisers.
    match unsafe { tt_pu1_load(c_path.as_ptr(), err.ptr(), ErrBuf::LEN) } {
        0 => Ok(()),
        _ => Err(load_error(err.message())),
    }
}

/// Loads the libraries [`LIBRARY_ENV`] names; `None` when it is unset or empty.
pub fn load_from_env() -> Result<Option<Backend>, DeviceError> {
    match std::env::var_os(LIBRARY_ENV) {
        Some(v) if !v.is_empty() => {
            let paths: Vec<PathBuf> = std::env::split_paths(&v)
                .filter(|p| !p.as_os_str().is_empty())
                .collect();
            load(&paths).map(Some)
        }
        _ => Ok(None),
    }
}

/// The backend libtorch has registered now, whoever loaded it; `None` when there is none.
pub fn registered() -> Result<Option<Backend>, DeviceError> {
    // SAFETY: a constant query.
    if unsafe { tt_pu1_registered() } == 0 {
        return Ok(None);
    }
    let query_error = |reason: String| DeviceError::UnknownDevice {
        name: "privateuseone".into(),
        reason,
    };
    let (mut name, mut err) = (ErrBuf::new(), ErrBuf::new());
    // SAFETY: valid buffers of the stated lengths.
    if unsafe { tt_pu1_name(name.ptr(), ErrBuf::LEN, err.ptr(), ErrBuf::LEN) } != 0 {
        return Err(query_error(err.message()));
    }
    let mut count: c_int = 0;
    // SAFETY: as above.
    if unsafe { tt_pu1_device_count(&mut count, err.ptr(), ErrBuf::LEN) } != 0 {
        return Err(query_error(err.message()));
    }
    let mut library = ErrBuf::new();
    // SAFETY: as above.
    if unsafe { tt_pu1_library(library.ptr(), ErrBuf::LEN, err.ptr(), ErrBuf::LEN) } != 0 {
        return Err(query_error(err.message()));
    }
    let library = library.message();
    Ok(Some(Backend {
        libraries: (!library.is_empty())
            .then(|| PathBuf::from(library))
            .into_iter()
            .collect(),
        name: name.message(),
        device_count: count.max(0) as usize,
    }))
}

/// Runs `work`, the whole of an operation on `device`. On a PrivateUse1 device a kernel the
/// backend lacks becomes [`DeviceError::MissingOp`] naming the operator, the device and the
/// backend's library, whether libtorch's error came back through a `Result` or was raised as a
/// panic by one of tch's infallible ops (the panic is caught here, at the API boundary; other
/// panics go on unwinding). Elsewhere `work` just runs.
pub fn checked<T, E>(device: Device, work: impl FnOnce() -> Result<T, E>) -> Result<T, E>
where
    E: From<DeviceError> + std::fmt::Display,
{
    if !device.is_privateuse1() {
        return work();
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(missing_op(device, &e.to_string()).map_or(e, E::from)),
        Err(payload) => {
            let text = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            match missing_op(device, &text) {
                Some(e) => Err(E::from(e)),
                None => std::panic::resume_unwind(payload),
            }
        }
    }
}

/// The operator named by libtorch's "Could not run 'aten::cat.out' with arguments from the
/// 'neuron' backend" in `text`, as a [`DeviceError::MissingOp`] on `device`.
fn missing_op(device: Device, text: &str) -> Option<DeviceError> {
    let (_, rest) = text.split_once("Could not run '")?;
    let (op, _) = rest.split_once('\'')?;
    let library = registered()
        .ok()
        .flatten()
        .map_or_else(|| "an unknown library".into(), |b| b.library_list());
    Some(DeviceError::MissingOp {
        op: op.to_string(),
        device: device.to_string(),
        library,
    })
}

/// `t` on PrivateUse1 device `index` (a copy; `t` itself, shallowly, when it is there already).
pub(crate) fn to_device(t: &Tensor, index: usize) -> Result<Tensor, tch::TchError> {
    let mut out: AtTensor = std::ptr::null_mut();
    let mut err = ErrBuf::new();
    // SAFETY: `t` is a live tensor; on success the shim hands over a new `at::Tensor*`, which
    // `from_ptr` owns from then on (tch deletes it on drop).
    let rc = unsafe { tt_pu1_to(t.as_ptr() as AtTensor, index as c_int, &mut out, err.ptr(), ErrBuf::LEN) };
    match rc {
        0 => Ok(unsafe { Tensor::from_ptr(out.cast()) }),
        _ => Err(tch::TchError::Torch(err.message())),
    }
}

/// Moves the parameter `var` onto PrivateUse1 device `index` in place: every handle sharing it
/// (the var store's, the layers') then sees the moved data, as after `set_data`.
pub(crate) fn move_into(var: &Tensor, index: usize) -> Result<(), tch::TchError> {
    let mut err = ErrBuf::new();
    // SAFETY: `var` is a live tensor; the shim swaps its implementation's data in place.
    match unsafe { tt_pu1_move_into(var.as_ptr() as AtTensor, index as c_int, err.ptr(), ErrBuf::LEN) } {
        0 => Ok(()),
        _ => Err(tch::TchError::Torch(err.message())),
    }
}

/// The PrivateUse1 device index of `t`, `None` when it lives on a device tch names.
pub(crate) fn index_of(t: &Tensor) -> Option<usize> {
    // SAFETY: `t` is a live tensor; the shim only reads its device.
    let index = unsafe { tt_pu1_index_of(t.as_ptr() as AtTensor) };
    usize::try_from(index).ok()
}

crate::display::rich_display!(Backend);

impl Rich for Backend {
    fn html(&self) -> String {
        let (count, libraries) = (self.device_count.to_string(), self.library_list());
        display::kv_card(
            "PrivateUse1 backend",
            [
                ("name", self.name.as_str()),
                ("devices", count.as_str()),
                ("libraries", libraries.as_str()),
            ],
        )
    }

    fn text(&self) -> String {
        format!(
            "PrivateUse1 backend {:?}: {} device(s), from {}",
            self.name,
            self.device_count,
            self.library_list()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::BackendName;

    fn neuron() -> Device {
        Device::PrivateUse1 {
            name: BackendName::new("neuron"),
            index: 1,
        }
    }

    // libtorch's words for a kernel a backend lacks (as the stand-in without fallback gives).
    const MISSING: &str = "Could not run 'aten::rsqrt' with arguments from the 'neuron' backend. This could be because \
                           the operator doesn't exist for this backend";

    #[test]
    fn a_missing_kernel_becomes_a_typed_error_returned_or_raised() {
        let returned = checked(neuron(), || -> Result<(), DeviceError> {
            Err(DeviceError::InvalidPadTo(MISSING.into()))
        });
        let text = returned.unwrap_err().to_string();
        assert!(text.starts_with("neuron:1 has no kernel for aten::rsqrt"), "{text}");
        // What tch's infallible ops raise: the TchError's Debug form inside a panic.
        let raised = checked(neuron(), || -> Result<(), DeviceError> {
            panic!("called `Result::unwrap()` on an `Err` value: Torch(\"{MISSING}\")")
        });
        assert!(matches!(raised, Err(DeviceError::MissingOp { ref op, .. }) if op == "aten::rsqrt"));
    }

    #[test]
    fn other_failures_pass_through_untouched() {
        let other = checked(neuron(), || -> Result<(), DeviceError> {
            Err(DeviceError::InvalidPadTo("x".into()))
        });
        assert!(matches!(other, Err(DeviceError::InvalidPadTo(_))));
        let panicked = std::panic::catch_unwind(|| {
            let _ = checked(neuron(), || -> Result<(), DeviceError> {
                panic!("index out of bounds")
            });
        });
        assert!(
            panicked.is_err(),
            "a panic that is not a missing kernel keeps unwinding"
        );
        // Off PrivateUse1 nothing is caught or rewritten.
        let cpu = checked(Device::Cpu, || -> Result<(), DeviceError> {
            Err(DeviceError::InvalidPadTo(MISSING.into()))
        });
        assert!(matches!(cpu, Err(DeviceError::InvalidPadTo(_))));
    }
}
