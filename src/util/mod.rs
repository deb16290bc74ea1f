//! Small helpers with no better home.

mod rng;

pub use rng::SplitMix64;
