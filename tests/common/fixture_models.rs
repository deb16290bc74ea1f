//! The tiny checkpoints transformers saved under `tests/fixtures/models` and what the parity
//! tests do with them: load, read the expected numbers, forward rows alone, back-propagate a
//! row's next-token cross-entropy, run a Python reference.

use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::model::moe::{RecordedRouting, RouterLoss};
use treetrain::model::{Activations, AttentionLayout, Inputs, LoadOptions, Model};
use treetrain::pack::Rollout;

use super::row_logits;

/// `tests/fixtures/models/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

/// The fixture's `expected.json`.
pub fn expected(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("expected.json")).unwrap()).unwrap()
}

/// The checkpoint in `dir`, in fp32 on the CPU.
pub fn load_f32(dir: &Path) -> Model {
    let opts = LoadOptions {
        dtype: Some(Kind::Float),
        device: Device::Cpu,
    };
    Model::load(dir, opts).unwrap()
}

/// The rows of an `expected.json`.
pub fn rows(exp: &serde_json::Value) -> Vec<Vec<i64>> {
    serde_json::from_value(exp["rows"].clone()).unwrap()
}

/// A nested JSON array of numbers as an f32 tensor of its shape.
pub fn tensor(v: &serde_json::Value) -> Tensor {
    fn flatten(v: &serde_json::Value) -> Vec<f32> {
        match v.as_array() {
            Some(a) => a.iter().flat_map(flatten).collect(),
            None => vec![v.as_f64().unwrap() as f32],
        }
    }
    let mut shape = Vec::new();
    let mut at = v;
    while let Some(a) = at.as_array() {
        shape.push(a.len() as i64);
        at = &a[0];
    }
    Tensor::from_slice(&flatten(v)).view(shape.as_slice())
}

/// The largest absolute difference.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// A rollout of `ids` whose first `prompt` tokens are the prompt.
pub fn rollout(ids: Vec<i64>, prompt: usize) -> Rollout {
    let n = ids.len();
    let mut completion_mask = vec![0u8; prompt];
    completion_mask.resize(n, 1);
    Rollout {
        input_ids: ids,
        completion_mask,
        old_log_probs: vec![0.0; n],
        advantage: 1.0,
        group_id: "g".into(),
    }
}

/// The log-prob of every trained token, each rollout forwarded alone.
pub fn separate_logprobs(m: &Model, rs: &[Rollout]) -> Tensor {
    tch::no_grad(|| {
        let mut out = Vec::new();
        for r in rs {
            let lsm = row_logits(m, &r.input_ids).log_softmax(-1, Kind::Float);
            for p in 1..r.input_ids.len() {
                if r.completion_mask[p] == 1 {
                    out.push(lsm.get(p as i64 - 1).get(r.input_ids[p]));
                }
            }
        }
        Tensor::stack(&out, 0)
    })
}

/// The mean next-token cross-entropy of `row` (transformers' loss with `labels = row`),
/// back-propagated as a training pass does, with `router`'s load-balancing loss and the
/// `recorded` routing where given; returns the cross-entropy and the router loss's value.
pub fn ce_pass(
    m: &Model,
    row: &[i64],
    activations: Activations,
    (router, recorded): (Option<&RouterLoss>, Option<&RecordedRouting>),
) -> (f64, Option<f64>) {
    let n = row.len() as i64;
    let ids = Tensor::from_slice(row).view([1, n]);
    let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
    let inputs = Inputs {
        input_ids: &ids,
        position_ids: &pos,
        layout: &AttentionLayout::Causal,
        routing: recorded,
    };
    m.lm.forward_backward_routed(inputs, activations, router, |hidden| {
        let logits = m.lm.logits(hidden).squeeze_dim(0);
        let ce = logits
            .narrow(0, 0, n - 1)
            .log_softmax(-1, Kind::Float)
            .gather(1, &ids.squeeze_dim(0).narrow(0, 1, n - 1).unsqueeze(1), false)
            .mean(Kind::Float)
            .neg();
        let value = ce.double_value(&[]);
        Ok((Some(ce), value))
    })
    .unwrap()
}

/// The JSON line `python args...` prints (a reference script under `scripts/fixtures`).
pub fn python_json(python: &str, args: &[&std::ffi::OsStr]) -> serde_json::Value {
    let out = std::process::Command::new(python).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// transformers (`python`, `scripts/fixtures/hf_logits.py`) loads the folder `dir` that `m` was
/// saved to with no tensor missing or left over, and gives `m`'s logits on `rows`.
pub fn assert_transformers_loads(python: &str, dir: &Path, m: &Model, rows: &[Vec<i64>]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fixtures/hf_logits.py");
    let rows_json = serde_json::to_string(rows).unwrap();
    let v = python_json(python, &[script.as_os_str(), dir.as_os_str(), rows_json.as_ref()]);
    assert_eq!(v["missing_keys"], serde_json::json!([]), "{v:?}");
    assert_eq!(v["unexpected_keys"], serde_json::json!([]));
    for (row, want) in rows.iter().zip(v["logits"].as_array().unwrap()) {
        let d = max_diff(&row_logits(m, row), &tensor(want));
        assert!(d <= 1e-4, "treetrain vs transformers: {d:e}");
    }
}

/// LoRA both ways with PEFT (`python`), on the checkpoint `base` and `rows`: PEFT loads the
/// adapter `m` carries (saved by treetrain) and gives `m`'s logits; then PEFT makes an adapter
/// of `config` (`scripts/fixtures/peft_make_adapter.py`) and treetrain, loading it onto `base`,
/// gives PEFT's logits. Returns PEFT's count of trainable parameters in treetrain's adapter.
pub fn assert_peft_round_trip(
    python: &str,
    (base, m): (&Path, &Model),
    config: serde_json::Value,
    rows: &[Vec<i64>],
) -> i64 {
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fixtures");
    let rows_json = serde_json::to_string(rows).unwrap();
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let unique = format!("{}-{call}", std::process::id());
    let [ours, theirs] =
        ["ours", "theirs"].map(|side| std::env::temp_dir().join(format!("treetrain-peft-{side}-{unique}")));
    for dir in [&ours, &theirs] {
        let _ = std::fs::remove_dir_all(dir);
    }
    // 1. treetrain's adapter in PEFT.
    m.save_adapter(&ours).unwrap();
    let script = scripts.join("peft_logits.py");
    let v = python_json(
        python,
        &[
            script.as_os_str(),
            base.as_os_str(),
            ours.as_os_str(),
            rows_json.as_ref(),
        ],
    );
    for (row, want) in rows.iter().zip(v["logits"].as_array().unwrap()) {
        let d = max_diff(&row_logits(m, row), &tensor(want));
        assert!(d <= 1e-4, "treetrain's adapter in PEFT ({config}): {d:e}");
    }
    // 2. PEFT's adapter in treetrain.
    let script = scripts.join("peft_make_adapter.py");
    let config_json = config.to_string();
    let w = python_json(
        python,
        &[
            script.as_os_str(),
            base.as_os_str(),
            theirs.as_os_str(),
            config_json.as_ref(),
            rows_json.as_ref(),
        ],
    );
    let mut loaded = load_f32(base);
    loaded.load_adapter(&theirs).unwrap();
    for (row, want) in rows.iter().zip(w["logits"].as_array().unwrap()) {
        let d = max_diff(&row_logits(&loaded, row), &tensor(want));
        assert!(d <= 1e-4, "PEFT's adapter in treetrain ({config}): {d:e}");
    }
    for dir in [ours, theirs] {
        let _ = std::fs::remove_dir_all(dir);
    }
    v["trainable"].as_i64().unwrap()
}

/// Greedy generation of the fixture `case` equals transformers' (`expected.json`'s `greedy`
/// for its `prompts`: 12 new tokens, eos 2), prefilled in chunks of each of `chunks`.
pub fn assert_greedy_matches(case: &str, chunks: &[i64]) {
    use treetrain::generate::{GenerationConfig, Generator};
    let m = load_f32(&fixture(case));
    let exp = expected(case);
    let prompts: Vec<Vec<i64>> = serde_json::from_value(exp["prompts"].clone()).unwrap();
    let want: Vec<Vec<i64>> = serde_json::from_value(exp["greedy"].clone()).unwrap();
    for &chunk in chunks {
        let cfg = GenerationConfig {
            max_new_tokens: 12,
            eos_token_ids: vec![2],
            prefill_chunk_size: chunk,
            ..Default::default()
        };
        let out = Generator::new().generate(&m.lm, &prompts, &cfg).unwrap();
        for (i, (c, w)) in out.iter().zip(&want).enumerate() {
            assert_eq!(&c.output_ids, w, "{case} prompt {i}, prefill chunk {chunk}");
        }
    }
}

/// transformers (`python`) loads treetrain's save of the fixture `case` with `tensor` scaled by
/// 1.5 first (so the save writes the in-memory weights, not a copy of the source files) and
/// gives the edited model's logits on `rows` (see [`assert_transformers_loads`]).
pub fn assert_edited_save_loads(python: &str, (case, tensor): (&str, &str), rows: &[Vec<i64>]) {
    let dir = std::env::temp_dir().join(format!("treetrain-hf-save-{case}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let m = load_f32(&fixture(case));
    tch::no_grad(|| {
        let _ = m.vs.variables()[tensor].shallow_clone().g_mul_scalar_(1.5);
    });
    m.save(&dir, None).unwrap();
    assert_transformers_loads(python, &dir, &m, rows);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The rollouts `prompt + tail` for each of `tails`, then one unrelated rollout `other` (its
/// first 2 tokens the prompt): tree and flat packing of them give, under each fixture of
/// `cases`, the log-probs of each rollout forwarded alone within 1e-5.
pub fn assert_packings_equal_separate_rows(cases: &[&str], prompt: &[i64], tails: &[&[i64]], other: Vec<i64>) {
    use treetrain::model::LogprobChunks;
    use treetrain::pack::{PackedRow, PrefixTree, pack_flat, row_logprobs};
    let mut rs: Vec<Rollout> = tails
        .iter()
        .map(|t| rollout([prompt, t].concat(), prompt.len()))
        .collect();
    rs.push(rollout(other, 2));
    let mut tree = PrefixTree::new();
    for (i, r) in rs.iter().enumerate() {
        tree.add(r.clone(), i).unwrap();
    }
    let tree: PackedRow = tree.pack();
    assert!(tree.packing_ratio() > 1.3, "{}", tree.packing_ratio());
    let chunks = LogprobChunks { tokens: 7, vocab: 100 };
    for case in cases {
        let m = load_f32(&fixture(case));
        let want = tch::no_grad(|| separate_logprobs(&m, &rs));
        for (what, row) in [("tree", &tree), ("flat", &pack_flat(&rs).unwrap())] {
            let got = tch::no_grad(|| row_logprobs(&m.lm, row, chunks)).unwrap();
            let d = max_diff(&got, &want);
            assert!(d <= 1e-5, "{case} {what}: max |diff| = {d:e}");
        }
    }
}
