//! Small helpers with no better home.

mod rng;
mod text_value;

pub use rng::SplitMix64;
pub(crate) use text_value::{TextValue, serde_via_str};
