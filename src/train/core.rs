//! What both trainers hold and do the same way: the model and tokenizer loaded from the shared
//! settings, the optimizer with its schedule, the dataset opened from a file or the hub cache,
//! checkpoints and the step log.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{AdamW, LrSchedule, Optimization, TrainConfig, TrainError, checkpoint};
use crate::data::Dataset;
use crate::hub::HubCache;
use crate::model::{LoadOptions, Model, SpecialTokens};
use crate::tokenizer::Tokenizer;

/// The trained model, its tokenizer and its optimizer.
#[derive(Debug)]
pub struct TrainCore {
    /// The model being trained.
    pub model: Model,
    /// Its tokenizer (shared with generation threads).
    pub tokenizer: Arc<Tokenizer>,
    /// The folder the run started from (tokenizer files, starting weights).
    pub model_dir: PathBuf,
    /// How the model was loaded (dtype, device): copies for a reference or a generator match.
    pub load_options: LoadOptions,
    /// Optimizer and schedule.
    pub optim: Optimization,
    /// Special token ids from the tokenizer and `config.json`.
    pub special: SpecialTokens,
}

impl TrainCore {
    /// Loads the model of `config` (its weights from `checkpoint` when resuming), the tokenizer
    /// and a fresh optimizer; the schedule is set by [`TrainCore::set_schedule`] once the run's
    /// length is known.
    pub fn load(config: &TrainConfig, checkpoint: Option<&Path>) -> Result<Self, TrainError> {
        config.validate()?;
        let model_dir = HubCache::from_env().model_dir(&config.model)?;
        let load_options = LoadOptions {
            dtype: Some(config.dtype.kind()),
            device: config.device.resolve()?,
        };
        let model = Model::load(checkpoint.unwrap_or(&model_dir), load_options)?;
        let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir)?);
        let special = SpecialTokens::resolve(Some(&tokenizer), &model.lm.config);
        let adamw = AdamW::new(&model.vs, config.adamw);
        let schedule = schedule(config, 0);
        Ok(TrainCore {
            model,
            tokenizer,
            model_dir,
            load_options,
            optim: Optimization { adamw, schedule },
            special,
        })
    }

    /// Sets the learning-rate schedule for a run of `total_steps`.
    pub fn set_schedule(&mut self, config: &TrainConfig, total_steps: u64) {
        self.optim.schedule = schedule(config, total_steps);
    }

    /// The training data: `config.dataset` as a file or folder when it exists, else as a dataset
    /// repo id in the Hugging Face cache (split `dataset_split`).
    pub fn open_dataset(config: &TrainConfig) -> Result<Dataset, TrainError> {
        if config.dataset.exists() {
            return Ok(Dataset::open(&config.dataset)?);
        }
        let spec = config.dataset.to_string_lossy();
        Ok(Dataset::from_hub(
            &HubCache::from_env(),
            &spec,
            config.dataset_split.as_deref(),
        )?)
    }

    /// Writes `output_dir/checkpoint-<step>/` atomically: the model as a Hugging Face folder
    /// (with the tokenizer files), the optimizer state and `state`.
    pub fn save_checkpoint(
        &self,
        config: &TrainConfig,
        step: u64,
        state: &impl serde::Serialize,
    ) -> Result<PathBuf, TrainError> {
        let out = config
            .output_dir
            .as_deref()
            .ok_or_else(|| TrainError::config("output_dir", "is not set: nowhere to write a checkpoint"))?;
        checkpoint::save_checkpoint(out, step, &self.model, &self.tokenizer.dir, &self.optim.adamw, state)
    }

    /// Restores the optimizer from a checkpoint folder and returns the trainer state saved there.
    pub fn restore<S: serde::de::DeserializeOwned>(&mut self, checkpoint: &Path) -> Result<S, TrainError> {
        checkpoint::load_checkpoint(checkpoint, &mut self.optim.adamw)
    }

    /// Appends a step's metrics to `output_dir/log.jsonl` (when set).
    pub fn log(&self, config: &TrainConfig, metrics: &impl serde::Serialize) {
        if let Some(dir) = &config.output_dir {
            checkpoint::append_log(dir, metrics);
        }
    }
}

/// The schedule of `config` over `total_steps`: warmup in steps, else as a ratio.
fn schedule(config: &TrainConfig, total_steps: u64) -> LrSchedule {
    match config.warmup_steps {
        Some(w) => LrSchedule {
            lr: config.learning_rate,
            kind: config.lr_scheduler,
            warmup_steps: w,
            total_steps,
        },
        None => LrSchedule::with_warmup_ratio(
            config.learning_rate,
            config.lr_scheduler,
            config.warmup_ratio,
            total_steps,
        ),
    }
}
