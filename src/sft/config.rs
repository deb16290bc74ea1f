//! SFT run configuration (TRL's `SFTConfig`), readable from TOML.

use std::path::Path;

use super::packing::PackingStrategy;
use super::tokenize::TokenizeOptions;
use crate::device::{PadTo, Platform};
use crate::train::{TrainConfig, TrainError};

/// Everything an SFT run needs: the shared settings ([`TrainConfig`], flattened: a TOML file
/// names them at the top level) and SFT's own.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SftConfig {
    /// Model, data, optimizer, schedule, dtype, device, bookkeeping.
    #[serde(flatten)]
    pub train: TrainConfig,
    /// Tokenization and loss masking.
    pub tokenize: TokenizeOptions,
    /// `None`: padded batches of `batch_size` sequences; else rows of `max_length` tokens.
    pub packing: Option<PackingStrategy>,
    /// Sequences (or packed rows) per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step; the loss is normalised over all of their tokens.
    pub gradient_accumulation_steps: usize,
    /// Optimizer steps of the run (overrides `num_train_epochs`).
    pub max_steps: Option<u64>,
    /// Epochs of the run when `max_steps` is not set.
    pub num_train_epochs: f64,
    /// Batch lengths are padded to a multiple (`auto`: 128 on Neuron, none elsewhere).
    pub pad_to_multiple_of: PadTo,
    /// Platform `auto` padding resolves for when the device does not decide it: a run on a
    /// PrivateUse1 device (`neuron`) always pads for Neuron; elsewhere this lets a CPU run plan
    /// Neuron's shapes.
    pub platform: Platform,
    /// Share of rows held out for `evaluate()`.
    pub eval_fraction: f64,
    /// Tokens per chunk of the LM head and loss in training (TRL's chunked NLL): at most one
    /// chunk's `[tokens, vocab]` logits exist at once, forward and backward.
    pub lm_head_chunk_tokens: i64,
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            train: TrainConfig::default(),
            tokenize: TokenizeOptions::default(),
            packing: None,
            batch_size: 8,
            gradient_accumulation_steps: 1,
            max_steps: None,
            num_train_epochs: 1.0,
            pad_to_multiple_of: PadTo::Auto,
            platform: Platform::Cpu,
            eval_fraction: 0.05,
            lm_head_chunk_tokens: 1024,
        }
    }
}

impl SftConfig {
    /// Writes the config as a TOML file [`SftConfig::from_toml_file`] reads back unchanged: how a
    /// notebook's run is scaled out (`treetrain launch --nproc-per-node N -- sft --config FILE`).
    pub fn save_toml(&self, path: &Path) -> Result<(), TrainError> {
        crate::train::config_file::write_toml(self, path)
    }

    /// Parses a TOML file of [`SftConfig`] fields (unset fields keep their defaults, unknown
    /// keys are refused; relative paths are taken relative to the file's folder).
    pub fn from_toml_file(path: &Path) -> Result<Self, TrainError> {
        let (mut cfg, base): (SftConfig, _) = crate::train::config_file::read_toml(path)?;
        cfg.train.anchor_paths(base);
        Ok(cfg)
    }

    /// The platform `pad_to_multiple_of = auto` resolves for on `device` (see `platform`).
    pub(crate) fn platform_for(&self, device: crate::device::Device) -> Platform {
        match device.platform() {
            Platform::Neuron => Platform::Neuron,
            _ => self.platform,
        }
    }

    /// Checks the numbers that would make a run meaningless or hang.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.train.validate()?;
        let positive = [
            ("batch_size", self.batch_size),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
            ("tokenize.max_length", self.tokenize.max_length),
        ];
        if let Some((field, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(TrainError::config(field, "must be at least 1"));
        }
        if !(self.num_train_epochs.is_finite() && self.num_train_epochs > 0.0) {
            return Err(TrainError::config("num_train_epochs", "must be finite and > 0"));
        }
        if self.lm_head_chunk_tokens < 1 {
            return Err(TrainError::config("lm_head_chunk_tokens", "must be at least 1"));
        }
        if !(0.0..1.0).contains(&self.eval_fraction) {
            return Err(TrainError::config("eval_fraction", "must lie in 0..1"));
        }
        Ok(())
    }
}
