//! Tree-packed forwards and gradients equal separate per-rollout forwards (fp32), on a tiny
//! random Qwen3 checkpoint (GQA, head_dim != hidden / heads).

use std::path::Path;

use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::grpo::{GrpoObjective, grpo_loss};
use treetrain::model::{AttentionLayout, LoadOptions, LogprobChunks, Model};
use treetrain::pack::{PackedRow, PrefixTree, Rollout, pack_flat, row_logprobs};

fn model() -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3");
    Model::load(
        &dir,
        LoadOptions {
            dtype: Some(Kind::Float),
            device: Device::Cpu,
        },
    )
    .unwrap()
}

fn r(ids: &[i64], prompt: usize, advantage: f32, group: &str) -> Rollout {
    let mut mask = vec![0u8; prompt];
    mask.resize(ids.len(), 1);
    let old_log_probs = (0..ids.len()).map(|i| -0.3 - 0.1 * (i % 5) as f32).collect();
    Rollout {
        input_ids: ids.to_vec(),
        completion_mask: mask,
        old_log_probs,
        advantage,
        group_id: group.into(),
    }
}

/// Shared prompt, nested forks, a rollout that is a prefix of another, a duplicate, a
/// single-token completion, an untrained rollout and a second group sharing a system prefix.
fn rollouts() -> Vec<Rollout> {
    let sys = [9, 8, 7];
    let p1: Vec<i64> = [&sys[..], &[20, 21, 22, 23]].concat();
    let p2: Vec<i64> = [&sys[..], &[30, 31]].concat();
    let c = |p: &[i64], tail: &[i64]| [p, tail].concat();
    let mut untrained = r(&c(&p2, &[44, 45]), p2.len(), 0.7, "b");
    untrained.completion_mask = vec![0; untrained.input_ids.len()];
    vec![
        r(&c(&p1, &[100, 101, 102, 103]), p1.len(), 1.0, "a"),
        r(&c(&p1, &[100, 101, 110, 111, 112]), p1.len(), -0.5, "a"),
        r(&c(&p1, &[100, 120]), p1.len(), 0.25, "a"),
        r(&c(&p1, &[100, 101, 102]), p1.len(), -1.0, "a"),
        r(&c(&p1, &[100, 101, 110, 111, 112]), p1.len(), -0.5, "a"),
        r(&c(&p1, &[200]), p1.len(), 2.0, "a"),
        r(&c(&p2, &[40, 41, 42]), p2.len(), 0.3, "b"),
        untrained,
    ]
}

fn tree_row(rs: &[Rollout]) -> PackedRow {
    let mut t = PrefixTree::new();
    for (i, x) in rs.iter().enumerate() {
        t.add(x.clone(), i).unwrap();
    }
    t.pack()
}

/// Per-rollout forwards: the log-prob of every trained token, in loss-term order.
fn reference_logprobs(m: &Model, rs: &[Rollout]) -> Tensor {
    let mut out = Vec::new();
    for x in rs {
        let n = x.input_ids.len() as i64;
        let ids = Tensor::from_slice(&x.input_ids).view([1, n]);
        let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
        let logits =
            m.lm.forward(&ids, &pos, &AttentionLayout::Causal)
                .unwrap()
                .squeeze_dim(0);
        let lsm = logits.log_softmax(-1, Kind::Float);
        for p in 1..x.input_ids.len() {
            if x.completion_mask[p] == 1 {
                out.push(lsm.get(p as i64 - 1).get(x.input_ids[p]));
            }
        }
    }
    Tensor::stack(&out, 0)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn tree_flat_and_dense_oracle_logprobs_equal_separate_forwards() {
    let m = model();
    let rs = rollouts();
    let tree = tree_row(&rs);
    assert!(tree.packing_ratio() > 1.5, "{}", tree.packing_ratio());
    let reference = tch::no_grad(|| reference_logprobs(&m, &rs));
    let chunks = LogprobChunks { tokens: 5, vocab: 100 };
    let tree_lp = tch::no_grad(|| row_logprobs(&m.lm, &tree, chunks)).unwrap();
    let flat_lp = tch::no_grad(|| row_logprobs(&m.lm, &pack_flat(&rs).unwrap(), chunks)).unwrap();
    assert!(
        max_diff(&tree_lp, &reference) <= 1e-5,
        "tree {}",
        max_diff(&tree_lp, &reference)
    );
    assert!(
        max_diff(&flat_lp, &reference) <= 1e-5,
        "flat {}",
        max_diff(&flat_lp, &reference)
    );
    // The segment layout and the dense ancestor mask (the oracle) give the same hidden states.
    let (ids, pos, layout) = tree.layout(Device::Cpu).unwrap();
    let seg = tch::no_grad(|| m.lm.forward_hidden(&ids, &pos, &layout)).unwrap();
    let dense = AttentionLayout::Dense {
        mask: tree.dense_mask().unsqueeze(0),
    };
    let oracle = tch::no_grad(|| m.lm.forward_hidden(&ids, &pos, &dense)).unwrap();
    assert!(max_diff(&seg, &oracle) <= 1e-5);
}

/// The clipped surrogate over per-rollout forwards, normalised by all loss terms, as a
/// differentiable scalar of `m`'s weights.
fn reference_loss(m: &Model, rs: &[Rollout], eps_low: f64, eps_high: f64) -> Tensor {
    let lp = reference_logprobs(m, rs);
    let flat = pack_flat(rs).unwrap();
    let old = Tensor::from_slice(&flat.old_log_probs);
    let adv = Tensor::from_slice(&flat.advantages);
    let ratio = (&lp - old).exp();
    let clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high);
    -(&ratio * &adv).minimum(&(&clipped * &adv)).sum(Kind::Float) / flat.token_index.len() as f64
}

/// `m`'s embedding and LM-head gradients equal the reference ones to 1e-4.
fn assert_grads_match(m: &Model, row: &PackedRow, e_ref: &Tensor, h_ref: &Tensor) {
    let (e, h) = grads(m);
    assert!(
        max_diff(&e, e_ref) <= 1e-4,
        "{:?} embed grad {}",
        row.kind,
        max_diff(&e, e_ref)
    );
    assert!(
        max_diff(&h, h_ref) <= 1e-4,
        "{:?} lm_head grad {}",
        row.kind,
        max_diff(&h, h_ref)
    );
}

fn grads(m: &Model) -> (Tensor, Tensor) {
    let e = m.lm.embed_tokens.grad().copy();
    let h = m.lm.lm_head.as_ref().unwrap().weight.grad().copy();
    (e, h)
}

#[test]
fn tree_gradients_equal_separate_forwards() {
    let rs = rollouts();
    let cfg = GrpoObjective {
        epsilon_low: 0.2,
        epsilon_high: 0.28,
        chunks: LogprobChunks { tokens: 7, vocab: 64 },
        ..Default::default()
    };
    // Reference: per-rollout forwards, the same clipped surrogate, the same normaliser.
    let a = model();
    let loss_ref = reference_loss(&a, &rs, 0.2, 0.28);
    loss_ref.backward();
    let (e_ref, h_ref) = grads(&a);
    for row in [tree_row(&rs), pack_flat(&rs).unwrap()] {
        let b = model();
        let loss = grpo_loss(&b.lm, &row, &cfg, None).unwrap();
        assert!((loss.loss.double_value(&[]) - loss_ref.double_value(&[])).abs() <= 1e-6);
        loss.loss.backward();
        assert!(grads(&b).0.abs().max().double_value(&[]) > 1e-3, "gradients flow");
        assert_grads_match(&b, &row, &e_ref, &h_ref);
    }
}

#[test]
fn clipping_and_normalisation() {
    let m = model();
    let rs = rollouts();
    let row = tree_row(&rs);
    let cfg = GrpoObjective::default();
    let own = tch::no_grad(|| grpo_loss(&m.lm, &row, &cfg, None)).unwrap();
    let window = tch::no_grad(|| grpo_loss(&m.lm, &row, &cfg, Some(2.0 * row.token_index.len() as f64))).unwrap();
    assert!((own.loss.double_value(&[]) - 2.0 * window.loss.double_value(&[])).abs() < 1e-6);
    // Old log-probs far below the policy's make every ratio huge: exactly the terms with a
    // positive advantage are clipped, and their gradient vanishes.
    let mut shifted = row.clone();
    shifted.old_log_probs.iter_mut().for_each(|x| *x -= 50.0);
    let out = tch::no_grad(|| grpo_loss(&m.lm, &shifted, &cfg, None)).unwrap();
    let positive = row.advantages.iter().filter(|&&a| a > 0.0).count() as f64 / row.advantages.len() as f64;
    assert!(
        (out.clip_fraction - positive).abs() < 1e-6,
        "{} vs {positive}",
        out.clip_fraction
    );
    assert_eq!(out.num_terms, row.token_index.len());
}

#[test]
fn long_segments_split_into_query_blocks_stay_exact() {
    let m = model();
    let mut rng = treetrain::util::SplitMix64::new(5);
    let mut tok = |n: usize| -> Vec<i64> { (0..n).map(|_| rng.below(256) as i64).collect() };
    let prompt = tok(300);
    let mid = tok(20);
    // Children longer than one query block (256) continue a 300-token path.
    let rs = vec![
        r(&[prompt.clone(), mid.clone(), tok(600)].concat(), 300, 1.0, "a"),
        r(&[prompt.clone(), mid, tok(530)].concat(), 300, -1.0, "a"),
        r(&[prompt, tok(257)].concat(), 300, 0.5, "a"),
    ];
    let tree = tree_row(&rs);
    assert!(
        tree.segments
            .iter()
            .any(|s| s.len > 2 * treetrain::model::QUERY_BLOCK as usize)
    );
    let reference = tch::no_grad(|| reference_logprobs(&m, &rs));
    let got = tch::no_grad(|| row_logprobs(&m.lm, &tree, LogprobChunks::default())).unwrap();
    assert!(max_diff(&got, &reference) <= 1e-5, "{}", max_diff(&got, &reference));
}

/// Short paths are attended in padded batches, long ones alone; a row mixing both (and
/// batches of different sizes) keeps log-probs and gradients exact.
#[test]
fn batched_short_segments_and_long_ones_mix_exactly() {
    let mut rng = treetrain::util::SplitMix64::new(11);
    let mut tok = |n: usize| -> Vec<i64> { (0..n).map(|_| rng.below(256) as i64).collect() };
    let (long, short, mid) = (tok(280), tok(10), tok(40));
    let mut rs = Vec::new();
    for (k, n) in [5usize, 7, 3].iter().enumerate() {
        rs.push(r(&[long.clone(), tok(*n)].concat(), 280, k as f32 - 1.0, "long"));
    }
    for (k, n) in [4usize, 6, 2, 9].iter().enumerate() {
        rs.push(r(&[short.clone(), tok(*n)].concat(), 10, 0.5 - k as f32 * 0.3, "short"));
    }
    for (k, n) in [100usize, 90].iter().enumerate() {
        rs.push(r(&[mid.clone(), tok(*n)].concat(), 40, 1.0 - 2.0 * k as f32, "mid"));
    }
    let cfg = GrpoObjective {
        chunks: LogprobChunks { tokens: 64, vocab: 128 },
        ..Default::default()
    };
    let a = model();
    let reference = tch::no_grad(|| reference_logprobs(&a, &rs));
    reference_loss(&a, &rs, 0.2, 0.2).backward();
    let (e_ref, h_ref) = grads(&a);
    for row in [tree_row(&rs), pack_flat(&rs).unwrap()] {
        let (_, _, layout) = row.layout(Device::Cpu).unwrap();
        let AttentionLayout::Segments(l) = &layout else {
            panic!("segments layout expected")
        };
        assert!(
            !l.singles.is_empty() && l.batches.len() >= 2,
            "{:?}: {} singles, {} batches",
            row.kind,
            l.singles.len(),
            l.batches.len()
        );
        let b = model();
        let lp = tch::no_grad(|| row_logprobs(&b.lm, &row, cfg.chunks)).unwrap();
        assert!(
            max_diff(&lp, &reference) <= 1e-5,
            "{:?} log-probs {}",
            row.kind,
            max_diff(&lp, &reference)
        );
        let loss = grpo_loss(&b.lm, &row, &cfg, None).unwrap();
        loss.loss.backward();
        assert_grads_match(&b, &row, &e_ref, &h_ref);
    }
}

#[test]
fn a_hand_made_row_with_bad_indices_is_an_error_not_a_panic() {
    let m = model();
    let mut row = tree_row(&rollouts());
    row.token_index[0] = row.len() as i64 + 3;
    let err = grpo_loss(&m.lm, &row, &GrpoObjective::default(), None).unwrap_err();
    assert!(err.to_string().contains("token_index"), "{err}");
    let mut row = tree_row(&rollouts());
    row.advantages.pop();
    let err = row_logprobs(&m.lm, &row, LogprobChunks::default()).unwrap_err();
    assert!(err.to_string().contains("advantages"), "{err}");
}

#[test]
fn packers_emit_rows_that_pass_their_own_check() {
    let rs = rollouts();
    tree_row(&rs).check().unwrap();
    pack_flat(&rs).unwrap().check().unwrap();
    let mut row = tree_row(&rs);
    row.tree_kv_index[2] = -1;
    assert_eq!(
        row.check().unwrap_err(),
        "tree_kv_index holds -1, outside 0..".to_string() + &row.len().to_string()
    );
    let mut row = tree_row(&rs);
    *row.tree_cu_seqlens_q.last_mut().unwrap() += 1;
    assert!(
        row.check()
            .unwrap_err()
            .starts_with("tree_cu_seqlens_q must rise from 0")
    );
}
