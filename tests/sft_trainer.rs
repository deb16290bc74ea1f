//! The SFT trainer on the shipped data and tiny model.

use std::path::PathBuf;

use tch::Kind;
use treetrain::device::{DeviceSpec, Platform};
use treetrain::sft::{SftConfig, SftTrainer};
use treetrain::train::{MAX_CONSECUTIVE_SKIPS, NanPolicy, TrainConfig, TrainError, Trainer};

mod common;

fn config(out: Option<PathBuf>) -> SftConfig {
    common::shipped_sft(out, 40)
}

/// `cfg` with its shared settings changed by `change`.
fn tweak(mut cfg: SftConfig, change: impl FnOnce(&mut TrainConfig)) -> SftConfig {
    change(&mut cfg.train);
    cfg
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("treetrain-sft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn loss_goes_down_on_the_shipped_conversations() {
    // Planned for Neuron: pad_to_multiple_of = auto resolves to 128.
    let mut t = SftTrainer::new(SftConfig {
        platform: Platform::Neuron,
        ..config(None)
    })
    .unwrap();
    let before = t.evaluate().unwrap();
    t.train_for(40).unwrap();
    let after = t.evaluate().unwrap();
    let h = &t.state.history;
    assert_eq!(h.len(), 40);
    let first: f64 = h[..5].iter().map(|m| m.loss).sum::<f64>() / 5.0;
    let last: f64 = h[35..].iter().map(|m| m.loss).sum::<f64>() / 5.0;
    assert!(last < first - 2.0, "train loss {first:.3} -> {last:.3}");
    assert!(after < before - 2.0, "eval loss {before:.3} -> {after:.3}");
    assert!(h.iter().all(|m| m.grad_norm.is_finite() && !m.skipped));
    assert!(h[0].lr < h[5].lr, "warmup");
    // Packed rows of at most 128 tokens padded to a multiple of 128: one training shape.
    assert_eq!(
        t.ledger.distinct("sft/forward"),
        1,
        "{:?}",
        t.ledger.graph("sft/forward")
    );
    let padding: Vec<f64> = h.iter().map(|m| m.padding_fraction).collect();
    // bfd fills rows nearly full; the first batches hold the longest conversations and pad
    // the most.
    let mean = padding.iter().sum::<f64>() / padding.len() as f64;
    assert!(
        mean < 0.1 && padding.iter().all(|&p| p < 0.3),
        "bfd rows are nearly full: {padding:?}"
    );
    // The epoch forecast: padded batches have many shapes unless padded to a multiple.
    let epoch = t.epoch_shapes(0).unwrap();
    assert!(epoch.distinct("sft/forward") <= 2, "{}", epoch.distinct("sft/forward"));
    let cpu = SftTrainer::new(SftConfig {
        packing: None,
        ..config(None)
    })
    .unwrap()
    .epoch_shapes(0)
    .unwrap();
    let neuron = SftTrainer::new(SftConfig {
        packing: None,
        platform: Platform::Neuron,
        ..config(None)
    })
    .unwrap()
    .epoch_shapes(0)
    .unwrap();
    assert!(
        cpu.distinct("sft/forward") > 5 * neuron.distinct("sft/forward"),
        "{} vs {}",
        cpu.distinct("sft/forward"),
        neuron.distinct("sft/forward")
    );
    let html = treetrain::display::Rich::html(&t.state);
    assert!(html.contains("<svg") && html.contains("Loss"));
}

#[test]
fn resume_from_a_checkpoint_is_bit_exact() {
    let out = scratch("resume");
    let mut a = SftTrainer::new(SftConfig {
        max_steps: Some(6),
        ..config(Some(out.clone()))
    })
    .unwrap();
    a.train_for(3).unwrap();
    let ckpt = a.save_checkpoint().unwrap();
    assert!(ckpt.join("model.safetensors").exists() && ckpt.join("optimizer.safetensors").exists());
    assert!(ckpt.join("tokenizer.json").exists() && ckpt.join("trainer_state.json").exists());
    a.train_for(3).unwrap();
    let mut b = SftTrainer::resume_from(
        SftConfig {
            max_steps: Some(6),
            ..config(Some(out.clone()))
        },
        &ckpt,
    )
    .unwrap();
    assert_eq!(b.state.global_step, 3);
    b.train_for(3).unwrap();
    for (x, y) in a.state.history[3..].iter().zip(&b.state.history[3..]) {
        assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "step {}", x.step);
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits());
    }
    let wa = a.model().lm.embed_tokens.shallow_clone();
    let wb = b.model().lm.embed_tokens.shallow_clone();
    assert_eq!((wa - wb).abs().max().double_value(&[]), 0.0);
    // b cut the log back to its checkpoint's step 3: each step once.
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let steps: Vec<u64> = log
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
}

#[test]
fn accumulation_normalises_over_the_whole_window() {
    let base = SftConfig {
        packing: None,
        max_steps: Some(1),
        ..tweak(config(None), |t| t.optimizer.max_grad_norm = None)
    };
    let mut one = SftTrainer::new(SftConfig {
        batch_size: 4,
        gradient_accumulation_steps: 1,
        ..base.clone()
    })
    .unwrap();
    let mut two = SftTrainer::new(SftConfig {
        batch_size: 2,
        gradient_accumulation_steps: 2,
        ..base
    })
    .unwrap();
    let warm = SftTrainer::new(SftConfig {
        max_steps: Some(8),
        ..tweak(config(None), |t| t.optimizer.warmup_steps = Some(4))
    })
    .unwrap();
    assert_eq!(warm.lr_schedule().warmup_steps, 4);
    let m1 = one.step().unwrap();
    let m2 = two.step().unwrap();
    assert!((m1.loss - m2.loss).abs() < 1e-5, "{} vs {}", m1.loss, m2.loss);
    assert!((m1.grad_norm - m2.grad_norm).abs() < 1e-5 * m1.grad_norm.max(1.0));
    let d = (&one.model().lm.embed_tokens - &two.model().lm.embed_tokens)
        .abs()
        .max()
        .double_value(&[]);
    assert!(d < 1e-6, "{d}");
    assert!(m1.padding_fraction > 0.0, "padded batches pad");
}

#[test]
fn non_finite_steps_are_skipped_or_stop_with_the_rows_named() {
    let mut t = SftTrainer::new(SftConfig {
        max_steps: Some(3 + MAX_CONSECUTIVE_SKIPS),
        ..config(None)
    })
    .unwrap();
    t.step().unwrap();
    let _ = tch::no_grad(|| t.model().lm.norm.weight.shallow_clone().fill_(f64::NAN));
    let before = t.model().lm.embed_tokens.copy();
    let m = t.step().unwrap();
    assert!(m.skipped && t.state.skipped_steps == 1);
    assert_eq!(
        (&t.model().lm.embed_tokens - before).abs().max().double_value(&[]),
        0.0,
        "weights untouched"
    );
    // Skipping forever is not training: the run stops at the limit, naming it.
    for _ in 2..MAX_CONSECUTIVE_SKIPS {
        assert!(t.step().unwrap().skipped);
    }
    let err = t.step().unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::KeepsSkipping {
                count: MAX_CONSECUTIVE_SKIPS,
                what: "loss",
                ..
            }
        ),
        "{err}"
    );
    t.set_on_nan(NanPolicy::Stop);
    let err = t.step().unwrap_err();
    assert!(matches!(err, TrainError::NonFinite { what: "loss", .. }), "{err}");
    assert!(err.to_string().contains("rows ["), "{err}");
    assert_eq!(t.model().lm.embed_tokens.kind(), Kind::Float);
}

#[test]
fn malformed_rows_are_named_or_skipped() {
    let dir = scratch("rows");
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("rows.jsonl");
    let good = serde_json::json!({"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "Answer: 2"}]});
    let rows = [
        good.clone(),
        serde_json::json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}),
        good.clone(),
        serde_json::json!({"prompt": "only a prompt"}),
    ];
    std::fs::write(&f, rows.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("\n")).unwrap();
    let cfg = SftConfig {
        eval_fraction: 0.0,
        ..tweak(config(None), |t| t.data.dataset = f)
    };
    let err = SftTrainer::new(cfg.clone()).unwrap_err().to_string();
    assert!(err.contains("row 1") && err.contains("empty assistant turn"), "{err}");
    let t = SftTrainer::new(tweak(cfg, |t| t.data.skip_invalid_rows = true)).unwrap();
    assert_eq!((t.num_train_rows(), t.state.skipped_rows), (2, 2));
}

#[test]
fn an_unknown_device_is_a_config_error() {
    let err = SftTrainer::new(tweak(config(None), |t| t.device = DeviceSpec::Cuda(7)))
        .unwrap_err()
        .to_string();
    let n = tch::Cuda::device_count();
    assert!(
        err.contains(&format!("device \"cuda:7\": libtorch sees {n} CUDA device")),
        "{err}"
    );
}
