use std::path::PathBuf;

/// Errors from loading, validating, running and saving models.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A JSON file is malformed or lacks a required field.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What serde said.
        message: String,
    },
    /// The device failed treetrain's self-check ([`super::check_device`]).
    #[error(
        "device {device} fails treetrain's self-check: {op}: {detail}. Its backend lacks or mis-implements this op; nothing ran on it (TREETRAIN_DEVICE_CHECK=0 skips the check)"
    )]
    DeviceCheck {
        /// The device.
        device: String,
        /// The first op that failed or differed from the CPU.
        op: String,
        /// How.
        detail: String,
    },
    /// A config field asks for something treetrain does not implement.
    #[error("config field `{field}` = {value}: {reason}")]
    Unsupported {
        /// The config.json field.
        field: String,
        /// Its value as written.
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// The checkpoint lacks a parameter the model needs.
    #[error("tensor `{name}` not found in {dir} (looked in: {files})")]
    MissingTensor {
        /// state_dict name.
        name: String,
        /// Checkpoint folder.
        dir: PathBuf,
        /// Files searched.
        files: String,
    },
    /// The target of a save holds something that would be replaced.
    #[error("{path}: {reason}")]
    WouldOverwrite {
        /// The target.
        path: PathBuf,
        /// What is there and how to go on.
        reason: String,
    },
    /// A checkpoint holds a tensor the model has no parameter for (another architecture or
    /// size, or a mislabelled file): refused rather than silently ignored.
    #[error("{file}: tensor `{name}` is not a parameter of this model (another architecture or size?)")]
    UnexpectedTensor {
        /// state_dict name.
        name: String,
        /// File holding it.
        file: PathBuf,
    },
    /// A tensor holds NaN or infinite values (loading it, or saving it, would spread nonsense).
    #[error("tensor `{name}` {place} holds NaN or infinite values")]
    NonFinite {
        /// state_dict name.
        name: String,
        /// `in FILE` (loading) or `to be written` (saving).
        place: String,
    },
    /// A checkpoint tensor has the wrong shape.
    #[error("tensor `{name}` in {file} has shape {found:?}, the config implies {expected:?}")]
    ShapeMismatch {
        /// state_dict name.
        name: String,
        /// File holding it.
        file: PathBuf,
        /// Shape from the config.
        expected: Vec<i64>,
        /// Shape in the file.
        found: Vec<i64>,
    },
    /// A safetensors file is malformed or holds an unsupported dtype.
    #[error("{file}: {message}")]
    Safetensors {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Only pickle (`.bin`/`.pt`) weights exist.
    #[error(
        "{dir} holds only PyTorch pickle weights ({file}); treetrain loads safetensors only, since unpickling can run \
         arbitrary code. Convert once in Python: `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`"
    )]
    PickleOnly {
        /// Checkpoint folder.
        dir: PathBuf,
        /// The pickle file found.
        file: String,
    },
    /// No weights at all.
    #[error("{dir} has no model.safetensors or model.safetensors.index.json")]
    NoWeights {
        /// Checkpoint folder.
        dir: PathBuf,
    },
    /// A LoRA adapter that does not fit this model or asks for what treetrain does not
    /// implement (`place`: the file and field, or the tensor).
    #[error("LoRA adapter: {place} {message}")]
    Adapter {
        /// Where: `adapter_config.json field `use_dora``, `tensor `...lora_A.weight``, ...
        place: String,
        /// What is wrong.
        message: String,
    },
    /// Input tensors or ids that do not fit the model.
    #[error("invalid input: {0}")]
    Input(String),
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// The device cannot run what was asked of it (a PrivateUse1 backend without a kernel).
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// The tokenizer files could not be read or copied.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// A collective of a parallel strategy's hooks failed: a peer died or timed out (names
    /// this rank, the collective and the peers that did not answer).
    #[error(transparent)]
    Collective(#[from] crate::distributed::DistError),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
    pub(crate) fn unsupported(field: &str, value: impl std::fmt::Display, reason: &str) -> Self {
        ModelError::Unsupported {
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

impl From<crate::device::UnknownDtype> for ModelError {
    fn from(e: crate::device::UnknownDtype) -> Self {
        ModelError::Unsupported {
            field: "dtype".into(),
            value: e.value,
            reason: format!("expected {}", e.expected),
        }
    }
}
