//! Activation checkpointing at decoder-layer boundaries gives the gradients of the plain
//! forward (fp32, 1e-6 relative) in every attention layout (padded batch, packed sequences,
//! tree segments), with LoRA dropout replayed, and in both trainers.

mod common;

use std::path::Path;

use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::grpo::{GrpoObjective, TermWeights, grpo_loss_backward};
use treetrain::model::lora::{LoraConfig, TargetModules};
use treetrain::model::{
    Activations, AttentionLayout, LoadOptions, LogprobChunks, Model, nll_backward_chunked, target_logprobs,
};
use treetrain::pack::{PrefixTree, Rollout};

fn model() -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3");
    let opts = LoadOptions {
        dtype: Some(Kind::Float),
        device: Device::Cpu,
    };
    Model::load(&dir, opts).unwrap()
}

/// Every trainable variable's gradient, by name, cleared afterwards.
fn take_grads(model: &Model) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = model
        .trainable()
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.grad().copy()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    treetrain::train::zero_grads(model.trainable());
    out
}

fn assert_same_grads(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    assert_close_grads(a, b, 1e-6, what)
}

fn assert_close_grads(a: &[(String, Tensor)], b: &[(String, Tensor)], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len());
    for ((name, x), (_, y)) in a.iter().zip(b) {
        let scale = x.abs().max().double_value(&[]);
        assert!(scale > 0.0, "{what}: `{name}` got no gradient");
        let d = (x - y).abs().max().double_value(&[]) / scale;
        assert!(d <= tol, "{what}: `{name}` differs by {d:e} (relative)");
    }
}

/// The NLL of next tokens over a forward, with both activation modes.
fn nll_grads(model: &Model, ids: &Tensor, pos: &Tensor, layout: &AttentionLayout, what: &str) {
    let run = |activations| {
        let loss = model
            .lm
            .forward_backward(ids, pos, layout, activations, |hidden| {
                let [b, t, h] = hidden.size()[..] else { unreachable!() };
                let flat = hidden.view([b * t, h]).narrow(0, 0, b * t - 1);
                let targets = ids.view([-1]).narrow(0, 1, b * t - 1);
                let lp = target_logprobs(&flat, model.lm.lm_head_weight(), &targets, LogprobChunks::default())?;
                let loss = -lp.mean(Kind::Float);
                let value = loss.double_value(&[]);
                Ok((Some(loss), value))
            })
            .unwrap();
        (loss, take_grads(model))
    };
    let (l1, g1) = run(Activations::Kept);
    let (l2, g2) = run(Activations::Recomputed);
    assert_eq!(l1, l2, "{what}: the loss itself");
    assert_same_grads(&g1, &g2, what);
}

#[test]
fn recomputed_activations_give_the_same_gradients_in_every_layout() {
    let model = model();
    let ids = Tensor::from_slice(&[5i64, 17, 99, 3, 250, 42, 7, 1, 2, 3, 200, 201, 9, 8, 7, 6]).view([2, 8]);
    let pos = Tensor::arange(8, (Kind::Int64, tch::Device::Cpu))
        .view([1, 8])
        .repeat([2, 1]);
    nll_grads(&model, &ids, &pos, &AttentionLayout::Causal, "padded batch, causal");
    let lengths = [5i64, 7, 4];
    let (layout, pos) = AttentionLayout::packed_row(&lengths, Device::Cpu).unwrap();
    nll_grads(&model, &ids.view([1, 16]), &pos, &layout, "packed sequences");
}

fn rollout(ids: &[i64], prompt: usize, advantage: f32) -> Rollout {
    let mut mask = vec![0u8; prompt];
    mask.resize(ids.len(), 1);
    Rollout {
        input_ids: ids.to_vec(),
        completion_mask: mask,
        old_log_probs: (0..ids.len()).map(|i| -0.5 - 0.05 * i as f32).collect(),
        advantage,
        group_id: "g".into(),
    }
}

/// A tree row of one prompt with nested forks.
fn tree() -> treetrain::pack::PackedRow {
    let prompt = [11i64, 12, 13, 14, 15];
    let tails: [&[i64]; 4] = [&[30, 31, 32], &[30, 31, 40, 41], &[30, 50], &[60, 61, 62, 63]];
    let mut t = PrefixTree::new();
    for (i, tail) in tails.iter().enumerate() {
        let ids = [&prompt[..], tail].concat();
        t.add(rollout(&ids, prompt.len(), 1.0 - 0.6 * i as f32), i).unwrap();
    }
    t.pack()
}

fn grpo_grads(model: &Model, activations: Activations) -> (f64, Vec<(String, Tensor)>) {
    let row = tree();
    let objective = GrpoObjective {
        activations,
        ..GrpoObjective::default()
    };
    let n = row.token_index.len().max(1) as f64;
    let out = grpo_loss_backward(
        &model.lm,
        &row,
        &objective,
        (TermWeights::Uniform(1.0 / n), Default::default()),
        (None, None),
    )
    .unwrap();
    (out.loss.double_value(&[]), take_grads(model))
}

#[test]
fn tree_segments_and_lora_dropout_recompute_to_the_same_gradients() {
    let model = model();
    let (l1, g1) = grpo_grads(&model, Activations::Kept);
    let (l2, g2) = grpo_grads(&model, Activations::Recomputed);
    assert_eq!(l1, l2);
    assert_same_grads(&g1, &g2, "tree segments");
    // LoRA with dropout on: the recomputation must replay the masks the forward drew.
    let mut model = model;
    model
        .add_lora(LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            lora_dropout: 0.3,
            target_modules: TargetModules::AllLinear,
            ..LoraConfig::default()
        })
        .unwrap();
    for (_, t) in model.trainable().variables() {
        tch::no_grad(|| t.shallow_clone().copy_(&(&t + 0.05)));
    }
    let _training = model.training();
    let adapter = model.adapter.as_ref().unwrap();
    let start = adapter.dropout_draws();
    let (_, g1) = grpo_grads(&model, Activations::Kept);
    let after_kept = adapter.dropout_draws();
    adapter.set_dropout_draws(start);
    let (_, g2) = grpo_grads(&model, Activations::Recomputed);
    assert!(after_kept > start, "dropout drew no masks");
    assert_eq!(
        adapter.dropout_draws(),
        after_kept,
        "the stream continues where one forward leaves it"
    );
    assert_same_grads(&g1, &g2, "LoRA with dropout");
}

#[test]
fn sft_with_gradient_checkpointing_trains_as_without() {
    use treetrain::sft::SftTrainer;
    use treetrain::train::Trainer;
    let run = |checkpointing: bool| {
        let mut cfg = common::shipped_sft(None, 4);
        cfg.train.precision.gradient_checkpointing = checkpointing;
        let mut t = SftTrainer::new(cfg).unwrap();
        t.train_for(4).unwrap();
        t.state
            .history
            .iter()
            .map(|m| (m.loss, m.grad_norm))
            .collect::<Vec<_>>()
    };
    let (plain, recomputed) = (run(false), run(true));
    for ((l1, g1), (l2, g2)) in plain.iter().zip(&recomputed) {
        assert!((l1 - l2).abs() <= 1e-6 * l1.abs(), "loss {l1} vs {l2}");
        assert!((g1 - g2).abs() <= 1e-5 * g1.abs(), "grad norm {g1} vs {g2}");
    }
}

/// The LM head back-propagated in token chunks gives one backward's gradients (hidden states'
/// and the head's), up to fp32 summation order.
#[test]
fn a_chunked_lm_head_backward_equals_one_backward() {
    let model = model();
    let ids = Tensor::from_slice(&[5i64, 17, 99, 3, 250, 42, 7, 1, 2, 3, 200, 201, 9]).view([1, 13]);
    let pos = Tensor::arange(13, (Kind::Int64, tch::Device::Cpu)).view([1, 13]);
    let targets = ids.view([-1]).narrow(0, 1, 12);
    let run = |chunk: Option<i64>| {
        let value = model
            .lm
            .forward_backward(&ids, &pos, &AttentionLayout::Causal, Activations::Kept, |hidden| {
                let h = hidden.view([13, -1]).narrow(0, 0, 12);
                match chunk {
                    Some(c) => {
                        let chunks = LogprobChunks { tokens: c, vocab: 100 };
                        nll_backward_chunked(&h, model.lm.lm_head_weight(), &targets, 0.5, chunks)
                    }
                    None => {
                        let lp = target_logprobs(&h, model.lm.lm_head_weight(), &targets, LogprobChunks::default())?;
                        let nll = -lp.sum(Kind::Float);
                        Ok((nll.double_value(&[]), Some(nll * 0.5)))
                    }
                }
                .map(|(sum, rest)| (rest, sum))
            })
            .unwrap();
        (value, take_grads(&model))
    };
    let (whole, g1) = run(None);
    for chunk in [1, 5, 12] {
        let (chunked, g2) = run(Some(chunk));
        assert!(
            (whole - chunked).abs() <= 1e-5 * whole.abs(),
            "NLL {whole} vs {chunked}"
        );
        // Another summation order over the chunks (fp32): 1e-5, not the 1e-6 of recomputation.
        assert_close_grads(&g1, &g2, 1e-5, &format!("chunks of {chunk} tokens"));
    }
}
