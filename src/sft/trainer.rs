//! The SFT trainer: step by step from a notebook cell, or `train_for(n)`; checkpoints resume
//! bit-exact on CPU.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use tch::{Kind, Tensor};

use super::collate::{BatchTensors, Collator, MicroBatch};
use super::config::SftConfig;
use super::tokenize;
use super::tokenize::TrainExample;
use crate::distributed::share;
use crate::model::moe::RouterLoss;
use crate::model::{
    Activations, AttentionLayout, Inputs, LogprobChunks, Model, ModelConfig, Pass, nll_backward_chunked,
    target_logprobs,
};
use crate::shapes::ShapeLedger;
use crate::tokenizer::Tokenizer;
use crate::train::{LrSchedule, NanPolicy, Scalars, TrainConfig, TrainCore, TrainError, Trainer};

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
    /// A mixture model's load-balancing loss, the mean over the step's micro-batches (and
    /// ranks); its `router_aux_loss_coef` multiple is in the gradient, not in `loss`. `None`
    /// for a dense model or with `router_aux_loss_coef = 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux_loss: Option<f64>,
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

/// A held-out evaluation: mean loss per trained token.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SftEval {
    /// Steps done when evaluated.
    pub step: u64,
    /// Mean loss per trained token of the held-out rows.
    pub loss: f64,
    /// Trained tokens scored.
    pub tokens: usize,
}

/// TensorBoard and CSV tags: transformers' names (`train/learning_rate`).
impl Scalars for StepMetrics {
    const SECTION: &'static str = "train";
    const RENAMES: &'static [(&'static str, &'static str)] = &[("lr", "learning_rate")];
    fn step(&self) -> u64 {
        self.step
    }
}

/// `eval/loss`, `eval/tokens`.
impl Scalars for SftEval {
    const SECTION: &'static str = "eval";
    fn step(&self) -> u64 {
        self.step
    }
}

/// Supervised fine-tuning of a causal LM on conversations or prompt/completion pairs.
///
/// The configuration is fixed once built ([`SftTrainer::config`] reads it); build a new trainer
/// (or resume from a checkpoint) to change it.
pub struct SftTrainer {
    /// Progress and metrics.
    pub state: TrainerState,
    /// Input shapes of every forward (what Neuron would compile).
    pub ledger: ShapeLedger,
    config: SftConfig,
    core: TrainCore,
    collator: Collator,
    train: Vec<TrainExample>,
    eval: Vec<TrainExample>,
    /// The current epoch's micro-batches (shuffling and packing every row is not free).
    epoch_batches: Option<(u64, Arc<Vec<MicroBatch>>)>,
}

impl std::fmt::Debug for SftTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SftTrainer")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl SftTrainer {
    /// Loads the model, tokenizer and dataset, tokenizes every row and sets up the optimizer.
    pub fn new(config: SftConfig) -> Result<Self, TrainError> {
        Self::build(config, None)
    }

    /// Continues a run from a checkpoint folder written by [`Trainer::save_checkpoint`].
    pub fn resume_from(config: SftConfig, checkpoint: &Path) -> Result<Self, TrainError> {
        Self::build(config, Some(checkpoint))
    }

    fn build(config: SftConfig, checkpoint: Option<&Path>) -> Result<Self, TrainError> {
        config.validate()?;
        let checkpoint = config.train.checkpoint_to_resume(checkpoint)?;
        let checkpoint = checkpoint.as_deref();
        let mut core = TrainCore::load(&config.train, checkpoint, &config)?;
        core.logs.set_settings(&config);
        let (rows, skipped_rows) = tokenized_rows(&config, &core.tokenizer, &core.model.lm.config)?;
        let total_rows = rows.len();
        let (train, eval) = split_held_out(rows, &config);
        if config.train.output.eval_steps.is_some() && eval.is_empty() {
            return Err(TrainError::config(
                "eval_steps",
                format!(
                    "is set, but eval_fraction {} of {total_rows} rows holds out none: there is nothing to evaluate on",
                    config.eval_fraction
                ),
            ));
        }
        if train.is_empty() {
            return Err(TrainError::Data("no training rows".into()));
        }
        // Micro-batches are global: `batch_size` rows per process, each rank forwarding its share.
        let collator = Collator {
            batch_size: config.batch_size * core.world.size,
            packing: config.packing,
            max_length: config.tokenize.max_length,
            pad_multiple: config
                .pad_to_multiple_of
                .resolve(config.platform_for(core.model.device())),
            pad_id: core.special.pad,
        };
        let first_epoch = Arc::new(collator.epoch(&train, config.train.seed, 0)?);
        let per_epoch = (first_epoch.len() / config.gradient_accumulation_steps).max(1);
        let total = config
            .max_steps
            .unwrap_or((per_epoch as f64 * config.num_train_epochs).ceil() as u64);
        core.set_schedule(&config.train, total);
        let mut state = TrainerState {
            skipped_rows,
            total_steps: total,
            ..Default::default()
        };
        if let Some(ckpt) = checkpoint {
            state = core.resume(ckpt, total)?;
            // The config's length wins: a resumed run may be extended (or cut to where it is).
            state.total_steps = total;
        }
        Ok(SftTrainer {
            state,
            ledger: ShapeLedger::default(),
            config,
            core,
            collator,
            train,
            eval,
            epoch_batches: Some((0, first_epoch)),
        })
    }

    /// The configuration (fixed once built).
    pub fn config(&self) -> &SftConfig {
        &self.config
    }

    /// What a non-finite step does from now on (the one setting that may change mid-run:
    /// `stop` to investigate a run that started skipping).
    pub fn set_on_nan(&mut self, policy: NanPolicy) {
        self.config.train.optimizer.on_nan = policy;
    }

    /// The model being trained.
    pub fn model(&self) -> &Model {
        &self.core.model
    }

    /// Its tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.core.tokenizer
    }

    /// The epoch's micro-batches, computed once per epoch.
    fn batches_of(&mut self, epoch: u64) -> Result<Arc<Vec<MicroBatch>>, TrainError> {
        if let Some((e, b)) = &self.epoch_batches
            && *e == epoch
        {
            return Ok(b.clone());
        }
        let b = Arc::new(self.collator.epoch(&self.train, self.config.train.seed, epoch)?);
        self.epoch_batches = Some((epoch, b.clone()));
        Ok(b)
    }

    /// The next `gradient_accumulation_steps` micro-batches, moving across epochs.
    fn next_window(&mut self) -> Result<Vec<MicroBatch>, TrainError> {
        let mut window = Vec::with_capacity(self.config.gradient_accumulation_steps);
        while window.len() < self.config.gradient_accumulation_steps {
            let batches = self.batches_of(self.state.epoch)?;
            if self.state.micro_batch >= batches.len() {
                self.state.epoch += 1;
                self.state.micro_batch = 0;
                continue;
            }
            window.push(batches[self.state.micro_batch].clone());
            self.state.micro_batch += 1;
        }
        Ok(window)
    }

    /// One optimizer step over `gradient_accumulation_steps` micro-batches (global ones: in a
    /// multi-process run each rank forwards its share of every micro-batch's rows).
    pub fn step(&mut self) -> Result<StepMetrics, TrainError> {
        let step = self.state.global_step;
        crate::train::out_of_memory::guard(step, "batch_size or max_length", || self.step_unguarded()).inspect_err(
            |e| {
                if matches!(e, TrainError::OutOfMemory { .. }) {
                    self.core.optim.discard_gradients();
                }
            },
        )
    }

    fn step_unguarded(&mut self) -> Result<StepMetrics, TrainError> {
        let device = self.core.model.device();
        crate::device::privateuse1::checked(device, || {
            let start = Instant::now();
            let window = self.next_window()?;
            // The loss is normalised over every trained token of the global window, not per
            // micro-batch or per rank: every rank counts them from the same rows, so no message is
            // needed for it.
            let window_tokens: usize = window
                .iter()
                .map(|mb| Collator::trained_tokens(&self.train, mb))
                .sum::<usize>()
                .max(1);
            // [loss sum, real tokens, forwarded tokens, aux loss sum, forwards with an aux loss]
            // of this rank, then of the whole world.
            let mut sums = [0.0; 5];
            let coef = self.router_coef(&window);
            let training = self.core.model.training();
            let activations = Activations::from_checkpointing(self.config.train.precision.gradient_checkpointing);
            // Every rank makes a pass (or an idle one) per micro-batch.
            self.core.model.lm.expect_backward_passes(window.len());
            for mb in &window {
                let mine: MicroBatch = mb[self.core.world.share(mb.len())].to_vec();
                if mine.is_empty() {
                    // Sharded parameters: the other ranks' pass gathers them from this one too.
                    self.core.model.lm.idle_pass(Pass::ForwardBackward)?;
                    continue;
                }
                let b = self.collator.tensors(&self.train, &mine);
                let pass = MicroPass {
                    tokens: window_tokens as f64,
                    chunk: self.config.lm_head_chunk_tokens,
                    activations,
                    router_aux_loss_coef: coef,
                };
                let (nll, aux) = backward_nll(&self.core.model, &mut self.ledger, &b, pass)
                    .inspect_err(|_| self.core.optim.discard_gradients())?;
                sums[0] += nll;
                sums[1] += b.real as f64;
                sums[2] += b.total as f64;
                if let Some(aux) = aux {
                    sums[3] += aux;
                    sums[4] += 1.0;
                }
            }
            drop(training);
            self.core.world.sum(&mut sums)?;
            let [loss_sum, real, total, aux_sum, aux_passes] = sums;
            let step = self.state.global_step;
            let rows = || window.iter().flatten().flatten().map(|p| p.0).collect();
            let outcome = self.core.optim.finish_step(&self.config.train, step, loss_sum, rows)?;
            self.state.skipped_steps += usize::from(outcome.skipped);
            self.state.global_step = step + 1;
            let per_epoch = self.batches_of(self.state.epoch)?.len().max(1) as f64;
            let m = StepMetrics {
                step: step + 1,
                epoch: self.state.epoch as f64 + self.state.micro_batch as f64 / per_epoch,
                loss: loss_sum / window_tokens as f64,
                lr: outcome.lr,
                grad_norm: outcome.grad_norm,
                tokens_per_s: real / start.elapsed().as_secs_f64().max(1e-9),
                padding_fraction: 1.0 - real / total.max(1.0),
                skipped: outcome.skipped,
                aux_loss: (aux_passes > 0.0).then(|| aux_sum / aux_passes),
            };
            self.core.log(&m);
            self.state.history.push(m.clone());
            Ok(m)
        })
    }

    /// Mean loss per trained token on the held-out rows.
    pub fn evaluate(&mut self) -> Result<f64, TrainError> {
        crate::device::privateuse1::checked(self.core.model.device(), || Ok(self.evaluate_rows()?.loss))
    }

    fn evaluate_rows(&mut self) -> Result<SftEval, TrainError> {
        if self.eval.is_empty() {
            return Err(TrainError::config("eval_fraction", "is 0: there are no held-out rows"));
        }
        // Each rank scores its share of the held-out micro-batches; the sums are global.
        let batches = self.collator.in_order(&self.eval);
        let mut sums = [0.0; 2];
        let mine = &batches[self.core.world.share(batches.len())];
        for mb in mine {
            let b = self.collator.tensors(&self.eval, mb);
            sums[0] += tch::no_grad(|| forward_nll(&self.core.model, &mut self.ledger, &b))?.double_value(&[]);
            sums[1] += b.tgt.len() as f64;
        }
        // Sharded parameters: as many passes as the rank with the most batches.
        for _ in mine.len()..batches.len().div_ceil(self.core.world.size) {
            self.core.model.lm.idle_pass(Pass::Forward)?;
        }
        self.core.world.sum(&mut sums)?;
        let (loss, tokens) = (sums[0] / sums[1].max(1.0), sums[1] as usize);
        self.state.eval_history.push((self.state.global_step, loss));
        let eval = SftEval {
            step: self.state.global_step,
            loss,
            tokens,
        };
        self.core.log_eval(&eval);
        Ok(eval)
    }

    /// The input shapes one epoch of training would feed the model, priced as Neuron compiles:
    /// what `pad_to_multiple_of` buys before any Trainium time is spent.
    pub fn epoch_shapes(&self, epoch: u64) -> Result<ShapeLedger, TrainError> {
        let mut ledger = ShapeLedger::default();
        for mb in self.collator.epoch(&self.train, self.config.train.seed, epoch)? {
            ledger.record("sft/forward", &self.collator.tensors(&self.train, &mb).ids.size());
        }
        Ok(ledger)
    }

    /// The learning-rate schedule of the run.
    pub fn lr_schedule(&self) -> &LrSchedule {
        &self.core.optim.schedule
    }

    /// Training rows (after the held-out split).
    pub fn num_train_rows(&self) -> usize {
        self.train.len()
    }
}

impl Trainer for SftTrainer {
    type Config = SftConfig;
    type Metrics = StepMetrics;
    type Eval = SftEval;
    type State = TrainerState;

    fn from_config(config: SftConfig, resume_from: Option<&Path>) -> Result<Self, TrainError> {
        Self::build(config, resume_from)
    }
    fn step(&mut self) -> Result<StepMetrics, TrainError> {
        SftTrainer::step(self)
    }
    fn core(&self) -> &TrainCore {
        &self.core
    }
    fn train_config(&self) -> &TrainConfig {
        &self.config.train
    }
    fn state(&self) -> &TrainerState {
        &self.state
    }
    fn evaluate_held_out(&mut self) -> Result<Option<SftEval>, TrainError> {
        if self.eval.is_empty() {
            return Ok(None);
        }
        self.evaluate_rows().map(Some)
    }
    fn describe(&self) -> String {
        format!(
            "{} training rows ({} skipped), {} steps",
            self.train.len(),
            self.state.skipped_rows,
            self.state.total_steps
        )
    }
}

impl SftTrainer {
    /// The router loss's weight on each forward of `window`: each micro-batch's forward adds
    /// the loss over its own tokens, and the mean over the forwards of the window's
    /// micro-batches on every rank (an idle pass adds none) is what the gradient holds, as the
    /// logged mean is. 0 for a model whose family has no such loss.
    fn router_coef(&self, window: &[MicroBatch]) -> f64 {
        if !self.core.model.lm.config.load_balancing() {
            return 0.0;
        }
        let size = self.core.world.size;
        let forwards = window
            .iter()
            .map(|mb| (0..size).filter(|&r| !share(mb.len(), r, size).is_empty()).count())
            .sum::<usize>();
        self.config.train.router_aux_loss_coef / forwards.max(1) as f64
    }
}

/// Every row of the dataset tokenized; malformed rows are an error naming them, or counted and
/// skipped under `skip_invalid_rows`.
/// Every row tokenized; a row whose ids the model's embedding lacks (a tokenizer larger than
/// the model's `vocab_size`) is an error naming it before any step, or skipped.
fn tokenized_rows(
    config: &SftConfig,
    tokenizer: &Tokenizer,
    model: &ModelConfig,
) -> Result<(Vec<TrainExample>, usize), TrainError> {
    let vocab_size = model.vocab_size;
    let ds = TrainCore::open_dataset(&config.train)?;
    let skip = config.train.data.skip_invalid_rows;
    let (mut rows, mut skipped, mut skipped_examples) = (Vec::new(), 0, 0);
    for (i, ex) in ds.examples(skip, &mut skipped_examples).enumerate() {
        let ex = ex?;
        let in_vocab = |t: TrainExample| match t.input_ids.iter().find(|&&id| id < 0 || id >= vocab_size) {
            Some(id) => Err(format!(
                "{}: row {i} (0-based) tokenizes to id {id}, outside the model's vocab_size {vocab_size}",
                config.train.data.dataset.display()
            )),
            None => match model.tower_token(&t.input_ids) {
                Some(why) => Err(format!(
                    "{}: row {i} (0-based): {why}",
                    config.train.data.dataset.display()
                )),
                None => Ok(t),
            },
        };
        match tokenize(tokenizer, &ex, i, &config.tokenize).and_then(in_vocab) {
            Ok(t) => rows.push(t),
            Err(_) if skip => skipped += 1,
            Err(e) => return Err(TrainError::Data(e)),
        }
    }
    Ok((rows, skipped + skipped_examples))
}

/// `(train, held-out)`: a seeded choice of `eval_fraction` of the rows, stable across resumes;
/// training rows keep the dataset's order.
fn split_held_out(rows: Vec<TrainExample>, config: &SftConfig) -> (Vec<TrainExample>, Vec<TrainExample>) {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    crate::util::SplitMix64::new(config.train.seed ^ 0xe7a1).shuffle(&mut order);
    let n_eval = ((rows.len() as f64) * config.eval_fraction).round() as usize;
    let mut held_out = vec![false; rows.len()];
    for &i in &order[..n_eval] {
        held_out[i] = true;
    }
    let eval = order[..n_eval].iter().map(|&i| rows[i].clone()).collect();
    let train = rows
        .into_iter()
        .zip(held_out)
        .filter(|(_, h)| !h)
        .map(|(r, _)| r)
        .collect();
    (train, eval)
}

/// Sum of the token NLLs of a micro-batch's tensors (differentiable unless under `no_grad`).
fn forward_nll(model: &Model, ledger: &mut ShapeLedger, b: &BatchTensors) -> Result<Tensor, TrainError> {
    let (ids, pos, layout) = batch_inputs(model, ledger, b).map_err(crate::model::ModelError::from)?;
    let hidden = model.lm.forward_hidden(&ids, &pos, &layout)?;
    Ok(nll_of(model, &hidden, b)?)
}

/// How one micro-batch's forward and backward run.
struct MicroPass {
    /// The window's trained tokens, which the NLL is divided by.
    tokens: f64,
    /// LM-head chunk in tokens.
    chunk: i64,
    activations: Activations,
    /// The weight of this forward's load-balancing loss (0: none).
    router_aux_loss_coef: f64,
}

/// [`forward_nll`] back-propagated with the loss divided by `pass.tokens`, plus a mixture
/// model's load-balancing loss over the batch's real tokens: the LM head in chunks, layer
/// activations kept or recomputed; returns the NLL sum and the load-balancing loss.
fn backward_nll(
    model: &Model,
    ledger: &mut ShapeLedger,
    b: &BatchTensors,
    pass: MicroPass,
) -> Result<(f64, Option<f64>), TrainError> {
    let (ids, pos, layout) = batch_inputs(model, ledger, b).map_err(crate::model::ModelError::from)?;
    // The backward graph sees the forward's shapes: a second compiled graph per shape.
    ledger.record("sft/backward", &b.ids.size());
    let chunks = LogprobChunks {
        tokens: pass.chunk,
        ..LogprobChunks::default()
    };
    // Padding (sequence index -1) is left out, as transformers' attention mask leaves it out.
    let router = (pass.router_aux_loss_coef > 0.0)
        .then(|| -> Result<RouterLoss, tch::TchError> {
            Ok(RouterLoss {
                coef: pass.router_aux_loss_coef,
                token_weights: b.seq.f_ge(0)?.f_to_kind(Kind::Float)?,
            })
        })
        .transpose()
        .map_err(crate::model::ModelError::from)?;
    let inputs = Inputs {
        input_ids: &ids,
        position_ids: &pos,
        layout: &layout,
        routing: None,
    };
    Ok(model
        .lm
        .forward_backward_routed(inputs, pass.activations, router.as_ref(), |hidden| {
            let h = trained_hidden(model, hidden, b)?;
            let targets = Tensor::from_slice(&b.tgt);
            let (sum, rest) = nll_backward_chunked(&h, model.lm.head(), &targets, 1.0 / pass.tokens, chunks)?;
            Ok((rest, sum))
        })?)
}

/// The batch's ids, positions and packed layout on the model's device (its shape recorded).
fn batch_inputs(
    model: &Model,
    ledger: &mut ShapeLedger,
    b: &BatchTensors,
) -> Result<(Tensor, Tensor, AttentionLayout), tch::TchError> {
    ledger.record("sft/forward", &b.ids.size());
    let device = model.device();
    // The rows as one (`AttentionLayout::packed`): the hidden states keep the row-major order
    // `b.src` indexes.
    let row_len = b.ids.size()[1];
    let seq = Vec::<i64>::try_from(b.seq.f_flatten(0, -1)?)?;
    let layout = AttentionLayout::packed(&seq, row_len, device)?;
    let (rows, n) = match &layout {
        AttentionLayout::Packed { .. } => (b.ids.size()[0], row_len),
        _ => (1, seq.len() as i64),
    };
    Ok((
        device.put(&b.ids.f_view([rows, n])?)?,
        device.put(&b.pos.f_view([rows, n])?)?,
        layout,
    ))
}

/// The final hidden states `[n, hidden]` at the positions predicting the batch's targets.
fn trained_hidden(model: &Model, hidden: &Tensor, b: &BatchTensors) -> Result<Tensor, tch::TchError> {
    hidden
        .f_view([-1, model.lm.config.hidden_size])?
        .f_index_select(0, &model.device().from_slice(&b.src)?)
}

/// The NLL sum of the batch's targets from the final hidden states (chunked LM head).
fn nll_of(model: &Model, hidden: &Tensor, b: &BatchTensors) -> Result<Tensor, crate::model::ModelError> {
    let h = trained_hidden(model, hidden, b)?;
    let lp = target_logprobs(
        &h,
        model.lm.head(),
        &Tensor::from_slice(&b.tgt),
        LogprobChunks::default(),
    )?;
    Ok(-lp.sum(Kind::Float))
}

crate::train::run_state!(TrainerState);
