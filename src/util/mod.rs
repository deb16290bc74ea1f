//! Small helpers with no better home.

mod atomic_file;
pub(crate) mod clock;
mod ffi;
mod fnv;
pub(crate) mod off_or;
mod rng;
pub(crate) mod runtime_library;
mod text_value;

pub(crate) use atomic_file::write_atomically;
pub(crate) use clock::host_name;
pub(crate) use ffi::ErrBuf;
pub(crate) use fnv::{Fnv1a, fnv1a};
pub use rng::SplitMix64;
pub(crate) use text_value::{TextValue, serde_via_str};
