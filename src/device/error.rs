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
    /// The device's backend has no kernel for an operator treetrain ran there.
    #[error(
        "{device} has no kernel for {op} (PrivateUse1 backend from {library}); register one or a CPU fallback in the backend"
    )]
    MissingOp {
        /// The operator, as libtorch names it (`aten::cat.out`).
        op: String,
        /// The device it ran on (`neuron:0`).
        device: String,
        /// The backend's library file(s).
        library: String,
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
