//! The settings every trainer shares (transformers' `TrainingArguments`), flattened into
//! [`crate::sft::SftConfig`] and [`crate::grpo::GrpoConfig`] so a TOML file names them at the
//! top level. In Rust they are grouped by concern, each group a flattened struct that checks
//! its own settings: the data, the optimizer (with its schedule and the end of a step), the
//! precision, what the run writes, and the multi-process settings. The model, the device, the
//! seed, the router's loss weight and the LoRA adapter say what is trained and where, and stay
//! on [`TrainConfig`].

use std::path::{Path, PathBuf};

use super::adamw::AdamWConfig;
use super::error::TrainError;
use super::report::ReportTo;
use super::resume::ResumeFrom;
use super::schedule::ScheduleKind;
use crate::device::DeviceSpec;
use crate::model::DtypeSetting;
use crate::model::lora::LoraConfig;

/// The longest timeout a setting may ask for, in seconds (about 31 years): longer ones would
/// overflow a `Duration` and c10d's milliseconds.
pub const MAX_TIMEOUT_S: f64 = 1e9;
/// What to do when a step's loss or gradient norm is NaN or infinite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum NanPolicy {
    /// Drop the step's gradients, leave the weights untouched, count it, go on; a run whose
    /// last [`super::MAX_CONSECUTIVE_SKIPS`] steps were all skipped stops with an error.
    #[default]
    Skip,
    /// Return an error naming the rows of the step; weights untouched.
    Stop,
}

/// Model, data, optimizer, schedule, precision, placement and bookkeeping of a run, grouped by
/// concern: what is trained and where ([`TrainConfig::model`], [`TrainConfig::device`],
/// [`TrainConfig::seed`], [`TrainConfig::lora`]), then [`DataSettings`], [`OptimizerSettings`],
/// [`PrecisionSettings`], [`OutputSettings`] and [`ParallelSettings`]. The groups are flattened:
/// a TOML file (and `save_toml`) names every setting at the top level under transformers'
/// names (`learning_rate = 2e-5`, not `optimizer.learning_rate`), and each group checks its own
/// settings.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    /// Model folder or cached repo id (`org/name[@revision]`).
    pub model: String,
    /// Where the model trains: `cpu`, `cuda`, `cuda:N`, `mps` or `auto` (CUDA when available).
    pub device: DeviceSpec,
    /// Seed of the data order, the held-out split and sampling.
    pub seed: u64,
    /// Weight of a mixture-of-experts model's load-balancing loss in the training loss (TRL's
    /// `router_aux_loss_coef`, whose default it shares; 0 turns it off). Nothing for a dense
    /// model. Each forward of a micro-batch (a packed row in GRPO) adds it over its own tokens,
    /// as transformers' model adds it to a labelled forward.
    pub router_aux_loss_coef: f64,
    /// The training data.
    #[serde(flatten)]
    pub data: DataSettings,
    /// The optimizer, its schedule and the end of each step.
    #[serde(flatten)]
    pub optimizer: OptimizerSettings,
    /// What the forward and backward compute in, and what they keep.
    #[serde(flatten)]
    pub precision: PrecisionSettings,
    /// What the run writes: the output folder, logs, checkpoints, and how often.
    #[serde(flatten)]
    pub output: OutputSettings,
    /// How a multi-process run shares its work.
    #[serde(flatten)]
    pub parallel: ParallelSettings,
    /// Train a LoRA adapter instead of every weight (TRL's `peft_config`; the `[lora]` table
    /// of a TOML file). Checkpoints then hold the adapter alone, in PEFT's format.
    pub lora: Option<LoraConfig>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: String::new(),
            device: DeviceSpec::Cpu,
            seed: 42,
            router_aux_loss_coef: 0.001,
            data: DataSettings::default(),
            optimizer: OptimizerSettings::default(),
            precision: PrecisionSettings::default(),
            output: OutputSettings::default(),
            parallel: ParallelSettings::default(),
            lora: None,
        }
    }
}

/// The training data ([`TrainConfig::data`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct DataSettings {
    /// Dataset file or folder (Parquet, Arrow, JSON lines), or a dataset repo id in the Hugging
    /// Face cache (`org/name[@revision]`).
    pub dataset: PathBuf,
    /// Split of a folder or hub dataset (default `train`), as `datasets.load_dataset` splits
    /// it: `save_to_disk` split folders, or split names in folder and file names.
    pub dataset_split: Option<String>,
    /// Skip malformed rows (counted) instead of failing on the first.
    pub skip_invalid_rows: bool,
}

impl DataSettings {
    /// The dataset is named.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.dataset.as_os_str().is_empty() {
            return Err(TrainError::config(
                "dataset",
                "is not set: name a data file, folder or hub dataset id",
            ));
        }
        Ok(())
    }
}

/// The optimizer, its learning-rate schedule and what the end of a step does with the
/// gradients ([`TrainConfig::optimizer`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct OptimizerSettings {
    /// Peak learning rate (SFT's default is TRL's 2e-5; GRPO's is 1e-6).
    pub learning_rate: f64,
    /// Schedule after warmup.
    pub lr_scheduler: ScheduleKind,
    /// Warmup as a fraction of all steps.
    pub warmup_ratio: f64,
    /// Warmup in steps (overrides `warmup_ratio`).
    pub warmup_steps: Option<u64>,
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
    /// Gradient-norm clipping (`None`, written `"off"` in a file: no clipping).
    #[serde(with = "crate::util::off_or")]
    pub max_grad_norm: Option<f64>,
    /// Non-finite loss or gradient handling.
    pub on_nan: NanPolicy,
}

impl Default for OptimizerSettings {
    fn default() -> Self {
        OptimizerSettings {
            learning_rate: 2e-5,
            lr_scheduler: ScheduleKind::Linear,
            warmup_ratio: 0.0,
            warmup_steps: None,
            adamw: AdamWConfig::default(),
            max_grad_norm: Some(1.0),
            on_nan: NanPolicy::Skip,
        }
    }
}

impl OptimizerSettings {
    /// The learning rate, AdamW's hyper-parameters, the warmup and the clipping norm.
    pub fn validate(&self) -> Result<(), TrainError> {
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return Err(TrainError::config(
                "learning_rate",
                format!("is {}; must be finite and > 0", self.learning_rate),
            ));
        }
        self.adamw.validate()?;
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return Err(TrainError::config(
                "warmup_ratio",
                format!("is {}; must lie in 0..=1", self.warmup_ratio),
            ));
        }
        if self.max_grad_norm.is_some_and(|n| !(n.is_finite() && n > 0.0)) {
            return Err(TrainError::config(
                "max_grad_norm",
                "must be finite and > 0 (or \"off\")",
            ));
        }
        Ok(())
    }
}

/// What the forward and backward compute in, and which activations they keep
/// ([`TrainConfig::precision`]; `src/guide/memory_and_precision.md`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PrecisionSettings {
    /// Parameter dtype: what the forward and backward compute in. `auto` (default): the
    /// device's policy, bf16 on CUDA and Neuron (mixed, with the default `mixed_precision`),
    /// fp32 on CPU and MPS; `fp32`, `bf16` or `fp16` fix it.
    pub dtype: DtypeSetting,
    /// With a half `dtype` (bf16, fp16): the optimizer keeps fp32 master weights beside its
    /// fp32 moments, updates them, and the parameters get their rounded values (mixed
    /// precision, what `bf16=True` means to a transformers user). `false`: pure half precision,
    /// the half parameters updated in place (updates below a half step are lost). No effect at
    /// fp32. The loss and the LM head's log-softmax are always fp32.
    pub mixed_precision: bool,
    /// Recompute each decoder layer's activations in backward instead of keeping them
    /// (activation checkpointing at layer boundaries: far less memory for long sequences, one
    /// more forward of the stack per step). Same gradients.
    pub gradient_checkpointing: bool,
}

impl Default for PrecisionSettings {
    fn default() -> Self {
        PrecisionSettings {
            dtype: DtypeSetting::Auto,
            mixed_precision: true,
            gradient_checkpointing: false,
        }
    }
}

/// What a run writes and how often: the output folder, the metric logs, checkpoints and
/// evaluations ([`TrainConfig::output`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct OutputSettings {
    /// Where checkpoints, `log.jsonl` and `metrics.csv` go (none: nothing written).
    pub output_dir: Option<PathBuf>,
    /// A fresh run into an `output_dir` that holds checkpoints deletes them (transformers'
    /// setting); otherwise such a run is refused (resume it, or choose another folder).
    pub overwrite_output_dir: bool,
    /// Where the metrics go (transformers' `report_to`): a list of `"jsonl"` (`log.jsonl`, the
    /// default), `"tensorboard"` (event files in `logging_dir`), `"csv"` (`metrics.csv`), or
    /// `"none"`; a single name is taken as a list of one.
    #[serde(with = "super::report::one_or_many")]
    pub report_to: Vec<ReportTo>,
    /// TensorBoard's folder (default `<output_dir>/runs/<Mon><DD>_<HH>-<MM>-<SS>_<host>`, as
    /// transformers places it; a resumed run continues in its checkpoint's folder).
    pub logging_dir: Option<PathBuf>,
    /// Write a checkpoint every this many steps (the CLI's run loop).
    pub save_steps: Option<u64>,
    /// Keep only the newest this many checkpoints in `output_dir`, deleting older ones after
    /// each save (never the one just written or the one the run resumed from). Unset: keep all.
    pub save_total_limit: Option<u64>,
    /// Checkpoints hold the model (or adapter), tokenizer and state but no optimizer state:
    /// smaller, loadable as a model, not resumable.
    pub save_only_model: bool,
    /// Continue from a checkpoint: `true` (or `"latest"`) picks the newest resumable one in
    /// `output_dir`, a path names one (transformers' `resume_from_checkpoint`; the CLI's
    /// `--resume-from` overrides it).
    #[serde(with = "super::resume::setting")]
    pub resume_from_checkpoint: Option<ResumeFrom>,
    /// Evaluate every this many steps, and once before the first (the CLI's run loop).
    pub eval_steps: Option<u64>,
    /// Print a step's metrics every this many steps (the CLI's run loop; `"off"` in a file:
    /// never).
    #[serde(with = "crate::util::off_or")]
    pub logging_steps: Option<u64>,
}

impl Default for OutputSettings {
    fn default() -> Self {
        OutputSettings {
            output_dir: None,
            overwrite_output_dir: false,
            report_to: vec![ReportTo::Jsonl],
            logging_dir: None,
            save_steps: None,
            save_total_limit: None,
            save_only_model: false,
            resume_from_checkpoint: None,
            eval_steps: None,
            logging_steps: Some(1),
        }
    }
}

impl OutputSettings {
    /// `report_to`'s list, and the intervals and limits that must be at least 1.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.report_to.contains(&ReportTo::None) && self.report_to.len() > 1 {
            return Err(TrainError::config(
                "report_to",
                "names \"none\" beside other targets: \"none\" stands alone",
            ));
        }
        for (field, v, or) in [
            (
                "save_total_limit",
                self.save_total_limit,
                "unset keeps every checkpoint",
            ),
            ("save_steps", self.save_steps, "unset"),
            ("eval_steps", self.eval_steps, "unset"),
            ("logging_steps", self.logging_steps, "\"off\""),
        ] {
            if v == Some(0) {
                return Err(TrainError::config(field, format!("is 0: must be at least 1 (or {or})")));
            }
        }
        Ok(())
    }

    /// Takes the relative output, logging and checkpoint paths from the config file's folder.
    fn anchor_paths(&mut self, base: &Path) {
        use super::config_file::anchor;
        for dir in [self.output_dir.as_mut(), self.logging_dir.as_mut()]
            .into_iter()
            .flatten()
        {
            anchor(base, dir);
        }
        if let Some(ResumeFrom::Checkpoint(dir)) = self.resume_from_checkpoint.as_mut() {
            anchor(base, dir);
        }
    }
}

/// How a multi-process run shares its work: the collectives and the sharding
/// ([`TrainConfig::parallel`]; `src/guide/data_parallelism.md`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ParallelSettings {
    /// Seconds a multi-process run waits for its peers (the rendezvous, every collective)
    /// before failing with an error naming the rank (torch's default: 30 minutes).
    pub distributed_timeout_s: f64,
    /// The c10d backend of a multi-process run: `auto` (NCCL for a CUDA run when its library
    /// loads, else Gloo, said once), `gloo` or `nccl` (stops when NCCL cannot be had).
    pub distributed_backend: crate::distributed::CommBackend,
    /// How a multi-process run shares its state, as transformers' `fsdp`: `no_shard`
    /// (replicated, the default), `shard_grad_op` (ZeRO-2: gradients reduce-scattered, fp32
    /// master weights and AdamW moments sharded) or `full_shard` (ZeRO-3: parameters too,
    /// gathered layer by layer). One process does not shard.
    pub fsdp: super::Fsdp,
    /// `full_shard`'s prefetching (transformers' `fsdp_config`: `forward_prefetch`, on by
    /// default here; `backward_prefetch`: `backward_pre`, the default, `backward_post` or
    /// `no_prefetch`).
    pub fsdp_config: super::FsdpConfig,
    /// `no_shard` across processes: all-reduce the gradients in buckets during the step's last
    /// backward, as each layer's are done (DDP's overlap; the default), or `false`: all of
    /// them after it. Same sums either way. (Megatron's name; the sharded modes always
    /// overlap.)
    pub overlap_grad_reduce: bool,
}

impl Default for ParallelSettings {
    fn default() -> Self {
        ParallelSettings {
            distributed_timeout_s: 1800.0,
            distributed_backend: Default::default(),
            fsdp: Default::default(),
            fsdp_config: Default::default(),
            overlap_grad_reduce: true,
        }
    }
}

impl ParallelSettings {
    /// The timeout is a finite, positive number of seconds.
    pub fn validate(&self) -> Result<(), TrainError> {
        if !(self.distributed_timeout_s > 0.0 && self.distributed_timeout_s <= MAX_TIMEOUT_S) {
            return Err(TrainError::config(
                "distributed_timeout_s",
                format!(
                    "is {:?}; must be > 0 and at most {MAX_TIMEOUT_S:e} seconds",
                    self.distributed_timeout_s
                ),
            ));
        }
        Ok(())
    }

    /// [`ParallelSettings::distributed_timeout_s`] as a duration.
    pub(crate) fn distributed_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.distributed_timeout_s)
    }
}

impl TrainConfig {
    /// Checks the numbers that would make a run meaningless: the model is named, then each
    /// group checks its own settings.
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.model.trim().is_empty() {
            return Err(TrainError::config(
                "model",
                "is not set: name a model folder or a hub repo id",
            ));
        }
        if !(self.router_aux_loss_coef.is_finite() && self.router_aux_loss_coef >= 0.0) {
            return Err(TrainError::config(
                "router_aux_loss_coef",
                format!("is {}; must be finite and >= 0", self.router_aux_loss_coef),
            ));
        }
        self.data.validate()?;
        self.optimizer.validate()?;
        if let Some(lora) = &self.lora {
            lora.validate()?;
        }
        self.parallel.validate()?;
        self.output.validate()
    }

    /// Takes relative paths from the config file's folder `base`: the output folders always, the
    /// model and the dataset only when they exist there (otherwise they may be hub repo ids).
    pub(crate) fn anchor_paths(&mut self, base: &Path) {
        use super::config_file::{anchor, anchor_if_exists};
        self.output.anchor_paths(base);
        // An unset (empty) model or dataset stays unset, for validation to name, rather than
        // becoming the config file's own folder.
        if !self.data.dataset.as_os_str().is_empty() {
            anchor_if_exists(base, &mut self.data.dataset);
        }
        let mut model = PathBuf::from(&self.model);
        if !self.model.is_empty() && base.join(&model).is_dir() {
            anchor(base, &mut model);
            self.model = model.display().to_string();
        }
    }
}

impl crate::display::Rich for TrainConfig {
    fn html(&self) -> String {
        crate::display::config_html("Training settings", self)
    }
    fn text(&self) -> String {
        crate::display::config_text(self)
    }
}

crate::display::rich_display!(TrainConfig);

/// Each group of a [`TrainConfig`] renders as the settings it holds, under their file names (a
/// notebook cell may end with `config.train.optimizer`).
macro_rules! group_display {
    ($($group:ident => $title:literal),* $(,)?) => {$(
        impl crate::display::Rich for $group {
            fn html(&self) -> String {
                crate::display::config_html($title, self)
            }

            fn text(&self) -> String {
                crate::display::config_text(self)
            }
        }

        crate::display::rich_display!($group);
    )*};
}

group_display!(
    DataSettings => "Training data",
    OptimizerSettings => "Optimizer settings",
    PrecisionSettings => "Precision settings",
    OutputSettings => "Output settings",
    ParallelSettings => "Parallelism settings",
);
