//! What both trainers hold and do the same way: the model and tokenizer loaded from the shared
//! settings, the optimizer with its schedule, the dataset opened from a file or the hub cache,
//! checkpoints and the step log, and the processes of the run ([`World`]): one, or several
//! joined by c10d, where rank 0 broadcasts the starting weights, gradients are summed before
//! every update, and only rank 0 writes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::config::TrainConfig;
use super::error::TrainError;
use super::optimization::Optimization;
use super::output_lock::{OutputLock, check_writable};
use super::report::{RunLogs, Scalars};
use super::schedule::LrSchedule;
use super::{checkpoint, parallel, resume};
use crate::data::Dataset;
use crate::device::DeviceSpec;
use crate::distributed::World;
use crate::hub::HubCache;
use crate::model::lora::ADAPTER_CONFIG;
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
    /// The processes of the run (one outside a multi-process launch); shared with a
    /// `full_shard` model, which gathers its layers through it.
    pub world: Arc<World>,
    /// Where metrics go (`report_to`; written by the main rank).
    pub(crate) logs: RunLogs,
    /// The checkpoint this run continued from (spared by `save_total_limit`).
    resumed_from: Option<PathBuf>,
    /// This run's hold on `output_dir` (main rank), released when the core is dropped.
    _output_lock: Option<OutputLock>,
    /// With LoRA: a fingerprint of the frozen base's weights, which the checkpoint does not
    /// hold; a resume onto another base is refused.
    base_fingerprint: Option<String>,
}

impl TrainCore {
    /// Loads the model of `config` (its weights from `checkpoint` when resuming), the tokenizer
    /// and a fresh optimizer; the schedule is set by `TrainCore::set_schedule` once the run's
    /// length is known.
    ///
    /// Under torchrun (or `treetrain launch`) this process joins the run's other processes
    /// first ([`World::from_env`]).
    /// Every rank first checks that all ranks run the same `whole` config (the trainer's, of
    /// which `config` is the training part) and world, and, once the model is loaded, the same
    /// model: a difference is an error naming it on every rank.
    pub(crate) fn load(
        config: &TrainConfig,
        checkpoint: Option<&Path>,
        whole: &impl serde::Serialize,
    ) -> Result<Self, TrainError> {
        config.validate()?;
        let world = World::from_env(
            config.parallel.distributed_timeout(),
            config.parallel.distributed_backend,
            config.device,
        )?;
        let mut settings = crate::distributed::settings_of(&serde_json::to_value(whole).unwrap_or_default());
        settings.push(("world size".into(), world.size.to_string()));
        let resumed = checkpoint.map_or("none".into(), |c| c.display().to_string());
        settings.push(("resumed checkpoint".into(), resumed));
        world.agree("settings", &settings)?;
        Self::load_in(config, checkpoint, world)
    }

    /// [`TrainCore::load`] as one of the processes of `world`: the device index is offset by
    /// the local rank (`cuda` is each rank's own GPU) and rank 0's weights are broadcast.
    pub(crate) fn load_in(config: &TrainConfig, checkpoint: Option<&Path>, world: World) -> Result<Self, TrainError> {
        config.validate()?;
        let output_lock = match config.output.output_dir.as_deref().filter(|_| world.is_main()) {
            Some(out) => Some(claim_output_dir(config, out, checkpoint)?),
            None => None,
        };
        let logs = RunLogs::new(config, world.is_main())?;
        let model_dir = HubCache::from_env().model_dir(&config.model)?;
        let device = rank_device(config.device, &world).resolve()?;
        let load_options = LoadOptions {
            dtype: Some(config.precision.dtype.resolve(device).kind()),
            device,
        };
        let model = load_policy(config, &model_dir, checkpoint, load_options)?;
        let base_fingerprint = match &model.adapter {
            Some(_) => Some(crate::model::weights_fingerprint(&model.vs)?),
            None => None,
        };
        // Every trained variable, by name (the same order on every rank).
        let variables: std::collections::BTreeMap<String, tch::Tensor> =
            model.trainable().variables().into_iter().collect();
        world.agree(
            "models",
            &model_settings(&model, &variables, base_fingerprint.as_deref()),
        )?;
        world.broadcast_from_main(&variables.values().collect::<Vec<_>>())?;
        let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir)?);
        let special = SpecialTokens::resolve(Some(&tokenizer), &model.lm.config);
        let mut model = model;
        let world = Arc::new(world);
        let strategy = parallel::choose(config, &world, &mut model)?;
        let optim = Optimization::new(strategy, schedule(config, 0));
        world.set_held(optim.held());
        Ok(TrainCore {
            model,
            tokenizer,
            model_dir,
            load_options,
            optim,
            special,
            world,
            logs,
            resumed_from: None,
            _output_lock: output_lock,
            base_fingerprint,
        })
    }

    /// A second instance of the policy with the same current weights (a generation thread's
    /// copy): the base loaded again and the trained variables copied (with LoRA, the adapter
    /// alone, attached to a fresh base).
    /// Under `full_shard` the weights are gathered for the copy (a collective every rank calls).
    pub(crate) fn copy_of_policy(&self) -> Result<Model, TrainError> {
        let mut copy = Model::load(&self.model_dir, self.load_options)?;
        self.model.lm.with_whole_weights(|| self.copy_into(&mut copy))?;
        Ok(copy)
    }

    /// The trained variables copied into `copy`, a fresh load of the policy.
    fn copy_into(&self, copy: &mut Model) -> Result<(), TrainError> {
        match &self.model.adapter {
            Some(adapter) => {
                copy.copy_adapter_from(adapter)?;
            }
            // Straight from the live weights: no intermediate deep copy of the whole model.
            None => {
                let weights: Vec<(String, tch::Tensor)> = self.model.vs.variables().into_iter().collect();
                super::snapshot::load_snapshot(&copy.vs, &weights)?
            }
        }
        Ok(())
    }

    /// Sets the learning-rate schedule for a run of `total_steps`.
    pub(crate) fn set_schedule(&mut self, config: &TrainConfig, total_steps: u64) {
        self.optim.schedule = schedule(config, total_steps);
    }

    /// The training data: `config.data.dataset` as a file or folder when it exists, else as a dataset
    /// repo id in the Hugging Face cache; split `dataset_split` (default `train`) of a folder
    /// or repo, as `datasets.load_dataset` splits it.
    pub(crate) fn open_dataset(config: &TrainConfig) -> Result<Dataset, TrainError> {
        if config.data.dataset.exists() {
            return Ok(Dataset::open_split(
                &config.data.dataset,
                config.data.dataset_split.as_deref(),
            )?);
        }
        let spec = config.data.dataset.to_string_lossy();
        Ok(Dataset::from_hub(
            &HubCache::from_env(),
            &spec,
            config.data.dataset_split.as_deref(),
        )?)
    }

    /// Writes `output_dir/checkpoint-<step>/` atomically: the model as a Hugging Face folder
    /// (with the tokenizer files), the optimizer state (not with `save_only_model`) and `state`
    /// with the run's world size and log folder; then deletes checkpoints beyond
    /// `save_total_limit`. Every rank calls it: rank 0 writes the model and the state; a
    /// sharded optimizer's ranks each write their shard, and rank 0 the manifest last.
    pub fn save_checkpoint(
        &self,
        config: &TrainConfig,
        step: u64,
        state: &impl serde::Serialize,
    ) -> Result<PathBuf, TrainError> {
        self.save_checkpoint_with(config, step, state, |_| Ok(()))
    }

    /// [`TrainCore::save_checkpoint`] with `extra` writing a trainer's own files into the
    /// checkpoint folder before it is renamed into place.
    pub(crate) fn save_checkpoint_with(
        &self,
        config: &TrainConfig,
        step: u64,
        state: &impl serde::Serialize,
        extra: impl FnOnce(&Path) -> Result<(), String>,
    ) -> Result<PathBuf, TrainError> {
        let out = config
            .output
            .output_dir
            .as_deref()
            .ok_or_else(|| TrainError::config("output_dir", "is not set: nowhere to write a checkpoint"))?;
        let staged = checkpoint::Staged::new(out, step, &self.world)?;
        // The model first: under `full_shard` its writing gathers unit by unit, collectives
        // every rank makes whatever else fails.
        let mut mine = self.write_model(staged.path());
        if mine.is_ok() && !config.output.save_only_model {
            let written = self.optim.write_state(staged.path());
            mine = written.map_err(|e| staged.error(e.to_string()));
        }
        if mine.is_ok() && self.world.is_main() {
            mine = self
                .write_state(staged.path(), (config, state), extra)
                .map_err(|m| staged.error(m));
        }
        let optim = &self.optim;
        let dir = staged.commit(&self.world, mine, |tmp| {
            optim.write_manifest(tmp).map_err(|e| e.to_string())
        })?;
        if let (Some(limit), true) = (config.output.save_total_limit, self.world.is_main()) {
            let keep: Vec<&Path> = [Some(dir.as_path()), self.resumed_from.as_deref()]
                .into_iter()
                .flatten()
                .collect();
            resume::rotate(out, limit, &keep)?;
        }
        Ok(dir)
    }

    /// The model into the checkpoint folder `dir`: rank 0 writes a Hugging Face folder (or a
    /// LoRA run's adapter as PEFT's folder) with the tokenizer files; a sharded model's ranks
    /// take part in gathering it.
    fn write_model(&self, dir: &Path) -> Result<(), TrainError> {
        let main = self.world.is_main();
        let tokenizer = &self.tokenizer.dir;
        match &self.model.adapter {
            // A LoRA run's checkpoint is the adapter in PEFT's format: the base is the run's
            // `model`. The adapter is small; it is gathered whole.
            Some(adapter) => self.model.lm.with_whole_weights(|| match main {
                true => {
                    adapter.write_files(dir)?;
                    Ok(crate::tokenizer::copy_tokenizer_files(tokenizer, dir)?)
                }
                false => Ok(()),
            }),
            None => {
                let file = dir.join("model.safetensors");
                self.model.write_weights_by_unit(main.then_some(file.as_path()))?;
                match main {
                    true => Ok(self.model.write_config_files(dir, Some(tokenizer))?),
                    false => Ok(()),
                }
            }
        }
    }

    /// Rank 0's `trainer_state.json` (`state` with the run's world size, LoRA dropout draws,
    /// log folder and base fingerprint) and the trainer's own files.
    fn write_state(
        &self,
        dir: &Path,
        (config, state): (&TrainConfig, &impl serde::Serialize),
        extra: impl FnOnce(&Path) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut value = serde_json::to_value(state).map_err(|e| e.to_string())?;
        value[WORLD_SIZE_KEY] = self.world.size.into();
        if let Some(adapter) = &self.model.adapter {
            value[DROPOUT_DRAWS_KEY] = adapter.dropout_draws().into();
        }
        if let Some(dir) = self.logs.logging_dir_to_save() {
            value[LOGGING_DIR_KEY] = dir.to_string_lossy().into();
        }
        if let Some(base) = &self.base_fingerprint {
            value[BASE_MODEL_KEY] = serde_json::json!({"model": config.model, "fingerprint": base});
        }
        let text = serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?;
        std::fs::write(dir.join(checkpoint::STATE_FILE), text).map_err(|e| e.to_string())?;
        extra(dir)
    }

    /// Restores the optimizer and the state saved in `checkpoint` for a run of `total_steps`
    /// (the config's, which may extend the run): a checkpoint already past them is an error,
    /// not a silent run to the checkpoint's own end.
    pub fn resume<S>(&mut self, checkpoint: &Path, total_steps: u64) -> Result<S, TrainError>
    where
        S: serde::de::DeserializeOwned + super::RunState,
    {
        let state: S = self.restore(checkpoint)?;
        let done = state.progress().done;
        if done > total_steps {
            return Err(TrainError::config(
                "max_steps",
                format!(
                    "is {total_steps}, but {} is at step {done}: raise max_steps to continue it",
                    checkpoint.display()
                ),
            ));
        }
        Ok(state)
    }

    /// Restores the optimizer from a checkpoint folder and returns the trainer state saved there.
    /// A checkpoint of a run with another world size is an error: its step counts and data
    /// position mean other global batches.
    pub(crate) fn restore<S: serde::de::DeserializeOwned>(&mut self, checkpoint: &Path) -> Result<S, TrainError> {
        let fail = |message: String| TrainError::Checkpoint {
            path: checkpoint.into(),
            message,
        };
        if checkpoint.join(checkpoint::STATE_FILE).is_file() && !resume::resumable(checkpoint) {
            return Err(resume::not_resumable(checkpoint));
        }
        let value = checkpoint::read_state(checkpoint)?;
        let saved = match value.get(WORLD_SIZE_KEY) {
            None => 1,
            Some(v) => v.as_u64().filter(|&n| n >= 1).ok_or_else(|| {
                fail(format!(
                    "{}: `{WORLD_SIZE_KEY}` is {v}; must be a whole number of processes, at least 1",
                    checkpoint::STATE_FILE
                ))
            })? as usize,
        };
        if let Some(base) = &self.base_fingerprint {
            check_base(&value, base).map_err(fail)?;
        }
        // Checked before the optimizer's files are read: their state would re-shard, but the
        // run's batches would not be the same.
        if saved != self.world.size {
            return Err(fail(format!(
                "written by a run of {saved} process(es), resumed with {}: the global batch (per-process batch x processes) and the data position would change; resume with {saved} process(es)",
                self.world.size
            )));
        }
        self.optim.load(checkpoint).map_err(|e| fail(e.to_string()))?;
        let step = check_update_count(&value, self.optim.updates()).map_err(fail)?;
        if let (Some(adapter), Some(draws)) = (&self.model.adapter, value.get(DROPOUT_DRAWS_KEY)) {
            adapter.set_dropout_draws(draws.as_u64().unwrap_or(0));
        }
        let saved_logs = value.get(LOGGING_DIR_KEY).and_then(|d| d.as_str()).map(PathBuf::from);
        self.logs.resume(step, saved_logs);
        self.resumed_from = Some(checkpoint.into());
        serde_json::from_value(value).map_err(|e| fail(e.to_string()))
    }

    /// Logs a training step's metrics where `report_to` says (main rank only).
    pub fn log(&mut self, metrics: &impl Scalars) {
        self.logs.step(metrics);
    }

    /// Logs an evaluation's metrics (TensorBoard and CSV; main rank only).
    pub(crate) fn log_eval(&mut self, metrics: &impl Scalars) {
        self.logs.eval(metrics);
    }

    /// Logs markdown text under `tag` (TensorBoard's text tab; main rank only).
    pub(crate) fn log_text(&mut self, tag: &str, step: u64, markdown: &str) {
        self.logs.text(tag, step, markdown);
    }

    /// The checkpoint this run continued from, if it resumed.
    pub fn resumed_from(&self) -> Option<&Path> {
        self.resumed_from.as_deref()
    }

    /// The TensorBoard folder of the run, when `report_to` names tensorboard (main rank).
    pub fn logging_dir(&self) -> Option<&Path> {
        self.logs.logging_dir()
    }
}

/// The optimizer's update count must be the steps the state says were taken and not skipped:
/// a hand-edited or mismatched `global_step` or `optimizer.json` would change the schedule and
/// AdamW's bias correction. Returns the steps taken.
fn check_update_count(state: &serde_json::Value, updates: u64) -> Result<u64, String> {
    let field = |k: &str| match state.get(k) {
        None => Ok(0),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("{}: `{k}` is {v}; must be a whole number", checkpoint::STATE_FILE)),
    };
    let (steps, skipped) = (field("global_step")?, field("skipped_steps")?);
    if steps.checked_sub(skipped) != Some(updates) {
        return Err(format!(
            "{} says {steps} steps ({skipped} skipped), but optimizer.json counts {updates} updates: the files do not belong together",
            checkpoint::STATE_FILE
        ));
    }
    Ok(steps)
}

/// A LoRA checkpoint holds the adapter alone: it resumes only onto the base it was trained on.
fn check_base(state: &serde_json::Value, fingerprint: &str) -> Result<(), String> {
    let Some(saved) = state.get(BASE_MODEL_KEY) else {
        return Ok(());
    };
    match saved.get("fingerprint").and_then(|f| f.as_str()) {
        Some(f) if f == fingerprint => Ok(()),
        _ => Err(format!(
            "its adapter was trained on base model {} (weights fingerprint {}), but this run's `model` has other weights (fingerprint {fingerprint}): resume with the run's base model",
            saved.get("model").unwrap_or(&serde_json::Value::Null),
            saved.get("fingerprint").unwrap_or(&serde_json::Value::Null),
        )),
    }
}

/// Makes `out` this run's: writable, held against other runs, and (unless the run resumes)
/// holding no earlier run's checkpoints, or with `overwrite_output_dir` emptied of them, so a
/// new run's checkpoints never mix with an old one's.
fn claim_output_dir(config: &TrainConfig, out: &Path, resuming: Option<&Path>) -> Result<OutputLock, TrainError> {
    check_writable("output_dir", out)?;
    let lock = OutputLock::acquire(out)?;
    for dir in resume::remove_partial(out) {
        eprintln!(
            "treetrain: removed {}, a checkpoint an interrupted run left half-written",
            dir.display()
        );
    }
    let earlier = resume::checkpoints(out);
    if resuming.is_some() || earlier.is_empty() {
        return Ok(lock);
    }
    if !config.output.overwrite_output_dir {
        let names: Vec<String> = earlier.iter().map(|(s, _)| format!("checkpoint-{s}")).collect();
        return Err(TrainError::config(
            "output_dir",
            format!(
                "{} holds an earlier run's checkpoints ({}): resume it (resume_from_checkpoint = true, --resume-from latest), set overwrite_output_dir = true to delete them, or choose another output_dir",
                out.display(),
                names.join(", ")
            ),
        ));
    }
    for (_, dir) in earlier {
        std::fs::remove_dir_all(&dir).map_err(|e| {
            TrainError::config(
                "overwrite_output_dir",
                format!("{}: could not be deleted: {e}", dir.display()),
            )
        })?;
    }
    Ok(lock)
}

/// Where the world size is kept in `trainer_state.json`.
const WORLD_SIZE_KEY: &str = "world_size";
/// Where the run's TensorBoard folder is kept, relative to `output_dir` (a resume continues in
/// the folder of that name under its own `output_dir`).
const LOGGING_DIR_KEY: &str = "logging_dir";
/// Where a LoRA run records its base model (`model` and a weight fingerprint).
const BASE_MODEL_KEY: &str = "base_model";
/// Where a LoRA run keeps its dropout stream's position (exact resume).
const DROPOUT_DRAWS_KEY: &str = "lora_dropout_draws";

/// The model a run trains: the checkpoint's weights when resuming a full fine-tune; with
/// `lora`, the base from `model_dir` and the adapter new or from the checkpoint (which must
/// have been written with the same `[lora]` settings).
fn load_policy(
    config: &TrainConfig,
    model_dir: &Path,
    checkpoint: Option<&Path>,
    options: LoadOptions,
) -> Result<Model, TrainError> {
    let holds_adapter = checkpoint.is_some_and(|c| c.join(ADAPTER_CONFIG).exists());
    let Some(lora) = &config.lora else {
        if holds_adapter {
            return Err(TrainError::config(
                "lora",
                format!(
                    "is not set, but {} holds a LoRA adapter: resume with the run's [lora] settings",
                    checkpoint.unwrap_or(model_dir).display()
                ),
            ));
        }
        return Ok(Model::load(checkpoint.unwrap_or(model_dir), options)?);
    };
    let mut model = Model::load(model_dir, options)?;
    match checkpoint {
        None => {
            model.add_lora(lora.clone())?;
        }
        Some(ckpt) if !holds_adapter => {
            return Err(TrainError::config(
                "lora",
                format!(
                    "is set, but {} holds no LoRA adapter (a full fine-tune's checkpoint?)",
                    ckpt.display()
                ),
            ));
        }
        Some(ckpt) => {
            let saved = &model.load_adapter(ckpt)?.config;
            if saved != lora {
                return Err(TrainError::config(
                    "lora",
                    format!("is {lora:?}, but {} was written with {saved:?}", ckpt.display()),
                ));
            }
        }
    }
    Ok(model)
}

/// What must be the same model on every rank: its config, each trained variable's shape and
/// dtype (the broadcast of rank 0's weights assumes them) and, with LoRA, the frozen base's
/// fingerprint (never broadcast, so another base would train another model).
fn model_settings(
    model: &Model,
    variables: &std::collections::BTreeMap<String, tch::Tensor>,
    base: Option<&str>,
) -> crate::distributed::Settings {
    let c = &model.lm.config;
    let mut out: crate::distributed::Settings = [
        ("architecture", format!("{:?}", c.arch)),
        ("vocab_size", c.vocab_size.to_string()),
        ("hidden_size", c.hidden_size.to_string()),
        ("num_hidden_layers", c.num_layers.to_string()),
        ("num_attention_heads", c.num_heads.to_string()),
        // Whatever else the config sets, as one fingerprint.
        ("the rest", crate::util::fnv1a(format!("{c:?}").as_bytes())),
    ]
    .into_iter()
    .map(|(k, v)| (format!("model config {k}"), v))
    .collect();
    for (name, t) in variables {
        out.push((
            format!("trained variable {name}"),
            format!("{:?} {:?}", t.size(), t.kind()),
        ));
    }
    out.push(("frozen base weights".into(), base.unwrap_or("none").into()));
    out
}

/// The device of this rank: in a multi-process run, CUDA indices count from the rank's local
/// rank (`distributed::rank_gpu`), so `cuda` means each rank's own GPU.
fn rank_device(spec: DeviceSpec, world: &World) -> DeviceSpec {
    match (spec, world.is_distributed()) {
        (DeviceSpec::Cuda(_) | DeviceSpec::Auto, true) => {
            crate::distributed::rank_gpu(spec, world.local_rank).map_or(spec, |g| DeviceSpec::Cuda(g.index))
        }
        _ => spec,
    }
}

/// The schedule of `config` over `total_steps`: warmup in steps, else as a ratio.
fn schedule(config: &TrainConfig, total_steps: u64) -> LrSchedule {
    match config.optimizer.warmup_steps {
        Some(w) => LrSchedule {
            lr: config.optimizer.learning_rate,
            kind: config.optimizer.lr_scheduler,
            warmup_steps: w,
            total_steps,
        },
        None => LrSchedule::with_warmup_ratio(
            config.optimizer.learning_rate,
            config.optimizer.lr_scheduler,
            config.optimizer.warmup_ratio,
            total_steps,
        ),
    }
}
