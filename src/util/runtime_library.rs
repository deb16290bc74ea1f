//! A shared library of treetrain's own loaded at run time (the CUDA-graph and NCCL libraries):
//! built beside treetrain against libtorch's headers, its CUDA symbols resolve only against a
//! CUDA libtorch already in the process, so it is opened only when asked for. It is found
//! through its environment variable, beside the running executable (or its parent folder), or
//! where the build put it.

use std::ffi::{CStr, CString, c_void};
use std::path::PathBuf;

/// Where one library may be and what it is called.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LibrarySpec {
    /// The environment variable naming it explicitly.
    pub env: &'static str,
    /// Its file name.
    pub name: &'static str,
    /// Where the build put it (empty: the build did not make it).
    pub built: &'static str,
    /// What it needs in the process, said when it cannot load.
    pub needs: &'static str,
}

/// An opened library; closed on drop.
pub(crate) struct RuntimeLibrary {
    handle: *mut c_void,
    /// Where it was loaded from.
    pub path: PathBuf,
}

impl Drop for RuntimeLibrary {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen; the owners of what the library made drop those
        // before the library (they hold it).
        unsafe { libc::dlclose(self.handle) };
    }
}

impl LibrarySpec {
    /// Where to look, in order.
    fn candidates(&self) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = std::env::var_os(self.env).map(PathBuf::from).into_iter().collect();
        if let Ok(exe) = std::env::current_exe()
            && let Some(dir) = exe.parent()
        {
            out.push(dir.join(self.name));
            out.extend(dir.parent().map(|p| p.join(self.name)));
        }
        if !self.built.is_empty() {
            out.push(PathBuf::from(self.built));
        }
        out
    }

    /// Opens the first candidate that exists, every symbol resolved now (`RTLD_NOW`): a
    /// missing one fails here with its name.
    pub(crate) fn open(&self) -> Result<RuntimeLibrary, String> {
        let Some(path) = self.candidates().into_iter().find(|p| p.exists()) else {
            return Err(format!(
                "{} not found (set {}, or put it beside the executable; this build {})",
                self.name,
                self.env,
                match self.built {
                    "" => "did not make it: no CUDA headers (scripts/setup-libtorch.sh unpacks them)",
                    _ => "made it, but it is not where the build left it",
                }
            ));
        };
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: dlopen of a NUL-terminated path.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("loading {}: {} ({})", path.display(), dl_error(), self.needs));
        }
        Ok(RuntimeLibrary { handle, path })
    }
}

impl RuntimeLibrary {
    /// The address of `name`.
    pub(crate) fn symbol(&self, name: &CStr) -> Result<*mut c_void, String> {
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        let s = unsafe { libc::dlsym(self.handle, name.as_ptr()) };
        match s.is_null() {
            true => Err(format!("{} lacks {name:?}", self.path.display())),
            false => Ok(s),
        }
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    unsafe {
        let e = libc::dlerror();
        match e.is_null() {
            true => "unknown dlopen error".into(),
            false => CStr::from_ptr(e).to_string_lossy().into_owned(),
        }
    }
}
