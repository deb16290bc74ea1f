//! The SFT trainer: step by step from a notebook cell, or `train_for(n)`; checkpoints resume
//! bit-exact on CPU.

use std::path::{Path, PathBuf};
use std::time::Instant;

use tch::{Kind, Tensor};

use super::{PackingStrategy, TokenizeOptions, TrainExample, pack, tokenize};
use crate::data::Dataset;
use crate::device::{PadTo, Platform};
use crate::display::{self, LineChart, Rich, escape};
use crate::model::{AttentionLayout, LoadOptions, LogprobChunks, Model, target_logprobs};
use crate::shapes::ShapeLedger;
use crate::tokenizer::Tokenizer;
use crate::train::{AdamW, AdamWConfig, LrSchedule, ScheduleKind};
use crate::util::SplitMix64;

/// What to do when a step's loss or gradient norm is NaN or infinite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NanPolicy {
    /// Drop the step's gradients, leave the weights untouched, count it, go on.
    Skip,
    /// Return an error naming the rows of the step; weights untouched.
    Stop,
}

/// Everything an SFT run needs (TRL's `SFTConfig`, single process).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SftConfig {
    /// Model folder or cached repo id.
    pub model: String,
    /// Dataset file or folder (Parquet, Arrow, JSON lines), or a dataset repo id in the Hugging
    /// Face cache (`org/name[@revision]`).
    pub dataset: PathBuf,
    /// Split of a hub dataset (`train`).
    pub dataset_split: Option<String>,
    /// Where checkpoints and `log.jsonl` go (none: nothing written).
    pub output_dir: Option<PathBuf>,
    /// Tokenization and loss masking.
    pub tokenize: TokenizeOptions,
    /// `None`: padded batches of `batch_size` sequences; else rows of `max_length` tokens.
    pub packing: Option<String>,
    /// Sequences (or packed rows) per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step; the loss is normalised over all of their tokens.
    pub gradient_accumulation_steps: usize,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Schedule after warmup.
    pub lr_scheduler: ScheduleKind,
    /// Warmup as a fraction of all steps.
    pub warmup_ratio: f64,
    /// Warmup in steps (overrides `warmup_ratio`).
    pub warmup_steps: Option<u64>,
    /// AdamW hyper-parameters.
    pub adamw: AdamWConfig,
    /// Gradient-norm clipping (`None`: off).
    pub max_grad_norm: Option<f64>,
    /// Optimizer steps of the run (overrides `num_train_epochs`).
    pub max_steps: Option<u64>,
    /// Epochs of the run when `max_steps` is not set.
    pub num_train_epochs: f64,
    /// Seed of the data order and the held-out split.
    pub seed: u64,
    /// `auto`, `none` or a number: batch lengths are padded to a multiple (shapes on Neuron).
    pub pad_to_multiple_of: String,
    /// Platform `auto` padding resolves for.
    pub platform: String,
    /// Share of rows held out for `evaluate()`.
    pub eval_fraction: f64,
    /// Non-finite loss handling.
    pub on_nan: NanPolicy,
    /// Skip malformed rows (counted) instead of failing on the first.
    pub skip_invalid_rows: bool,
    /// Parameter dtype (`fp32` or `bf16`).
    pub dtype: String,
    /// Where the model trains: `cpu`, `cuda`, `cuda:N`, `mps` or `auto` (CUDA when available).
    pub device: String,
    /// Write a checkpoint every this many steps (CLI).
    pub save_steps: Option<u64>,
    /// Evaluate every this many steps (CLI).
    pub eval_steps: Option<u64>,
}

impl Default for SftConfig {
    fn default() -> Self {
        SftConfig {
            model: String::new(),
            dataset: PathBuf::new(),
            dataset_split: None,
            output_dir: None,
            tokenize: TokenizeOptions::default(),
            packing: None,
            batch_size: 8,
            gradient_accumulation_steps: 1,
            learning_rate: 2e-5,
            lr_scheduler: ScheduleKind::Linear,
            warmup_ratio: 0.0,
            warmup_steps: None,
            adamw: AdamWConfig::default(),
            max_grad_norm: Some(1.0),
            max_steps: None,
            num_train_epochs: 1.0,
            seed: 42,
            pad_to_multiple_of: "auto".into(),
            platform: "cpu".into(),
            eval_fraction: 0.05,
            on_nan: NanPolicy::Skip,
            skip_invalid_rows: false,
            dtype: "fp32".into(),
            device: "cpu".into(),
            save_steps: None,
            eval_steps: None,
        }
    }
}

/// Errors from SFT.
#[derive(Debug, thiserror::Error)]
pub enum SftError {
    /// Configuration problem.
    #[error("sft config: {0}")]
    Config(String),
    /// A dataset row could not be used.
    #[error("{0}")]
    Data(String),
    /// A step produced a non-finite loss or gradient under `on_nan = stop`.
    #[error("step {step}: non-finite {what} on rows {rows:?}; weights left untouched")]
    NonFinite {
        /// Optimizer step.
        step: u64,
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// Training rows of the step.
        rows: Vec<usize>,
    },
    /// Model, tokenizer, hub or optimizer failure.
    #[error("{0}")]
    Other(String),
}

fn other<E: std::fmt::Display>(e: E) -> SftError {
    SftError::Other(e.to_string())
}

/// Metrics of one optimizer step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepMetrics {
    /// Step number (1-based).
    pub step: u64,
    /// Epoch (fractional).
    pub epoch: f64,
    /// Mean loss per trained token over the accumulation window.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Non-padding tokens per second.
    pub tokens_per_s: f64,
    /// Share of forwarded tokens that were padding.
    pub padding_fraction: f64,
    /// Whether the step was skipped (non-finite loss or gradient).
    pub skipped: bool,
}

/// Where the run is: saved with checkpoints.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub global_step: u64,
    /// Steps of the whole run.
    pub total_steps: u64,
    /// Current epoch.
    pub epoch: u64,
    /// Next micro-batch within the epoch.
    pub micro_batch: usize,
    /// Every step's metrics.
    pub history: Vec<StepMetrics>,
    /// `(step, eval loss)` of every evaluation.
    pub eval_history: Vec<(u64, f64)>,
    /// Rows skipped as malformed.
    pub skipped_rows: usize,
    /// Steps skipped as non-finite.
    pub skipped_steps: usize,
}

/// A micro-batch: one or more training rows per batch row.
type MicroBatch = Vec<Vec<usize>>;

/// One batch row before padding: ids, positions, sequence index and loss mask per token.
#[derive(Default)]
struct RowParts {
    ids: Vec<i64>,
    pos: Vec<i64>,
    seq: Vec<i64>,
    mask: Vec<u8>,
}

/// A micro-batch as tensors `[b, t]` (ids, positions, sequence ids; -1 on padding), the flat
/// predicting positions and targets of its trained tokens, and (real, forwarded) token counts.
struct BatchTensors {
    ids: Tensor,
    pos: Tensor,
    seq: Tensor,
    src: Vec<i64>,
    tgt: Vec<i64>,
    real: usize,
    total: usize,
}

/// Supervised fine-tuning of a causal LM on conversations or prompt/completion pairs.
pub struct SftTrainer {
    /// The configuration.
    pub config: SftConfig,
    /// The model being trained.
    pub model: Model,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Progress and metrics.
    pub state: TrainerState,
    /// Input shapes of every forward (what Neuron would compile).
    pub ledger: ShapeLedger,
    optimizer: AdamW,
    schedule: LrSchedule,
    train: Vec<TrainExample>,
    eval: Vec<TrainExample>,
    pad_multiple: Option<usize>,
    packing: Option<PackingStrategy>,
    pad_id: i64,
    /// The current epoch's micro-batches (shuffling and packing every row is not free).
    epoch_batches: Option<(u64, std::sync::Arc<Vec<MicroBatch>>)>,
}

impl std::fmt::Debug for SftTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SftTrainer")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl SftConfig {
    /// Parses a TOML file of [`SftConfig`] fields (unset fields keep their defaults; relative
    /// paths are taken relative to the file's folder).
    pub fn from_toml_file(path: &Path) -> Result<Self, SftError> {
        use crate::train::config_file::{anchor, anchor_model, read_toml};
        let (mut cfg, base): (SftConfig, _) = read_toml(path).map_err(SftError::Config)?;
        anchor(base, &mut cfg.dataset);
        if let Some(out) = cfg.output_dir.as_mut() {
            anchor(base, out);
        }
        anchor_model(base, &mut cfg.model);
        Ok(cfg)
    }
}

impl SftTrainer {
    /// Loads the model, tokenizer and dataset, tokenizes every row and sets up the optimizer.
    pub fn new(config: SftConfig) -> Result<Self, SftError> {
        Self::build(config, None)
    }

    /// Continues a run from a checkpoint folder written by [`SftTrainer::save_checkpoint`].
    pub fn resume_from(config: SftConfig, checkpoint: &Path) -> Result<Self, SftError> {
        Self::build(config, Some(checkpoint))
    }

    fn build(config: SftConfig, checkpoint: Option<&Path>) -> Result<Self, SftError> {
        if config.batch_size == 0 || config.gradient_accumulation_steps == 0 {
            return Err(SftError::Config(
                "batch_size and gradient_accumulation_steps must be at least 1".into(),
            ));
        }
        let packing = config
            .packing
            .as_deref()
            .map(str::parse::<PackingStrategy>)
            .transpose()
            .map_err(SftError::Config)?;
        let pad: PadTo = config.pad_to_multiple_of.parse().map_err(other)?;
        let platform: Platform = config.platform.parse().map_err(other)?;
        let dir = crate::hub::HubCache::from_env()
            .model_dir(&config.model)
            .map_err(other)?;
        let dtype = crate::model::parse_kind(&config.dtype).map_err(other)?;
        let weights_dir = checkpoint.unwrap_or(&dir);
        let model = Model::load(
            weights_dir,
            LoadOptions {
                dtype: Some(dtype),
                device: crate::device::parse_device(&config.device).map_err(|e| SftError::Config(e.to_string()))?,
            },
        )
        .map_err(other)?;
        let tokenizer = Tokenizer::from_dir(&dir).map_err(other)?;
        let pad_id = tokenizer
            .pad_token_id()
            .map(i64::from)
            .or(model.lm.config.pad_token_id)
            .unwrap_or(0);
        let ds = if config.dataset.exists() {
            Dataset::open(&config.dataset)
        } else {
            let spec = config.dataset.to_string_lossy();
            Dataset::from_hub(
                &crate::hub::HubCache::from_env(),
                &spec,
                config.dataset_split.as_deref(),
            )
        }
        .map_err(other)?;
        let mut skipped_rows = 0;
        let mut rows = Vec::new();
        {
            let mut skipped_examples = 0;
            for (i, ex) in ds.examples(config.skip_invalid_rows, &mut skipped_examples).enumerate() {
                let ex = ex.map_err(|e| SftError::Data(e.to_string()))?;
                match tokenize(&tokenizer, &ex, i, &config.tokenize) {
                    Ok(t) => rows.push(t),
                    Err(e) if config.skip_invalid_rows => {
                        let _ = e;
                        skipped_rows += 1;
                    }
                    Err(e) => return Err(SftError::Data(e)),
                }
            }
            skipped_rows += skipped_examples;
        }
        // Held-out rows: a seeded choice, stable across resumes.
        let mut order: Vec<usize> = (0..rows.len()).collect();
        shuffle(&mut order, config.seed ^ 0xe7a1);
        let n_eval = ((rows.len() as f64) * config.eval_fraction).round() as usize;
        let eval: Vec<TrainExample> = order[..n_eval].iter().map(|&i| rows[i].clone()).collect();
        let mut train_idx = order[n_eval..].to_vec();
        train_idx.sort_unstable();
        let train: Vec<TrainExample> = train_idx.iter().map(|&i| rows[i].clone()).collect();
        if train.is_empty() {
            return Err(SftError::Data("no training rows".into()));
        }
        let mut trainer = SftTrainer {
            optimizer: AdamW::new(&model.vs, config.adamw),
            schedule: LrSchedule {
                lr: config.learning_rate,
                kind: config.lr_scheduler,
                warmup_steps: 0,
                total_steps: 0,
            },
            model,
            tokenizer,
            state: TrainerState {
                skipped_rows,
                ..Default::default()
            },
            ledger: ShapeLedger::default(),
            train,
            eval,
            pad_multiple: pad.resolve(platform),
            packing,
            pad_id,
            epoch_batches: None,
            config,
        };
        let per_epoch = (trainer.micro_batches(0).len() / trainer.config.gradient_accumulation_steps).max(1) as u64;
        let total = trainer
            .config
            .max_steps
            .unwrap_or((per_epoch as f64 * trainer.config.num_train_epochs).ceil() as u64);
        trainer.schedule = match trainer.config.warmup_steps {
            Some(w) => LrSchedule {
                lr: trainer.config.learning_rate,
                kind: trainer.config.lr_scheduler,
                warmup_steps: w,
                total_steps: total,
            },
            None => LrSchedule::with_warmup_ratio(
                trainer.config.learning_rate,
                trainer.config.lr_scheduler,
                trainer.config.warmup_ratio,
                total,
            ),
        };
        trainer.state.total_steps = total;
        if let Some(ckpt) = checkpoint {
            trainer.state = crate::train::load_checkpoint(ckpt, &mut trainer.optimizer).map_err(SftError::Other)?;
        }
        Ok(trainer)
    }

    /// The epoch's micro-batches: a seeded permutation of the rows, batched (or packed).
    fn micro_batches(&self, epoch: u64) -> Vec<MicroBatch> {
        let mut order: Vec<usize> = (0..self.train.len()).collect();
        shuffle(&mut order, self.config.seed.wrapping_add(epoch));
        let rows: Vec<Vec<usize>> = match self.packing {
            None => order.into_iter().map(|i| vec![i]).collect(),
            Some(strategy) => {
                let lengths: Vec<usize> = order.iter().map(|&i| self.train[i].input_ids.len()).collect();
                pack(&lengths, self.config.tokenize.max_length, strategy)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|r| r.pieces.iter().map(|p| order[p.0]).collect())
                    .collect()
            }
        };
        rows.chunks(self.config.batch_size)
            .map(<[Vec<usize>]>::to_vec)
            .collect()
    }

    /// [`SftTrainer::micro_batches`] of `epoch`, computed once per epoch.
    fn cached_batches(&mut self, epoch: u64) -> std::sync::Arc<Vec<MicroBatch>> {
        match &self.epoch_batches {
            Some((e, b)) if *e == epoch => b.clone(),
            _ => {
                let b = std::sync::Arc::new(self.micro_batches(epoch));
                self.epoch_batches = Some((epoch, b.clone()));
                b
            }
        }
    }

    /// Trained tokens of a micro-batch (what [`SftTrainer::tensors`] emits as targets: masked
    /// positions after each sequence's first token).
    fn trained_tokens(&self, mb: &MicroBatch) -> usize {
        mb.iter()
            .flatten()
            .map(|&i| self.train[i].loss_mask.iter().skip(1).filter(|&&m| m == 1).count())
            .sum()
    }

    /// The tensors of a micro-batch (rows concatenated, right-padded to a common length).
    fn tensors(&self, mb: &MicroBatch) -> BatchTensors {
        let rows: Vec<RowParts> = mb
            .iter()
            .map(|examples| {
                let mut r = RowParts::default();
                for (s, &i) in examples.iter().enumerate() {
                    let ex = &self.train[i];
                    r.ids.extend(&ex.input_ids);
                    r.pos.extend(0..ex.input_ids.len() as i64);
                    r.seq.extend(std::iter::repeat_n(s as i64, ex.input_ids.len()));
                    r.mask.extend(&ex.loss_mask);
                }
                r
            })
            .collect();
        let longest = rows.iter().map(|r| r.ids.len()).max().unwrap_or(1);
        let t = crate::device::round_up(longest, self.pad_multiple);
        let b = rows.len();
        let (mut ids, mut pos, mut seq) = (
            Vec::with_capacity(b * t),
            Vec::with_capacity(b * t),
            Vec::with_capacity(b * t),
        );
        let (mut src, mut tgt) = (Vec::new(), Vec::new());
        let mut real = 0;
        for (k, r) in rows.iter().enumerate() {
            for j in 1..r.ids.len() {
                if r.mask[j] == 1 && r.seq[j] == r.seq[j - 1] {
                    src.push((k * t + j - 1) as i64);
                    tgt.push(r.ids[j]);
                }
            }
            real += r.ids.len();
            let pad = t - r.ids.len();
            ids.extend(r.ids.iter().copied().chain(std::iter::repeat_n(self.pad_id, pad)));
            pos.extend(r.pos.iter().copied().chain(std::iter::repeat_n(0, pad)));
            seq.extend(r.seq.iter().copied().chain(std::iter::repeat_n(-1, pad)));
        }
        let shape = [b as i64, t as i64];
        BatchTensors {
            ids: Tensor::from_slice(&ids).view(shape),
            pos: Tensor::from_slice(&pos).view(shape),
            seq: Tensor::from_slice(&seq).view(shape),
            src,
            tgt,
            real,
            total: b * t,
        }
    }

    /// Sum of the token NLLs of a micro-batch (differentiable) and its trained-token count.
    fn nll(&mut self, mb: &MicroBatch) -> Result<(Tensor, usize, usize, usize), SftError> {
        let BatchTensors {
            ids,
            pos,
            seq,
            src,
            tgt,
            real,
            total,
        } = self.tensors(mb);
        debug_assert_eq!(self.trained_tokens(mb), tgt.len(), "window normalisation counts differ");
        self.ledger.record("sft/forward", &ids.size());
        let device = self.model.lm.device();
        let layout = AttentionLayout::Packed {
            sequence_ids: seq.to_device(device),
        };
        let hidden = self
            .model
            .lm
            .forward_hidden(&ids.to_device(device), &pos.to_device(device), &layout)
            .map_err(other)?;
        let h = hidden
            .view([-1, self.model.lm.config.hidden_size])
            .index_select(0, &Tensor::from_slice(&src).to_device(device));
        let lp = target_logprobs(
            &h,
            self.model.lm.lm_head_weight(),
            &Tensor::from_slice(&tgt),
            LogprobChunks::default(),
        )
        .map_err(other)?;
        Ok((-lp.sum(Kind::Float), tgt.len(), real, total))
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches.
    pub fn step(&mut self) -> Result<StepMetrics, SftError> {
        let start = Instant::now();
        let mut window: Vec<MicroBatch> = Vec::new();
        while window.len() < self.config.gradient_accumulation_steps {
            let batches = self.cached_batches(self.state.epoch);
            if self.state.micro_batch >= batches.len() {
                self.state.epoch += 1;
                self.state.micro_batch = 0;
                continue;
            }
            window.push(batches[self.state.micro_batch].clone());
            self.state.micro_batch += 1;
        }
        // The loss is normalised over every trained token of the window, not per micro-batch.
        let window_tokens: usize = window.iter().map(|mb| self.trained_tokens(mb)).sum::<usize>().max(1);
        let (mut loss_sum, mut real, mut total) = (0.0, 0usize, 0usize);
        let rows: Vec<usize> = window.iter().flatten().flatten().copied().collect();
        let step = self.state.global_step + 1;
        for mb in &window {
            let (nll, _, r, t) = self.nll(mb)?;
            loss_sum += nll.double_value(&[]);
            (nll / window_tokens as f64).backward();
            real += r;
            total += t;
        }
        let grad_norm = self.optimizer.clip_grad_norm(self.config.max_grad_norm);
        let lr = self.schedule.lr_at(self.state.global_step);
        let bad = if !loss_sum.is_finite() {
            Some("loss")
        } else if !grad_norm.is_finite() {
            Some("gradient norm")
        } else {
            None
        };
        if let Some(what) = bad {
            self.optimizer.zero_grad();
            if self.config.on_nan == NanPolicy::Stop {
                return Err(SftError::NonFinite { step, what, rows });
            }
            self.state.skipped_steps += 1;
        } else {
            self.optimizer.step(lr).map_err(other)?;
            self.optimizer.zero_grad();
        }
        self.state.global_step = step;
        let per_epoch = self.cached_batches(self.state.epoch).len().max(1) as f64;
        let m = StepMetrics {
            step,
            epoch: self.state.epoch as f64 + self.state.micro_batch as f64 / per_epoch,
            loss: loss_sum / window_tokens as f64,
            lr,
            grad_norm,
            tokens_per_s: real as f64 / start.elapsed().as_secs_f64().max(1e-9),
            padding_fraction: 1.0 - real as f64 / total.max(1) as f64,
            skipped: bad.is_some(),
        };
        if let Some(dir) = &self.config.output_dir {
            crate::train::append_log(dir, &m);
        }
        self.state.history.push(m.clone());
        Ok(m)
    }

    /// Runs `n` steps (or until the run's last step).
    pub fn train_for(&mut self, n: u64) -> Result<Option<StepMetrics>, SftError> {
        let mut last = None;
        for _ in 0..n {
            if self.state.global_step >= self.state.total_steps {
                break;
            }
            last = Some(self.step()?);
        }
        Ok(last)
    }

    /// Mean loss per trained token on the held-out rows.
    pub fn evaluate(&mut self) -> Result<f64, SftError> {
        if self.eval.is_empty() {
            return Err(SftError::Config("no held-out rows (eval_fraction is 0)".into()));
        }
        let saved = std::mem::take(&mut self.train);
        self.train = self.eval.clone();
        let batches: Vec<MicroBatch> = (0..self.train.len())
            .collect::<Vec<_>>()
            .chunks(self.config.batch_size)
            .map(|c| c.iter().map(|&i| vec![i]).collect())
            .collect();
        let mut result = Ok((0.0, 0usize));
        for mb in &batches {
            match tch::no_grad(|| self.nll(mb)) {
                Ok((nll, n, _, _)) => {
                    if let Ok((s, c)) = &mut result {
                        *s += nll.double_value(&[]);
                        *c += n;
                    }
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.train = saved;
        let (s, c) = result?;
        let loss = s / c.max(1) as f64;
        self.state.eval_history.push((self.state.global_step, loss));
        Ok(loss)
    }

    /// Writes `output_dir/checkpoint-<step>/`: the model as a Hugging Face folder, the optimizer
    /// and the trainer state, atomically (a temporary folder renamed into place).
    pub fn save_checkpoint(&self) -> Result<PathBuf, SftError> {
        let out = self
            .config
            .output_dir
            .clone()
            .ok_or_else(|| SftError::Config("output_dir is not set".into()))?;
        crate::train::save_checkpoint(
            &out,
            self.state.global_step,
            &self.model,
            &self.tokenizer.dir,
            &self.optimizer,
            &self.state,
        )
        .map_err(SftError::Other)
    }

    /// The input shapes one epoch of training would feed the model, priced as Neuron compiles:
    /// what `pad_to_multiple_of` buys before any Trainium time is spent.
    pub fn epoch_shapes(&self, epoch: u64) -> ShapeLedger {
        let mut ledger = ShapeLedger::default();
        for mb in self.micro_batches(epoch) {
            ledger.record("sft/forward", &self.tensors(&mb).ids.size());
        }
        ledger
    }

    /// The learning-rate schedule of the run.
    pub fn lr_schedule(&self) -> &LrSchedule {
        &self.schedule
    }

    /// Training rows (after the held-out split).
    pub fn num_train_rows(&self) -> usize {
        self.train.len()
    }
}

/// Fisher-Yates with a seeded generator.
fn shuffle(v: &mut [usize], seed: u64) {
    let mut rng = SplitMix64::new(seed);
    for i in (1..v.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        v.swap(i, j);
    }
}

impl Rich for TrainerState {
    fn html(&self) -> String {
        let pts = |f: fn(&StepMetrics) -> f64| -> Vec<(f64, f64)> {
            self.history
                .iter()
                .filter(|m| !m.skipped)
                .map(|m| (m.step as f64, f(m)))
                .collect()
        };
        let mut loss = LineChart::new("Loss", "step", "loss per token").with_series("train", pts(|m| m.loss));
        if !self.eval_history.is_empty() {
            loss = loss.with_series("eval", self.eval_history.iter().map(|&(s, l)| (s as f64, l)).collect());
        }
        let lr = LineChart::new("Learning rate", "step", "lr").with_series("lr", pts(|m| m.lr));
        let last = self.history.last();
        let rows = vec![
            ("step", format!("{} / {}", self.global_step, self.total_steps)),
            ("epoch", format!("{:.2}", last.map_or(0.0, |m| m.epoch))),
            ("loss", last.map_or("-".into(), |m| format!("{:.4}", m.loss))),
            ("grad norm", last.map_or("-".into(), |m| format!("{:.3}", m.grad_norm))),
            (
                "tokens/s",
                last.map_or("-".into(), |m| format!("{:.0}", m.tokens_per_s)),
            ),
            (
                "padding",
                last.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m.padding_fraction)),
            ),
            (
                "skipped steps / rows",
                format!("{} / {}", self.skipped_steps, self.skipped_rows),
            ),
        ];
        let rows: Vec<(&str, String)> = rows.into_iter().map(|(k, v)| (k, escape(&v))).collect();
        display::style::container(&format!(
            "{}{}{}",
            display::section("Training", &display::kv_table(&rows)),
            loss.to_svg(),
            lr.to_svg()
        ))
    }

    fn text(&self) -> String {
        match self.history.last() {
            Some(m) => format!(
                "step {}/{} epoch {:.2}: loss {:.4}, lr {:.2e}, grad norm {:.3}, {:.0} tokens/s\n",
                self.global_step, self.total_steps, m.epoch, m.loss, m.lr, m.grad_norm, m.tokens_per_s
            ),
            None => format!("step 0/{}: not started\n", self.total_steps),
        }
    }
}

crate::rich_display!(TrainerState);

impl Rich for SftTrainer {
    fn html(&self) -> String {
        self.state.html()
    }
    fn text(&self) -> String {
        self.state.text()
    }
}

crate::rich_display!(SftTrainer);

impl Rich for StepMetrics {
    fn html(&self) -> String {
        display::config_html(&format!("SFT step {}", self.step), self)
    }
    fn text(&self) -> String {
        format!(
            "step {}: loss {:.4}, lr {:.2e}, grad norm {:.3}, {:.0} tokens/s, padding {:.1}%{}\n",
            self.step,
            self.loss,
            self.lr,
            self.grad_norm,
            self.tokens_per_s,
            100.0 * self.padding_fraction,
            if self.skipped { " (skipped)" } else { "" }
        )
    }
}

crate::rich_display!(StepMetrics);

impl Rich for SftConfig {
    fn html(&self) -> String {
        display::config_html("SFT config", self)
    }
    fn text(&self) -> String {
        display::config_text(self)
    }
}

crate::rich_display!(SftConfig);
