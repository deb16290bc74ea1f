//! What treetrain checks before any work starts, as one table: the README's list of validated
//! settings is generated from [`RULES`] (`tests/validation_doc.rs` keeps it fresh), and the
//! same test feeds every rule's out-of-range example through the config files and checks that
//! the error names the field, so the table cannot drift from the checks.

/// Where a rule applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Both trainers' shared settings (`TrainConfig`).
    Train,
    /// `SftConfig`.
    Sft,
    /// `GrpoConfig`.
    Grpo,
    /// Sampling, wherever it is set (`generate` flags, GRPO configs, `SamplingConfig`).
    Sampling,
    /// Checked when the run starts (files, data, the model), not by `validate()`.
    Start,
}

impl Scope {
    fn label(self) -> &'static str {
        match self {
            Scope::Train => "SFT and GRPO",
            Scope::Sft => "SFT",
            Scope::Grpo => "GRPO",
            Scope::Sampling => "sampling (`generate`, GRPO)",
            Scope::Start => "at start",
        }
    }
}

/// One validated setting.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    /// Where it applies.
    pub scope: Scope,
    /// The setting as written in a config file (or the CLI flag's name).
    pub field: &'static str,
    /// What it must be.
    pub must: &'static str,
    /// A TOML value breaking the rule (the test feeds it through), when one exists.
    pub bad: Option<&'static str>,
}

const fn rule(scope: Scope, field: &'static str, must: &'static str, bad: Option<&'static str>) -> Rule {
    Rule {
        scope,
        field,
        must,
        bad,
    }
}

/// Every validated setting.
pub const RULES: &[Rule] = &[
    rule(
        Scope::Train,
        "model",
        "set: a model folder or hub repo id (a file or a missing `./path` is never taken for a repo id)",
        None,
    ),
    rule(
        Scope::Train,
        "dataset",
        "set: a data file, folder or hub dataset id; of a folder or repo, split `dataset_split` (default `train`) as `datasets.load_dataset` splits it, which must exist",
        None,
    ),
    rule(Scope::Train, "learning_rate", "finite and > 0", Some("0.0")),
    rule(Scope::Train, "router_aux_loss_coef", "finite and >= 0", Some("-0.1")),
    rule(Scope::Train, "warmup_ratio", "in [0, 1]", Some("2.0")),
    rule(
        Scope::Train,
        "max_grad_norm",
        "finite and > 0, or \"off\"",
        Some("-1.0"),
    ),
    rule(Scope::Train, "adamw.beta1", "in [0, 1)", Some("1.0")),
    rule(Scope::Train, "adamw.beta2", "in [0, 1)", Some("-0.5")),
    rule(Scope::Train, "adamw.eps", "finite and > 0", Some("0.0")),
    rule(Scope::Train, "adamw.weight_decay", "finite and >= 0", Some("-0.1")),
    rule(Scope::Train, "save_steps", "at least 1 (or unset)", Some("0")),
    rule(
        Scope::Train,
        "save_total_limit",
        "at least 1 (or unset: every checkpoint kept)",
        Some("0"),
    ),
    rule(
        Scope::Train,
        "report_to",
        "`jsonl`, `tensorboard`, `csv`, or a list of them; `none` alone",
        Some("\"wandb\""),
    ),
    rule(Scope::Train, "eval_steps", "at least 1 (or unset)", Some("0")),
    rule(Scope::Train, "logging_steps", "at least 1, or \"off\"", Some("0")),
    rule(
        Scope::Train,
        "distributed_timeout_s",
        "> 0 and at most 1e9",
        Some("inf"),
    ),
    rule(Scope::Train, "lora.r", "at least 1", Some("0")),
    rule(Scope::Train, "lora.lora_alpha", "finite and > 0", Some("0.0")),
    rule(Scope::Train, "lora.lora_dropout", "in [0, 1)", Some("1.0")),
    rule(
        Scope::Train,
        "lora.target_modules",
        "module names, each matching a linear layer of the model (not `lm_head`: train it whole with `modules_to_save`), or \"all-linear\"; a single other string (a PEFT regular expression) is refused",
        Some("[]"),
    ),
    rule(
        Scope::Train,
        "lora.target_parameters",
        "a mixture's expert tensors (`experts.gate_up_proj`, `experts.down_proj`, by full name or dotted tail), each matching one when the adapter attaches; with any, `lora_dropout` must be 0 (as PEFT requires)",
        None,
    ),
    rule(
        Scope::Train,
        "lora (resuming)",
        "the checkpoint's adapter settings equal `[lora]`; a LoRA checkpoint needs `[lora]`, a full one refuses it",
        None,
    ),
    rule(
        Scope::Start,
        "adapter_config.json (`--adapter`, `load_adapter`)",
        "`peft_type` LORA; DoRA, biases, per-layer ranks or patterns, base-rewriting initialisations (PiSSA, OLoRA, ...) and unknown options refused by field; every tensor one the config implies, in its shape",
        None,
    ),
    rule(
        Scope::Train,
        "unknown keys",
        "refused, with the nearest known key suggested, inside `[[rewards]]` tables too; a top-level key written below a table's header is named as such",
        None,
    ),
    rule(Scope::Sft, "batch_size", "at least 1 (per process)", Some("0")),
    rule(Scope::Sft, "gradient_accumulation_steps", "at least 1", Some("0")),
    rule(Scope::Sft, "tokenize.max_length", "at least 1", Some("0")),
    rule(Scope::Sft, "num_train_epochs", "finite and > 0", Some("-1.0")),
    rule(Scope::Sft, "eval_fraction", "in [0, 1)", Some("2.0")),
    rule(Scope::Sft, "lm_head_chunk_tokens", "at least 1", Some("0")),
    rule(Scope::Grpo, "num_generations", "at least 2", Some("1")),
    rule(Scope::Grpo, "prompts_per_step", "at least 1 (per process)", Some("0")),
    rule(Scope::Grpo, "max_completion_length", "at least 1", Some("0")),
    rule(Scope::Grpo, "token_budget", "at least 1", Some("0")),
    rule(Scope::Grpo, "num_iterations", "at least 1", Some("0")),
    rule(Scope::Grpo, "per_device_train_batch_size", "at least 1", Some("0")),
    rule(Scope::Grpo, "epsilon_low", "finite and >= 0", Some("-0.2")),
    rule(Scope::Grpo, "epsilon_high", "finite and >= 0", Some("-0.2")),
    rule(Scope::Grpo, "beta", "finite and >= 0", Some("-1.0")),
    rule(Scope::Grpo, "top_entropy_quantile", "in [0, 1]", Some("1.5")),
    rule(Scope::Grpo, "max_turns", "at least 1", Some("0")),
    rule(Scope::Grpo, "turn_generations", "at least 1", Some("0")),
    rule(
        Scope::Grpo,
        "max_conversation_length",
        "above max_completion_length; with an environment, at least the longest prompt (padded to `prefill_chunk_size`) + max_completion_length",
        Some("8"),
    ),
    rule(
        Scope::Grpo,
        "importance_sampling_clip_max",
        "and `importance_sampling_clip_min`: finite, >= 0, min below max",
        Some("-1.0"),
    ),
    rule(
        Scope::Grpo,
        "delta",
        "unset, or finite and above 1 + epsilon_high (it caps the unclipped ratio)",
        Some("1.1"),
    ),
    rule(
        Scope::Grpo,
        "rewards",
        "at least one, finite weights; a built-in reward's column (`exact_answer`: `answer`) in every prompt row, one value (not a list, object or null)",
        None,
    ),
    rule(
        Scope::Sampling,
        "temperature",
        "finite and at least 1e-5 (vLLM's floor: far below it the scaled logits overflow)",
        Some("1e-40"),
    ),
    rule(Scope::Sampling, "top_p", "in (0, 1]", Some("1.5")),
    rule(Scope::Sampling, "min_p", "in [0, 1]", Some("2.0")),
    rule(
        Scope::Sampling,
        "repetition_penalty",
        "finite and > 0 (`generate`)",
        None,
    ),
    rule(Scope::Sampling, "num_generations", "at least 1 (`generate`)", None),
    rule(
        Scope::Start,
        "device",
        "one this process can use: a CUDA index libtorch sees; `neuron[:N]` only with a PrivateUse1 backend loaded (`TREETRAIN_PRIVATEUSE1_LIB`, a loadable library that registers one) and N below its device count; any device but the CPU passes the self-check first (primitive ops and a tiny decoder's forward and backward equal the CPU's; the first op that differs is named; `treetrain env --check-device DEVICE` runs it alone, `TREETRAIN_DEVICE_CHECK=0` skips it)",
        None,
    ),
    rule(
        Scope::Start,
        "output_dir",
        "writable (created and probed with real bytes before step 1, by rank 0); not in use by another live run (`.treetrain.lock`: pid, host, start; a lock naming no process is refused as unreadable); no earlier run's checkpoints unless resuming or `overwrite_output_dir`",
        None,
    ),
    rule(
        Scope::Start,
        "logging_dir",
        "writable (created and probed before step 1, by rank 0); with `report_to` naming tensorboard, it or `output_dir` set",
        None,
    ),
    rule(
        Scope::Start,
        "--resume-from",
        "(and `resume_from_checkpoint`) a checkpoint at or before `max_steps`, written with the same number of processes and with optimizer state (not `save_only_model`; shard files without their manifest are named a checkpoint cut short); each optimizer shard file records the rank, world size and step its name and the checkpoint say; `latest`: `output_dir` holds one",
        None,
    ),
    rule(
        Scope::Start,
        "every rank (a multi-process run)",
        "the same resolved config, world size, resumed checkpoint and model (config, trained variables' shapes, a LoRA run's frozen base) on every rank, checked before the weights are broadcast: the first difference is named with each rank's value; `MASTER_PORT` from 1 to 65535",
        None,
    ),
    rule(
        Scope::Start,
        "a step's memory",
        "an allocation that fails inside a step (host or device memory, `ulimit -v`, a cgroup limit) is an out-of-memory error naming the settings to lower; the size check before a step counts those limits too",
        None,
    ),
    rule(
        Scope::Start,
        "chat_template",
        "renders at most 64 MiB and within its fuel (a unit a template instruction, one per 64 bytes of strings built: about 1 GiB), so a runaway loop or a string doubled with `~` is an error, not an abort",
        None,
    ),
    rule(
        Scope::Start,
        "dataset rows",
        "text only: image, audio and video content parts, and media columns (`images`, `audios`, `videos`), are refused as unsupported, naming the row and field",
        None,
    ),
    rule(
        Scope::Start,
        "config.json (the model)",
        "`rope_theta` and RoPE scaling factors finite and > 0, `rms_norm_eps` finite and > 0; sizes whose parameters fit the host's memory (in fp32) before any allocation",
        None,
    ),
    rule(
        Scope::Start,
        "eval_steps",
        "with held-out data to evaluate on: SFT's `eval_fraction` holds out at least one row; GRPO has an `eval_dataset`",
        None,
    ),
    rule(
        Scope::Start,
        "`--model` / `model`",
        "a model folder (a LoRA adapter's folder is named as one, with its base); `model.safetensors` wins over an index beside it, as in transformers",
        None,
    ),
    rule(
        Scope::Start,
        "packed rows (`max_length`, `batch_size`)",
        "a micro-batch's dense attention mask fits the host's available memory: refused with its size, never an allocation abort",
        None,
    ),
    rule(
        Scope::Start,
        "log-probs and logits",
        "finite: `score` and `generate` fail naming the row and the device instead of writing NaN or garbage tokens",
        None,
    ),
    rule(
        Scope::Start,
        "rows and prompts",
        "token ids in the vocabulary (SFT rows checked after tokenizing, before step 1); prompt + `max_new_tokens` (or a scored row) within `max_position_embeddings`",
        None,
    ),
    rule(
        Scope::Start,
        "KV cache",
        "fits the host's available memory (`generate`: rows x positions), else refused saying how many rows fit; so does a prefill chunk's attention (`prefill_chunk_size`), saying what chunk fits",
        None,
    ),
    rule(
        Scope::Start,
        "weights",
        "finite when loaded and before every checkpoint; no tensor the model lacks; an update that makes one non-finite stops the run",
        None,
    ),
    rule(
        Scope::Start,
        "output folders",
        "`convert --out` and every model save refuse a file or a non-empty folder (`convert --overwrite` replaces a folder); `convert --out` never equals, contains or lies inside the model, its tokenizer or the adapter it reads",
        None,
    ),
];

/// [`RULES`] as a Markdown table (the README's section).
pub fn markdown() -> String {
    let mut s = String::from("| where | setting | must be |\n|---|---|---|\n");
    for r in RULES {
        let field = match r.field.contains(' ') {
            true => r.field.to_string(),
            false => format!("`{}`", r.field),
        };
        s.push_str(&format!("| {} | {field} | {} |\n", r.scope.label(), r.must));
    }
    s
}
