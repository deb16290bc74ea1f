//! What every C++ shim call shares on the Rust side.

use std::ffi::c_char;

/// The text buffer a shim call writes its error (or a short string result) into.
pub(crate) struct ErrBuf([u8; ErrBuf::LEN]);

impl ErrBuf {
    /// Its length in bytes, as passed to the shim.
    pub(crate) const LEN: usize = 1024;

    /// An empty buffer.
    pub(crate) fn new() -> Self {
        ErrBuf([0; Self::LEN])
    }

    /// The pointer the shim writes through.
    pub(crate) fn ptr(&mut self) -> *mut c_char {
        self.0.as_mut_ptr().cast()
    }

    /// The NUL-terminated text written, lossily decoded.
    pub(crate) fn message(&self) -> String {
        let end = self.0.iter().position(|&b| b == 0).unwrap_or(self.0.len());
        String::from_utf8_lossy(&self.0[..end]).into_owned()
    }
}

impl Default for ErrBuf {
    fn default() -> Self {
        Self::new()
    }
}
