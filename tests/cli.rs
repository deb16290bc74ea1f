//! The `treetrain` binary, run as a user would.

mod common;

use std::process::Command;

use common::score_lines;

fn treetrain(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_treetrain"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn env_json_reports_versions_and_policies() {
    let (ok, out, err) = treetrain(&["env", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["versions"]["libtorch"], "2.11.0");
    assert_eq!(v["versions"]["tch"], "0.24.0");
    assert!(v["accelerators"]["CUDA"].as_str().is_some());
    assert!(v["policies"]["platform"].as_str().is_some());
}

#[test]
fn shapes_reads_a_lengths_file() {
    let dir = std::env::temp_dir().join(format!("treetrain-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("lengths.jsonl");
    std::fs::write(&file, "100\n{\"length\": 130}\n{\"input_ids\": [1,2,3]}\n\n300\n").unwrap();
    let (ok, out, err) = treetrain(&[
        "shapes",
        "--lengths",
        file.to_str().unwrap(),
        "--batch-size",
        "2",
        "--pad",
        "128",
    ]);
    assert!(ok, "{err}");
    // batches [100,130] [3,300]: two shapes unpadded; [2,256] and [2,384] padded.
    assert!(out.contains("4 sequences, batch 2"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("longest row only") || l.starts_with("pad to"))
        .collect();
    assert!(rows[0].split_whitespace().nth(3) == Some("2"), "{out}");
    assert!(rows[1].split_whitespace().nth(3) == Some("2"), "{out}");
}

#[test]
fn bad_arguments_fail_with_a_message() {
    let (ok, _, err) = treetrain(&["shapes", "--pad", "sometimes"]);
    assert!(!ok && err.contains("invalid pad_to_multiple_of \"sometimes\""), "{err}");
    let (ok, _, err) = treetrain(&["shapes", "--batch-size", "0"]);
    assert!(!ok && err.contains("batch_size must be at least 1"), "{err}");
    let (ok, _, err) = treetrain(&["shapes", "--lengths", "/nonexistent.txt"]);
    assert!(!ok && err.contains("/nonexistent.txt"), "{err}");
}

#[test]
fn score_flat_and_tree_packing_equal_separate_rows() {
    let dir = std::env::temp_dir().join(format!("treetrain-cli-score-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("rows.jsonl");
    std::fs::write(
        &input,
        "{\"input_ids\": [5, 17, 99, 3, 250]}\n\n{\"input_ids\": [1]}\n{\"input_ids\": [7, 8, 9, 10, 11, 12, 13]}\n",
    )
    .unwrap();
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/models/qwen2");
    let run = |packing: &str, extra: &[&str]| {
        let mut args = vec![
            "score",
            "--model",
            model,
            "--input",
            input.to_str().unwrap(),
            "--packing",
            packing,
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = treetrain(&args);
        assert!(ok, "{err}");
        score_lines(&out)
    };
    let none = run("none", &[]);
    assert_eq!(none.iter().map(Vec::len).collect::<Vec<_>>(), vec![4, 0, 6]);
    for flat in [
        run("flat", &[]),
        run("flat", &["--max-tokens", "6"]),
        run("tree", &[]),
        run("tree", &["--max-tokens", "7"]),
    ] {
        for (a, b) in none.iter().zip(&flat) {
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
            }
        }
    }
}

#[test]
fn score_text_rows_use_the_tokenizer_and_errors_name_the_line() {
    let dir = std::env::temp_dir().join(format!("treetrain-cli-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = treetrain::shipped::tiny_model_dir().unwrap();
    let input = dir.join("text.jsonl");
    std::fs::write(&input, "{\"text\": \"What is 2 + 3?\"}\n").unwrap();
    let (ok, out, err) = treetrain(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let tok = treetrain::tokenizer::Tokenizer::from_dir(&model).unwrap();
    assert_eq!(
        score_lines(&out)[0].len(),
        tok.encode("What is 2 + 3?", true).unwrap().len() - 1
    );
    std::fs::write(&input, "{\"input_ids\": [1, 2]}\n{\"ids\": [1]}\n").unwrap();
    let (ok, _, err) = treetrain(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("text.jsonl:2") && err.contains("input_ids"),
        "{err}"
    );
    std::fs::write(&input, "{\"input_ids\": [1, 99999]}\n").unwrap();
    let (ok, _, err) = treetrain(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("text.jsonl:1") && err.contains("0..2048"), "{err}");
}

#[test]
fn pack_reproduces_the_trl_fixture_and_names_bad_lines() {
    let dir = std::env::temp_dir().join(format!("treetrain-cli-pack-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("rollouts.jsonl");
    let line = |ids: &[i64], adv: f64| {
        let n = ids.len();
        let mask: Vec<u8> = (0..n).map(|i| u8::from(i >= 3)).collect();
        let lp: Vec<f64> = (0..n).map(|i| if i >= 3 { -0.5 } else { 0.0 }).collect();
        serde_json::json!({"input_ids": ids, "completion_mask": mask, "old_log_probs": lp, "advantage": adv, "group_id": 0}).to_string()
    };
    let rows = [
        line(&[101, 102, 103, 201, 202], 1.0),
        line(&[101, 102, 103, 301, 302], -1.0),
        line(&[101, 102, 103, 201, 202, 401], 0.5),
    ];
    std::fs::write(&input, rows.join("\n")).unwrap();
    let (ok, out, err) = treetrain(&["pack", "--input", input.to_str().unwrap()]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        v["input_ids"],
        serde_json::json!([101, 102, 103, 201, 202, 202, 401, 103, 301, 302])
    );
    assert_eq!(v["tree_cu_seqlens_k"], serde_json::json!([0, 2, 6, 11, 17, 22]));
    let (ok, out, _) = treetrain(&["pack", "--input", input.to_str().unwrap(), "--flat"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["input_ids"].as_array().unwrap().len(), 16);
    // Budget 8: A and B share 101 102 (5 + 3 unique tokens); C would add 2 more, so it opens a row.
    let (ok, out, _) = treetrain(&["pack", "--input", input.to_str().unwrap(), "--budget", "8"]);
    assert!(ok);
    let packed: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(packed.len(), 2, "{out}");
    assert_eq!(
        packed[0]["input_ids"],
        serde_json::json!([101, 102, 103, 201, 202, 103, 301, 302])
    );
    let (ok, _, err) = treetrain(&["pack", "--input", input.to_str().unwrap(), "--budget", "4"]);
    assert!(!ok && err.contains("exceed the row budget of 4"), "{err}");
    std::fs::write(
        &input,
        format!(
            "{}\n{{\"input_ids\": [1, 2], \"completion_mask\": [0], \"old_log_probs\": [0, 0], \"advantage\": 1}}\n",
            rows[0]
        ),
    )
    .unwrap();
    let (ok, _, err) = treetrain(&["pack", "--input", input.to_str().unwrap()]);
    assert!(
        !ok && err.contains("rollouts.jsonl:2") && err.contains("completion_mask"),
        "{err}"
    );
}

#[test]
fn generate_greedy_matches_transformers_and_reports_each_completion() {
    let fixture: serde_json::Value = serde_json::from_str(include_str!("fixtures/greedy_generation.json")).unwrap();
    let dir = std::env::temp_dir().join(format!("treetrain-cli-gen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("prompts.jsonl");
    let lines: Vec<String> = fixture["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| serde_json::json!({"input_ids": p}).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/models/qwen2");
    let args = [
        "generate",
        "--model",
        model,
        "--input",
        input.to_str().unwrap(),
        "--greedy",
        "--max-new-tokens",
        "16",
        "--prefill-chunk-size",
        "8",
    ];
    let (ok, out, err) = treetrain(&args);
    assert!(ok, "{err}");
    let got: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let want = fixture["cases"]["qwen2"]["outputs"].as_array().unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert_eq!(&g["output_ids"], w);
        assert_eq!(g["logprobs"].as_array().unwrap().len(), w.as_array().unwrap().len());
        assert!(["eos", "length"].contains(&g["finish_reason"].as_str().unwrap()));
        assert!(g.get("text").is_none(), "no tokenizer, no text");
    }
    // Groups: G lines per prompt, prompt by prompt.
    let (ok, out, err) = treetrain(&[&args[..], &["--num-generations", "3"]].concat());
    assert!(ok, "{err}");
    let idx: Vec<u64> = out
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt_index"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(idx, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
    std::fs::write(&input, "{\"prompt\": \"hi\"}\n").unwrap();
    let (ok, _, err) = treetrain(&["generate", "--model", model, "--input", input.to_str().unwrap()]);
    assert!(
        !ok && err.contains("prompts.jsonl:1") && err.contains("tokenizer"),
        "{err}"
    );
}

/// An empty scratch folder for test `name`.
/// `TREETRAIN_TORCH_CUDA` is read by every command before anything asks libtorch about CUDA:
/// a folder without `libtorch_cuda.so` stops the command with that reason (the same command
/// runs without it), and a CUDA device libtorch cannot see is refused with why.
#[test]
fn every_command_reads_the_cuda_library_setting_first() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let model = root.join("tests/fixtures/models/qwen3");
    let input = scratch_dir("torch-cuda").join("rows.jsonl");
    std::fs::write(&input, "{\"input_ids\": [5, 17, 99, 3]}\n").unwrap();
    let args = |device: &'static str| {
        let (m, i) = (model.display().to_string(), input.display().to_string());
        vec![
            "score".to_string(),
            "--model".into(),
            m,
            "--input".into(),
            i,
            "--device".into(),
            device.into(),
        ]
    };
    let run = |args: &[String], env: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_treetrain"));
        c.args(args).env_remove("TREETRAIN_TORCH_CUDA");
        if let Some(dir) = env {
            c.env("TREETRAIN_TORCH_CUDA", dir);
        }
        let out = c.output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    assert!(run(&args("cpu"), None).0);
    for command in [args("cpu"), vec!["shapes".to_string()]] {
        let (ok, err) = run(&command, Some("/nonexistent/torch/lib"));
        assert!(
            !ok && err.contains("libtorch_cuda.so") && err.contains("no such file"),
            "{command:?}: {err}"
        );
    }
    let (ok, err) = run(&args("cuda"), None);
    assert!(
        !ok && err.contains("libtorch sees 0 CUDA device(s): ") && err.contains("driver"),
        "{err}"
    );
}

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("treetrain-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The shipped recipe `datasets/NAME.toml` written into `dir` with absolute model and data
/// paths, its output under `dir/out`, and `edits` (text replacements) applied.
fn local_recipe(name: &str, dir: &std::path::Path, edits: &[(&str, &str)]) -> std::path::PathBuf {
    let datasets = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets");
    let shipped = std::fs::read_to_string(datasets.join(format!("{name}.toml"))).unwrap();
    let mut text: String = shipped
        .lines()
        .map(|line| match line.split_once(" = \"") {
            Some(("model" | "dataset" | "eval_dataset", path)) => {
                let key = line.split_once(' ').unwrap().0;
                format!("{key} = {:?}", datasets.join(path.trim_end_matches('"')))
            }
            Some(("output_dir", _)) => format!("output_dir = {:?}", dir.join("out")),
            _ => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    for (from, to) in edits {
        assert!(text.contains(from), "{name}.toml has no {from:?}");
        text = text.replace(from, to);
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn grpo_runs_a_shipped_environment() {
    let dir = scratch_dir("env");
    // The calculator recipe at test size (one step of 2 prompts).
    let cfg = local_recipe(
        "calculator",
        &dir,
        &[
            ("prompts_per_step = 8", "prompts_per_step = 2"),
            // No held-out evaluation: one step is what this test runs.
            ("eval_steps = 10", ""),
        ],
    );
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = treetrain(&[
        "grpo",
        "--config",
        cfg,
        "--max-steps",
        "1",
        "--environment",
        "calculator",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("step    1: reward") && out.contains("(calculator "),
        "{out}"
    );
    assert!(dir.join("out/checkpoint-1/model.safetensors").exists());
    let (ok, _, err) = treetrain(&["grpo", "--config", cfg, "--environment", "chess"]);
    assert!(
        !ok && err.contains("--environment chess") && err.contains("retry-game"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn grpo_runs_from_a_toml_file_and_resumes() {
    let dir = scratch_dir("grpo");
    let cfg = local_recipe(
        "grpo",
        &dir,
        &[
            ("prompts_per_step = 16", "prompts_per_step = 2"),
            ("eval_samples = 8", "eval_samples = 1"),
        ],
    );
    let cfg = cfg.to_str().unwrap();
    let (ok, out, err) = treetrain(&["grpo", "--config", cfg, "--max-steps", "2", "--mode", "async"]);
    assert!(ok, "{err}");
    assert!(out.contains("step    2: reward"), "{out}");
    assert!(out.contains("eval at step 0: reward"), "{out}");
    assert!(err.contains("async rollouts, tree packing"), "{err}");
    let ckpt = dir.join("out/checkpoint-2");
    assert!(ckpt.join("model.safetensors").exists());
    let (ok, out, err) = treetrain(&[
        "grpo",
        "--config",
        cfg,
        "--max-steps",
        "3",
        "--packing",
        "flat",
        "--resume-from",
        "latest",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("step    3: reward") && !out.contains("step    2: reward"),
        "{out}"
    );
    let log = std::fs::read_to_string(dir.join("out/log.jsonl")).unwrap();
    assert_eq!(log.lines().count(), 3);
    assert_eq!(out.matches("saved ").count(), 1, "the end's checkpoint, once: {out}");
    let (ok, _, err) = treetrain(&["grpo", "--config", cfg, "--mode", "sometimes"]);
    assert!(!ok && err.contains("--mode sometimes"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Multi-turn with a tool: the calculator recipe's held-out right answers rise, and
/// conversations forked after the tool's result share more than single-turn groups.
fn assert_the_calculator_task_rose(mt: &serde_json::Value) {
    assert_eq!(mt["steps"].as_array().unwrap().len(), 40, "{mt}");
    let (tool_before, tool_after) = (
        mt["held_out_reward_before"].as_f64().unwrap(),
        mt["held_out_reward_after"].as_f64().unwrap(),
    );
    assert!(
        tool_after > tool_before + 0.05,
        "calculator: {tool_before} -> {tool_after}"
    );
    assert!(mt["packing"]["packing_ratio"].as_f64().unwrap() > 2.0, "{mt}");
}

#[test]
#[ignore = "slow: the whole demo (~3 min)"]
fn the_demo_tells_the_whole_story() {
    let out = std::env::temp_dir().join(format!("treetrain-demo-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let (ok, stdout, err) = treetrain(&["demo", "--out", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    for section in [
        "== 1. Environment",
        "== 4. SFT",
        "== 5. GRPO",
        "== 6. The last informative step",
        "== 7. Multi-turn",
    ] {
        assert!(stdout.contains(section), "missing {section}:\n{stdout}");
    }
    for file in [
        "report.html",
        "shapes.svg",
        "sft_curves.svg",
        "grpo_curves.svg",
        "calculator_curves.svg",
        "grpo/log.jsonl",
        "grpo/checkpoint-250/model.safetensors",
    ] {
        assert!(out.join(file).exists(), "{file} missing");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let s = &summary["sft"];
    assert!(s["held_out_loss_after"].as_f64().unwrap() < s["held_out_loss_before"].as_f64().unwrap() - 1.0);
    let g = &summary["grpo"];
    let (before, after) = (
        g["held_out_reward_before"].as_f64().unwrap(),
        g["held_out_reward_after"].as_f64().unwrap(),
    );
    assert!(after > before + 0.05, "held-out reward {before} -> {after}");
    // The shipped recipe's point: held-out exact answers (100 prompts x 8 samples) rise by the
    // issue's +0.3 (training seeds 1-3 all do).
    let (exact_before, exact_after) = (
        g["held_out_exact_before"].as_f64().unwrap(),
        g["held_out_exact_after"].as_f64().unwrap(),
    );
    assert!(
        exact_after > exact_before + 0.3,
        "held-out exact answers {exact_before} -> {exact_after}"
    );
    let curve = g["held_out_exact_curve"].as_array().unwrap();
    assert_eq!(curve.len(), 11, "step 0, every 25 steps, the end: {curve:?}");
    let t = &summary["tree_packing"];
    // The speedup itself is timing, measured by the benches; here: the tree shares, and both
    // packings give the same loss.
    assert!(
        t["packing_ratio"].as_f64().unwrap() > 3.0 && t["tree_speedup"].as_f64().unwrap() > 0.0,
        "{t}"
    );
    // The loss is a sum that cancels to ~1e-4 here: fp32 rounding is compared against 1e-3.
    let (tree, flat) = (t["loss_tree"].as_f64().unwrap(), t["loss_flat"].as_f64().unwrap());
    assert!((tree - flat).abs() <= 1e-5 * flat.abs().max(1e-3), "{tree} vs {flat}");
    assert_the_calculator_task_rose(&summary["multi_turn"]);
    assert_eq!(
        std::fs::read_to_string(out.join("grpo/log.jsonl"))
            .unwrap()
            .lines()
            .count(),
        250
    );
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("Sample completions") && html.contains("Latest micro-batch"));
    let _ = std::fs::remove_dir_all(&out);
}
