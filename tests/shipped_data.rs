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
    treetrain::shipped::tiny_model::write_mixture_files(&out.join("tiny-qwen3-moe")).unwrap();
    treetrain::shipped::tiny_model::write_muse_spark_files(&out.join("tiny-muse-spark")).unwrap();
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets");
    for f in [
        "sft/train.parquet",
        "sft/train-calculator.parquet",
        "grpo/train.parquet",
        "grpo/test.parquet",
        "calculator/train.parquet",
        "calculator/test.parquet",
        "tiny-qwen3/config.json",
        "tiny-qwen3/tokenizer.json",
        "tiny-qwen3/tokenizer_config.json",
        "tiny-qwen3/treetrain_init.json",
        "tiny-qwen3-moe/config.json",
        "tiny-qwen3-moe/tokenizer.json",
        "tiny-qwen3-moe/tokenizer_config.json",
        "tiny-qwen3-moe/treetrain_init.json",
        "tiny-muse-spark/config.json",
        "tiny-muse-spark/tokenizer.json",
        "tiny-muse-spark/tokenizer_config.json",
        "tiny-muse-spark/treetrain_init.json",
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

/// A folder mounted for the test (tmpfs `size`), unmounted and removed on drop.
struct Mounted(std::path::PathBuf);

impl Mounted {
    /// None where this process may not mount (not root): the caller says so and stops.
    fn tmpfs(name: &str, size: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("treetrain-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(Mounted(dir))
    }

    fn remount_read_only(&self) {
        let ok = std::process::Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&self.0)
            .status();
        assert!(ok.unwrap().success(), "remount read-only");
    }

    fn listing(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A seeded folder that cannot take its weights file (a full disk, a read-only mount) still
/// loads the same weights, from memory, and leaves no temporary file behind.
#[test]
fn seeded_folders_that_cannot_be_written_load_from_memory() {
    // 1 MB cannot hold the tiny model's 14.7 MB of weights.
    let Some(full) = Mounted::tmpfs("seeded-full", "1m") else {
        eprintln!("skipped: mounting a tmpfs needs root (CI runs as root)");
        return;
    };
    let src = treetrain::shipped::tiny_model_dir().unwrap();
    for f in ["config.json", "treetrain_init.json"] {
        std::fs::copy(src.join(f), full.0.join(f)).unwrap();
    }
    let shipped = Model::load(&src, LoadOptions::default()).unwrap();
    let same = |m: &Model| {
        let a = shipped.vs.variables();
        m.vs.variables().iter().all(|(name, t)| t.equal(&a[name]))
    };
    let want = vec!["config.json".to_string(), "treetrain_init.json".to_string()];
    let on_full_disk = Model::load(&full.0, LoadOptions::default()).unwrap();
    assert!(same(&on_full_disk), "the weights made in memory are the shipped ones");
    assert_eq!(full.listing(), want, "no temporary file left on the full disk");
    full.remount_read_only();
    let bf16 = LoadOptions {
        dtype: Some(Kind::BFloat16),
        ..LoadOptions::default()
    };
    let read_only = Model::load(&full.0, bf16).unwrap();
    let embed = shipped.lm.embed_tokens.to_kind(Kind::BFloat16);
    assert!(
        read_only.lm.embed_tokens.equal(&embed),
        "converted as a file load converts"
    );
    assert_eq!(full.listing(), want);
}

/// The shipped tasks' point: the model picks a listed item by a rule, never spells one, so every
/// item and answer must be a single token of the shipped tokenizer, the same in the question as
/// after `Answer:`.
#[test]
fn every_listed_item_and_answer_is_one_token_in_question_and_reply() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/tiny-qwen3");
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let ids = |text: &str| tok.encode(text, false).unwrap().get_ids().to_vec();
    for t in treetrain::shipped::tasks::tasks(400, 11) {
        let question = ids(&t.question);
        let reply = ids(&treetrain::shipped::tasks::format_reply(&t.answer));
        let answer = ids(&format!(" {}", t.answer));
        assert_eq!(answer.len(), 1, "answer {:?} of {:?}", t.answer, t.question);
        assert!(reply.ends_with(&answer), "{:?}", t.answer);
        for item in &t.options {
            let id = ids(&format!(" {item}"));
            assert_eq!(id.len(), 1, "item {item:?}");
            assert!(question.contains(&id[0]), "{item:?} not a token of {:?}", t.question);
        }
    }
}
