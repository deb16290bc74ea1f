//! The NCCL backend: `libtreetrain_nccl.so` (`nccl.cpp`), loaded at run time into a process
//! running CUDA libtorch (`TREETRAIN_TORCH_CUDA`), makes a `ProcessGroupNCCL` that the c10d shim
//! then drives like Gloo's, on the GPU's own memory (no copy through the host). The library is
//! compiled against the `nccl.h` torch 2.11.0 pins; the version the loaded `libnccl.so.2`
//! reports must be the same (`ProcessGroupNCCL::Options` embeds NCCL's config struct).

use std::ffi::{CString, c_char, c_int, c_void};
use std::time::Duration;

use crate::util::ErrBuf;
use crate::util::runtime_library::{LibrarySpec, RuntimeLibrary};

/// The environment variable naming the library explicitly.
pub const LIBRARY_ENV: &str = "TREETRAIN_NCCL_LIB";
/// The library's file name.
pub(crate) const LIBRARY_NAME: &str = "libtreetrain_nccl.so";

const SPEC: LibrarySpec = LibrarySpec {
    env: LIBRARY_ENV,
    name: LIBRARY_NAME,
    built: env!("TREETRAIN_NCCL_LIB_BUILT"),
    needs: "NCCL needs a CUDA libtorch in the process: set TREETRAIN_TORCH_CUDA",
};

type VersionsFn = unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_char, usize) -> c_int;
type GroupFn =
    unsafe extern "C" fn(*mut c_void, *const c_char, c_int, c_int, c_int, f64, *mut c_char, usize) -> *mut c_void;

/// NCCL's versions as `NCCL_VERSION_CODE`s (`22809` is 2.28.9).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclVersions {
    /// Of the `nccl.h` the library was compiled with.
    pub header: i32,
    /// Of the `libnccl.so.2` in the process.
    pub runtime: i32,
}

/// `major.minor.patch` of an `NCCL_VERSION_CODE` (NCCL 2.9 and later).
pub fn version_string(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

/// The loaded library.
pub struct NcclLibrary {
    versions: VersionsFn,
    group: GroupFn,
    // Last: its functions are dropped before it closes.
    lib: RuntimeLibrary,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclLibrary({})", self.lib.path.display())
    }
}

impl NcclLibrary {
    /// Loads the library; every symbol resolves against the CUDA libtorch in the process, or
    /// this fails naming the first that does not.
    pub fn load() -> Result<Self, String> {
        let lib = SPEC.open()?;
        // SAFETY: each symbol is the extern "C" function of nccl.cpp with this signature.
        unsafe {
            Ok(NcclLibrary {
                versions: std::mem::transmute::<*mut c_void, VersionsFn>(lib.symbol(c"tt_nccl_versions")?),
                group: std::mem::transmute::<*mut c_void, GroupFn>(lib.symbol(c"tt_nccl_group")?),
                lib,
            })
        }
    }

    /// The header's and the runtime's versions.
    pub fn versions(&self) -> Result<NcclVersions, String> {
        let (mut header, mut runtime) = (0, 0);
        let mut err = ErrBuf::new();
        // SAFETY: writes two ints, or an error message into `err`.
        match unsafe { (self.versions)(&mut header, &mut runtime, err.ptr(), ErrBuf::LEN) } {
            0 => Ok(NcclVersions { header, runtime }),
            _ => Err(err.message()),
        }
    }

    /// The versions, refused unless the runtime is the header's.
    pub fn checked_versions(&self) -> Result<NcclVersions, String> {
        let v = self.versions()?;
        match v.header == v.runtime {
            true => Ok(v),
            false => Err(format!(
                "{} was built against nccl.h {} but the process runs libnccl {} (torch 2.11.0 pins 2.28.9)",
                self.lib.path.display(),
                version_string(v.header),
                version_string(v.runtime)
            )),
        }
    }

    /// A `ProcessGroupNCCL` over the c10d store `store` (borrowed; the group takes its own
    /// reference) bound to CUDA device `device`: an owning `c10d::Backend*` for the shim.
    pub(crate) fn group(
        &self,
        store: *mut c_void,
        prefix: &str,
        (rank, size): (usize, usize),
        device: usize,
        timeout: Duration,
    ) -> Result<*mut c_void, String> {
        let prefix = CString::new(prefix).map_err(|_| format!("{prefix:?} holds a NUL byte"))?;
        let mut err = ErrBuf::new();
        // SAFETY: a live store pointer and a C string; the result is owned by the caller.
        let pg = unsafe {
            (self.group)(
                store,
                prefix.as_ptr(),
                rank as c_int,
                size as c_int,
                device as c_int,
                timeout.as_secs_f64(),
                err.ptr(),
                ErrBuf::LEN,
            )
        };
        match pg.is_null() {
            true => Err(err.message()),
            false => Ok(pg),
        }
    }
}
