//! A checkpoint saved by treetrain loads in transformers with the same outputs
//! (tests/fixtures/saved_tiny_qwen3.json, made by scripts/fixtures/make_saved_checkpoint_fixture.py
//! from `treetrain convert --model datasets/tiny-qwen3`).

use std::path::Path;

use serde_json::Value;
use treetrain::model::{LoadOptions, Model};
use treetrain::tokenizer::{ChatOptions, Tokenizer};

#[test]
fn saved_tiny_model_matches_what_transformers_computed_on_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = treetrain::shipped::tiny_model_dir().unwrap();
    let out = std::env::temp_dir().join(format!("treetrain-saved-tiny-{}", std::process::id()));
    Model::load(&src, LoadOptions::default())
        .unwrap()
        .save(&out, Some(&src))
        .unwrap();
    for f in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    let model = Model::load(&out, LoadOptions::default()).unwrap();
    let tok = Tokenizer::from_dir(&out).unwrap();
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tests/fixtures/saved_tiny_qwen3.json")).unwrap())
            .unwrap();
    assert_eq!(fixture["eos_token_id"].as_i64(), Some(model.lm.config.eos_token_ids[0]));
    for row in fixture["rows"].as_array().unwrap() {
        let opts = ChatOptions {
            add_generation_prompt: row["add_generation_prompt"].as_bool().unwrap(),
            ..Default::default()
        };
        let chat = tok.tokenize_chat(&row["messages"], &opts).unwrap();
        assert_eq!(chat.text, row["text"].as_str().unwrap());
        let want_ids: Vec<u32> = serde_json::from_value(row["input_ids"].clone()).unwrap();
        assert_eq!(chat.input_ids, want_ids);
        let ids: Vec<i64> = want_ids.iter().map(|&i| i64::from(i)).collect();
        let got = model.score(&ids).unwrap();
        let want: Vec<f64> = serde_json::from_value(row["logprobs"].clone()).unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 1e-4, "{g} vs {w}");
        }
    }
}
