use std::ffi::CString;
use std::path::{Path, PathBuf};

use super::error::DeviceError;
use super::probe::HostProbe;

/// One CUDA device as libtorch and the driver describe it.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaDevice {
    /// libtorch device index.
    pub index: usize,
    /// Model name from the driver (`/proc/driver/nvidia/gpus/*/information`), when readable.
    pub name: Option<String>,
}

/// What is known about CUDA in this process.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaInfo {
    /// libtorch can run CUDA kernels.
    pub available: bool,
    /// Devices libtorch sees.
    pub devices: Vec<CudaDevice>,
    /// cuDNN is usable.
    pub cudnn: bool,
    /// NVIDIA driver version, when the driver is present.
    pub driver: Option<String>,
    /// Why CUDA is unavailable (None when it is available).
    pub unavailable_reason: Option<String>,
}

impl CudaInfo {
    /// Combines libtorch's answers (`device_count`, `cudnn`) with what the machine shows, to
    /// explain a missing CUDA in terms a user can act on.
    pub fn from_parts(probe: &HostProbe, device_count: usize, cudnn: bool) -> Self {
        let driver = probe.read("/proc/driver/nvidia/version").map(|v| {
            v.lines()
                .next()
                .unwrap_or("")
                .split("  ")
                .find(|s| s.contains('.'))
                .unwrap_or("")
                .trim()
                .to_string()
        });
        let driver_present = driver.is_some() || probe.exists("/dev/nvidiactl");
        let names: Vec<String> = probe
            .list("/proc/driver/nvidia/gpus")
            .iter()
            .filter_map(|bus| probe.read(&format!("/proc/driver/nvidia/gpus/{bus}/information")))
            .filter_map(|info| {
                info.lines()
                    .find_map(|l| l.strip_prefix("Model:"))
                    .map(|m| m.trim().to_string())
            })
            .collect();
        let devices: Vec<CudaDevice> = (0..device_count)
            .map(|index| CudaDevice {
                index,
                name: names.get(index).cloned(),
            })
            .collect();
        let cuda_lib_loaded = probe
            .read("/proc/self/maps")
            .is_some_and(|m| m.contains("libtorch_cuda.so"));
        let unavailable_reason = if device_count > 0 {
            None
        } else if !driver_present {
            Some("no NVIDIA driver on this machine (no /dev/nvidiactl, no /proc/driver/nvidia/version)".to_string())
        } else if !cuda_lib_loaded {
            Some(
                "an NVIDIA driver is present but this process runs CPU-only libtorch (libtorch_cuda.so is not loaded): \
                 run with LD_LIBRARY_PATH=<torch 2.11.0+cu130>/torch/lib, or set TREETRAIN_TORCH_CUDA to that folder"
                    .to_string(),
            )
        } else {
            Some(
                "libtorch_cuda.so is loaded but reports no device: check that the driver supports CUDA 13 (nvidia-smi) \
                 and CUDA_VISIBLE_DEVICES"
                    .to_string(),
            )
        };
        CudaInfo {
            available: device_count > 0,
            devices,
            cudnn: cudnn && device_count > 0,
            driver,
            unavailable_reason,
        }
    }
}

/// The variable naming a torch 2.11.0 CUDA `lib` folder whose `libtorch_cuda.so` treetrain
/// loads into its CPU-only libtorch.
pub(crate) const TORCH_CUDA_ENV: &str = "TREETRAIN_TORCH_CUDA";

/// Loads `TORCH_CUDA_ENV`'s `libtorch_cuda.so` when the variable is set (`None` when it is
/// not). Every entry point that may touch CUDA calls it before its first CUDA query (the CLI at
/// start, [`super::DeviceSpec::resolve`], a model loaded onto a CUDA device): loading again is
/// harmless, as `dlopen` counts references.
pub fn load_torch_cuda_from_env() -> Option<Result<PathBuf, DeviceError>> {
    let dir = PathBuf::from(std::env::var_os(TORCH_CUDA_ENV)?);
    Some(load_torch_cuda(&dir).map(|()| dir))
}

/// Loads `libtorch_cuda.so` from a full torch 2.11.0 CUDA `lib` folder into this process.
///
/// treetrain links against CPU-only libtorch; loading the CUDA library registers libtorch's CUDA
/// backend. It must happen before anything asks libtorch about CUDA, because libtorch caches the
/// answer on first use. `super::Accelerators::detect` does this for `TREETRAIN_TORCH_CUDA`.
pub fn load_torch_cuda(lib_dir: &Path) -> Result<(), DeviceError> {
    let path = lib_dir.join("libtorch_cuda.so");
    let load_error = |reason: String| DeviceError::Load {
        path: path.clone(),
        reason,
    };
    if !path.exists() {
        return Err(load_error(
            "no such file (expected a torch 2.11.0+cu130 torch/lib folder)".into(),
        ));
    }
    let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| load_error(e.to_string()))?;
    // SAFETY: dlopen with a valid NUL-terminated path; the handle is deliberately never closed
    // because libtorch keeps pointers into the library for the life of the process.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let msg = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown dlopen error".to_string()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(load_error(msg));
    }
    Ok(())
}
