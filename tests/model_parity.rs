//! The decoder against transformers' outputs on tiny random checkpoints
//! (tests/fixtures/models, made by scripts/fixtures/make_model_fixtures.py).

mod common;

use std::path::{Path, PathBuf};

use common::row_logits;
use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::model::{
    AttentionLayout, LoadOptions, LogprobChunks, Model, ModelError, target_logprobs, target_logprobs_and_entropy,
};

const CASES: [&str; 5] = [
    "qwen3",
    "qwen3_tied_gqa_bf16",
    "qwen2",
    "llama3_scaled_v4config",
    "llama_linear_bias",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

struct Expected {
    rows: Vec<Vec<i64>>,
    logits: Vec<Tensor>,
}

fn expected(name: &str) -> Expected {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap()).unwrap();
    let rows: Vec<Vec<i64>> = serde_json::from_value(v["rows"].clone()).unwrap();
    let logits = v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            let m: Vec<Vec<f32>> = serde_json::from_value(row.clone()).unwrap();
            Tensor::from_slice2(&m)
        })
        .collect();
    Expected { rows, logits }
}

fn load_f32(name: &str) -> Model {
    Model::load(
        &fixture(name),
        LoadOptions {
            dtype: Some(Kind::Float),
            device: Device::Cpu,
        },
    )
    .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn logits_match_transformers_to_1e4() {
    for case in CASES {
        let model = load_f32(case);
        let exp = expected(case);
        for (row, want) in exp.rows.iter().zip(&exp.logits) {
            let got = row_logits(&model, row);
            let d = max_diff(&got, want);
            assert!(d <= 1e-4, "{case}, row of {}: max |diff| = {d:e}", row.len());
        }
    }
}

#[test]
fn checkpoint_dtype_is_kept_unless_asked() {
    let bf16 = Model::load(&fixture("qwen3_tied_gqa_bf16"), LoadOptions::default()).unwrap();
    assert_eq!(bf16.kind(), Kind::BFloat16);
    assert!(bf16.lm.lm_head.is_none(), "tied model has no separate lm_head");
    let f32 = load_f32("qwen3_tied_gqa_bf16");
    assert_eq!(f32.kind(), Kind::Float);
    // bf16 compute stays close to the fp32 reference.
    let exp = expected("qwen3_tied_gqa_bf16");
    let got = row_logits(&bf16, &exp.rows[0]).to_kind(Kind::Float);
    assert!(max_diff(&got, &exp.logits[0]) < 0.1);
}

#[test]
fn packed_and_padded_layouts_equal_separate_rows() {
    for case in ["qwen3", "qwen2", "llama3_scaled_v4config"] {
        let model = load_f32(case);
        let exp = expected(case);
        let singles: Vec<Tensor> = exp.rows.iter().map(|r| row_logits(&model, r)).collect();
        // One packed row, positions restarting per sequence.
        let lengths: Vec<i64> = exp.rows.iter().map(|r| r.len() as i64).collect();
        let flat: Vec<i64> = exp.rows.concat();
        let (layout, pos) = AttentionLayout::packed_row(&lengths, Device::Cpu).unwrap();
        let packed = model
            .lm
            .forward(&Tensor::from_slice(&flat).view([1, -1]), &pos, &layout)
            .unwrap()
            .squeeze_dim(0);
        let mut at = 0;
        for (single, &len) in singles.iter().zip(&lengths) {
            assert!(max_diff(&packed.narrow(0, at, len), single) <= 1e-5, "{case} packed");
            at += len;
        }
        // Padded batches, left and right padding.
        let t = *lengths.iter().max().unwrap();
        for left in [true, false] {
            let (mut ids, mut mask, mut pos) = (Vec::new(), Vec::new(), Vec::new());
            for r in &exp.rows {
                let pad = t as usize - r.len();
                let (pre, post) = if left { (pad, 0) } else { (0, pad) };
                ids.extend(
                    std::iter::repeat_n(0, pre)
                        .chain(r.iter().copied())
                        .chain(std::iter::repeat_n(0, post)),
                );
                mask.extend(
                    std::iter::repeat_n(0i64, pre)
                        .chain(std::iter::repeat_n(1, r.len()))
                        .chain(std::iter::repeat_n(0, post)),
                );
                pos.extend(
                    std::iter::repeat_n(0i64, pre)
                        .chain(0..r.len() as i64)
                        .chain(std::iter::repeat_n(0, post)),
                );
            }
            let b = exp.rows.len() as i64;
            let layout = AttentionLayout::Padded {
                attention_mask: Tensor::from_slice(&mask).view([b, t]),
            };
            let out = model
                .lm
                .forward(
                    &Tensor::from_slice(&ids).view([b, t]),
                    &Tensor::from_slice(&pos).view([b, t]),
                    &layout,
                )
                .unwrap();
            for (i, (single, &len)) in singles.iter().zip(&lengths).enumerate() {
                let start = if left { t - len } else { 0 };
                let got = out.get(i as i64).narrow(0, start, len);
                assert!(max_diff(&got, single) <= 1e-5, "{case} padded left={left} row {i}");
            }
        }
    }
}

/// Packed rows as causal segments over one flattened row (`AttentionLayout::packed`, no
/// `[seq, seq]` mask) give what the dense sequence-id mask gives on every real token: long
/// sequences attended alone, short ones batched, padding runs, a sequence id that repeats at
/// the start of the next row.
#[test]
fn packed_rows_as_segments_equal_the_dense_mask() {
    let model = load_f32("qwen3_tied_gqa_bf16");
    let vocab = model.lm.config.vocab_size;
    // Row 0: 300 + 20 + 16 tokens; row 1: 5 + 320 tokens (its first id, 2, ends row 0 too)
    // and 11 of padding.
    let row_len = 336;
    let runs: [&[(i64, i64)]; 2] = [&[(0, 300), (1, 20), (2, 16)], &[(2, 5), (3, 320), (-1, 11)]];
    let (mut ids, mut pos, mut seq) = (Vec::new(), Vec::new(), Vec::new());
    for row in runs {
        for &(id, len) in row {
            seq.extend(std::iter::repeat_n(id, len as usize));
            pos.extend(0..len);
            ids.extend((0..len).map(|i| (i * 7919 + id * 31 + 3).rem_euclid(vocab)));
        }
    }
    let dense = AttentionLayout::Packed {
        sequence_ids: Tensor::from_slice(&seq).view([2, row_len]),
    };
    let view = |v: &[i64], rows: i64| Tensor::from_slice(v).view([rows, -1]);
    let want = model.lm.forward(&view(&ids, 2), &view(&pos, 2), &dense).unwrap();
    let layout = AttentionLayout::packed(&seq, row_len, Device::Cpu).unwrap();
    let AttentionLayout::Segments(segments) = &layout else {
        panic!("a CPU packing is segments");
    };
    assert!(
        !segments.singles.is_empty() && !segments.batches.is_empty(),
        "{segments:?}"
    );
    let got = model.lm.forward(&view(&ids, 1), &view(&pos, 1), &layout).unwrap();
    let real = Tensor::from_slice(&seq.iter().map(|&s| s >= 0).collect::<Vec<_>>());
    let (want, got) = (want.view([2 * row_len, -1]), got.view([2 * row_len, -1]));
    let diff = (want - got).index(&[Some(real)]).abs().max().double_value(&[]);
    assert!(diff <= 1e-4, "max diff {diff}");
}

#[test]
fn dense_mask_oracle_equals_causal() {
    let model = load_f32("qwen3");
    let row = &expected("qwen3").rows[1];
    let n = row.len() as i64;
    let mask = Tensor::ones([n, n], (Kind::Bool, tch::Device::Cpu))
        .tril(0)
        .unsqueeze(0);
    let ids = Tensor::from_slice(row).view([1, n]);
    let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
    let dense = model
        .lm
        .forward(&ids, &pos, &AttentionLayout::Dense { mask })
        .unwrap()
        .squeeze_dim(0);
    assert!(max_diff(&dense, &row_logits(&model, row)) <= 1e-5);
}

#[test]
fn chunked_logprobs_equal_full_log_softmax() {
    let model = load_f32("qwen2");
    let row = &expected("qwen2").rows[1];
    let n = row.len() as i64;
    let ids = Tensor::from_slice(row).view([1, n]);
    let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
    let hidden = model
        .lm
        .forward_hidden(&ids, &pos, &AttentionLayout::Causal)
        .unwrap()
        .squeeze_dim(0);
    let targets = Tensor::from_slice(&row[1..]);
    let h = hidden.narrow(0, 0, n - 1);
    let full = model
        .lm
        .logits(&h)
        .log_softmax(-1, Kind::Float)
        .gather(1, &targets.unsqueeze(1), false)
        .squeeze_dim(1);
    for chunks in [
        LogprobChunks { tokens: 3, vocab: 7 },
        LogprobChunks {
            tokens: 1024,
            vocab: 100,
        },
        LogprobChunks::default(),
    ] {
        let got = target_logprobs(&h, model.lm.lm_head_weight(), &targets, chunks).unwrap();
        assert!(max_diff(&got, &full) <= 1e-5, "{chunks:?}");
        // The same pass's entropies against the full distribution's, in f64.
        let logp = model.lm.logits(&h).log_softmax(-1, Kind::Double);
        let entropy = -(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Double);
        let (lp, got) = target_logprobs_and_entropy(&h, model.lm.lm_head_weight(), &targets, chunks).unwrap();
        assert!(lp.equal(&target_logprobs(&h, model.lm.lm_head_weight(), &targets, chunks).unwrap()));
        assert!(max_diff(&got.to_kind(Kind::Double), &entropy) <= 1e-5, "{chunks:?}");
    }
    let err = target_logprobs(
        &h,
        model.lm.lm_head_weight(),
        &Tensor::from_slice(&[999i64; 19]),
        LogprobChunks::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("0..256"), "{err}");
}

#[test]
fn score_packed_matches_transformers_log_softmax() {
    for case in CASES {
        if case.ends_with("bf16") {
            continue;
        }
        let model = load_f32(case);
        let exp = expected(case);
        let rows: Vec<&[i64]> = exp.rows.iter().map(Vec::as_slice).collect();
        let scored = model.score_packed(&rows).unwrap();
        for ((row, logits), got) in exp.rows.iter().zip(&exp.logits).zip(&scored) {
            assert_eq!(got.len(), row.len() - 1);
            for (i, lp) in got.iter().enumerate() {
                let want = logits
                    .get(i as i64)
                    .log_softmax(-1, Kind::Float)
                    .double_value(&[row[i + 1]]);
                assert!((*lp as f64 - want).abs() <= 1e-4, "{case} token {i}: {lp} vs {want}");
            }
        }
    }
}

#[test]
fn save_round_trips_and_keeps_config_fields() {
    let model = load_f32("llama3_scaled_v4config");
    let dir = std::env::temp_dir().join(format!("treetrain-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    model.save(&dir, None).unwrap();
    model.save_over(&dir, None).unwrap(); // replacing an existing checkpoint folder works
    let err = model.save(&dir, None).unwrap_err().to_string();
    assert!(err.contains("not empty") && err.contains("--overwrite"), "{err}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(cfg["pretraining_tp"], 1, "unknown fields are written back");
    assert_eq!(cfg["torch_dtype"], "float32");
    let generation: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("generation_config.json")).unwrap()).unwrap();
    assert_eq!(generation["eos_token_id"], 2);
    let again = load_f32(dir.to_str().unwrap());
    let row = &expected("llama3_scaled_v4config").rows[0];
    assert_eq!(max_diff(&row_logits(&again, row), &row_logits(&model, row)), 0.0);
}

fn scratch_checkpoint(name: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("treetrain-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture("qwen3");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    dir
}

#[test]
fn unsupported_configs_name_their_field() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("gpt2", Box::new(|c| c["model_type"] = "gpt2".into()), "model_type"),
        ("gelu", Box::new(|c| c["hidden_act"] = "gelu".into()), "hidden_act"),
        (
            "yarn",
            Box::new(|c| c["rope_parameters"]["rope_type"] = "yarn".into()),
            "rope_parameters.rope_type",
        ),
        (
            "llama3-missing",
            Box::new(|c| c["rope_parameters"]["rope_type"] = "llama3".into()),
            "rope_parameters.factor",
        ),
        (
            "sliding",
            Box::new(|c| c["use_sliding_window"] = true.into()),
            "use_sliding_window",
        ),
        (
            "kvheads",
            Box::new(|c| c["num_key_value_heads"] = 3.into()),
            "num_key_value_heads",
        ),
    ];
    for (name, edit, field) in cases {
        let err = Model::load(&scratch_checkpoint(name, edit), LoadOptions::default()).unwrap_err();
        assert!(matches!(err, ModelError::Unsupported { .. }), "{name}: {err}");
        assert!(err.to_string().contains(field), "{name}: {err}");
    }
    // A shape the weights contradict.
    let err = Model::load(
        &scratch_checkpoint("shape", |c| c["intermediate_size"] = 128.into()),
        LoadOptions::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, ModelError::ShapeMismatch { .. }) && err.to_string().contains("mlp"),
        "{err}"
    );
    // Untied config over a checkpoint without lm_head.weight.
    let dir = scratch_checkpoint("untied", |c| c["tie_word_embeddings"] = false.into());
    std::fs::copy(
        fixture("qwen3_tied_gqa_bf16/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_tied_gqa_bf16/config.json")).unwrap()).unwrap();
    cfg["tie_word_embeddings"] = false.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let err = Model::load(&dir, LoadOptions::default()).unwrap_err();
    assert!(err.to_string().contains("tensor `lm_head.weight` not found"), "{err}");
}

#[test]
fn pickle_and_empty_folders_are_refused_clearly() {
    let dir = scratch_checkpoint("pickle", |_| {});
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let err = Model::load(&dir, LoadOptions::default()).unwrap_err();
    assert!(matches!(err, ModelError::NoWeights { .. }), "{err}");
    std::fs::write(dir.join("pytorch_model.bin"), b"not really").unwrap();
    let err = Model::load(&dir, LoadOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("safetensors only") && err.to_string().contains("pytorch_model.bin"),
        "{err}"
    );
    let err = Model::load(Path::new("/nonexistent/model"), LoadOptions::default()).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/model/config.json"), "{err}");
}

#[test]
fn bad_token_ids_are_errors_not_panics() {
    let model = load_f32("qwen3");
    let err = model.score(&[1, 2, 256]).unwrap_err();
    assert!(err.to_string().contains("0..256"), "{err}");
    let err = model.score(&[-1, 2]).unwrap_err();
    assert!(err.to_string().contains("-1"), "{err}");
    assert_eq!(model.score(&[5]).unwrap(), Vec::<f32>::new());
}
