//! Muse Spark Open's text decoder against transformers 5.23 on tiny random checkpoints it saved
//! itself (tests/fixtures/models/muse_spark*, made by scripts/fixtures/make_muse_fixtures.py):
//! a window of 5 positions on three of four layers (the last full and without RoPE), two
//! sparse layers, perturbed norms, gates and correction biases; one saved in fp32, one in bf16.

mod common;

use std::path::Path;

use common::fixture_models::*;
use common::row_logits;
use tch::{Kind, Tensor};
use treetrain::generate::{GenerationConfig, Generator};
use treetrain::model::{Activations, AttentionLayout, LogprobChunks, Model};
use treetrain::pack::{PackedRow, PrefixTree, pack_flat, row_logprobs};

const CASES: [&str; 2] = ["muse_spark", "muse_spark_bf16"];

/// transformers' own fp32 error on a fixture number (from its float64 forward): two fp32
/// computations as exact as each other differ by up to twice it.
fn fp32_err(exp: &serde_json::Value, key: &str, at: impl serde_json::value::Index) -> f64 {
    exp["f64"][key][at].as_f64().unwrap()
}

/// Log-probs within 1e-5 of transformers' fp32 ones, or of its own fp32 rounding (this model's
/// scaled q/k norms make attention sharp, and fp32 rounding shows: the fixture measures it), and
/// the scored tokens as close to the float64 forward as transformers' fp32 comes.
#[test]
fn logprobs_match_transformers_past_the_window() {
    for case in CASES {
        let model = load_f32(&fixture(case));
        let exp = expected(case);
        for (i, (row, want)) in rows(&exp).iter().zip(exp["logits"].as_array().unwrap()).enumerate() {
            let (got, want) = (row_logits(&model, row), tensor(want));
            let err = fp32_err(&exp, "logprob_err_f32", i);
            let lsm = got.log_softmax(-1, Kind::Float);
            let lp = max_diff(&lsm, &want.log_softmax(-1, Kind::Float));
            assert!(
                lp <= (2.0 * err).max(1e-5),
                "{case}, row of {}: log-probs max |diff| = {lp:e} (transformers' own fp32 error {err:e})",
                row.len()
            );
            let n = row.len() as i64;
            if n > 1 {
                let targets = Tensor::from_slice(&row[1..]).view([n - 1, 1]);
                let scored = lsm.narrow(0, 0, n - 1).gather(1, &targets, false).view([n - 1]);
                let exact: Vec<f64> = serde_json::from_value(exp["f64"]["token_logprobs"][i].clone()).unwrap();
                let d = max_diff(&scored.to_kind(Kind::Double), &Tensor::from_slice(&exact));
                assert!(
                    d <= (1.5 * err).max(1e-5),
                    "{case}, row of {}: scores off the float64 ones by {d:e}",
                    n
                );
            }
        }
    }
}

/// A left-padded batch of the fixture rows gives each row's own logits.
#[test]
fn a_padded_batch_equals_each_row_alone() {
    let model = load_f32(&fixture("muse_spark"));
    let exp = expected("muse_spark");
    let rows = rows(&exp);
    let width = rows.iter().map(Vec::len).max().unwrap();
    let (mut ids, mut mask, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    for r in &rows {
        let pad = width - r.len();
        ids.extend(std::iter::repeat_n(0i64, pad).chain(r.iter().copied()));
        mask.extend(std::iter::repeat_n(0i64, pad).chain(std::iter::repeat_n(1, r.len())));
        pos.extend(std::iter::repeat_n(0i64, pad).chain(0..r.len() as i64));
    }
    let shape = [rows.len() as i64, width as i64];
    let layout = AttentionLayout::Padded {
        attention_mask: Tensor::from_slice(&mask).view(shape),
    };
    let ids = Tensor::from_slice(&ids).view(shape);
    let logits = tch::no_grad(|| model.lm.forward(&ids, &Tensor::from_slice(&pos).view(shape), &layout)).unwrap();
    for (i, (r, want)) in rows.iter().zip(exp["logits"].as_array().unwrap()).enumerate() {
        let got = logits.get(i as i64).narrow(0, (width - r.len()) as i64, r.len() as i64);
        let d = max_diff(&got, &tensor(want));
        assert!(d <= 1e-4, "row {i}: max |diff| = {d:e}");
    }
}

/// Tree and flat packing equal each rollout forwarded alone, with a shared prefix longer than
/// the window and branches that fork and run past it.
#[test]
fn tree_and_flat_packing_apply_the_window_along_each_path() {
    let tails: [&[i64]; 4] = [
        &[31, 64, 128, 200, 11, 12, 13],
        &[31, 64, 40],
        &[8, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        &[31, 64, 128, 200, 11, 12, 13],
    ];
    let prompt = [5, 17, 99, 3, 240, 42, 7, 9];
    assert_packings_equal_separate_rows(&CASES, &prompt, &tails, vec![77, 78, 79, 80, 81, 82, 83]);
}

/// Mean next-token cross-entropy of `row`, back-propagated as a training pass does
/// (transformers' loss with `labels = row`; Muse Spark's code adds no router loss).
fn training_pass(m: &Model, row: &[i64], activations: Activations) -> f64 {
    let (ce, aux) = ce_pass(m, row, activations, (None, None));
    assert!(aux.is_none());
    ce
}

#[test]
fn gradients_match_transformers_kept_or_recomputed() {
    for case in CASES {
        let m = load_f32(&fixture(case));
        let exp = expected(case);
        for activations in [Activations::Kept, Activations::Recomputed] {
            let loss = training_pass(&m, &rows(&exp)[0], activations);
            let d = (loss - exp["loss"].as_f64().unwrap()).abs();
            assert!(d <= 1e-5, "{case} {activations:?}: loss off by {d:e}");
            let grads: std::collections::HashMap<String, Tensor> = common::take_grads(&m).into_iter().collect();
            for (name, want) in exp["grads"].as_object().unwrap() {
                let grad = match name.ends_with("_proj") && name.contains("experts") {
                    true => grads[name].narrow(0, 0, 2),
                    false => grads[name].shallow_clone(),
                };
                let want = tensor(want);
                let scale = want.abs().max().double_value(&[]).max(1e-3);
                let d = max_diff(&grad, &want) / scale;
                let err = fp32_err(&exp, "grad_err_f32", name.as_str());
                assert!(
                    d <= (2.0 * err).max(1e-5),
                    "{case} {activations:?} {name}: gradient off by {d:e} of its largest entry (transformers' own fp32 error {err:e})"
                );
            }
        }
    }
}

#[test]
fn greedy_generation_matches_transformers_past_the_window() {
    for case in CASES {
        assert_greedy_matches(case, &[4, 16]);
    }
}

#[test]
fn the_card_counts_and_a_save_reloads_to_the_same_logits() {
    let dir = std::env::temp_dir().join(format!("treetrain-muse-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let m = load_f32(&fixture("muse_spark"));
    let card = treetrain::display::Rich::text(&m);
    assert!(
        card.contains("Muse Spark") && card.contains("6 experts (top 2, width 24) in 2 of 4 layers"),
        "{card}"
    );
    let exp = expected("muse_spark");
    let saved: i64 = exp["param_names"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p[0].as_str().unwrap().starts_with("model.language_model.") || p[0] == "lm_head.weight")
        .map(|p| {
            p[1].as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_i64().unwrap())
                .product::<i64>()
        })
        .sum();
    let c = &m.lm.config;
    assert_eq!(c.num_parameters(), saved);
    assert_eq!(
        m.vs.variables().values().map(Tensor::numel).sum::<usize>() as i64,
        saved
    );
    assert!(c.active_parameters() < c.num_parameters());
    m.save(&dir, None).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], "muse_spark");
    assert_eq!(cfg["text_config"]["sliding_window"], 5);
    let again = load_f32(&dir);
    let row = [5i64, 17, 99, 3, 240, 42, 7, 9, 31];
    assert_eq!(max_diff(&row_logits(&m, &row), &row_logits(&again, &row)), 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rows a user gives that hold an image, video or audio placeholder are refused by name.
#[test]
fn rows_holding_a_tower_placeholder_are_refused() {
    let m = load_f32(&fixture("muse_spark"));
    let e = m.score(&[5, 17, 250, 3]).unwrap_err().to_string();
    assert!(e.contains("250") && e.contains("image_token_id"), "{e}");
    let cfg = GenerationConfig {
        max_new_tokens: 2,
        ..Default::default()
    };
    let e = Generator::new()
        .generate(&m.lm, &[vec![5, 252, 3]], &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("audio_token_id"), "{e}");
    // One that reaches the decoder anyway (a sampled token) embeds as token 0, as
    // transformers' multimodal model hands it to its decoder.
    let (a, b) = (row_logits(&m, &[5, 17, 250, 3]), row_logits(&m, &[5, 17, 0, 3]));
    assert_eq!(max_diff(&a, &b), 0.0);
}

/// TRL's Muse recipe (LoRA r = 16, alpha = 32 on q/k/v/o) both ways with PEFT 0.21: PEFT loads
/// the adapter treetrain saves and gives its logits, and treetrain loads one PEFT made.
#[test]
#[ignore = "slow: runs PEFT (scripts/setup-peft.sh; test.sh sets TREETRAIN_PEFT_PYTHON)"]
fn lora_on_the_attention_round_trips_with_peft() {
    use treetrain::model::lora::{LoraConfig, TargetModules};
    let python = std::env::var("TREETRAIN_PEFT_PYTHON")
        .expect("set TREETRAIN_PEFT_PYTHON to a python with peft (scripts/setup-peft.sh prints it)");
    let targets = ["q_proj", "k_proj", "v_proj", "o_proj"];
    let rows = vec![vec![5i64, 17, 99, 3, 240, 42, 7, 9, 31], vec![1, 33, 3, 4]];
    // treetrain's adapter, every tensor moved off its initial value.
    let mut m = load_f32(&fixture("muse_spark"));
    m.add_lora(LoraConfig {
        r: 16,
        lora_alpha: 32.0,
        target_modules: TargetModules::Names(targets.iter().map(|t| t.to_string()).collect()),
        ..LoraConfig::default()
    })
    .unwrap();
    tch::manual_seed(7);
    for (_, t) in m.trainable().variables() {
        tch::no_grad(|| t.shallow_clone().copy_(&(&t + t.randn_like() * 0.2)));
    }
    let config = serde_json::json!({"r": 16, "lora_alpha": 32, "target_modules": targets});
    let trainable = assert_peft_round_trip(&python, (&fixture("muse_spark"), &m), config, &rows);
    // PEFT also wraps the vision tower's q/k/v (3 x r x (8 + 8) here), which treetrain neither
    // loads nor trains: a text-only run never reaches them.
    let towers = 3 * 16 * (8 + 8);
    assert_eq!(trainable, m.adapter.as_ref().unwrap().num_parameters() + towers);
}

/// transformers loads treetrain's save of a Muse Spark checkpoint unchanged (the decoder from
/// the edited in-memory weights, the vision and audio towers carried over from the source
/// folder) and computes the same logits.
#[test]
#[ignore = "slow: runs transformers (test.sh sets TREETRAIN_PEFT_PYTHON)"]
fn transformers_loads_a_saved_muse_spark_checkpoint() {
    let python = std::env::var("TREETRAIN_PEFT_PYTHON")
        .expect("set TREETRAIN_PEFT_PYTHON to a python with transformers (scripts/setup-peft.sh prints it)");
    let rows = vec![
        vec![5i64, 17, 99, 3, 240, 42, 7, 9, 31],
        vec![1, 33, 3, 4, 5, 6, 7, 8, 9, 10],
    ];
    let tensor = "model.language_model.layers.2.mlp.experts.gate_up_proj";
    assert_edited_save_loads(&python, ("muse_spark_bf16", tensor), &rows);
}

/// SFT (bf16 mixed precision, gradient checkpointing) and tree-packed GRPO train the shipped
/// tiny Muse Spark, whose rows and prefix trees run past its 32-position window; Muse Spark's
/// code adds no router loss, so none is logged whatever `router_aux_loss_coef` says, and the
/// experts' routers still train through the routing weights.
#[test]
fn sft_and_grpo_train_the_tiny_muse_spark() {
    use treetrain::grpo::GrpoTrainer;
    use treetrain::sft::SftTrainer;
    let dir = std::env::temp_dir().join(format!("treetrain-muse-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = treetrain::shipped::tiny_muse_spark_dir().unwrap().display().to_string();
    let router = |m: &Model| m.vs.variables()["model.language_model.layers.1.mlp.gate.weight"].copy();
    let before = router(&load_f32(Path::new(&model)));
    let mut cfg = common::shipped_sft(Some(dir.join("sft")), 2);
    cfg.train.model = model.clone();
    cfg.train.router_aux_loss_coef = 0.5;
    cfg.train.precision.dtype = treetrain::model::DtypeSetting::Fixed(treetrain::model::Dtype::Bf16);
    cfg.train.precision.gradient_checkpointing = true;
    let mut t = SftTrainer::new(cfg).unwrap();
    for _ in 0..2 {
        let m = t.step().unwrap();
        assert_eq!(m.aux_loss, None, "{m:?}");
        assert!(m.loss.is_finite(), "{m:?}");
    }
    assert!(max_diff(&router(t.model()), &before) > 0.0, "the router trained");
    let mut cfg = common::shipped_grpo();
    cfg.train.model = model;
    cfg.train.output.output_dir = Some(dir.join("grpo"));
    cfg.max_steps = 1;
    let mut t = GrpoTrainer::new(cfg).unwrap();
    let m = t.step().unwrap();
    assert_eq!(m.update.aux_loss, None, "{m:?}");
    let row = t.last_row.clone().unwrap();
    assert!(
        row.rollouts > 1 && row.len() > 32,
        "a prefix tree past the window: {}",
        row.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Segments past the batched size (their queries in blocks, each reading only the keys of its
/// window) give what each rollout forwarded alone gives: the shipped tiny Muse Spark (a window
/// of 32), a 300-token prompt shared by branches of 40 to 300 tokens, tree and flat packed.
#[test]
fn long_segments_read_only_their_windows_keys_and_stay_exact() {
    let m = load_f32(&treetrain::shipped::tiny_muse_spark_dir().unwrap());
    let tokens =
        |n: usize, salt: i64| -> Vec<i64> { (0..n as i64).map(|i| 3 + (i * 37 + salt * 101) % 2000).collect() };
    let prompt = tokens(300, 0);
    let tail = |t: Vec<i64>| [&prompt[..], &t].concat();
    let rs = vec![
        rollout(tail(tokens(300, 1)), prompt.len()),
        rollout(tail(tokens(40, 2)), prompt.len()),
        rollout(tail([tokens(260, 1), tokens(30, 3)].concat()), prompt.len()),
    ];
    let mut tree = PrefixTree::new();
    for (i, r) in rs.iter().enumerate() {
        tree.add(r.clone(), i).unwrap();
    }
    let tree: PackedRow = tree.pack();
    let chunks = LogprobChunks {
        tokens: 256,
        vocab: 2048,
    };
    let want = separate_logprobs(&m, &rs);
    for (what, row) in [("tree", &tree), ("flat", &pack_flat(&rs).unwrap())] {
        let got = tch::no_grad(|| row_logprobs(&m.lm, row, chunks)).unwrap();
        let d = max_diff(&got, &want);
        assert!(d <= 1e-5, "{what}: max |diff| = {d:e}");
    }
}
