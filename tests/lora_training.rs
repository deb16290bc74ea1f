//! LoRA in the trainers: SFT and GRPO train the adapter alone (the base untouched, no gradient
//! or optimizer state for it), checkpoints hold the adapter in PEFT's format and resume
//! exactly, and GRPO's reference is the base with the adapter off, sharing its tensors.

use std::path::PathBuf;

use tch::Tensor;
use treetrain::grpo::{GrpoConfig, GrpoTrainer, RolloutMode};
use treetrain::model::lora::{LoraConfig, TargetModules};
use treetrain::model::{LoadOptions, Model};
use treetrain::sft::{SftConfig, SftTrainer};
use treetrain::train::{TrainConfig, TrainError, Trainer};

mod common;

use common::root;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treetrain-lora-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn lora(dropout: f64) -> LoraConfig {
    LoraConfig {
        r: 16,
        lora_alpha: 32.0,
        lora_dropout: dropout,
        target_modules: TargetModules::AllLinear,
        seed: 3,
        ..LoraConfig::default()
    }
}

fn sft(out: Option<PathBuf>, lora: Option<LoraConfig>, steps: u64) -> SftConfig {
    let mut cfg = common::shipped_sft(out, steps);
    cfg.train.optimizer.learning_rate = 1e-2;
    cfg.train.optimizer.warmup_ratio = 0.0;
    cfg.train.lora = lora;
    cfg
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Every base variable of `model` equals the checkpoint it was loaded from, and has no gradient.
fn assert_base_untouched(model: &Model) {
    let dir = model.source.clone().unwrap();
    let fresh = Model::load(&dir, LoadOptions::default()).unwrap().vs.variables();
    for (name, t) in model.vs.variables() {
        assert!(
            !t.requires_grad() && !t.grad().defined(),
            "base `{name}` has a gradient"
        );
        assert_eq!(max_diff(&t, &fresh[&name]), 0.0, "base `{name}` changed");
    }
}

#[test]
fn lora_sft_lowers_the_loss_and_trains_the_adapter_alone() {
    let mut t = SftTrainer::new(sft(None, Some(lora(0.0)), 30)).unwrap();
    let before = t.evaluate().unwrap();
    t.train_for(30).unwrap();
    let after = t.evaluate().unwrap();
    let h = &t.state.history;
    let first: f64 = h[..5].iter().map(|m| m.loss).sum::<f64>() / 5.0;
    let last: f64 = h[25..].iter().map(|m| m.loss).sum::<f64>() / 5.0;
    assert!(last < first - 1.0, "train loss {first:.3} -> {last:.3}");
    assert!(after < before - 1.0, "eval loss {before:.3} -> {after:.3}");
    assert_base_untouched(t.model());
    let adapter = t.model().adapter.as_ref().unwrap();
    assert!(
        adapter.num_parameters() * 10 < adapter.base_parameters,
        "LoRA should train a small share"
    );
}

#[test]
fn lora_checkpoints_hold_the_adapter_alone_and_resume_exactly() {
    let out = scratch("resume");
    let cfg = || sft(Some(out.clone()), Some(lora(0.1)), 6);
    let mut a = SftTrainer::new(cfg()).unwrap();
    a.train_for(3).unwrap();
    let ckpt = a.save_checkpoint().unwrap();
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "tokenizer.json",
    ] {
        assert!(ckpt.join(f).exists(), "{f} missing");
    }
    assert!(
        !ckpt.join("model.safetensors").exists(),
        "a LoRA checkpoint holds no base weights"
    );
    // The optimizer state covers the adapter tensors alone.
    let opt = std::fs::read(ckpt.join("optimizer.safetensors")).unwrap();
    let names: Vec<String> = safetensors::SafeTensors::deserialize(&opt)
        .unwrap()
        .names()
        .into_iter()
        .map(String::from)
        .collect();
    assert!(
        !names.is_empty() && names.iter().all(|n| n.contains(".lora_A.") || n.contains(".lora_B.")),
        "{names:?}"
    );
    a.train_for(3).unwrap();
    let mut b = SftTrainer::resume_from(cfg(), &ckpt).unwrap();
    b.train_for(3).unwrap();
    for (x, y) in a.state.history[3..].iter().zip(&b.state.history[3..]) {
        assert_eq!(
            x.loss.to_bits(),
            y.loss.to_bits(),
            "step {} (dropout masks included)",
            x.step
        );
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits());
    }
    let (va, vb) = (a.model().trainable().variables(), b.model().trainable().variables());
    for (name, t) in &va {
        assert_eq!(max_diff(t, &vb[name]), 0.0, "{name}");
    }
    // Resuming with other settings, or without LoRA, is refused with the reason.
    let other = SftConfig {
        train: TrainConfig {
            lora: Some(LoraConfig { r: 8, ..lora(0.1) }),
            ..cfg().train
        },
        ..cfg()
    };
    let err = SftTrainer::resume_from(other, &ckpt).unwrap_err();
    assert!(
        matches!(&err, TrainError::Config { field, .. } if *field == "lora"),
        "{err}"
    );
    let plain = SftConfig {
        train: TrainConfig {
            lora: None,
            ..cfg().train
        },
        ..cfg()
    };
    let err = SftTrainer::resume_from(plain, &ckpt).unwrap_err();
    assert!(err.to_string().contains("holds a LoRA adapter"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

fn grpo(lora: Option<LoraConfig>, mode: RolloutMode) -> GrpoConfig {
    let mut cfg = common::shipped_grpo();
    cfg.train.optimizer.learning_rate = 1e-2;
    cfg.train.lora = lora;
    cfg.reference.beta = 0.02;
    cfg.rollouts.mode = mode;
    cfg
}

#[test]
fn grpo_with_lora_uses_the_base_as_reference_and_syncs_the_adapter_alone() {
    let cfg = {
        let mut c = grpo(Some(lora(0.0)), RolloutMode::Async);
        c.max_steps = 3;
        c.rollouts.max_staleness = 1;
        c.rollouts.queue_size = 1;
        c
    };
    let mut t = GrpoTrainer::new(cfg).unwrap();
    t.train_for(3).unwrap();
    // The reference is the policy's own base tensors (no second copy of the weights).
    let reference = t.reference().unwrap();
    let policy = &t.model().lm;
    assert_eq!(reference.embed_tokens.data_ptr(), policy.embed_tokens.data_ptr());
    assert_eq!(
        reference.layers[0].mlp.dense().unwrap().up_proj().weight.data_ptr(),
        policy.layers[0].mlp.dense().unwrap().up_proj().weight.data_ptr()
    );
    assert!(
        reference.layers[0].mlp.dense().unwrap().up_proj().adapter.is_none()
            && policy.layers[0].mlp.dense().unwrap().up_proj().adapter.is_some()
    );
    // The generator received the adapter's tensors, nothing of the base.
    let adapter = t.model().adapter.as_ref().unwrap();
    let synced = t.async_rollouts().unwrap().published_bytes();
    assert_eq!(
        synced,
        adapter.num_parameters() as usize * 4,
        "one sync = the f32 adapter"
    );
    assert!(
        t.state.history.last().unwrap().update.kl > 0.0,
        "the adapter moved away from the base"
    );
    assert_base_untouched(t.model());
}

/// Held-out reward before and after LoRA GRPO on the shipped task (sync). LoRA's scale 1 at lr
/// 1e-2: at scale x lr of 0.015 and more the tiny policy collapses (reward 0), at 0.005 it
/// barely moves.
#[test]
#[ignore = "slow: 40 GRPO steps with LoRA (~40 s)"]
fn grpo_with_lora_raises_the_reward() {
    let adapter = LoraConfig {
        lora_alpha: 16.0,
        ..lora(0.0)
    };
    // No KL term, as the full-weight test (TRL's default beta = 0).
    let cfg = {
        let mut c = grpo(Some(adapter), RolloutMode::Sync);
        c.reference.beta = 0.0;
        c
    };
    let mut t = GrpoTrainer::new(cfg).unwrap();
    let held_out = t.load_prompts(&root().join("datasets/grpo/test.parquet")).unwrap();
    let before = t.evaluate(&held_out, 8, 99).unwrap().reward_mean;
    t.train_for(40).unwrap();
    let after = t.evaluate(&held_out, 8, 99).unwrap().reward_mean;
    eprintln!("LoRA GRPO: held-out reward {before:.3} -> {after:.3}");
    // The rewards are printed above; the bound asks only for a clear rise.
    assert!(after > before + 0.01, "held-out reward {before:.3} -> {after:.3}");
    assert_base_untouched(t.model());
}

#[test]
fn a_lora_table_in_a_toml_file_configures_the_adapter() {
    let dir = scratch("toml");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("run.toml");
    let write = |lora: &str| {
        std::fs::write(
            &file,
            format!("model = \"m\"\ndataset = \"d.jsonl\"\n\n[lora]\n{lora}\n"),
        )
        .unwrap();
        SftConfig::from_toml_file(&file)
    };
    let cfg = write("r = 4\nlora_alpha = 16\ntarget_modules = [\"q_proj\", \"v_proj\"]\nuse_rslora = true").unwrap();
    let lora = cfg.train.lora.clone().unwrap();
    assert_eq!((lora.r, lora.lora_alpha, lora.use_rslora), (4, 16.0, true));
    assert_eq!(
        lora.target_modules,
        TargetModules::Names(vec!["q_proj".into(), "v_proj".into()])
    );
    assert_eq!(lora.lora_dropout, 0.0, "PEFT's default");
    assert_eq!(
        write("target_modules = \"all-linear\"")
            .unwrap()
            .train
            .lora
            .unwrap()
            .target_modules,
        TargetModules::AllLinear
    );
    // Round trip through save_toml, as a notebook hands a run to the CLI.
    let saved = dir.join("saved.toml");
    cfg.save_toml(&saved).unwrap();
    assert_eq!(SftConfig::from_toml_file(&saved).unwrap(), cfg);
    for (bad, want) in [
        ("rank = 8", "rank"),
        ("target_modules = \"q_proj|v_proj\"", "regular expression"),
        ("lora_dropout = 1.5", "lora.lora_dropout"),
    ] {
        let err = write(bad)
            .and_then(|c| c.validate().map(|_| c))
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{bad}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
