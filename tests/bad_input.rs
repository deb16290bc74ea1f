//! Hostile but realistic input against the CLI and the library: every case is an error that
//! says what and where (exit status 1, never a panic's 101), and no user file is destroyed.
//! Each case guards against one way such input can go wrong: a panic, a killed process, exit 0
//! with a wrong result, a destroyed file, or an error that does not say what or where.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tch::Tensor;

const BIN: &str = env!("CARGO_BIN_EXE_treetrain");

fn datasets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets")
}

fn tiny() -> String {
    datasets().join("tiny-qwen3").display().to_string()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treetrain-bad-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

/// The command failed cleanly (exit 1, not a panic) with an error holding every `needle`.
fn fails_with(args: &[&str], needles: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {:?}\n{err}", out.status);
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: `{n}` missing in\n{err}");
    }
    err
}

fn prompts_file(dir: &Path) -> String {
    let p = dir.join("prompts.jsonl");
    std::fs::write(&p, "{\"input_ids\": [1, 2, 3]}\n").unwrap();
    p.display().to_string()
}

/// `generate` of one 3-token prompt with the tiny model and `extra` flags fails naming `needles`.
fn generate_fails(name: &str, extra: &[&str], needles: &[&str]) {
    let dir = scratch(name);
    let (p, m) = (prompts_file(&dir), tiny());
    let mut args = vec!["generate", "--model", &m, "--input", &p];
    args.extend_from_slice(extra);
    fails_with(&args, needles);
}

#[test]
fn generation_requests_that_cannot_fit_are_refused_before_allocating() {
    generate_fails(
        "gen-len",
        &["--max-new-tokens", "1000000000"],
        &["max_position_embeddings is 2048", "prompt 0"],
    );
    // 10 M rows x 35 positions of cache: terabytes; said with what would fit.
    generate_fails(
        "gen-rows",
        &["--max-new-tokens", "3", "--num-generations", "10000000"],
        &["KV cache", "GB of memory is available", "rows fit"],
    );
    generate_fails("gen-zero", &["--num-generations", "0"], &["--num-generations 0"]);
    // A prefill chunk of a million tokens: its attention over the padded cache is terabytes.
    generate_fails(
        "gen-chunk",
        &["--max-new-tokens", "2", "--prefill-chunk-size", "1000000"],
        &["prefill_chunk_size 1000000", "GB of memory is available", "tokens fits"],
    );
}

#[test]
fn sampling_values_out_of_range_are_refused() {
    for (flag, value, field) in [
        ("--min-p", "2", "min_p"),
        ("--min-p", "-0.1", "min_p"),
        ("--top-p", "1.5", "top_p"),
        ("--top-p", "-1", "top_p"),
        ("--top-p", "NaN", "top_p"),
        ("--temperature", "inf", "temperature"),
        ("--repetition-penalty", "0", "repetition_penalty"),
    ] {
        let arg = format!("{flag}={value}");
        generate_fails("sampling", &["--max-new-tokens", "2", &arg], &[field]);
    }
}

#[test]
fn convert_never_destroys_or_moves_the_users_files() {
    let dir = scratch("convert");
    let m = tiny();
    let folder = dir.join("mine");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("notes.txt"), "keep me").unwrap();
    let f = folder.display().to_string();
    fails_with(&["convert", "--model", &m, "--out", &f], &["not empty", "--overwrite"]);
    assert_eq!(std::fs::read_to_string(folder.join("notes.txt")).unwrap(), "keep me");
    let file = dir.join("file.bin");
    std::fs::write(&file, "data").unwrap();
    let fp = file.display().to_string();
    for extra in [&[][..], &["--overwrite"][..]] {
        let mut args = vec!["convert", "--model", &m, "--out", &fp];
        args.extend_from_slice(extra);
        fails_with(&args, &["is not a folder"]);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "data");
    }
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(leftovers.len(), 2, "nothing renamed or left behind: {leftovers:?}");
    // Asked for explicitly, a folder is replaced; an empty one is used as it is.
    assert!(
        run(&["convert", "--model", &m, "--out", &f, "--overwrite"])
            .status
            .success()
    );
    assert!(folder.join("config.json").exists() && !folder.join("notes.txt").exists());
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = empty.display().to_string();
    let out = run(&["convert", "--model", &m, "--out", &e]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("(float32)"),
        "no Debug text"
    );
}

/// `convert --out P --overwrite` where the model lives in `P/model` (or `P` is the model, or
/// lies inside it) is refused before anything is written: it would delete the model it reads.
#[test]
fn convert_never_writes_over_the_model_it_reads() {
    let dir = scratch("convert-overlap");
    let model = dir.join("model");
    let converted = run(&["convert", "--model", &tiny(), "--out", model.to_str().unwrap()]);
    assert!(
        converted.status.success(),
        "{}",
        String::from_utf8_lossy(&converted.stderr)
    );
    std::fs::create_dir_all(dir.join("other")).unwrap();
    std::fs::write(dir.join("other/notes.txt"), "keep me").unwrap();
    let m = model.display().to_string();
    let inside = model.join("sub").display().to_string();
    let dotted = model.join("../model").display().to_string();
    for out in [dir.display().to_string(), m.clone(), inside, dotted] {
        fails_with(
            &["convert", "--model", &m, "--out", &out, "--overwrite"],
            &["which this save reads from"],
        );
    }
    assert!(model.join("model.safetensors").exists() && model.join("config.json").exists());
    assert_eq!(std::fs::read_to_string(dir.join("other/notes.txt")).unwrap(), "keep me");
    assert!(!model.join("sub").exists(), "nothing written inside the source");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `dir/sft.toml`: SFT of the tiny model on `dataset` with `settings` (top-level lines) and
/// rows cut at `max_length` tokens; returns its path.
fn sft_toml(dir: &Path, dataset: &Path, settings: &str, max_length: usize) -> String {
    let path = dir.join("sft.toml");
    let text = format!(
        "model = {:?}\ndataset = {:?}\n{settings}\n[tokenize]\nmax_length = {max_length}\n",
        tiny(),
        dataset,
    );
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

/// A TOML config of the shipped SFT run with `extra` lines.
fn sft_config(dir: &Path, extra: &str) -> String {
    let settings = format!("max_steps = 2\nbatch_size = 2\n{extra}");
    sft_toml(dir, &datasets().join("sft/train.parquet"), &settings, 64)
}

#[test]
fn config_values_out_of_range_name_their_field() {
    let dir = scratch("config");
    for (line, field) in [
        ("eval_steps = 0", "eval_steps"),
        ("save_steps = 0", "save_steps"),
        ("eval_fraction = 2.0", "eval_fraction"),
        ("eval_fraction = -0.1", "eval_fraction"),
        ("num_train_epochs = -1.0", "num_train_epochs"),
        ("learning_rate = nan", "learning_rate"),
        ("learning_rate = inf", "learning_rate"),
        ("learning_rate = 0.0", "learning_rate"),
        ("learning_rate = -0.001", "learning_rate"),
        ("max_grad_norm = -1.0", "max_grad_norm"),
        ("warmup_ratio = 2.0", "warmup_ratio"),
        ("distributed_timeout_s = 0.0", "distributed_timeout_s"),
        ("distributed_timeout_s = 1e300", "distributed_timeout_s"),
        ("adamw = { beta1 = 1.0 }", "adamw.beta1"),
        ("adamw = { eps = 0.0 }", "adamw.eps"),
    ] {
        let cfg = sft_config(&dir, line);
        fails_with(&["sft", "--config", &cfg], &[&format!("config `{field}`")]);
    }
    let cfg = sft_config(&dir, "learning_rat = 0.1");
    fails_with(
        &["sft", "--config", &cfg],
        &["unknown key `learning_rat`", "did you mean `learning_rate`"],
    );
    let path = dir.join("nomodel.toml");
    std::fs::write(&path, "dataset = \"x.jsonl\"\n").unwrap();
    fails_with(
        &["sft", "--config", path.to_str().unwrap()],
        &["config `model`: is not set"],
    );
    // The output folder is checked before step 1.
    let cfg = sft_config(&dir, "output_dir = \"/dev/null/out\"");
    fails_with(&["sft", "--config", &cfg], &["config `output_dir`", "/dev/null/out"]);
}

/// `dir/grpo.toml`: one step of GRPO on the shipped SFT model over `prompts`, with `settings`
/// (top-level lines) and then `tables` (the `[[rewards]]` tables and whatever follows them).
fn grpo_config(dir: &Path, prompts: &Path, settings: &str, tables: &str) -> String {
    let path = dir.join("grpo.toml");
    let text = format!(
        "model = {:?}\ndataset = {:?}\nprompt_field = \"prompt\"\nmax_steps = 1\n{settings}\n{tables}",
        datasets().join("tiny-qwen3-sft").display().to_string(),
        prompts,
    );
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn grpo_sampling_settings_and_missing_reward_columns_are_config_errors() {
    let dir = scratch("grpo");
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"2+2=\"}\n{\"prompt\": \"3+3=\"}\n").unwrap();
    let write = |extra: &str| grpo_config(&dir, &prompts, extra, "[[rewards]]\nname = \"exact_answer\"\n");
    fails_with(
        &["grpo", "--config", &write("")],
        &["reward `exact_answer` reads the `answer` column", "row 0"],
    );
    for (line, field) in [
        ("top_p = 1.5", "top_p"),
        ("min_p = 2.0", "min_p"),
        ("temperature = inf", "temperature"),
    ] {
        fails_with(&["grpo", "--config", &write(line)], &[&format!("config `{field}`")]);
    }
}

#[test]
fn rows_the_model_cannot_take_are_named_by_file_and_line() {
    let dir = scratch("rows");
    let m = tiny();
    let long: Vec<i64> = (0..3000).map(|i| i % 100).collect();
    let rows = dir.join("rows.jsonl");
    std::fs::write(
        &rows,
        format!(
            "{{\"input_ids\": [1, 2, 3]}}\n{}\n",
            serde_json::json!({ "input_ids": long })
        ),
    )
    .unwrap();
    let at = format!("{}:2", rows.display());
    for packing in ["none", "flat", "tree"] {
        fails_with(
            &[
                "score",
                "--model",
                &m,
                "--input",
                rows.to_str().unwrap(),
                "--packing",
                packing,
            ],
            &[&at, "3000 positions", "max_position_embeddings is 2048"],
        );
    }
    std::fs::write(&rows, "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 99999]}\n").unwrap();
    let err = fails_with(
        &[
            "score",
            "--model",
            &m,
            "--input",
            rows.to_str().unwrap(),
            "--packing",
            "flat",
        ],
        &[&at, "outside the vocabulary"],
    );
    assert!(!err.contains(":1"), "only line 2 is bad: {err}");
}

#[test]
fn readers_say_which_file_and_line() {
    let dir = scratch("readers");
    let m = tiny();
    let d = dir.display().to_string();
    fails_with(&["score", "--model", &m, "--input", &d], &[&d]);
    let bin = dir.join("latin1.jsonl");
    std::fs::write(&bin, b"{\"text\": \"ok\"}\n{\"text\": \"caf\xe9\"}\n").unwrap();
    fails_with(
        &["score", "--model", &m, "--input", bin.to_str().unwrap()],
        &[&format!("{}:2", bin.display()), "UTF-8"],
    );
    let nan = dir.join("rollouts.jsonl");
    std::fs::write(
        &nan,
        "{\"input_ids\": [1, 2], \"completion_mask\": [0, 1], \"old_log_probs\": [0.0, NaN], \"advantage\": 1.0, \"group_id\": \"a\"}\n",
    )
    .unwrap();
    fails_with(
        &["pack", "--input", nan.to_str().unwrap()],
        &[
            &format!("{}:1", nan.display()),
            "NaN and Infinity are not JSON numbers in field `old_log_probs`",
        ],
    );
    let huge = dir.join("huge.jsonl");
    std::fs::write(&huge, "{\"input_ids\": [1, 2], \"completion_mask\": [0, 1], \"old_log_probs\": [0.0, 1e999], \"advantage\": 1.0, \"group_id\": \"a\"}\n").unwrap();
    fails_with(
        &["pack", "--input", huge.to_str().unwrap()],
        &[&format!("{}:1", huge.display()), "number out of range"],
    );
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    fails_with(&["pack", "--input", empty.to_str().unwrap()], &["no rollouts"]);
    let lengths = dir.join("lengths.txt");
    std::fs::write(&lengths, "12\n18446744073709551615\n").unwrap();
    fails_with(
        &["shapes", "--lengths", lengths.to_str().unwrap()],
        &["too large", "sequence 1"],
    );
    // A local file or path is never taken for a hub repo id.
    let f = bin.display().to_string();
    fails_with(&["score", "--model", &f, "--input", &f], &["is a file"]);
    fails_with(&["score", "--model", "./no/such", "--input", &f], &["no such folder"]);
}

/// The shipped SFT model (committed weights) copied to `dir` with `edit` applied to them.
fn edited_model(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) -> PathBuf {
    let out = dir.join("model");
    std::fs::create_dir_all(&out).unwrap();
    for f in std::fs::read_dir(datasets().join("tiny-qwen3-sft")).unwrap().flatten() {
        std::fs::copy(f.path(), out.join(f.file_name())).unwrap();
    }
    let file = out.join("model.safetensors");
    let mut tensors = Tensor::read_safetensors(&file).unwrap();
    edit(&mut tensors);
    Tensor::write_safetensors(&tensors, &file).unwrap();
    out
}

#[test]
fn non_finite_or_foreign_weights_are_refused_with_the_tensor_named() {
    let dir = scratch("weights");
    let rows = prompts_file(&dir);
    let nan = edited_model(&dir.join("nan"), |ts| {
        let t = ts
            .iter_mut()
            .find(|(n, _)| n.ends_with("layers.0.mlp.up_proj.weight"))
            .unwrap();
        let _ = t.1.get(0).get(0).fill_(f64::NAN);
    });
    fails_with(
        &["score", "--model", nan.to_str().unwrap(), "--input", &rows],
        &["model.layers.0.mlp.up_proj.weight", "NaN or infinite"],
    );
    let extra = edited_model(&dir.join("extra"), |ts| {
        ts.push((
            "model.layers.99.foo.weight".into(),
            Tensor::zeros([2], tch::kind::FLOAT_CPU),
        ))
    });
    fails_with(
        &["score", "--model", extra.to_str().unwrap(), "--input", &rows],
        &["model.layers.99.foo.weight", "not a parameter of this model"],
    );
}

#[test]
fn a_resume_past_max_steps_is_refused() {
    let dir = scratch("resume");
    let out = dir.join("out");
    let cfg = sft_config(&dir, &format!("output_dir = {:?}\nsave_steps = 2", out));
    assert!(run(&["sft", "--config", &cfg]).status.success());
    let path = dir.join("short.toml");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("max_steps = 2", "max_steps = 1");
    std::fs::write(&path, text).unwrap();
    let ckpt = out.join("checkpoint-2");
    fails_with(
        &[
            "sft",
            "--config",
            path.to_str().unwrap(),
            "--resume-from",
            ckpt.to_str().unwrap(),
        ],
        &["config `max_steps`: is 1", "step 2"],
    );
}

#[test]
fn an_update_that_makes_weights_non_finite_stops_the_run() {
    use treetrain::sft::{SftConfig, SftTrainer, TokenizeOptions};
    use treetrain::train::{DataSettings, OptimizerSettings, OutputSettings, TrainConfig, TrainError};
    let dir = scratch("blowup");
    let cfg = SftConfig {
        train: TrainConfig {
            model: tiny(),
            data: DataSettings {
                dataset: datasets().join("sft/train.parquet"),
                ..Default::default()
            },
            optimizer: OptimizerSettings {
                learning_rate: 1e300,
                max_grad_norm: None,
                ..Default::default()
            },
            output: OutputSettings {
                output_dir: Some(dir.join("out")),
                ..Default::default()
            },
            ..Default::default()
        },
        tokenize: TokenizeOptions {
            max_length: 64,
            ..Default::default()
        },
        batch_size: 2,
        max_steps: Some(3),
        ..Default::default()
    };
    let mut t = SftTrainer::new(cfg).unwrap();
    match t.step() {
        Err(TrainError::NonFiniteWeights { step: 1, name }) => {
            assert!(name.starts_with("model.") || name.starts_with("lm_head"))
        }
        other => panic!("expected NonFiniteWeights, got {other:?}"),
    }
    let err = treetrain::train::Trainer::save_checkpoint(&t).unwrap_err().to_string();
    assert!(err.contains("NaN or infinite"), "{err}");
    assert!(!dir.join("out/checkpoint-1").exists());
}

/// `generate` of one chat prompt with the shipped SFT model, greedy, with `extra` flags: the
/// output line.
fn generate_answer(dir: &Path, extra: &[&str]) -> serde_json::Value {
    let input = dir.join("question.jsonl");
    let messages = r#"{"messages": [{"role": "user", "content": "What is 17 + 11?"}]}"#;
    std::fs::write(&input, format!("{messages}\n")).unwrap();
    let model = datasets().join("tiny-qwen3-sft").display().to_string();
    let mut args = vec!["generate", "--model", &model, "--input", input.to_str().unwrap()];
    args.extend_from_slice(&["--chat", "--greedy", "--max-new-tokens", "16"]);
    args.extend_from_slice(extra);
    let out = run(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn stop_strings_match_the_text_across_tokens_and_inside_one() {
    let dir = scratch("stop-strings");
    let full = generate_answer(&dir, &[]);
    let ids: Vec<u32> = serde_json::from_value(full["output_ids"].clone()).unwrap();
    let tok = treetrain::tokenizer::Tokenizer::from_dir(&datasets().join("tiny-qwen3-sft")).unwrap();
    let prefix = |n: usize| tok.decode(&ids[..n], true).unwrap();
    let text = full["text"].as_str().unwrap().to_string();
    // A string from two characters before a token boundary to one character into a token
    // that adds at least two: it spans the boundary and ends inside the token.
    let (k, stop) = (1..ids.len())
        .find_map(|k| {
            let (before, with) = (prefix(k), prefix(k + 1));
            let b = before.len();
            let candidate = with.get(b.checked_sub(2)?..b + 1)?.to_string();
            let ok = with.len() >= b + 2 && before.is_ascii() && text.find(&candidate) == Some(b - 2);
            ok.then_some((k, candidate))
        })
        .expect("a token boundary to stop across");
    let stopped = generate_answer(&dir, &["--stop", &stop]);
    assert_eq!(stopped["finish_reason"], "stop", "{stop:?}: {stopped}");
    let got: Vec<u32> = serde_json::from_value(stopped["output_ids"].clone()).unwrap();
    assert_eq!(got, ids[..k + 1], "ends with the token the string ends inside");
    let cut = stopped["text"].as_str().unwrap();
    assert!(cut.ends_with(&stop) && text.starts_with(cut), "{cut:?} vs {text:?}");
    // The number the model answers, as a user would type it: it stops there too (its ids on
    // their own are not the ids it has inside the answer).
    let digits: String = text
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(char::is_ascii_digit)
        .collect();
    if !digits.is_empty() {
        let stopped = generate_answer(&dir, &["--stop", &digits]);
        assert_eq!(stopped["finish_reason"], "stop", "{digits:?}: {stopped}");
        assert!(stopped["text"].as_str().unwrap().ends_with(&digits));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The shipped SFT model copied to `dir` with `edit` applied to its config.json.
fn model_with_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let out = edited_model(dir, |_| {});
    let path = out.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    out.display().to_string()
}

#[test]
fn model_settings_that_compute_garbage_are_refused_at_load() {
    let dir = scratch("model-settings");
    let rows = prompts_file(&dir);
    let cases: [(&str, serde_json::Value, &str); 4] = [
        ("rope_theta", serde_json::json!(0.0), "`rope_theta` = 0"),
        ("rope_theta", serde_json::json!(-10000.0), "`rope_theta` = -10000"),
        ("rms_norm_eps", serde_json::json!(-1e-6), "`rms_norm_eps` = -0.000001"),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "linear", "factor": 0.0}),
            "`rope_scaling.factor` = 0",
        ),
    ];
    for (i, (key, value, want)) in cases.into_iter().enumerate() {
        // transformers v5's `rope_parameters` wins over the v4 keys: the case uses those.
        let model = model_with_config(&dir.join(format!("m{i}")), |c| {
            c.as_object_mut().unwrap().remove("rope_parameters");
            c[key] = value;
        });
        fails_with(
            &["score", "--model", &model, "--input", &rows],
            &[want, "must be finite and > 0"],
        );
        fails_with(&["generate", "--model", &model, "--input", &rows], &[want]);
    }
}

#[test]
fn model_sizes_beyond_memory_are_refused_before_allocating() {
    let dir = scratch("model-sizes");
    let rows = prompts_file(&dir);
    for (i, (key, value)) in [("hidden_size", 1_000_000), ("num_hidden_layers", 100_000)]
        .into_iter()
        .enumerate()
    {
        let model = model_with_config(&dir.join(format!("m{i}")), |c| {
            c[key] = value.into();
            c["head_dim"] = 64.into();
        });
        fails_with(
            &["score", "--model", &model, "--input", &rows],
            &["parameters", "GB of host memory (fp32)", "GB is available"],
        );
    }
}

#[test]
fn reward_tables_and_reward_columns_are_read_as_the_user_meant() {
    let dir = scratch("reward-tables");
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"2+2=\", \"answer\": \"4\"}\n{\"prompt\": \"3+3=\", \"answer\": [\"6\", \"six\"]}\n",
    )
    .unwrap();
    let write = |rewards: &str| {
        let tables = format!("[[rewards]]\nname = \"exact_answer\"\n[[rewards]]\nname = \"answer_format\"\n{rewards}");
        grpo_config(&dir, &prompts, "", &tables)
    };
    // A typo inside a [[rewards]] table is not a reward field silently ignored.
    fails_with(
        &["grpo", "--config", &write("wieght = 0.25\n")],
        &["unknown key `rewards[1].wieght`", "did you mean `rewards[1].weight`"],
    );
    // A top-level key written after the last [[rewards]] header lands in that table.
    fails_with(
        &["grpo", "--config", &write("num_generations = 4\n")],
        &[
            "unknown key `rewards[1].num_generations`",
            "top-level setting",
            "above the first header",
        ],
    );
    // A list in the answer column would be compared as JSON text: 0 on every rollout.
    fails_with(
        &["grpo", "--config", &write("")],
        &[
            "reads the `answer` column as one value",
            "dataset row 1",
            "[\"6\",\"six\"]",
        ],
    );
}

#[test]
fn smaller_faults_are_refused_or_read_as_transformers_does() {
    let dir = scratch("smaller");
    let rows = prompts_file(&dir);
    // An index beside model.safetensors (a sharded save over an unsharded one): transformers
    // loads the single file, and so does treetrain.
    let both = edited_model(&dir.join("both"), |_| {});
    let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}});
    std::fs::write(both.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let out = run(&["score", "--model", both.to_str().unwrap(), "--input", &rows]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A LoRA checkpoint named as the model says what it is and what to do.
    let out_dir = dir.join("lora-run");
    let cfg = sft_config(
        &dir,
        &format!("output_dir = {out_dir:?}\nsave_steps = 2\n[lora]\nr = 4\ntarget_modules = [\"q_proj\"]"),
    );
    assert!(run(&["sft", "--config", &cfg]).status.success());
    let ckpt = out_dir.join("checkpoint-2").display().to_string();
    fails_with(
        &["score", "--model", &ckpt, "--input", &rows],
        &["holds a LoRA adapter, not a model", "--adapter"],
    );
    // eval_steps with nothing to evaluate on is an error, not a silent skip.
    let cfg = sft_config(&dir, "eval_steps = 1\neval_fraction = 0.0");
    fails_with(&["sft", "--config", &cfg], &["config `eval_steps`", "holds out none"]);
    // Rows whose ids the model's embedding lacks are named before step 1.
    let small = edited_model(&dir.join("small-vocab"), |ts| {
        let e = ts.iter_mut().find(|(n, _)| n == "model.embed_tokens.weight").unwrap();
        e.1 = e.1.narrow(0, 0, 300);
    });
    let config = small.join("config.json");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("\"vocab_size\": 2048", "\"vocab_size\": 300");
    std::fs::write(&config, text).unwrap();
    let cfg = sft_config(&dir, "");
    let cfg_text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(&format!("{:?}", tiny()), &format!("{small:?}"));
    std::fs::write(&cfg, cfg_text).unwrap();
    fails_with(
        &["sft", "--config", &cfg],
        &["row 0 (0-based) tokenizes to id", "outside the model's vocab_size 300"],
    );
}

#[test]
fn a_dense_packed_mask_that_cannot_fit_is_an_error_not_an_abort() {
    // The trainers pack rows as causal segments (no `[seq, seq]` mask); a library user who asks
    // for the dense sequence-id mask of 8 rows of 65,536 tokens (tens of GB) gets an error.
    let opts = treetrain::model::LoadOptions {
        dtype: Some(tch::Kind::Float),
        device: treetrain::device::Device::Cpu,
    };
    let model = treetrain::model::Model::load(Path::new(&tiny()), opts).unwrap();
    let (rows, len) = (8, 65536);
    let ids = Tensor::zeros([rows, len], (tch::Kind::Int64, tch::Device::Cpu));
    let pos = Tensor::arange(len, (tch::Kind::Int64, tch::Device::Cpu)).repeat([rows, 1]);
    let layout = treetrain::model::AttentionLayout::Packed {
        sequence_ids: Tensor::zeros([rows, len], (tch::Kind::Int64, tch::Device::Cpu)),
    };
    let err = tch::no_grad(|| model.lm.forward_hidden(&ids, &pos, &layout))
        .unwrap_err()
        .to_string();
    for want in ["attention mask of", "tokens needs", "GB of memory is available"] {
        assert!(err.contains(want), "{err}");
    }
}

#[test]
fn a_batch_whose_activations_cannot_fit_is_refused_naming_the_tokens_that_fit() {
    let dir = scratch("huge-batch");
    // 2,000 conversations of some 1,200 tokens in one batch: over 100 GB of activations.
    let long = "7 + 8 = 15. ".repeat(200);
    let row = serde_json::json!({"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "Answer: 15"}]});
    let data = dir.join("long.jsonl");
    std::fs::write(&data, format!("{row}\n").repeat(2000)).unwrap();
    let settings = "max_steps = 1\nbatch_size = 100000\neval_fraction = 0.0";
    let path = sft_toml(&dir, &data, settings, 2048);
    fails_with(
        &["sft", "--config", &path],
        &[
            "a training step over",
            "tokens keeps at least",
            "GB of activations",
            "enough for about",
            "gradient_checkpointing",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chat template that loops out gigabytes, or doubles a string with `~` until memory runs
/// out, is an error, not an abort (the process runs under an 8 GB address-space limit, so a
/// regression aborts instead of filling the machine).
#[test]
fn a_runaway_chat_template_is_an_error_not_an_abort() {
    let dir = scratch("runaway-template");
    let model = edited_model(&dir, |_| {});
    let path = model.join("tokenizer_config.json");
    let input = dir.join("chat.jsonl");
    std::fs::write(&input, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n").unwrap();
    let output = format!("more than {} bytes", treetrain::tokenizer::MAX_RENDERED_BYTES);
    let runaways = [
        (
            "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
            output.as_str(),
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "fuel (the most a chat may take",
        ),
    ];
    for (template, want) in runaways {
        let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config["chat_template"] = template.into();
        std::fs::write(&path, config.to_string()).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.args([
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--chat",
        ])
        .env("RUST_BACKTRACE", "0");
        limit_address_space(&mut cmd, 8 << 30);
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains("chat template") && err.contains(want), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `cmd` under `ulimit -v` of `bytes`.
fn limit_address_space(cmd: &mut Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: between fork and exec the closure calls setrlimit alone, which is
    // async-signal-safe; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            match libc::setrlimit(libc::RLIMIT_AS, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
}

/// An `fsdp` value transformers does not spell is an error naming the values there are.
#[test]
fn an_unknown_fsdp_value_names_the_values() {
    let dir = scratch("fsdp");
    let path = sft_toml(&dir, &datasets().join("sft"), "fsdp = \"zero3\"", 128);
    fails_with(
        &["sft", "--config", &path],
        &["unknown variant `zero3`", "`no_shard`, `shard_grad_op`, `full_shard`"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A small tmpfs mounted for a test (root only), unmounted when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(at: PathBuf, size: &str) -> Self {
        std::fs::create_dir_all(&at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&at)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mounting a tmpfs at {} needs root", at.display());
        SmallDisk(at)
    }

    /// Fills the disk to the last byte with `fill`.
    fn fill(&self) {
        let mut f = std::fs::File::create(self.0.join("fill")).unwrap();
        let chunk = vec![7u8; 1 << 16];
        while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
        let _ = std::io::Write::write_all(&mut f, &[7]);
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// A full disk at the start of a run: the output folder's and the log folder's writability
/// checks fail naming the field and the lack of space (an empty file can still be made there),
/// no lock is left behind, and once space is freed the same run starts and finishes.
#[test]
#[ignore = "needs root to mount a tmpfs; test.sh runs it"]
fn a_full_disk_fails_the_start_and_leaves_no_lock() {
    let dir = scratch("full-disk");
    let disk = SmallDisk::mount(dir.join("disk"), "96m");
    disk.fill();
    let out = disk.0.join("out");
    let cfg = sft_config(&dir, &format!("output_dir = {out:?}"));
    fails_with(
        &["sft", "--config", &cfg],
        &["config `output_dir`", "No space left on device"],
    );
    assert!(
        !out.join(".treetrain.lock").exists(),
        "a lock was left on the full disk"
    );
    let logs = disk.0.join("logs");
    let cfg = sft_config(
        &dir,
        &format!(
            "output_dir = {:?}\nreport_to = [\"tensorboard\"]\nlogging_dir = {logs:?}",
            dir.join("out")
        ),
    );
    fails_with(
        &["sft", "--config", &cfg],
        &["config `logging_dir`", "No space left on device"],
    );
    std::fs::remove_file(disk.0.join("fill")).unwrap();
    let cfg = sft_config(&dir, &format!("output_dir = {out:?}"));
    let done = run(&["sft", "--config", &cfg]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    drop(disk);
    let _ = std::fs::remove_dir_all(&dir);
}

/// TRL's spellings read as TRL reads them (`scale_rewards = true` is "group", `false` is
/// "none"), and a refused value names its field, its line and what would be accepted.
#[test]
fn trl_spellings_are_read_and_refused_values_name_field_line_and_choices() {
    let dir = scratch("spellings");
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"2+2=\", \"answer\": \"4\"}\n{\"prompt\": \"3+3=\", \"answer\": \"6\"}\n",
    )
    .unwrap();
    let rewards = "[[rewards]]\nname = \"exact_answer\"\n";
    let out = dir.join("out");
    for flag in ["true", "false"] {
        let settings = format!(
            "output_dir = {out:?}\nprompts_per_step = 2\nnum_generations = 2\nmax_completion_length = 4\nscale_rewards = {flag}"
        );
        let done = run(&["grpo", "--config", &grpo_config(&dir, &prompts, &settings, rewards)]);
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
        let _ = std::fs::remove_dir_all(&out);
    }
    // Line 5: after model, dataset, prompt_field and max_steps.
    let cfg = grpo_config(&dir, &prompts, "multi_objective_aggregation = \"sum\"", rewards);
    fails_with(
        &["grpo", "--config", &cfg],
        &[
            "`multi_objective_aggregation` (line 5)",
            "sum_then_normalize",
            "normalize_then_sum",
        ],
    );
    let cfg = grpo_config(&dir, &prompts, "scale_rewards = 1", rewards);
    fails_with(
        &["grpo", "--config", &cfg],
        &[
            "`scale_rewards` (line 5)",
            "\"group\", \"batch\" or \"none\" (or true = \"group\"",
        ],
    );
    // Values of the right meaning in the wrong type, or past a floor: each says what to write.
    for (line, want) in [
        (
            "num_generations = \"4\"",
            "write the number without quotes: num_generations = 4",
        ),
        ("num_generations = 2.0", "write a whole number: num_generations = 2"),
        (
            "learning_rate = \"1e-5\"",
            "write the number without quotes: learning_rate = 1e-5",
        ),
        (
            "gradient_checkpointing = \"True\"",
            "write the boolean without quotes: gradient_checkpointing = true",
        ),
        ("top_k = -1", "write top_k = 0 to keep every token"),
        ("seed = -3", "write a whole number, 0 or more"),
        (
            "temperature = 1e-40",
            "write temperature = 0.01 for near-greedy sampling",
        ),
    ] {
        let cfg = grpo_config(&dir, &prompts, line, rewards);
        let field = line.split(' ').next().unwrap();
        let named = match field {
            "temperature" => "config `temperature`: is 1e-40; must be finite and at least 1e-5".to_string(),
            _ => format!("`{field}` (line 5)"),
        };
        fails_with(&["grpo", "--config", &cfg], &[&named, want]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// One endless line on standard input (no newline, past the bound) is an error naming the
/// line and the bound, never an allocation that grows until the process aborts.
#[test]
fn an_endless_input_line_is_an_error_not_an_abort() {
    let mut child = Command::new(BIN)
        .args(["score", "--model"])
        .arg(tiny())
        .args(["--input", "-"])
        .env("RUST_BACKTRACE", "0")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let feeder = std::thread::spawn(move || {
        let endless = std::io::Read::take(std::io::repeat(b'x'), treetrain::data::MAX_LINE_BYTES + (1 << 20));
        // The reader stops at the bound and exits: the rest meets a closed pipe.
        let _ = std::io::copy(&mut std::io::BufReader::new(endless), &mut stdin);
    });
    let out = child.wait_with_output().unwrap();
    let _ = feeder.join();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("-:1: is longer than 256 MiB"), "{err}");
}

/// A batch whose activations pass the size check but not the allocator (here an address-space
/// limit of 4 GB, as `ulimit -v` sets) is an out-of-memory error naming the settings to lower,
/// never a panic from inside a torch op.
#[test]
fn an_allocation_that_fails_inside_a_step_is_an_error_naming_the_settings() {
    let dir = scratch("step-oom");
    let long = "7 + 8 = 15. ".repeat(200);
    let row = serde_json::json!({"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "Answer: 15"}]});
    let data = dir.join("long.jsonl");
    std::fs::write(&data, format!("{row}\n").repeat(45)).unwrap();
    let settings = format!(
        "max_steps = 1\nbatch_size = 100000\neval_fraction = 0.0\noutput_dir = {:?}",
        dir.join("out")
    );
    let path = sft_toml(&dir, &data, &settings, 2048);
    let mut cmd = Command::new(BIN);
    cmd.args(["sft", "--config", &path]).env("RUST_BACKTRACE", "0");
    limit_address_space(&mut cmd, 4 << 30);
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked") && !err.contains("frame #"), "{err}");
    // Refused before the step when the size check sees the limit, else when the allocation fails.
    let before = err.contains("GB of activations") && err.contains("batch_size");
    let inside = err.contains("step 0: out of memory (DefaultCPUAllocator: can't allocate memory")
        && err.contains("lower batch_size or max_length, or turn on gradient_checkpointing");
    assert!(before || inside, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Image, audio and video content parts, and the media columns of vision-language datasets,
/// are refused as unsupported, naming the row, field and part, before any row is rendered.
#[test]
fn media_inputs_are_refused_as_unsupported() {
    let dir = scratch("media");
    let text = serde_json::json!({"messages": [
        {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]});
    let image = serde_json::json!({"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A cat."}]});
    let column = serde_json::json!({"images": ["cat.png"], "messages": [
        {"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "A cat."}]});
    for (rows, want) in [
        (
            vec![&text, &image],
            "row 1 (0-based): field `messages` message 0's content part 0 is \"image\"",
        ),
        (
            vec![&text, &text, &column],
            "row 2 (0-based): field `images` is a media column",
        ),
    ] {
        let data = dir.join("rows.jsonl");
        let lines: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
        std::fs::write(&data, lines.join("\n") + "\n").unwrap();
        let path = sft_toml(&dir, &data, "max_steps = 1\nbatch_size = 1\neval_fraction = 0.0", 64);
        fails_with(
            &["sft", "--config", &path],
            &[want, "image, audio and video inputs", "not supported"],
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `MASTER_PORT` 0 or past 65535 is named as the problem, with the ports that would do.
#[test]
fn a_master_port_no_rank_can_use_is_named() {
    let dir = scratch("master-port");
    let cfg = sft_config(&dir, "");
    for (port, why) in [("0", "asks for any free port"), ("70000", "is past the last TCP port")] {
        let out = Command::new(BIN)
            .args(["sft", "--config", &cfg])
            .envs([
                ("WORLD_SIZE", "2"),
                ("RANK", "1"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port),
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains(&format!("MASTER_PORT=\"{port}\" {why}")) && err.contains("from 1 to 65535"),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
