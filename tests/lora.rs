//! LoRA adapters against PEFT: adapters PEFT made (tests/fixtures/adapters, by
//! scripts/fixtures/make_lora_fixtures.py) give PEFT's logits here, PEFT itself loads adapters
//! treetrain saves and agrees (the venv of scripts/setup-peft.sh), merging keeps the outputs,
//! and only adapter tensors train.

mod common;

use std::path::{Path, PathBuf};

use common::{row_logits, score_lines};
use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::model::lora::{LoraConfig, TargetModules};
use treetrain::model::{AttentionLayout, LoadOptions, Model, ModelError};
use treetrain::train::{AdamW, AdamWConfig};

const PEFT_CASES: [&str; 3] = [
    "peft_qwen3_attention",
    "peft_qwen3_all_linear_rslora",
    "peft_llama_bias_mlp",
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn load_base(name: &str) -> Model {
    let opts = LoadOptions {
        dtype: Some(Kind::Float),
        device: Device::Cpu,
    };
    Model::load(&fixtures().join("models").join(name), opts).unwrap()
}

struct Expected {
    base: String,
    rows: Vec<Vec<i64>>,
    logits: Vec<Tensor>,
}

fn logits_of(v: &serde_json::Value) -> Vec<Tensor> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|row| Tensor::from_slice2(&serde_json::from_value::<Vec<Vec<f32>>>(row.clone()).unwrap()))
        .collect()
}

fn expected(case: &str) -> Expected {
    let path = fixtures().join("adapters").join(case).join("expected.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    Expected {
        base: v["base"].as_str().unwrap().into(),
        rows: serde_json::from_value(v["rows"].clone()).unwrap(),
        logits: logits_of(&v["logits"]),
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("treetrain-lora-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn adapters_made_by_peft_give_peft_logits_and_merge_to_the_same() {
    for case in PEFT_CASES {
        let exp = expected(case);
        let mut model = load_base(&exp.base);
        let base_logits: Vec<Tensor> = exp.rows.iter().map(|r| row_logits(&model, r)).collect();
        model.load_adapter(&fixtures().join("adapters").join(case)).unwrap();
        for (row, want) in exp.rows.iter().zip(&exp.logits) {
            let d = max_diff(&row_logits(&model, row), want);
            assert!(d <= 1e-4, "{case}, row of {}: max |diff| to PEFT = {d:e}", row.len());
        }
        // The adapter matters: PEFT's outputs are far from the base's.
        assert!(
            max_diff(&base_logits[0], &exp.logits[0]) > 1e-2,
            "{case}: adapter changes nothing"
        );
        let view = model.base_view().unwrap();
        let n = exp.rows[0].len() as i64;
        let ids = Tensor::from_slice(&exp.rows[0]).view([1, n]);
        let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
        let base = tch::no_grad(|| {
            view.forward(&ids, &pos, &AttentionLayout::Causal)
                .unwrap()
                .squeeze_dim(0)
        });
        assert!(
            max_diff(&base, &base_logits[0]) <= 1e-6,
            "{case}: the base view is not the base"
        );
        // Merged in place, unmerged back, then merged for good and saved as a plain checkpoint.
        model.merge_adapter().unwrap();
        let d = max_diff(&row_logits(&model, &exp.rows[1]), &exp.logits[1]);
        assert!(d <= 1e-4, "{case}: merged vs PEFT {d:e}");
        model.unmerge_adapter().unwrap();
        let d = max_diff(&row_logits(&model, &exp.rows[1]), &exp.logits[1]);
        assert!(d <= 1e-4, "{case}: unmerged vs PEFT {d:e}");
        model.merge_and_unload().unwrap();
        assert!(model.adapter.is_none());
        let dir = temp_dir(&format!("merged-{case}"));
        model.save(&dir, None).unwrap();
        let reloaded = Model::load(&dir, LoadOptions::default()).unwrap();
        for (row, want) in exp.rows.iter().zip(&exp.logits) {
            let d = max_diff(&row_logits(&reloaded, row), want);
            assert!(d <= 1e-4, "{case}: merged checkpoint vs PEFT {d:e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn the_base_view_shares_every_base_tensor() {
    let mut model = load_base("qwen3");
    model
        .load_adapter(&fixtures().join("adapters/peft_qwen3_attention"))
        .unwrap();
    let view = model.base_view().unwrap();
    let pairs = [
        (&view.embed_tokens, &model.lm.embed_tokens),
        (
            &view.layers[1].self_attn.q_proj().weight,
            &model.lm.layers[1].self_attn.q_proj().weight,
        ),
        (
            &view.layers[0].mlp.dense().unwrap().down_proj.weight,
            &model.lm.layers[0].mlp.dense().unwrap().down_proj.weight,
        ),
    ];
    for (a, b) in pairs {
        assert_eq!(a.data_ptr(), b.data_ptr(), "the reference copied a weight");
    }
    assert!(view.layers[0].self_attn.q_proj().adapter.is_none());
    model.merge_adapter().unwrap();
    assert!(model.base_view().is_err(), "a merged adapter hides the base");
}

fn small_config() -> LoraConfig {
    LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        target_modules: TargetModules::AllLinear,
        seed: 7,
        ..LoraConfig::default()
    }
}

#[test]
fn a_new_adapter_starts_at_the_base_and_only_its_tensors_train() {
    let mut model = load_base("qwen3");
    let row = [5i64, 17, 99, 3, 250, 42, 7];
    let before = row_logits(&model, &row);
    model.add_lora(small_config()).unwrap();
    let adapter = model.adapter.as_ref().unwrap();
    // all-linear: 7 per layer, never lm_head.
    assert_eq!(adapter.modules.len(), 14);
    assert!(adapter.modules.iter().all(|m| m != "lm_head"));
    assert!(
        max_diff(&row_logits(&model, &row), &before) == 0.0,
        "B = 0 must leave outputs unchanged"
    );
    // A's values lie in PEFT's Kaiming-uniform bound, B is zero.
    let vars = adapter.vs.variables();
    let a = &vars["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
    assert_eq!(a.size(), [4, 64]);
    let bound = 1.0 / 64f64.sqrt();
    assert!(a.abs().max().double_value(&[]) <= bound && a.abs().max().double_value(&[]) > 0.9 * bound);
    assert_eq!(
        vars["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
            .abs()
            .sum(Kind::Float)
            .double_value(&[]),
        0.0
    );
    let mut adamw = AdamW::new(model.trainable(), AdamWConfig::default());
    let n = row.len() as i64;
    let ids = Tensor::from_slice(&row).view([1, n]);
    let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
    let base_before: Vec<(String, Tensor)> = model
        .vs
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.detach().copy()))
        .collect();
    for _ in 0..3 {
        let loss = model
            .lm
            .forward(&ids, &pos, &AttentionLayout::Causal)
            .unwrap()
            .pow_tensor_scalar(2)
            .mean(Kind::Float);
        loss.backward();
        for (name, t) in model.vs.variables() {
            assert!(
                !t.requires_grad() && !t.grad().defined(),
                "base `{name}` has a gradient"
            );
        }
        adamw.step(1e-2).unwrap();
        adamw.zero_grad();
    }
    assert_eq!(
        adamw.parameters().len(),
        14 * 2,
        "optimizer state only for lora_A/lora_B"
    );
    let vars = model.vs.variables();
    for (name, t) in &base_before {
        assert!(max_diff(&vars[name], t) == 0.0, "base `{name}` changed");
    }
    assert!(
        max_diff(&row_logits(&model, &row), &before) > 1e-4,
        "the adapter did not train"
    );
}

#[test]
fn dropout_is_seeded_on_while_training_and_off_in_eval() {
    let mut model = load_base("qwen3");
    model
        .add_lora(LoraConfig {
            lora_dropout: 0.5,
            ..small_config()
        })
        .unwrap();
    // Give B values so the adapter's input matters.
    for (name, t) in model.trainable().variables() {
        if name.contains("lora_B") {
            tch::no_grad(|| t.shallow_clone().copy_(&(Tensor::ones_like(&t) * 0.1)));
        }
    }
    let row = [5i64, 17, 99, 3, 250, 42, 7];
    let eval = row_logits(&model, &row);
    assert!(
        max_diff(&row_logits(&model, &row), &eval) == 0.0,
        "eval must be deterministic"
    );
    model.set_training(true);
    let a = model.adapter.as_ref().unwrap();
    let draws = a.dropout_draws();
    let t1 = row_logits(&model, &row);
    let t2 = row_logits(&model, &row);
    assert!(
        max_diff(&t1, &eval) > 1e-4 && max_diff(&t1, &t2) > 1e-4,
        "dropout did nothing"
    );
    // The same draw count gives the same masks (what exact resume relies on).
    model.adapter.as_ref().unwrap().set_dropout_draws(draws);
    assert!(max_diff(&row_logits(&model, &row), &t1) == 0.0);
    model.set_training(false);
    assert!(max_diff(&row_logits(&model, &row), &eval) == 0.0);
}

/// PEFT's `PeftModel.from_pretrained` loads an adapter treetrain saved (random non-zero values
/// everywhere, rsLoRA and a saved module) and gives treetrain's logits.
#[test]
#[ignore = "slow: runs PEFT (scripts/setup-peft.sh; test.sh sets TREETRAIN_PEFT_PYTHON)"]
fn peft_loads_adapters_treetrain_saves_and_agrees() {
    let python = std::env::var("TREETRAIN_PEFT_PYTHON")
        .expect("set TREETRAIN_PEFT_PYTHON to a python with peft (scripts/setup-peft.sh prints it)");
    let configs = [
        small_config(),
        LoraConfig {
            r: 3,
            lora_alpha: 5.0,
            use_rslora: true,
            target_modules: TargetModules::Names(vec!["v_proj".into(), "model.layers.1.mlp.up_proj".into()]),
            modules_to_save: vec!["lm_head".into()],
            ..small_config()
        },
    ];
    let rows = vec![vec![5i64, 17, 99, 3, 250, 42, 7], vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]];
    for (i, config) in configs.into_iter().enumerate() {
        let mut model = load_base("qwen3");
        model.add_lora(config).unwrap();
        let mut g = treetrain::util::SplitMix64::new(i as u64);
        for (_, t) in model.trainable().variables() {
            let noise: Vec<f32> = (0..t.numel()).map(|_| (g.next_f64() as f32 - 0.5) * 0.6).collect();
            let noise = Tensor::from_slice(&noise).view(t.size().as_slice());
            tch::no_grad(|| t.shallow_clone().copy_(&(&t + noise)));
        }
        let dir = temp_dir(&format!("for-peft-{i}"));
        model.save_adapter(&dir).unwrap();
        let stdout = run_ok(
            std::process::Command::new(&python)
                .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fixtures/peft_logits.py"))
                .arg(fixtures().join("models/qwen3"))
                .arg(&dir)
                .arg(serde_json::to_string(&rows).unwrap()),
        );
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let adapter = model.adapter.as_ref().unwrap();
        assert_eq!(
            v["trainable"].as_i64().unwrap(),
            adapter.num_parameters(),
            "trainable count"
        );
        for (row, want) in rows.iter().zip(logits_of(&v["logits"])) {
            let d = max_diff(&row_logits(&model, row), &want);
            assert!(d <= 1e-4, "config {i}: treetrain vs PEFT {d:e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn adapter_error(base: &str, edit: impl FnOnce(&Path)) -> String {
    let dir = temp_dir(&format!("bad-{base}-{}", rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixtures().join("adapters/peft_qwen3_attention");
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    edit(&dir);
    let mut model = load_base(base);
    let err = model.load_adapter(&dir).unwrap_err().to_string();
    assert!(model.adapter.is_none());
    let _ = std::fs::remove_dir_all(&dir);
    err
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn set_field(dir: &Path, key: &str, value: serde_json::Value) {
    let path = dir.join("adapter_config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn adapters_that_do_not_fit_or_ask_for_more_are_errors_naming_the_tensor_or_field() {
    // Another base: qwen2's attention is 4 heads of 16, the adapter's of 24 (layer 0's o_proj
    // comes first by name: its lora_A is [4, 96] where qwen2 needs [4, 64]).
    let err = adapter_error("qwen2", |_| {});
    assert!(
        err.contains("layers.0.self_attn.o_proj.lora_A.weight") && err.contains("shape [4, 96]"),
        "{err}"
    );
    for (key, value, want) in [
        ("use_dora", serde_json::json!(true), "use_dora"),
        ("bias", serde_json::json!("all"), "bias"),
        ("rank_pattern", serde_json::json!({"q_proj": 2}), "rank_pattern"),
        ("peft_type", serde_json::json!("IA3"), "peft_type"),
        ("init_lora_weights", serde_json::json!("pissa"), "init_lora_weights"),
        ("some_new_option", serde_json::json!(3), "some_new_option"),
        ("target_modules", serde_json::json!(".*q_proj"), "regular expression"),
        ("target_modules", serde_json::json!(["q_proj", "qkv"]), "`qkv`"),
    ] {
        let err = adapter_error("qwen3", |d| set_field(d, key, value));
        assert!(err.contains(want), "{key}: {err}");
    }
    // A tensor the config does not imply.
    let err = adapter_error("qwen3", |d| {
        set_field(d, "target_modules", serde_json::json!(["q_proj"]))
    });
    assert!(err.contains("o_proj.lora_A.weight") || err.contains("v_proj"), "{err}");
    let err = adapter_error("qwen3", |d| {
        std::fs::remove_file(d.join("adapter_model.safetensors")).unwrap()
    });
    assert!(err.contains("adapter_model.safetensors"), "{err}");
    // New adapters: a missing target, LoRA on the head, an overlap.
    let mut model = load_base("qwen3");
    for (config, want) in [
        (TargetModules::Names(vec!["embed_tokens".into()]), "embed_tokens"),
        (TargetModules::Names(vec!["lm_head".into()]), "lm_head"),
    ] {
        let err = model
            .add_lora(LoraConfig {
                target_modules: config,
                ..small_config()
            })
            .unwrap_err();
        assert!(
            matches!(err, ModelError::Adapter { .. }) && err.to_string().contains(want),
            "{err}"
        );
    }
    let err = model
        .add_lora(LoraConfig {
            modules_to_save: vec!["q_proj".into()],
            ..small_config()
        })
        .unwrap_err();
    assert!(err.to_string().contains("modules_to_save"), "{err}");
    let err = model.add_lora(LoraConfig { r: 0, ..small_config() }).unwrap_err();
    assert!(err.to_string().contains("lora.r"), "{err}");
    // Saving a plain checkpoint would lose an unmerged adapter.
    model.add_lora(small_config()).unwrap();
    assert!(model.add_lora(small_config()).is_err(), "two adapters at once");
    let err = model.save(&temp_dir("plain"), None).unwrap_err();
    assert!(err.to_string().contains("save_adapter"), "{err}");
}

/// Runs `cmd` to success and returns its standard output.
fn run_ok(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn treetrain(args: &[&str]) -> String {
    run_ok(std::process::Command::new(env!("CARGO_BIN_EXE_treetrain")).args(args))
}

/// Greedy `generate --adapter` (which merges) gives the tokens the unmerged adapter gives.
fn assert_merged_generation_equals_the_adapters(
    base_s: &str,
    adapter_s: &str,
    input_s: &str,
    adapter: &std::path::Path,
    rows: &[Vec<i64>],
) {
    let generated = treetrain(&[
        "generate",
        "--model",
        base_s,
        "--adapter",
        adapter_s,
        "--input",
        input_s,
        "--greedy",
        "--max-new-tokens",
        "12",
    ]);
    let got: Vec<Vec<i64>> = generated
        .lines()
        .map(|l| {
            serde_json::from_value(serde_json::from_str::<serde_json::Value>(l).unwrap()["output_ids"].clone()).unwrap()
        })
        .collect();
    let mut model = load_base("qwen3");
    model.load_adapter(adapter).unwrap();
    let cfg = treetrain::generate::GenerationConfig {
        max_new_tokens: 12,
        ..Default::default()
    };
    let unmerged = treetrain::generate::Generator::new()
        .generate(&model.lm, rows, &cfg)
        .unwrap();
    for (g, u) in got.iter().zip(&unmerged) {
        assert_eq!(g, &u.output_ids, "merged generation differs from the adapter's");
    }
}

/// `score --adapter` gives PEFT's log-probs, `convert --adapter` writes a merged checkpoint that
/// scores the same without it, and greedy `generate --adapter` (merged) gives the tokens the
/// unmerged adapter gives.
#[test]
fn the_cli_applies_and_merges_adapters() {
    let case = "peft_qwen3_all_linear_rslora";
    let exp = expected(case);
    let adapter = fixtures().join("adapters").join(case);
    let base = fixtures().join("models/qwen3");
    let dir = temp_dir("cli");
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("rows.jsonl");
    let lines: Vec<String> = exp
        .rows
        .iter()
        .map(|r| serde_json::json!({"input_ids": r}).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let (base_s, input_s, adapter_s) = (
        base.to_str().unwrap(),
        input.to_str().unwrap(),
        adapter.to_str().unwrap(),
    );
    let scored = score_lines(&treetrain(&[
        "score",
        "--model",
        base_s,
        "--adapter",
        adapter_s,
        "--input",
        input_s,
    ]));
    for ((row, logits), got) in exp.rows.iter().zip(&exp.logits).zip(&scored) {
        let lp = logits.log_softmax(-1, Kind::Float);
        for (i, g) in got.iter().enumerate() {
            let want = lp.double_value(&[i as i64, row[i + 1]]);
            assert!((g - want).abs() <= 1e-4, "position {i}: {g} vs PEFT {want}");
        }
    }
    let merged = dir.join("merged");
    treetrain(&[
        "convert",
        "--model",
        base_s,
        "--adapter",
        adapter_s,
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert!(!merged.join("adapter_config.json").exists() && merged.join("model.safetensors").exists());
    let plain = score_lines(&treetrain(&[
        "score",
        "--model",
        merged.to_str().unwrap(),
        "--input",
        input_s,
    ]));
    for (a, b) in scored.iter().flatten().zip(plain.iter().flatten()) {
        assert!((a - b).abs() <= 1e-4, "merged {b} vs adapter {a}");
    }
    assert_merged_generation_equals_the_adapters(base_s, adapter_s, input_s, &adapter, &exp.rows);
    let _ = std::fs::remove_dir_all(&dir);
}
