//! What a generation call is asked to do ([`GenerationConfig`]) and how it can fail
//! ([`GenerateError`]).

use super::sampling::SamplingConfig;
use crate::model::ModelError;

/// Errors from generation.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// A prompt is empty or holds an id outside the vocabulary.
    #[error("prompt {index}: {message}")]
    Prompt {
        /// Index of the prompt.
        index: usize,
        /// What is wrong.
        message: String,
    },
    /// The configuration cannot work.
    #[error("generation config: {0}")]
    Config(String),
    /// The model failed (includes static-cache overflow).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// libtorch failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// The model's logits were NaN or infinite (a broken model or device).
    #[error(
        "row {row}, generated token {step}: the logits are NaN or infinite on device {device}; the model or the device computes garbage"
    )]
    NonFinite {
        /// Row of the call.
        row: usize,
        /// Tokens generated before.
        step: usize,
        /// Where the model ran.
        device: String,
    },
    /// A CUDA graph of the decode step could not be loaded, recorded or replayed.
    #[error("CUDA graph: {0}")]
    CudaGraph(String),
}

impl From<crate::device::DeviceError> for GenerateError {
    fn from(e: crate::device::DeviceError) -> Self {
        GenerateError::Model(ModelError::Device(e))
    }
}

/// How long and how to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// Most tokens generated per completion.
    pub max_new_tokens: usize,
    /// Tokens that end a completion (included in its output).
    pub eos_token_ids: Vec<i64>,
    /// Token sequences that end a completion (included in its output).
    pub stop_sequences: Vec<Vec<i64>>,
    /// Strings that end a completion when its text contains one, matched on the decoded text
    /// (the token holding the string's end is the last one).
    pub stop_strings: Option<super::StopStrings>,
    /// Id written in padding slots.
    pub pad_token_id: i64,
    /// Prompts are left-padded to a multiple of this and prefilled this many tokens at a time.
    pub prefill_chunk_size: i64,
    /// Cache capacity; default: padded prompt length + `max_new_tokens`. Too small is an error.
    pub max_cache_len: Option<i64>,
    /// Token choice.
    pub sampling: SamplingConfig,
    /// On CUDA, run the decode steps as a captured CUDA graph (`generate::cuda_graph`): the
    /// first step runs as usual, the second is recorded, every later one is a replay. Needs
    /// the static cache ([`super::Generator::generate`], [`super::Generator::generate_groups`]); an error on
    /// other devices.
    pub cuda_graph: bool,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_new_tokens: 64,
            eos_token_ids: Vec::new(),
            stop_sequences: Vec::new(),
            stop_strings: None,
            pad_token_id: 0,
            prefill_chunk_size: 128,
            max_cache_len: None,
            sampling: SamplingConfig::default(),
            cuda_graph: false,
        }
    }
}
