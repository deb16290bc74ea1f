//! The training core both trainers share: config files (defaults per trainer, unknown keys,
//! hub datasets), the typed errors, and failures the core rules out, each test naming the one
//! it guards against.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use treetrain::grpo::{GrpoConfig, RewardFn, RolloutProducer};
use treetrain::sft::{PackingStrategy, SftConfig, SftTrainer, TokenizeOptions};
use treetrain::train::{DataSettings, OptimizerSettings, OutputSettings, TrainConfig, TrainError};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treetrain-core-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn shared_settings_keep_each_trainers_defaults_and_unknown_keys_are_refused() {
    let dir = scratch("toml");
    let file = dir.join("c.toml");
    std::fs::write(&file, "model = \"m\"\nseed = 3\n").unwrap();
    // The flattened shared section still takes GRPO's own learning-rate default (TRL's 1e-6).
    let g = GrpoConfig::from_toml_file(&file).unwrap();
    assert_eq!((g.train.optimizer.learning_rate, g.train.seed), (1e-6, 3));
    let s = SftConfig::from_toml_file(&file).unwrap();
    assert_eq!(s.train.optimizer.learning_rate, 2e-5);
    std::fs::write(&file, "learning_rat = 0.1\n").unwrap();
    let err = SftConfig::from_toml_file(&file).unwrap_err().to_string();
    assert!(
        err.contains("c.toml") && err.contains("unknown key `learning_rat`"),
        "{err}"
    );
    std::fs::write(&file, "mode = \"sometimes\"\n").unwrap();
    let err = GrpoConfig::from_toml_file(&file).unwrap_err().to_string();
    assert!(
        err.contains("sometimes") && err.contains("`sync`") && err.contains("`async`"),
        "{err}"
    );
    std::fs::write(&file, "[[rewards]]\nname = \"vibes\"\n").unwrap();
    let err = GrpoConfig::from_toml_file(&file).unwrap_err().to_string();
    assert!(
        err.contains("unknown reward `vibes` (built-ins: exact_answer, answer_format)"),
        "{err}"
    );
    std::fs::write(&file, "device = \"tpu\"\npad_to_multiple_of = 64\n").unwrap();
    let err = SftConfig::from_toml_file(&file).unwrap_err().to_string();
    assert!(err.contains("device \"tpu\": expected cpu, cuda"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A config saved as TOML (how a notebook's run goes to `treetrain launch`) reads back equal.
#[test]
fn configs_saved_as_toml_read_back_unchanged() {
    let dir = scratch("save-toml");
    let sft = SftConfig {
        train: TrainConfig {
            model: root().join("datasets/tiny-qwen3").display().to_string(),
            data: DataSettings {
                dataset: root().join("datasets/sft/train.parquet"),
                ..Default::default()
            },
            optimizer: OptimizerSettings {
                max_grad_norm: None,
                warmup_steps: Some(3),
                ..Default::default()
            },
            output: OutputSettings {
                output_dir: Some(dir.join("out")),
                ..Default::default()
            },
            ..Default::default()
        },
        packing: Some(PackingStrategy::Bfd),
        max_steps: Some(7),
        ..Default::default()
    };
    let path = dir.join("sft.toml");
    sft.save_toml(&path).unwrap();
    assert_eq!(SftConfig::from_toml_file(&path).unwrap(), sft);
    let mut grpo = GrpoConfig::default();
    grpo.train.model = sft.train.model.clone();
    grpo.train.data.dataset = root().join("datasets/grpo/train.parquet");
    grpo.eval.eval_dataset = Some(root().join("datasets/grpo/test.parquet"));
    let path = dir.join("grpo.toml");
    grpo.save_toml(&path).unwrap();
    assert_eq!(GrpoConfig::from_toml_file(&path).unwrap(), grpo);
    // Settings on by default are turned off by "off" (a missing key means the default).
    std::fs::write(&path, "max_grad_norm = \"off\"\nlogging_steps = \"off\"\n").unwrap();
    let off = SftConfig::from_toml_file(&path).unwrap();
    assert_eq!(
        (off.train.optimizer.max_grad_norm, off.train.output.logging_steps),
        (None, None)
    );
    std::fs::write(&path, "max_grad_norm = 2\n").unwrap();
    assert_eq!(
        SftConfig::from_toml_file(&path).unwrap().train.optimizer.max_grad_norm,
        Some(2.0)
    );
    std::fs::write(&path, "max_grad_norm = \"never\"\n").unwrap();
    let err = SftConfig::from_toml_file(&path).unwrap_err().to_string();
    assert!(err.contains("max_grad_norm") || err.contains("\"off\""), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn out_of_range_settings_name_their_field() {
    let named = TrainConfig {
        model: "m".into(),
        data: DataSettings {
            dataset: "d.jsonl".into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let cfg = SftConfig {
        train: named.clone(),
        gradient_accumulation_steps: 0,
        ..Default::default()
    };
    let err = SftTrainer::new(cfg).unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::Config {
                field: "gradient_accumulation_steps",
                ..
            }
        ),
        "{err}"
    );
    let cfg = GrpoConfig {
        train: TrainConfig {
            optimizer: OptimizerSettings {
                learning_rate: f64::NAN,
                ..Default::default()
            },
            ..named
        },
        ..Default::default()
    };
    assert!(
        cfg.validate()
            .unwrap_err()
            .to_string()
            .starts_with("config `learning_rate`")
    );
}

/// A fake Hugging Face cache holding the shipped SFT conversations as dataset `acme/chat`.
fn hub_with_dataset(dir: &Path) -> PathBuf {
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo = dir.join("hf/hub/datasets--acme--chat");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    let data = repo.join("snapshots").join(commit).join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::copy(
        root().join("datasets/sft/train.parquet"),
        data.join("train-00000-of-00001.parquet"),
    )
    .unwrap();
    dir.join("hf")
}

/// SFT's config reader anchors `dataset` to the file's folder only where it names something
/// there; a hub repo id stays one: `dataset = "acme/chat"` must not look for
/// `<config dir>/acme/chat` and fail.
#[test]
fn an_sft_config_file_can_name_a_hub_dataset() {
    let dir = scratch("hub");
    let hf_home = hub_with_dataset(&dir);
    let model = root().join("datasets/tiny-qwen3");
    let cfg = dir.join("sft.toml");
    std::fs::write(
        &cfg,
        format!(
            "model = {model:?}\ndataset = \"acme/chat\"\ndataset_split = \"train\"\nmax_steps = 1\nbatch_size = 2\neval_fraction = 0.0\n[tokenize]\nmax_length = 64\n"
        ),
    )
    .unwrap();
    assert_eq!(
        SftConfig::from_toml_file(&cfg).unwrap().train.data.dataset,
        PathBuf::from("acme/chat")
    );
    let out = Command::new(env!("CARGO_BIN_EXE_treetrain"))
        .args(["sft", "--config", cfg.to_str().unwrap()])
        .env("HF_HOME", &hf_home)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("training rows") && stdout.contains("step 1: loss"),
        "{stdout}\n{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Settings that cannot pack are refused up front, not turned into an empty epoch
/// (`unwrap_or_default`) in which `step()` loops forever looking for a micro-batch; the test
/// bounds its time so such a loop shows as a failure, not a hung suite.
#[test]
fn packing_that_cannot_work_is_an_error_not_an_endless_step() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let cfg = SftConfig {
            train: TrainConfig {
                model: treetrain::shipped::tiny_model_dir().unwrap().display().to_string(),
                data: DataSettings {
                    dataset: root().join("datasets/sft/train.parquet"),
                    ..Default::default()
                },
                ..Default::default()
            },
            tokenize: TokenizeOptions {
                max_length: 0,
                ..Default::default()
            },
            packing: Some(PackingStrategy::Bfd),
            max_steps: Some(1),
            ..Default::default()
        };
        let result = SftTrainer::new(cfg).and_then(|mut t| t.step().map(|_| ()));
        let _ = tx.send(result.map_err(|e| e.to_string()));
    });
    let err = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("SftTrainer hung instead of failing")
        .unwrap_err();
    assert!(err.contains("tokenize.max_length"), "{err}");
}

/// A completion that does not decode is a reported failure of every reward for that
/// completion, with advantage 0, not the empty string (a valid 0 reward that would train the
/// policy on nonsense); the rest of the group is scored as usual.
#[test]
fn an_undecodable_completion_is_a_reward_failure_not_empty_text() {
    use std::sync::Arc;
    use treetrain::generate::{Completion, FinishReason};
    let model_dir = root().join("datasets/tiny-qwen3-sft");
    let tokenizer = Arc::new(treetrain::tokenizer::Tokenizer::from_dir(&model_dir).unwrap());
    let ds = treetrain::data::Dataset::open(&root().join("datasets/grpo/test.parquet")).unwrap();
    let prompts = Arc::new(treetrain::grpo::PromptSet::load(&ds, &tokenizer, "prompt", 512, false).unwrap());
    let good = tokenizer
        .encode("Answer: 3", false)
        .unwrap()
        .into_iter()
        .map(i64::from)
        .collect::<Vec<_>>();
    let completion = |ids: Vec<i64>| Completion {
        prompt_index: 0,
        logprobs: vec![-1.0; ids.len()],
        untruncated_logprobs: vec![-1.0; ids.len()],
        output_ids: ids,
        finish_reason: FinishReason::Eos,
    };
    let producer = RolloutProducer {
        prompts: prompts.clone(),
        rewards: Arc::new(vec![RewardFn::answer_format()]),
        tokenizer: tokenizer.clone(),
        generation: Default::default(),
        group: 2,
        per_batch: 1,
        shard: Default::default(),
        scale: Default::default(),
        aggregation: Default::default(),
        sampler: treetrain::grpo::PromptSampler::new(prompts.prompts.len(), 0),
        produced: 0,
        generator: Default::default(),
        multi_turn: None,
    };
    let group = producer.score_completions(0, vec![completion(good), completion(vec![1_000_000])], 0);
    assert_eq!(group.rewards.total[0], Some(1.0));
    assert_eq!(group.rewards.total[1], None, "{:?}", group.rewards);
    assert_eq!(group.advantages[1], 0.0);
    let failure = &group.rewards.failures[0];
    assert_eq!((failure.function.as_str(), failure.completion), ("decode", 1));
    assert!(
        failure.reason.contains("outside the tokenizer's vocabulary"),
        "{}",
        failure.reason
    );
}

/// Every setting a GRPO config file can hold, each away from its default (TRL's spellings
/// where TRL has one).
const GRPO_EVERY_SETTING: &str = r#"
model = "m"
router_aux_loss_coef = 0.01
dataset = "d.jsonl"
dataset_split = "test"
output_dir = "out"
overwrite_output_dir = true
report_to = ["jsonl", "csv"]
logging_dir = "tb"
learning_rate = 0.001
lr_scheduler = "cosine"
warmup_ratio = 0.1
warmup_steps = 3
adamw = { beta1 = 0.8, weight_decay = 0.1 }
max_grad_norm = "off"
seed = 7
dtype = "bf16"
mixed_precision = false
device = "auto"
on_nan = "stop"
skip_invalid_rows = true
save_steps = 5
save_total_limit = 2
save_only_model = true
resume_from_checkpoint = "ckpt"
eval_steps = 4
logging_steps = "off"
distributed_timeout_s = 60.0
distributed_backend = "gloo"
fsdp = "full_shard"
fsdp_config = { forward_prefetch = false, backward_prefetch = "backward_post" }
overlap_grad_reduce = false
gradient_checkpointing = true
max_steps = 9
prompt_field = "question"
num_generations = 4
prompts_per_step = 2
max_prompt_length = 100
max_completion_length = 32
prefill_chunk_size = 16
mode = "async"
queue_size = 3
max_staleness = 2
weight_sync_steps = 2
steps_per_generation = 2
generation_batch_size = 16
temperature = 0.7
top_p = 0.9
top_k = 20
min_p = 0.05
repetition_penalty = 1.1
epsilon = 0.3
epsilon_high = 0.28
delta = 1.5
importance_sampling_level = "sequence"
vllm_importance_sampling_correction = true
vllm_importance_sampling_mode = "token_mask"
vllm_importance_sampling_cap = 2.0
vllm_importance_sampling_clip_min = 0.5
top_entropy_quantile = 0.2
beta = 0.04
use_bias_correction_kl = false
scale_rewards = "batch"
multi_objective_aggregation = "normalize_then_sum"
loss_type = "dr_grpo"
per_device_train_batch_size = 4
mask_truncated_completions = true
num_iterations = 2
sapo_temperature_pos = 0.9
sapo_temperature_neg = 1.2
vespo_k_pos = 2.5
vespo_lambda_pos = 3.5
vespo_k_neg = 3.5
vespo_lambda_neg = 2.5
disable_dropout = true
routing_replay = true
sync_ref_model = true
ref_model_mixup_alpha = 0.5
ref_model_sync_steps = 64
entropy_coef = 0.01
use_adaptive_entropy = true
entropy_coef_min = 0.001
entropy_coef_max = 0.5
entropy_coef_delta = 0.002
entropy_target = 0.3
off_policy_mask_threshold = 0.5
packing = "flat"
token_budget = 2048
max_tool_calling_iterations = 2
turn_generations = 2
max_conversation_length = 512
fork_threshold_tokens = 8
eval_dataset = "e.jsonl"
num_generations_eval = 2
log_completions = 3
num_completions_to_print = 1
log_unique_prompts = true

[chat_template_kwargs]
enable_thinking = false

[lora]
r = 4

[[rewards]]
name = "answer_format"
weight = 0.5
"#;

/// The names of every setting in a config file, pinned: grouping the Rust fields by concern
/// never renames, adds or drops one. Each key of a file lands in its own field (away from the
/// default), and `save_toml` writes a file read back equal.
#[test]
fn config_files_keep_every_setting_name() {
    let keys = |v: serde_json::Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let train = [
        "adamw",
        "dataset",
        "dataset_split",
        "device",
        "distributed_backend",
        "distributed_timeout_s",
        "dtype",
        "eval_steps",
        "fsdp",
        "fsdp_config",
        "gradient_checkpointing",
        "learning_rate",
        "logging_dir",
        "logging_steps",
        "lora",
        "lr_scheduler",
        "max_grad_norm",
        "mixed_precision",
        "model",
        "on_nan",
        "output_dir",
        "overlap_grad_reduce",
        "overwrite_output_dir",
        "report_to",
        "resume_from_checkpoint",
        "router_aux_loss_coef",
        "save_only_model",
        "save_steps",
        "save_total_limit",
        "seed",
        "skip_invalid_rows",
        "warmup_ratio",
        "warmup_steps",
    ];
    let sft_own = [
        "batch_size",
        "eval_fraction",
        "gradient_accumulation_steps",
        "lm_head_chunk_tokens",
        "max_steps",
        "num_train_epochs",
        "packing",
        "pad_to_multiple_of",
        "platform",
        "tokenize",
    ];
    let mut sft: Vec<String> = train.iter().chain(&sft_own).map(|s| s.to_string()).collect();
    sft.sort();
    assert_eq!(keys(serde_json::to_value(SftConfig::default()).unwrap()), sft);
    let dir = scratch("every-setting");
    let file = dir.join("grpo.toml");
    std::fs::write(&file, GRPO_EVERY_SETTING).unwrap();
    let every = GrpoConfig::from_toml_file(&file).unwrap();
    let (set, default) = (
        serde_json::to_value(&every).unwrap(),
        serde_json::to_value(GrpoConfig::default()).unwrap(),
    );
    let grpo = keys(default.clone());
    assert_eq!(grpo.len(), 99, "{grpo:?}");
    for k in train.iter().chain(&["max_steps", "packing", "rewards"]) {
        assert!(grpo.contains(&k.to_string()), "{k}");
    }
    for k in &grpo {
        assert_ne!(set[k], default[k], "`{k}` of the file did not land in its field");
    }
    let saved = dir.join("saved.toml");
    every.save_toml(&saved).unwrap();
    assert_eq!(GrpoConfig::from_toml_file(&saved).unwrap(), every);
    let _ = std::fs::remove_dir_all(&dir);
}
