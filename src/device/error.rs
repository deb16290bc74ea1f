use std::path::PathBuf;

/// Errors from device detection, loading and policy parsing.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// An environment variable holds a value treetrain cannot interpret.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    InvalidEnv {
        /// Variable name.
        var: String,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A pad policy string is not `auto`, `none` or a positive integer.
    #[error("invalid pad_to_multiple_of {0:?}: expected \"auto\", \"none\" or a positive integer")]
    InvalidPadTo(String),
    /// A platform name is unknown.
    #[error("unknown platform {0:?}: expected cpu, cuda, mps or neuron")]
    UnknownPlatform(String),
    /// A device name is unknown or names a device this process cannot use.
    #[error("device {name:?}: {reason}")]
    UnknownDevice {
        /// As given.
        name: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A shared library could not be loaded.
    #[error("could not load {path}: {reason}")]
    Load {
        /// The library file.
        path: PathBuf,
        /// The dynamic loader's message.
        reason: String,
    },
}
