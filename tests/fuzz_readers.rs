//! Brief fuzzing (proptest) of every reader of user input: TOML configs, JSON-lines dataset
//! rows, rollouts, sequence lengths, safetensors headers and chat-template inputs. Each must
//! return a value or an error for any input, never panic. Cases are few per run (CI runs them
//! all every time); `PROPTEST_CASES` raises them for a longer session.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use treetrain::pack::{Packing, Rollout};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treetrain-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(n),
        ..ProptestConfig::default()
    }
}

/// Keys of the trainer configs and values of every TOML type, some out of range.
fn toml_line() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "model",
        "dataset",
        "learning_rate",
        "max_grad_norm",
        "logging_steps",
        "eval_steps",
        "batch_size",
        "max_steps",
        "eval_fraction",
        "num_train_epochs",
        "warmup_ratio",
        "seed",
        "device",
        "dtype",
        "packing",
        "pad_to_multiple_of",
        "num_generations",
        "prompts_per_step",
        "temperature",
        "top_p",
        "min_p",
        "token_budget",
        "mode",
        "loss_type",
        "beta",
        "unknown_key",
        "adamw.beta1",
        "tokenize.max_length",
    ]);
    let value = prop_oneof![
        any::<i64>().prop_map(|v| v.to_string()),
        any::<f64>().prop_map(|v| if v.is_finite() { format!("{v:?}") } else { "nan".into() }),
        Just("inf".to_string()),
        Just("-inf".to_string()),
        "[a-z\"{}\\[\\] ,=0-9.]{0,12}".prop_map(|s| s),
        "\"[a-z0-9/._ -]{0,12}\"".prop_map(|s| s),
        Just("true".to_string()),
        Just("[1, 2]".to_string()),
        Just("{ x = 1 }".to_string()),
    ];
    (key, value).prop_map(|(k, v)| format!("{k} = {v}"))
}

proptest! {
    #![proptest_config(cases(64))]

    #[test]
    fn toml_configs_parse_or_error(lines in prop::collection::vec(toml_line(), 0..6), raw in ".{0,40}") {
        let dir = scratch("toml");
        let path = dir.join("c.toml");
        for text in [lines.join("\n"), raw] {
            std::fs::write(&path, &text).unwrap();
            if let Ok(c) = treetrain::sft::SftConfig::from_toml_file(&path) {
                let _ = c.validate();
            }
            if let Ok(c) = treetrain::grpo::GrpoConfig::from_toml_file(&path) {
                let _ = c.validate();
            }
        }
    }

    #[test]
    fn dataset_rows_read_or_error(lines in prop::collection::vec(prop_oneof![
        ".{0,30}",
        Just("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}".to_string()),
        Just("{\"messages\": [{\"role\": 3}]}".to_string()),
        Just("{\"prompt\": \"a\", \"completion\": 5}".to_string()),
        Just("{\"text\": null}".to_string()),
        Just("[1, 2, 3]".to_string()),
    ], 0..5)) {
        let dir = scratch("rows");
        let path = dir.join("data.jsonl");
        std::fs::write(&path, lines.join("\n")).unwrap();
        if let Ok(ds) = treetrain::data::Dataset::open(&path) {
            for skip in [false, true] {
                let mut skipped = 0;
                let _: Vec<_> = ds.examples(skip, &mut skipped).collect();
            }
        }
    }

    #[test]
    fn rollouts_validate_and_plan_or_error(
        ids in prop::collection::vec(-3i64..200, 0..12),
        mask in prop::collection::vec(0u8..3, 0..12),
        lps in prop::collection::vec(prop_oneof![any::<f32>(), Just(f32::NAN), Just(f32::INFINITY)], 0..12),
        advantage in prop_oneof![any::<f32>(), Just(f32::NAN)],
        budget in 0usize..16,
        copies in 1usize..4,
    ) {
        let r = Rollout { input_ids: ids, completion_mask: mask, old_log_probs: lps, advantage, group_id: "g".into() };
        let json = serde_json::to_string(&r).unwrap_or_default();
        let _ = serde_json::from_str::<Rollout>(&json);
        let ok = r.validate(0).is_ok();
        for packing in [Packing::Tree, Packing::Flat] {
            let planned = packing.plan(vec![r.clone(); copies], budget, 2);
            if !ok {
                prop_assert!(planned.is_err(), "an invalid rollout was planned");
            }
        }
    }

    #[test]
    fn any_lengths_forecast_or_error(lengths in prop::collection::vec(prop_oneof![0usize..5000, Just(usize::MAX), any::<usize>()], 0..20), batch in 0usize..5) {
        use treetrain::device::{PadTo, Platform};
        for pad in [PadTo::Auto, PadTo::None, PadTo::Multiple(7)] {
            let _ = treetrain::shapes::PaddingComparison::new(&lengths, batch, pad, Platform::Neuron, 60.0);
        }
    }

    #[test]
    fn chat_inputs_render_or_error(messages in prop::collection::vec((
        prop_oneof![Just("user"), Just("assistant"), Just("system"), Just("tool"), Just(""), Just("robot")],
        prop_oneof![".{0,20}".prop_map(serde_json::Value::from), any::<i64>().prop_map(serde_json::Value::from), Just(serde_json::Value::Null), Just(serde_json::json!([{"type": "text", "text": "x"}]))],
    ), 0..5), generation_prompt: bool) {
        let tok = treetrain::tokenizer::Tokenizer::from_dir(&root().join("datasets/tiny-qwen3")).unwrap();
        let msgs: Vec<serde_json::Value> = messages.into_iter().map(|(role, content)| serde_json::json!({"role": role, "content": content})).collect();
        let opts = treetrain::tokenizer::ChatOptions { add_generation_prompt: generation_prompt, ..Default::default() };
        let _ = tok.tokenize_chat(&serde_json::Value::Array(msgs), &opts);
        let _ = tok.tokenize_chat(&serde_json::json!({"not": "a list"}), &opts);
    }
}

proptest! {
    #![proptest_config(cases(12))]

    /// A real checkpoint's safetensors header with bytes flipped, cut short or replaced.
    #[test]
    fn safetensors_headers_load_or_error(cut in 0usize..200, flips in prop::collection::vec((0usize..200, any::<u8>()), 0..6), garbage in prop::collection::vec(any::<u8>(), 0..64)) {
        let src = root().join("datasets/tiny-qwen3-sft"); // committed weights (tiny-qwen3 makes its own on first load)
        let dir = scratch("st");
        for f in ["config.json", "tokenizer.json"] {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
        let real = std::fs::read(src.join("model.safetensors")).unwrap();
        let header_end = 8 + u64::from_le_bytes(real[..8].try_into().unwrap()) as usize;
        let mut header = real[..header_end].to_vec();
        for (at, byte) in flips {
            let i = at % header.len();
            header[i] = byte;
        }
        for bytes in [header[..cut.min(header.len())].to_vec(), [header.clone(), real[header_end..].to_vec()].concat(), garbage] {
            std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
            let _ = treetrain::model::Model::load(&dir, Default::default());
        }
    }
}
