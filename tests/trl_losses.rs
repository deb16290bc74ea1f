//! Every GRPO loss type and option against TRL 1.16's own `_compute_loss` on the same per-token
//! log-probs (tests/fixtures/trl_grpo_losses.json, made by
//! scripts/fixtures/make_grpo_loss_fixtures.py), in tree and flat packing: the loss and its
//! gradient with respect to every completion token's log-prob.

mod common;

use serde_json::Value;
use tch::{Kind, Tensor};
use treetrain::grpo::{GrpoConfig, GrpoObjective, TermEntropies, TermLogprobs, grpo_loss_of_logprobs};
use treetrain::pack::{PackedRow, PrefixTree, Rollout, pack_flat};

fn fixture() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trl_grpo_losses.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn rollouts(case: &Value) -> Vec<Rollout> {
    let rs = case["rollouts"].as_array().unwrap();
    rs.iter()
        .map(|r| {
            let ids = |k: &str| -> Vec<i64> { r[k].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect() };
            let (prompt, completion) = (ids("prompt"), ids("completion"));
            Rollout {
                input_ids: [prompt.clone(), completion.clone()].concat(),
                completion_mask: [vec![0; prompt.len()], vec![1; completion.len()]].concat(),
                old_log_probs: [vec![0.0; prompt.len()], floats(&r["old_log_probs"])].concat(),
                advantage: r["advantage"].as_f64().unwrap() as f32,
                group_id: r["group_id"].as_str().unwrap().to_string(),
            }
        })
        .collect()
}

/// `(rollout, completion token)` of every loss term of `row`, checked against the sampler's
/// log-probs the row carries.
fn term_places(row: &PackedRow, rs: &[Rollout]) -> Vec<(usize, usize)> {
    let mut seen = vec![0usize; rs.len()];
    let places: Vec<(usize, usize)> = row
        .segment_id
        .iter()
        .map(|&s| {
            let r = row.sources[s as usize];
            seen[r] += 1;
            (r, seen[r] - 1)
        })
        .collect();
    for (j, &(r, t)) in places.iter().enumerate() {
        let prompt = rs[r].completion_mask.iter().take_while(|&&m| m == 0).count();
        assert_eq!(row.old_log_probs[j], rs[r].old_log_probs[prompt + t], "term {j}");
    }
    places
}

fn tree_row(rs: &[Rollout]) -> PackedRow {
    let mut t = PrefixTree::new();
    for (i, x) in rs.iter().enumerate() {
        t.add(x.clone(), i).unwrap();
    }
    t.pack()
}

#[test]
fn every_loss_type_and_option_equals_trl() {
    let fixture = fixture();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 18);
    for case in cases {
        let mut settings = case["settings"].clone();
        settings["max_completion_length"] = case["max_completion_length"].clone();
        settings["model"] = "unused".into();
        settings["dataset"] = "unused".into();
        let config: GrpoConfig = serde_json::from_value(settings.clone()).unwrap();
        config.validate().unwrap();
        let rs = rollouts(case);
        let per = |k: &str| -> Vec<Vec<f32>> {
            case["rollouts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| floats(&r[k]))
                .collect()
        };
        let (logps, refs, grads) = (per("log_probs"), per("ref_log_probs"), per("grad"));
        let (entropies, entropy_grads) = (per("entropies"), per("entropy_grad"));
        let objective = GrpoObjective {
            // Every term trains at `top_entropy_quantile = 1`: no floor.
            entropy_floor: (config.loss.top_entropy_quantile < 1.0).then(|| {
                let all: Vec<f64> = entropies.concat().into_iter().map(f64::from).collect();
                common::quantile(&all, 1.0 - config.loss.top_entropy_quantile)
            }),
            ..GrpoObjective::from(&config)
        };
        for row in [tree_row(&rs), pack_flat(&rs).unwrap()] {
            let places = term_places(&row, &rs);
            let pick = |v: &[Vec<f32>]| Tensor::from_slice(&places.iter().map(|&(r, t)| v[r][t]).collect::<Vec<f32>>());
            let leaf = pick(&logps).set_requires_grad(true);
            let entropy_leaf = pick(&entropies).set_requires_grad(true);
            let measured = entropy_leaf.detach();
            let term_entropies = TermEntropies {
                measured: &measured,
                differentiable: Some(&entropy_leaf),
            };
            let reference = pick(&refs);
            let other = TermLogprobs {
                reference: Some(&reference),
                before_update: None,
            };
            let weights = objective.row_weights(&row).unwrap();
            let out = grpo_loss_of_logprobs(
                &row,
                leaf.shallow_clone(),
                Some(term_entropies),
                &objective,
                weights,
                other,
            )
            .unwrap();
            let label = format!("{settings} ({:?})", row.kind);
            let (got, want) = (out.loss.double_value(&[]), case["loss"].as_f64().unwrap());
            assert!(
                (got - want).abs() < 1e-5 * want.abs().max(1.0),
                "{label}: loss {got} vs TRL {want}"
            );
            out.loss.backward();
            let grad_of = |t: &Tensor| {
                let g = t.grad();
                Vec::<f32>::try_from(if g.defined() {
                    g.to_kind(Kind::Float)
                } else {
                    t.zeros_like()
                })
                .unwrap()
            };
            for (what, got, want) in [
                ("logp", grad_of(&leaf), &grads),
                ("entropy", grad_of(&entropy_leaf), &entropy_grads),
            ] {
                for (j, &(r, t)) in places.iter().enumerate() {
                    let want = want[r][t];
                    assert!(
                        (got[j] - want).abs() < 1e-5 * want.abs().max(1.0),
                        "{label}: d loss / d {what} of rollout {r} token {t}: {} vs TRL {want}",
                        got[j]
                    );
                }
            }
        }
    }
}

#[test]
fn the_new_options_are_validated_by_name_and_reach_their_use() {
    let base = serde_json::json!({"model": "unused", "dataset": "unused"});
    let err = |extra: Value| {
        let mut v = base.clone();
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let config: GrpoConfig = serde_json::from_value(v).unwrap();
        config.validate().unwrap_err().to_string()
    };
    assert!(err(serde_json::json!({"sapo_temperature_neg": 0.0})).contains("sapo_temperature_neg"));
    assert!(err(serde_json::json!({"vespo_lambda_pos": -1.0})).contains("vespo_lambda_pos"));
    assert!(err(serde_json::json!({"off_policy_mask_threshold": -0.1})).contains("off_policy_mask_threshold"));
    let vespo = err(serde_json::json!({"loss_type": "vespo", "importance_sampling_correction": true}));
    assert!(
        vespo.contains("importance_sampling_mode") && vespo.contains("token_truncate"),
        "{vespo}"
    );
    assert!(err(serde_json::json!({"repetition_penalty": 0.0})).contains("repetition_penalty"));
    // A synced reference needs the KL term, and cannot be LoRA's base (the policy's own).
    assert!(err(serde_json::json!({"sync_ref_model": true})).contains("needs beta > 0"));
    let lora = serde_json::json!({"sync_ref_model": true, "beta": 0.04, "lora": {}});
    assert!(err(lora).contains("does not apply with lora"));
    // 50 rollouts are no whole number of steps' 4 x 8.
    assert!(err(serde_json::json!({"generation_batch_size": 50})).contains("generation_batch_size"));
    let penalised: GrpoConfig = serde_json::from_value(serde_json::json!({"repetition_penalty": 1.3})).unwrap();
    assert_eq!(
        penalised.sampling_config().repetition_penalty,
        1.3,
        "rollouts sample with it"
    );
    let unknown: Result<GrpoConfig, _> = serde_json::from_value(serde_json::json!({"loss_type": "ppo"}));
    assert!(unknown.unwrap_err().to_string().contains("cispo"));
}

/// A TRL config's own spellings are read as treetrain's fields.
#[test]
fn trl_spellings_are_accepted() {
    let dir = std::env::temp_dir().join(format!("treetrain-trl-spellings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("grpo.toml");
    let toml = "model = \"m\"\ndataset = \"d\"\nepsilon = 0.1\nvllm_importance_sampling_correction = true\nvllm_importance_sampling_mode = \"token_truncate\"\nvllm_importance_sampling_cap = 2.5\n";
    std::fs::write(&path, toml).unwrap();
    let c = GrpoConfig::from_toml_file(&path).unwrap();
    let s = &c.sampling_correction;
    assert_eq!((c.loss.epsilon_low, s.importance_sampling_correction), (0.1, true));
    assert_eq!(
        s.importance_sampling_mode,
        treetrain::grpo::SamplingCorrectionMode::TokenTruncate
    );
    assert_eq!(s.importance_sampling_clip_max, Some(2.5));
    std::fs::write(
        &path,
        format!("{toml}num_generations_eval = 3\nmax_tool_calling_iterations = 5\nfork_threshold_tokens = 64\n"),
    )
    .unwrap();
    let c = GrpoConfig::from_toml_file(&path).unwrap();
    assert_eq!(
        (c.eval.eval_samples, c.multi_turn.max_turns),
        (3, 6),
        "n tool calls: n + 1 turns"
    );
    assert_eq!(c.multi_turn.fork_threshold_tokens, 64);
    for (flag, kept) in [("true", 8), ("false", 0), ("3", 3)] {
        std::fs::write(&path, format!("{toml}log_completions = {flag}\n")).unwrap();
        assert_eq!(GrpoConfig::from_toml_file(&path).unwrap().eval.log_completions, kept);
    }
    assert!(
        GrpoConfig::default().reference.use_bias_correction_kl,
        "TRL 1.16's default"
    );
    std::fs::write(
        &path,
        format!("{toml}[chat_template_kwargs]\nenable_thinking = false\n"),
    )
    .unwrap();
    let kwargs = GrpoConfig::from_toml_file(&path).unwrap().rollouts.chat_template_kwargs;
    assert_eq!(kwargs.get("enable_thinking"), Some(&Value::Bool(false)));
    std::fs::write(&path, format!("{toml}max_tool_calling_iterations = -1\n")).unwrap();
    let bad = GrpoConfig::from_toml_file(&path).unwrap_err().to_string();
    assert!(
        bad.contains("`max_tool_calling_iterations` = -1 is not a value it takes"),
        "{bad}"
    );
    std::fs::write(&path, format!("{toml}epsilon_low = 0.3\n")).unwrap();
    let both = GrpoConfig::from_toml_file(&path).unwrap_err().to_string();
    assert!(
        both.contains("`epsilon` and `epsilon_low` name the same setting"),
        "{both}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README's table holds a row for every field TRL 1.16's `GRPOConfig` and
/// `AsyncGRPOConfig` add (tests/fixtures/trl_grpo_config_fields.json, made by
/// scripts/fixtures/make_trl_config_fields.py), and every treetrain name it gives is a setting
/// a config file takes.
#[test]
fn the_readme_maps_every_trl_grpo_field_to_a_setting() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let start = readme
        .find("## TRL's GRPO settings, field by field")
        .expect("the section");
    let section = &readme[start..start + readme[start..].find("</details>").unwrap()];
    let ticked = |cell: &str| -> Vec<String> { cell.split('`').skip(1).step_by(2).map(str::to_string).collect() };
    let rows: Vec<(Vec<String>, String)> = section
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            let cells: Vec<&str> = l.split(" | ").collect();
            (ticked(cells[0]), cells[1].to_string())
        })
        .collect();
    let fields: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/trl_grpo_config_fields.json")).unwrap(),
    )
    .unwrap();
    // Every key a config takes (unset options included), and a reward table's.
    let settings: Vec<String> = {
        let json = serde_json::to_value(GrpoConfig::default()).unwrap();
        let reward = serde_json::json!({"name": "exact_answer", "weight": 1.0});
        let spec: treetrain::grpo::RewardSpec = serde_json::from_value(reward).unwrap();
        let reward_keys = serde_json::to_value(spec).unwrap();
        [json, reward_keys]
            .iter()
            .flat_map(|v| v.as_object().unwrap().keys().cloned())
            .collect()
    };
    for class in ["GRPOConfig", "AsyncGRPOConfig"] {
        for f in fields[class].as_array().unwrap() {
            let f = f.as_str().unwrap();
            assert!(
                rows.iter().any(|(names, _)| names.iter().any(|n| n == f)),
                "{class}.{f} has no README row"
            );
        }
    }
    // A row of "same names" says each TRL name is a treetrain setting too.
    for (names, ours) in &rows {
        let claimed = match ours.as_str() {
            "same names" => names.clone(),
            _ if ours.starts_with('`') => ticked(ours).into_iter().take(1).collect(),
            _ => Vec::new(),
        };
        for name in &claimed {
            assert!(
                settings.contains(name),
                "{names:?}: `{name}` is not a treetrain setting"
            );
        }
    }
}
