//! The committed datasets and tiny-model files are exactly what the seeded generator makes.

use std::path::Path;

use tch::Kind;
use treetrain::model::{LoadOptions, Model};

#[test]
fn committed_files_equal_a_fresh_generation() {
    let out = std::env::temp_dir().join(format!("treetrain-shipped-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    treetrain::shipped::datasets::write_all(&out).unwrap();
    treetrain::shipped::tiny_model::write_model_files(&out.join("tiny-qwen3")).unwrap();
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets");
    for f in [
        "sft/train.parquet",
        "grpo/train.parquet",
        "grpo/test.parquet",
        "tiny-qwen3/config.json",
        "tiny-qwen3/tokenizer.json",
        "tiny-qwen3/tokenizer_config.json",
        "tiny-qwen3/treetrain_init.json",
    ] {
        let a = std::fs::read(out.join(f)).unwrap();
        let b = std::fs::read(committed.join(f)).unwrap();
        assert!(
            a == b,
            "{f} differs from a fresh generation: run `cargo run -- make-shipped-data`"
        );
    }
}

#[test]
fn seeded_weights_are_deterministic_and_shaped_as_initialised() {
    let src = treetrain::shipped::tiny_model_dir().unwrap();
    let scratch = std::env::temp_dir().join(format!("treetrain-seeded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    for f in ["config.json", "treetrain_init.json"] {
        std::fs::copy(src.join(f), scratch.join(f)).unwrap();
    }
    let fresh = Model::load(&scratch, LoadOptions::default()).unwrap();
    assert!(
        scratch.join("model.safetensors").exists(),
        "first load writes the weights"
    );
    let shipped = Model::load(&src, LoadOptions::default()).unwrap();
    assert_eq!(
        std::fs::read(scratch.join("model.safetensors")).unwrap(),
        std::fs::read(src.join("model.safetensors")).unwrap()
    );
    let e = &fresh.lm.embed_tokens;
    assert_eq!(e.size(), [2048, 256]);
    let std = e.std(true).double_value(&[]);
    assert!((std - 0.02).abs() < 0.001, "{std}");
    assert_eq!(fresh.lm.norm.weight.sum(Kind::Float).double_value(&[]), 256.0);
    assert_eq!(shipped.lm.config.num_parameters(), 3_672_832);
    let params: i64 = shipped.vs.variables().values().map(|t| t.numel() as i64).sum();
    assert_eq!(params, shipped.lm.config.num_parameters());
}
