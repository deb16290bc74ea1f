//! Qwen3-MoE against transformers 5.23 on tiny random checkpoints it saved itself
//! (tests/fixtures/models/qwen3_moe*, made by scripts/fixtures/make_moe_fixtures.py): one in
//! the hub's per-expert layout, one fused in bf16.

mod common;

use common::fixture_models::*;
use common::row_logits;
use tch::{Kind, Tensor};
use treetrain::generate::{GenerationConfig, Generator};
use treetrain::model::moe::{RouterLoss, load_balancing_loss};
use treetrain::model::{Activations, AttentionLayout, LoadOptions, LogprobChunks, Model};
use treetrain::pack::{PrefixTree, pack_flat};

const CASES: [&str; 2] = ["qwen3_moe", "qwen3_moe_fused_bf16"];

#[test]
fn logits_and_logprobs_match_transformers() {
    for case in CASES {
        let model = load_f32(&fixture(case));
        let exp = expected(case);
        for (row, want) in rows(&exp).iter().zip(exp["logits"].as_array().unwrap()) {
            let (got, want) = (row_logits(&model, row), tensor(want));
            let d = max_diff(&got, &want);
            assert!(d <= 1e-4, "{case}, row of {}: logits max |diff| = {d:e}", row.len());
            let lp = max_diff(&got.log_softmax(-1, Kind::Float), &want.log_softmax(-1, Kind::Float));
            assert!(
                lp <= 1e-5,
                "{case}, row of {}: log-probs max |diff| = {lp:e}",
                row.len()
            );
        }
    }
}

#[test]
fn tree_and_flat_packing_equal_separate_rows() {
    let tails: [&[i64]; 4] = [&[7, 9, 31, 64], &[7, 9, 40], &[8, 1, 2, 3, 4, 5], &[7, 9, 31, 64]];
    assert_packings_equal_separate_rows(&CASES, &[5, 17, 99, 3, 250, 42], &tails, vec![77, 78, 79, 80]);
}

/// The load-balancing loss of `row` forwarded alone, as transformers reports it.
fn aux_of(m: &Model, row: &[i64]) -> f64 {
    let n = row.len() as i64;
    let ids = Tensor::from_slice(row).view([1, n]);
    let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
    let (_, routes) = tch::no_grad(|| m.lm.forward_hidden_routed(&ids, &pos, &AttentionLayout::Causal)).unwrap();
    let logits: Vec<Tensor> = routes.into_iter().map(|r| r.logits).collect();
    let k = m.lm.config.mixture.as_ref().unwrap().experts_per_token;
    load_balancing_loss(&logits, k, None).unwrap().double_value(&[])
}

/// Mean next-token cross-entropy of `row` plus `router_aux_loss_coef` x the load-balancing
/// loss, back-propagated as a training pass does (transformers' `Qwen3MoeForCausalLM` loss with
/// `labels = row`); returns the loss.
fn training_pass(m: &Model, row: &[i64], activations: Activations) -> f64 {
    let router = RouterLoss {
        coef: m.lm.config.mixture.as_ref().unwrap().router_aux_loss_coef,
        token_weights: Tensor::ones([row.len() as i64], (Kind::Float, tch::Device::Cpu)),
    };
    let (ce, aux) = ce_pass(m, row, activations, (Some(&router), None));
    ce + router.coef * aux.unwrap()
}

#[test]
fn the_load_balancing_loss_and_gradients_match_transformers() {
    for case in CASES {
        let m = load_f32(&fixture(case));
        let exp = expected(case);
        for (row, want) in rows(&exp).iter().zip(exp["aux_loss"].as_array().unwrap()) {
            let d = (aux_of(&m, row) - want.as_f64().unwrap()).abs();
            assert!(d <= 1e-5, "{case}, row of {}: aux loss off by {d:e}", row.len());
        }
        for activations in [Activations::Kept, Activations::Recomputed] {
            let loss = training_pass(&m, &rows(&exp)[0], activations);
            let d = (loss - exp["loss"].as_f64().unwrap()).abs();
            assert!(d <= 1e-5, "{case} {activations:?}: loss off by {d:e}");
            let grads: std::collections::HashMap<String, Tensor> = common::take_grads(&m).into_iter().collect();
            for (name, want) in exp["grads"].as_object().unwrap() {
                // Of the experts, the fixture keeps the first two.
                let grad = match name.contains("experts") {
                    true => grads[name].narrow(0, 0, 2),
                    false => grads[name].shallow_clone(),
                };
                let want = tensor(want);
                let scale = want.abs().max().double_value(&[]).max(1e-3);
                let d = max_diff(&grad, &want) / scale;
                assert!(
                    d <= 1e-5,
                    "{case} {activations:?} {name}: gradient off by {d:e} of its largest entry"
                );
            }
        }
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    for case in CASES {
        assert_greedy_matches(case, &[4]);
    }
}

#[test]
fn both_layouts_load_and_a_save_reloads_to_the_same_logits() {
    let dir = std::env::temp_dir().join(format!("treetrain-moe-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let m = load_f32(&fixture("qwen3_moe"));
    let card = treetrain::display::Rich::text(&m);
    assert!(card.contains("8 experts (top 2, width 32) in 2 of 3 layers"), "{card}");
    let c = &m.lm.config;
    assert!(c.active_parameters() < c.num_parameters());
    assert_eq!(
        m.vs.variables().values().map(Tensor::numel).sum::<usize>() as i64,
        c.num_parameters()
    );
    m.save(&dir, None).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = file.names().into_iter().map(str::to_string).collect();
    assert!(
        names.iter().any(|n| n == "model.layers.0.mlp.experts.gate_up_proj"),
        "{names:?}"
    );
    let again = load_f32(&dir);
    let row = [5i64, 17, 99, 3, 250, 42, 7];
    assert_eq!(max_diff(&row_logits(&m, &row), &row_logits(&again, &row)), 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A per-expert piece repeated in a second shard does not stand in for a missing one: the
/// fused parameter is named missing.
#[test]
fn a_repeated_expert_piece_does_not_hide_a_missing_one() {
    let dir = std::env::temp_dir().join(format!("treetrain-moe-shards-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture("qwen3_moe");
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let all = Tensor::read_safetensors(src.join("model.safetensors")).unwrap();
    let (missing, repeated) = (
        "model.layers.0.mlp.experts.1.up_proj.weight",
        "model.layers.0.mlp.experts.0.gate_proj.weight",
    );
    let first: Vec<(String, Tensor)> = all
        .iter()
        .filter(|(n, _)| n != missing)
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let second: Vec<(String, Tensor)> = all
        .iter()
        .filter(|(n, _)| n == repeated)
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    Tensor::write_safetensors(&first, dir.join("a.safetensors")).unwrap();
    Tensor::write_safetensors(&second, dir.join("b.safetensors")).unwrap();
    let mut map = serde_json::Map::new();
    for (n, _) in &first {
        map.insert(n.clone(), "a.safetensors".into());
    }
    map.insert(repeated.into(), "b.safetensors".into());
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let e = Model::load(&dir, LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("model.layers.0.mlp.experts.gate_up_proj"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mixture_configs_refuse_what_is_not_implemented() {
    let scratch = std::env::temp_dir().join(format!("treetrain-moe-bad-{}", std::process::id()));
    let cases: [(&str, serde_json::Value); 4] = [
        (
            "shared_expert_intermediate_size",
            serde_json::json!({"shared_expert_intermediate_size": 64}),
        ),
        ("n_group", serde_json::json!({"n_group": 4, "topk_group": 2})),
        ("model_type", serde_json::json!({"model_type": "mixtral"})),
        ("num_experts_per_tok", serde_json::json!({"num_experts_per_tok": 99})),
    ];
    for (field, edit) in cases {
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).unwrap();
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe").join("config.json")).unwrap()).unwrap();
        for (k, v) in edit.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        std::fs::write(scratch.join("config.json"), cfg.to_string()).unwrap();
        std::fs::copy(
            fixture("qwen3_moe").join("model.safetensors"),
            scratch.join("model.safetensors"),
        )
        .unwrap();
        let e = Model::load(&scratch, LoadOptions::default()).unwrap_err().to_string();
        assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
    }
    // A multimodal config (its decoder under `text_config`) is named as what it is.
    std::fs::write(
        scratch.join("config.json"),
        r#"{"model_type": "llava", "text_config": {"vocab_size": 202048}}"#,
    )
    .unwrap();
    let e = Model::load(&scratch, LoadOptions::default()).unwrap_err().to_string();
    assert!(e.contains("text_config") && !e.contains("missing field"), "{e}");
    let _ = std::fs::remove_dir_all(&scratch);
}

#[test]
fn recomputed_activations_give_the_experts_the_same_gradients() {
    use treetrain::model::target_logprobs;
    let m = load_f32(&fixture("qwen3_moe"));
    let ids = Tensor::from_slice(&[5i64, 17, 99, 3, 250, 42, 7, 1, 2, 3, 200, 201, 9, 8, 7, 6]).view([2, 8]);
    let pos = Tensor::arange(8, (Kind::Int64, tch::Device::Cpu))
        .view([1, 8])
        .repeat([2, 1]);
    let run = |activations| {
        m.lm.forward_backward(&ids, &pos, &AttentionLayout::Causal, activations, |hidden| {
            let flat = hidden.view([16, -1]).narrow(0, 0, 15);
            let targets = ids.view([-1]).narrow(0, 1, 15);
            let lp = target_logprobs(&flat, m.lm.lm_head_weight(), &targets, LogprobChunks::default())?;
            Ok((Some(-lp.mean(Kind::Float)), ()))
        })
        .unwrap();
        common::take_grads(&m)
    };
    let (kept, recomputed) = (run(Activations::Kept), run(Activations::Recomputed));
    for ((name, a), (_, b)) in kept.iter().zip(&recomputed) {
        let scale = a.abs().max().double_value(&[]);
        assert!(scale > 0.0, "`{name}` got no gradient");
        let d = max_diff(a, b) / scale;
        assert!(d <= 1e-6, "`{name}` differs by {d:e} (relative)");
    }
    assert!(kept.iter().any(|(n, _)| n.ends_with("experts.gate_up_proj")));
}

/// transformers loads treetrain's save of a mixture model unchanged (experts fused, written
/// from the in-memory parameters after an edit) and computes the same logits.
#[test]
#[ignore = "slow: runs transformers (test.sh sets TREETRAIN_PEFT_PYTHON)"]
fn transformers_loads_a_saved_mixture_model() {
    let python = std::env::var("TREETRAIN_PEFT_PYTHON")
        .expect("set TREETRAIN_PEFT_PYTHON to a python with transformers (scripts/setup-peft.sh prints it)");
    let rows = vec![vec![5i64, 17, 99, 3, 250, 42, 7], vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]];
    assert_edited_save_loads(&python, ("qwen3_moe", "model.layers.2.mlp.experts.gate_up_proj"), &rows);
}

/// LoRA on a mixture model's attention works (TRL's Muse recipe targets q/k/v/o); feed-forward
/// names in `target_modules` are refused, pointing at `target_parameters`: PEFT would move them
/// onto the experts with per-tensor ranks (`rank_pattern`), which treetrain does not implement.
#[test]
fn lora_wraps_a_mixtures_attention_and_refuses_its_feed_forward() {
    use treetrain::model::lora::{LoraConfig, TargetModules};
    let config = |targets: &[&str]| LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        target_modules: TargetModules::Names(targets.iter().map(|t| t.to_string()).collect()),
        ..LoraConfig::default()
    };
    let mut m = load_f32(&fixture("qwen3_moe"));
    let row = [5i64, 17, 99, 3, 250, 42, 7];
    let before = row_logits(&m, &row);
    m.add_lora(config(&["q_proj", "k_proj", "v_proj", "o_proj"])).unwrap();
    assert_eq!(
        max_diff(&row_logits(&m, &row), &before),
        0.0,
        "a new adapter starts at the base"
    );
    for targets in [&["down_proj"][..], &["q_proj", "gate_proj"]] {
        let mut m = load_f32(&fixture("qwen3_moe"));
        let e = m.add_lora(config(targets)).unwrap_err().to_string();
        assert!(
            e.contains("target_parameters") && e.contains("mixture"),
            "{targets:?}: {e}"
        );
    }
}

fn expert_lora(targets: &[&str], parameters: &[&str]) -> treetrain::model::lora::LoraConfig {
    use treetrain::model::lora::{LoraConfig, TargetModules};
    LoraConfig {
        r: 3,
        lora_alpha: 7.0,
        target_modules: TargetModules::Names(targets.iter().map(|t| t.to_string()).collect()),
        target_parameters: parameters.iter().map(|t| t.to_string()).collect(),
        ..LoraConfig::default()
    }
}

/// LoRA on the experts (PEFT's `target_parameters`): a new adapter leaves the outputs as they
/// were, training reaches every expert's A and B, a merge gives the unmerged outputs, and what
/// PEFT refuses (dropout) or what names nothing is refused by name.
#[test]
fn lora_on_the_experts_starts_at_the_base_trains_and_merges() {
    use treetrain::model::target_logprobs;
    let mut m = load_f32(&fixture("qwen3_moe"));
    let row = [5i64, 17, 99, 3, 250, 42, 7];
    let before = row_logits(&m, &row);
    m.add_lora(expert_lora(
        &["q_proj"],
        &["mlp.experts.gate_up_proj", "experts.down_proj"],
    ))
    .unwrap();
    assert_eq!(max_diff(&row_logits(&m, &row), &before), 0.0);
    let names: Vec<String> = m.trainable().variables().into_keys().collect();
    for want in [
        "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight",
        "base_model.model.model.layers.0.mlp.experts.lora_B.weight",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    // B starts at 0, so only B's gradients are non-zero; every expert that a token chose gets one.
    let ids = Tensor::from_slice(&row).view([1, 7]);
    let pos = Tensor::arange(7, (Kind::Int64, tch::Device::Cpu)).view([1, 7]);
    m.lm.forward_backward(&ids, &pos, &AttentionLayout::Causal, Activations::Kept, |hidden| {
        let lp = target_logprobs(
            &hidden.view([7, -1]).narrow(0, 0, 6),
            m.lm.head(),
            &ids.view([-1]).narrow(0, 1, 6),
            LogprobChunks::default(),
        )?;
        Ok((Some(-lp.mean(Kind::Float)), ()))
    })
    .unwrap();
    let grads: std::collections::HashMap<String, Tensor> = m
        .trainable()
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.grad()))
        .collect();
    let b = &grads["base_model.model.model.layers.0.mlp.experts.lora_B.weight"];
    assert!(b.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    // Move every adapter tensor off its start, then merge: the same outputs.
    tch::manual_seed(3);
    for (_, t) in m.trainable().variables() {
        tch::no_grad(|| t.shallow_clone().copy_(&(&t + t.randn_like() * 0.3)));
    }
    let adapted = row_logits(&m, &row);
    assert!(max_diff(&adapted, &before) > 1e-3, "the adapter changes the outputs");
    let base = tch::no_grad(|| m.lm.base_view().forward(&ids, &pos, &AttentionLayout::Causal)).unwrap();
    assert_eq!(
        max_diff(&base.squeeze_dim(0), &before),
        0.0,
        "the base view has no adapter"
    );
    m.merge_adapter().unwrap();
    assert!(max_diff(&row_logits(&m, &row), &adapted) < 1e-4);
    m.unmerge_adapter().unwrap();
    assert!(max_diff(&row_logits(&m, &row), &adapted) < 1e-4);
    for (config, field) in [
        (
            treetrain::model::lora::LoraConfig {
                lora_dropout: 0.1,
                ..expert_lora(&["q_proj"], &["down_proj"])
            },
            "lora_dropout",
        ),
        (expert_lora(&["q_proj"], &["experts.up_proj"]), "target_parameters"),
    ] {
        let mut m = load_f32(&fixture("qwen3_moe"));
        let e = m.add_lora(config).unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    }
}

/// The GRPO update adds the load-balancing loss with each tree token counted once per rollout
/// through it: tree and flat packing give the same loss value and the same gradients, and the
/// loss value is the one of the rollouts forwarded as a padded batch, padding masked.
#[test]
fn the_grpo_update_adds_the_router_loss_the_same_in_both_packings() {
    use treetrain::grpo::{GrpoObjective, accumulate_gradients};
    let m = load_f32(&fixture("qwen3_moe"));
    let prompt: Vec<i64> = vec![5, 17, 99, 3, 250, 42];
    let tail = |t: &[i64]| [&prompt[..], t].concat();
    let mut rs = vec![
        rollout(tail(&[7, 9, 31, 64]), prompt.len()),
        rollout(tail(&[7, 9, 40]), prompt.len()),
        rollout(tail(&[8, 1, 2, 3, 4, 5]), prompt.len()),
    ];
    for (r, a) in rs.iter_mut().zip([1.0, -0.5, 0.25]) {
        r.advantage = a;
        r.old_log_probs = vec![-2.0; r.input_ids.len()];
    }
    let mut tree = PrefixTree::new();
    for (i, r) in rs.iter().enumerate() {
        tree.add(r.clone(), i).unwrap();
    }
    let objective = GrpoObjective {
        router_aux_loss_coef: 0.05,
        ..GrpoObjective::default()
    };
    let mut runs = Vec::new();
    for row in [tree.pack(), pack_flat(&rs).unwrap()] {
        let stats = accumulate_gradients(&m.lm, None, &[row], &objective).unwrap();
        runs.push((stats.aux_loss, common::take_grads(&m)));
    }
    let ((aux_tree, g_tree), (aux_flat, g_flat)) = (&runs[0], &runs[1]);
    assert!((aux_tree - aux_flat).abs() <= 1e-6, "tree {aux_tree} flat {aux_flat}");
    for ((name, a), (_, b)) in g_tree.iter().zip(g_flat) {
        let scale = a.abs().max().double_value(&[]).max(1e-8);
        assert!(max_diff(a, b) / scale <= 1e-4, "`{name}` differs");
    }
    // The rollouts as one right-padded batch, padding masked out.
    let longest = rs.iter().map(|r| r.input_ids.len()).max().unwrap();
    let (mut ids, mut mask) = (Vec::new(), Vec::new());
    for r in &rs {
        let pad = longest - r.input_ids.len();
        ids.extend(r.input_ids.iter().copied().chain(std::iter::repeat_n(0, pad)));
        mask.extend(std::iter::repeat_n(1.0f32, r.input_ids.len()).chain(std::iter::repeat_n(0.0, pad)));
    }
    let (b, n) = (rs.len() as i64, longest as i64);
    let ids = Tensor::from_slice(&ids).view([b, n]);
    let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu))
        .view([1, n])
        .repeat([b, 1]);
    let (_, routes) = tch::no_grad(|| m.lm.forward_hidden_routed(&ids, &pos, &AttentionLayout::Causal)).unwrap();
    let logits: Vec<Tensor> = routes.into_iter().map(|r| r.logits).collect();
    let want = load_balancing_loss(&logits, 2, Some(&Tensor::from_slice(&mask)))
        .unwrap()
        .double_value(&[]);
    assert!((aux_tree - want).abs() <= 1e-5, "tree {aux_tree}, padded batch {want}");
}

/// SFT and tree-packed GRPO train a tiny Qwen3-MoE (the shipped tokenizer, seeded weights) and
/// log its load-balancing loss as `aux_loss`, none with `router_aux_loss_coef = 0`; the loss
/// moves the weights differently than without it.
#[test]
fn sft_and_grpo_train_a_mixture_and_log_its_router_loss() {
    use treetrain::grpo::GrpoTrainer;
    use treetrain::sft::SftTrainer;
    let dir = std::env::temp_dir().join(format!("treetrain-moe-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = common::tiny_mixture().display().to_string();
    let weights = |t: &Model| t.vs.variables()["model.layers.1.mlp.gate.weight"].copy();
    let mut routers = Vec::new();
    for coef in [0.0, 0.5] {
        let mut cfg = common::shipped_sft(Some(dir.join(format!("sft-{coef}"))), 2);
        cfg.train.model = model.clone();
        cfg.train.router_aux_loss_coef = coef;
        let mut t = SftTrainer::new(cfg).unwrap();
        for _ in 0..2 {
            let m = t.step().unwrap();
            match coef > 0.0 {
                true => assert!(m.aux_loss.is_some_and(|a| a > 0.0 && a < 8.0), "{m:?}"),
                false => assert_eq!(m.aux_loss, None),
            }
        }
        routers.push(weights(t.model()));
        let log = std::fs::read_to_string(dir.join(format!("sft-{coef}/log.jsonl"))).unwrap();
        assert_eq!(log.contains("\"aux_loss\""), coef > 0.0, "{log}");
    }
    assert!(
        max_diff(&routers[0], &routers[1]) > 0.0,
        "the router loss reached the router"
    );
    let mut cfg = common::shipped_grpo();
    cfg.train.model = model;
    cfg.train.output.output_dir = Some(dir.join("grpo"));
    cfg.max_steps = 1;
    let mut t = GrpoTrainer::new(cfg).unwrap();
    let m = t.step().unwrap();
    assert!(m.update.aux_loss.is_some_and(|a| a > 0.0 && a < 8.0), "{m:?}");
    // The expert load of the update's last prefix tree: its rollouts forwarded one by one.
    let row = t.last_row.clone().unwrap();
    let got = t.expert_load().unwrap();
    let mut want: Option<treetrain::model::moe::ExpertLoad> = None;
    for (s, seg) in row.segments.iter().enumerate() {
        let children: usize = row
            .segments
            .iter()
            .filter(|c| c.parent == Some(s))
            .map(|c| c.rollouts)
            .sum();
        let mut path = vec![s];
        while let Some(p) = row.segments[*path.last().unwrap()].parent {
            path.push(p);
        }
        let ids: Vec<i64> = path
            .iter()
            .rev()
            .flat_map(|&i| row.input_ids[row.segments[i].start..][..row.segments[i].len].to_vec())
            .collect();
        for _ in children..seg.rollouts {
            let one = t.model().expert_load(&[&ids]).unwrap();
            want = Some(match want.take() {
                None => one,
                Some(mut w) => {
                    w.tokens += one.tokens;
                    for (a, b) in w.counts.iter_mut().zip(&one.counts) {
                        a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
                    }
                    w
                }
            });
        }
    }
    assert!(row.rollouts > 1 && got.tokens > row.len() as u64, "a shared prefix");
    assert_eq!(Some(got), want);
    let _ = std::fs::remove_dir_all(&dir);
}

/// LoRA on the experts both ways with PEFT 0.21, on Qwen3-MoE (in the hub's layout) and Muse
/// Spark: PEFT loads the adapter treetrain saves (random values everywhere) and gives its
/// logits, and treetrain loads one PEFT made, with one expert tensor targeted or both (PEFT
/// then nests gate_up_proj's wrapper under `base_layer`).
#[test]
#[ignore = "slow: runs PEFT (scripts/setup-peft.sh; test.sh sets TREETRAIN_PEFT_PYTHON)"]
fn lora_on_the_experts_round_trips_with_peft() {
    let python = std::env::var("TREETRAIN_PEFT_PYTHON")
        .expect("set TREETRAIN_PEFT_PYTHON to a python with peft (scripts/setup-peft.sh prints it)");
    let rows = vec![vec![5i64, 17, 99, 3, 240, 42, 7, 9, 31], vec![1, 33, 3, 4]];
    let cases: [(&str, &[&str]); 3] = [
        ("qwen3_moe", &["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        ("qwen3_moe", &["experts.down_proj"]),
        ("muse_spark", &["experts.gate_up_proj", "experts.down_proj"]),
    ];
    for (i, (base, parameters)) in cases.into_iter().enumerate() {
        let base = fixture(base);
        let mut m = load_f32(&base);
        m.add_lora(expert_lora(&["o_proj"], parameters)).unwrap();
        tch::manual_seed(i as i64);
        for (_, t) in m.trainable().variables() {
            tch::no_grad(|| t.shallow_clone().copy_(&(&t + t.randn_like() * 0.2)));
        }
        let config =
            serde_json::json!({"r": 3, "lora_alpha": 7, "target_modules": ["o_proj"], "target_parameters": parameters});
        let trainable = assert_peft_round_trip(&python, (&base, &m), config, &rows);
        assert_eq!(trainable, m.adapter.as_ref().unwrap().num_parameters(), "case {i}");
    }
}

/// Routing replay's forward and backward against transformers with every sparse layer's
/// experts fixed by hand (`scripts/fixtures/make_replay_fixture.py`): the same loss and
/// gradients, the router's included (its weights are recomputed at the replayed experts), and
/// no mismatch counted, kept or recomputed.
#[test]
fn replayed_routing_gives_the_gradients_of_a_routing_fixed_by_hand() {
    use treetrain::model::moe::RecordedRouting;
    let m = load_f32(&fixture("qwen3_moe"));
    let exp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe").join("replay.json")).unwrap()).unwrap();
    let row: Vec<i64> = serde_json::from_value(exp["row"].clone()).unwrap();
    let n = row.len() as i64;
    for activations in [Activations::Kept, Activations::Recomputed] {
        let experts = (0..m.lm.layers.len())
            .map(|i| {
                let chosen: Option<Vec<Vec<i64>>> = serde_json::from_value(exp["experts"][i.to_string()].clone()).ok();
                chosen.map(|c| Tensor::from_slice(&c.concat()).view([n, -1]))
            })
            .collect();
        let recorded = RecordedRouting::new(experts, true, Tensor::ones([n], (Kind::Bool, tch::Device::Cpu)));
        let (loss, _) = ce_pass(&m, &row, activations, (None, Some(&recorded)));
        assert!(
            (loss - exp["loss"].as_f64().unwrap()).abs() <= 1e-5,
            "{activations:?}: loss {loss}"
        );
        assert_eq!(recorded.mismatch(), (0.0, 2.0 * n as f64), "{activations:?}");
        let grads: std::collections::HashMap<String, Tensor> = common::take_grads(&m).into_iter().collect();
        for (name, want) in exp["grads"].as_object().unwrap() {
            let grad = match name.contains("experts") {
                true => grads[name].narrow(0, 0, 2),
                false => grads[name].shallow_clone(),
            };
            let want = tensor(want);
            let d = max_diff(&grad, &want) / want.abs().max().double_value(&[]).max(1e-3);
            assert!(d <= 1e-5, "{activations:?} {name}: off by {d:e} of its largest entry");
        }
    }
}

/// The generator's recorded routing of each completion is the routing a full forward of the
/// prompt and completion gives (every token the generator forwarded: the prompt, then each
/// sampled token fed back), prompts prefilled once and forked into a group.
#[test]
fn the_generator_records_the_routing_a_full_forward_gives() {
    let m = load_f32(&fixture("qwen3_moe"));
    let prompts = vec![vec![5i64, 17, 99, 3, 250, 42, 7], vec![1, 9, 4]];
    let cfg = GenerationConfig {
        max_new_tokens: 6,
        prefill_chunk_size: 4,
        ..Default::default()
    };
    let mut g = Generator::new();
    g.record_routing(true);
    let out = g.generate_groups(&m.lm, &prompts, 2, &cfg).unwrap();
    let traces = g.take_routing().unwrap();
    assert_eq!(traces.len(), out.len());
    for (c, trace) in out.iter().zip(&traces) {
        let ids: Vec<i64> = prompts[c.prompt_index].iter().chain(&c.output_ids).copied().collect();
        let forwarded = trace.tokens();
        assert!(
            forwarded + 1 >= ids.len() && forwarded <= ids.len(),
            "{forwarded} of {}",
            ids.len()
        );
        let n = forwarded as i64;
        let t = Tensor::from_slice(&ids[..forwarded]).view([1, n]);
        let pos = Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]);
        let (_, routes) = tch::no_grad(|| m.lm.forward_hidden_routed(&t, &pos, &AttentionLayout::Causal)).unwrap();
        let want: Vec<i64> = Vec::try_from(
            Tensor::stack(
                &routes.iter().map(|r| r.experts.sort(-1, false).0).collect::<Vec<_>>(),
                1,
            )
            .reshape([-1]),
        )
        .unwrap();
        let mut got: Vec<i64> = trace.ids.iter().map(|&e| i64::from(e)).collect();
        for token in got.chunks_mut(2) {
            token.sort();
        }
        assert_eq!(got, want);
    }
    assert!(Generator::new().take_routing().is_none());
}

/// Tree-packed GRPO on the tiny mixture, two updates a batch (`num_iterations = 2`): without
/// replay the update's routing is compared with the generator's and the mismatch logged (the
/// second update of a batch, after an optimizer step, routes differently); with
/// `routing_replay` the update routes every recorded token as the generator did, so none
/// differs.
#[test]
fn grpo_logs_the_routing_mismatch_and_replay_removes_it() {
    use treetrain::grpo::GrpoTrainer;
    for replay in [false, true] {
        let mut cfg = common::shipped_grpo();
        cfg.train.model = common::tiny_mixture().display().to_string();
        cfg.train.output.output_dir = None;
        cfg.update.routing_replay = replay;
        cfg.max_steps = 4;
        cfg.loss.num_iterations = 2;
        let mut t = GrpoTrainer::new(cfg).unwrap();
        let mismatches: Vec<f64> = (0..4)
            .map(|_| t.step().unwrap().update.routing_mismatch.expect("recorded routing"))
            .collect();
        assert!(mismatches.iter().all(|m| (0.0..=1.0).contains(m)), "{mismatches:?}");
        match replay {
            true => assert!(mismatches.iter().all(|&m| m == 0.0), "{mismatches:?}"),
            // A batch's second update comes after an optimizer step has moved the routers.
            false => assert!(mismatches[1] > 0.0 && mismatches[3] > 0.0, "{mismatches:?}"),
        }
    }
}
