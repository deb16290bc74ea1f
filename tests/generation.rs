//! The static-cache generator against full recomputation and against transformers' greedy
//! `generate` (tests/fixtures/greedy_generation.json, scripts/fixtures/make_generation_fixtures.py).

use std::path::Path;

use tch::{Kind, Tensor};
use treetrain::device::Device;
use treetrain::display::Rich;
use treetrain::generate::{FinishReason, GenerateError, GenerationConfig, Generator, SamplingConfig, choose};
use treetrain::model::{AttentionLayout, KvCache, LoadOptions, Model, StaticCache};

fn load(name: &str, kind: Kind) -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name);
    Model::load(
        &dir,
        LoadOptions {
            dtype: Some(kind),
            device: Device::Cpu,
        },
    )
    .unwrap()
}

const PROMPTS: [&[i64]; 4] = [
    &[5, 17, 99, 3, 250, 42, 7],
    &[1, 9, 4],
    &[200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210],
    &[77],
];

fn prompts() -> Vec<Vec<i64>> {
    PROMPTS.iter().map(|p| p.to_vec()).collect()
}

/// The logits `[vocab]` (f32) after the last of `ids`, from a forward of the whole sequence
/// (no cache).
fn last_logits(m: &Model, ids: &[i64]) -> Tensor {
    let n = ids.len() as i64;
    tch::no_grad(|| {
        m.lm.forward(
            &Tensor::from_slice(ids).view([1, n]),
            &Tensor::arange(n, (Kind::Int64, tch::Device::Cpu)).view([1, n]),
            &AttentionLayout::Causal,
        )
    })
    .unwrap()
    .get(0)
    .get(n - 1)
    .to_kind(Kind::Float)
}

/// Greedy decoding by recomputing the whole sequence every step, no cache, one prompt at a time:
/// tokens, the log-prob of each, and the margin between the two best logits at each step.
fn greedy_by_recomputation(m: &Model, prompt: &[i64], max_new: usize, eos: &[i64]) -> (Vec<i64>, Vec<f32>, Vec<f64>) {
    let mut ids = prompt.to_vec();
    let (mut out, mut lps, mut margins) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..max_new {
        let logits = last_logits(m, &ids);
        let t = logits.argmax(0, false).int64_value(&[]);
        let (top, _) = logits.topk(2, 0, true, true);
        margins.push(top.double_value(&[0]) - top.double_value(&[1]));
        lps.push(logits.log_softmax(0, Kind::Float).double_value(&[t]) as f32);
        out.push(t);
        ids.push(t);
        if eos.contains(&t) {
            break;
        }
    }
    (out, lps, margins)
}

fn cfg(max_new: usize, eos: Vec<i64>, chunk: i64) -> GenerationConfig {
    GenerationConfig {
        max_new_tokens: max_new,
        eos_token_ids: eos,
        prefill_chunk_size: chunk,
        ..Default::default()
    }
}

#[test]
fn greedy_static_cache_equals_recomputation_fp32_and_bf16() {
    for kind in [Kind::Float, Kind::BFloat16] {
        for name in ["qwen3", "llama3_scaled_v4config"] {
            let m = load(name, kind);
            let eos = m.lm.config.eos_token_ids.clone();
            let mut g = Generator::new();
            let out = g.generate(&m.lm, &prompts(), &cfg(12, eos.clone(), 4)).unwrap();
            for (p, c) in PROMPTS.iter().zip(&out) {
                let (want, lps, margins) = greedy_by_recomputation(&m, p, 12, &eos);
                if kind == Kind::BFloat16 {
                    // bf16 rounds differently when the same values are reduced in another order
                    // (a padded cache vs the exact sequence): tokens must agree until a step
                    // where the two best logits are within bf16 rounding of each other.
                    let same = c.output_ids.iter().zip(&want).take_while(|(a, b)| a == b).count();
                    if same < want.len() {
                        assert!(
                            margins[same] <= 0.125,
                            "{name} bf16 prompt {p:?}: diverged at step {same} with margin {}",
                            margins[same]
                        );
                    }
                    continue;
                }
                assert_eq!(c.output_ids, want, "{name} {kind:?} prompt {p:?}");
                if kind == Kind::Float {
                    for (a, b) in c.logprobs.iter().zip(&lps) {
                        assert!((a - b).abs() <= 1e-4, "{a} vs {b}");
                    }
                    assert_eq!(c.logprobs, c.untruncated_logprobs, "greedy reports one distribution");
                }
            }
        }
    }
}

#[test]
fn greedy_matches_transformers_generate() {
    let fixture: serde_json::Value = serde_json::from_str(include_str!("fixtures/greedy_generation.json")).unwrap();
    let prompts: Vec<Vec<i64>> = serde_json::from_value(fixture["prompts"].clone()).unwrap();
    for (name, case) in fixture["cases"].as_object().unwrap() {
        let m = load(name, Kind::Float);
        let eos: Vec<i64> = serde_json::from_value(case["eos"].clone()).unwrap();
        let want: Vec<Vec<i64>> = serde_json::from_value(case["outputs"].clone()).unwrap();
        let out = Generator::new()
            .generate(&m.lm, &prompts, &cfg(16, eos.clone(), 8))
            .unwrap();
        for (i, (c, w)) in out.iter().zip(&want).enumerate() {
            assert_eq!(&c.output_ids, w, "{name} prompt {i}");
            let expected = if w.last().is_some_and(|t| eos.contains(t)) {
                FinishReason::Eos
            } else {
                FinishReason::Length
            };
            assert_eq!(c.finish_reason, expected);
        }
    }
}

#[test]
fn exactly_two_shapes_per_call_whatever_the_prompt_lengths() {
    let m = load("qwen2", Kind::Float);
    let mut g = Generator::new();
    let c = cfg(6, vec![], 8);
    g.generate(&m.lm, &prompts(), &c).unwrap();
    assert_eq!(g.ledger.total_distinct(), 2);
    assert_eq!(g.ledger.distinct("prefill"), 1);
    assert_eq!(g.ledger.distinct("decode"), 1);
    // Other prompt lengths (all under one chunk): still the same two shapes.
    let other: Vec<Vec<i64>> = vec![vec![3; 5], vec![4; 2], vec![9; 8], vec![1; 1]];
    g.generate(&m.lm, &other, &c).unwrap();
    assert_eq!(g.ledger.total_distinct(), 2, "{}", g.ledger.text());
    assert!(g.ledger.graph("decode").unwrap().calls >= 10);
}

#[test]
fn dynamic_cache_and_group_generation_agree_with_static() {
    let m = load("qwen3", Kind::Float);
    let eos = m.lm.config.eos_token_ids.clone();
    let mut g = Generator::new();
    let c = cfg(10, eos, 4);
    let fixed = g.generate(&m.lm, &prompts(), &c).unwrap();
    let dynamic = g.generate_dynamic(&m.lm, &prompts(), &c).unwrap();
    for (a, b) in fixed.iter().zip(&dynamic) {
        assert_eq!(a.output_ids, b.output_ids);
        assert!(a.logprobs.iter().zip(&b.logprobs).all(|(x, y)| (x - y).abs() < 1e-5));
    }
    let groups = g.generate_groups(&m.lm, &prompts()[..2], 3, &c).unwrap();
    assert_eq!(groups.len(), 6);
    for (i, comp) in groups.iter().enumerate() {
        assert_eq!(comp.prompt_index, i / 3);
        assert_eq!(
            comp.output_ids,
            fixed[i / 3].output_ids,
            "greedy: every group member is the greedy completion"
        );
    }
    // Sampling: seeded, reproducible, group members differ.
    let sample = GenerationConfig {
        sampling: SamplingConfig {
            do_sample: true,
            temperature: 1.0,
            top_p: Some(0.95),
            seed: 7,
            ..Default::default()
        },
        ..c.clone()
    };
    let a = g.generate_groups(&m.lm, &prompts()[..2], 4, &sample).unwrap();
    let b = g.generate_groups(&m.lm, &prompts()[..2], 4, &sample).unwrap();
    assert_eq!(a, b);
    assert!(a[0].output_ids != a[1].output_ids || a[1].output_ids != a[2].output_ids);
    for comp in &a {
        for (lp, raw) in comp.logprobs.iter().zip(&comp.untruncated_logprobs) {
            assert!(lp >= raw, "truncation only raises a kept token's probability");
        }
    }
    // Shared prefill: the same completions as prefilling every group member separately.
    let repeated: Vec<Vec<i64>> = prompts()[..2]
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), 4))
        .collect();
    let separate = g.generate(&m.lm, &repeated, &sample).unwrap();
    let strip = |v: &[treetrain::generate::Completion]| v.iter().map(|c| c.output_ids.clone()).collect::<Vec<_>>();
    assert_eq!(strip(&a), strip(&separate));
}

/// Row `row`'s sampled completion replayed with the host sampler: the whole sequence recomputed
/// every step (no cache), the row's own random stream, the tokens seen so far.
fn sampled_by_recomputation(m: &Model, prompt: &[i64], row: usize, cfg: &GenerationConfig) -> Vec<i64> {
    let mut rng = cfg.sampling.row_stream(row);
    let mut ids = prompt.to_vec();
    for _ in 0..cfg.max_new_tokens {
        let logits = Vec::<f32>::try_from(&last_logits(m, &ids)).unwrap();
        let c = choose(&logits, &ids, &cfg.sampling, &mut rng);
        ids.push(c.token);
        if cfg.eos_token_ids.contains(&c.token) {
            break;
        }
    }
    ids[prompt.len()..].to_vec()
}

#[test]
fn sampling_on_the_device_draws_what_the_host_sampler_draws() {
    let m = load("qwen3", Kind::Float);
    let mut g = Generator::new();
    for sampling in [
        SamplingConfig {
            do_sample: true,
            temperature: 0.9,
            top_k: Some(40),
            top_p: Some(0.9),
            seed: 11,
            ..Default::default()
        },
        SamplingConfig {
            do_sample: true,
            min_p: Some(0.05),
            repetition_penalty: 1.3,
            seed: 12,
            ..Default::default()
        },
    ] {
        let c = GenerationConfig {
            sampling,
            ..cfg(12, m.lm.config.eos_token_ids.clone(), 4)
        };
        let batch = g.generate(&m.lm, &prompts(), &c).unwrap();
        for (row, comp) in batch.iter().enumerate() {
            let replay = sampled_by_recomputation(&m, &prompts()[row], row, &c);
            assert_eq!(comp.output_ids, replay, "row {row} of {:?}", c.sampling);
        }
    }
}

#[test]
fn stop_sequences_and_errors() {
    let m = load("qwen3", Kind::Float);
    let mut g = Generator::new();
    let first = g
        .generate(&m.lm, &prompts()[..1], &cfg(8, vec![], 4))
        .unwrap()
        .remove(0);
    let stop = first.output_ids[2..4].to_vec();
    let c = GenerationConfig {
        stop_sequences: vec![stop.clone()],
        ..cfg(8, vec![], 4)
    };
    let stopped = g.generate(&m.lm, &prompts()[..1], &c).unwrap().remove(0);
    assert_eq!(stopped.finish_reason, FinishReason::Stop);
    assert!(stopped.output_ids.ends_with(&stop) && stopped.output_ids.len() <= 4);
    let err = g.generate(&m.lm, &[vec![1, 2], vec![]], &c).unwrap_err();
    assert!(matches!(err, GenerateError::Prompt { index: 1, .. }), "{err}");
    assert!(
        g.generate(&m.lm, &[], &c)
            .unwrap_err()
            .to_string()
            .contains("no prompts")
    );
    let err = g.generate(&m.lm, &[vec![1, 999]], &c).unwrap_err();
    assert!(err.to_string().contains("prompt 0: token 999"), "{err}");
    let small = GenerationConfig {
        max_cache_len: Some(6),
        ..cfg(8, vec![], 4)
    };
    let err = g.generate(&m.lm, &prompts()[..1], &small).unwrap_err();
    assert!(err.to_string().contains("max_cache_len 6"), "{err}");
    // A model that computes NaN (a broken device, weights gone bad after loading): an error
    // naming the row and the step, never token 0 at every step.
    tch::no_grad(|| {
        let _ = m.vs.variables()["model.norm.weight"].shallow_clone().fill_(f64::NAN);
    });
    let err = g.generate(&m.lm, &prompts()[..2], &cfg(8, vec![], 4)).unwrap_err();
    assert!(matches!(err, GenerateError::NonFinite { row: 0, step: 0, .. }), "{err}");
    assert!(err.to_string().contains("NaN or infinite on device"), "{err}");
}

#[test]
fn static_cache_overflow_snapshot_and_rollback() {
    let m = load("qwen3", Kind::Float);
    let mut cache = StaticCache::new(&m.lm.config, 1, 4, Kind::Float, Device::Cpu).unwrap();
    let ids = Tensor::from_slice(&[1i64, 2, 3]).view([1, 3]);
    let pos = Tensor::arange(3, (Kind::Int64, tch::Device::Cpu)).view([1, 3]);
    let mask = Tensor::ones([4, 4], (Kind::Bool, tch::Device::Cpu))
        .tril(0)
        .narrow(0, 0, 3)
        .view([1, 1, 3, 4]);
    let _ = m.lm.forward_cached(&ids, &pos, &mut cache, &mask).unwrap();
    assert_eq!(cache.len(), 3);
    let snap = cache.snapshot();
    let err = m.lm.forward_cached(&ids, &pos, &mut cache, &mask).unwrap_err();
    assert!(err.to_string().contains("static cache overflow"), "{err}");
    cache.rollback(1).unwrap();
    assert_eq!(cache.len(), 1);
    assert!(cache.rollback(snap).is_err(), "cannot roll forward");
    cache.reset();
    assert!(cache.is_empty());
}

/// Four turns of conversations continued from their cache, forked within conversations, rows
/// finishing at different steps, the last one rewound to a history rendered otherwise: every
/// turn's greedy tokens and log-probs equal a recomputation of the whole conversation and a
/// fresh generation that prefills it all.
#[test]
fn continued_conversations_equal_prefilling_the_whole_conversation() {
    let m = load("qwen3", Kind::Float);
    // An end token the first prompt reaches early, so rows finish at different steps (and a
    // finished row's padding steps must not enter its cache).
    let eos = vec![greedy_by_recomputation(&m, PROMPTS[0], 6, &[]).0[2]];
    let c = GenerationConfig {
        max_cache_len: Some(96),
        ..cfg(6, eos.clone(), 4)
    };
    let mut g = Generator::new();
    let (mut conv, first) = g.start_conversations(&m.lm, &prompts(), 2, &c).unwrap();
    assert_eq!(conv.rows(), 8);
    assert!(first.iter().any(|o| o.finish_reason == FinishReason::Eos));
    assert!(first.iter().any(|o| o.finish_reason == FinishReason::Length));
    let check = |wholes: &[Vec<i64>], out: &[treetrain::generate::Completion], turn: usize| {
        let fresh = Generator::new()
            .generate(&m.lm, wholes, &cfg(6, eos.clone(), 4))
            .unwrap();
        for (i, (whole, o)) in wholes.iter().zip(out).enumerate() {
            let (want, lps, _) = greedy_by_recomputation(&m, whole, 6, &eos);
            assert_eq!(o.output_ids, want, "turn {turn} row {i}");
            assert_eq!(
                o.output_ids, fresh[i].output_ids,
                "turn {turn} row {i} vs re-prefilling"
            );
            for (a, b) in o.logprobs.iter().zip(&lps) {
                assert!((a - b).abs() <= 1e-4, "turn {turn} row {i}: {a} vs {b}");
            }
        }
    };
    // Turn 2: rows 0, 3, 5, 6 go on with messages of 1-3 tokens, each forked in two.
    let turns: Vec<(usize, Vec<i64>)> = [0usize, 3, 5, 6]
        .iter()
        .map(|&r| {
            let mut whole = conv.tokens(r).unwrap().to_vec();
            whole.extend((0..=(r % 3) as i64).map(|k| 30 + k + r as i64));
            (r, whole)
        })
        .collect();
    let second = g.continue_conversations(&m.lm, &mut conv, &turns, 2, &c).unwrap();
    assert_eq!(conv.rows(), 8);
    assert!(conv.html().contains("cache slots used / held"), "{}", conv.html());
    let wholes: Vec<Vec<i64>> = turns.iter().flat_map(|(_, w)| [w.clone(), w.clone()]).collect();
    check(&wholes, &second, 2);
    // Turn 3: two of those, one of them a long message, not forked.
    let turns: Vec<(usize, Vec<i64>)> = [1usize, 4]
        .iter()
        .map(|&r| {
            let mut whole = conv.tokens(r).unwrap().to_vec();
            whole.extend(100..100 + 2 * r as i64 + 1);
            (r, whole)
        })
        .collect();
    let third = g.continue_conversations(&m.lm, &mut conv, &turns, 1, &c).unwrap();
    let wholes: Vec<Vec<i64>> = turns.iter().map(|(_, w)| w.clone()).collect();
    check(&wholes, &third, 3);
    // Turn 4: histories rendered otherwise than generated: row 0 departs inside its last
    // turn, row 1 inside its prompt. Each row is rewound to what it shares and goes on as if
    // the whole sequence had been prefilled afresh.
    let turns: Vec<(usize, Vec<i64>)> = [0usize, 1]
        .iter()
        .map(|&r| {
            let held = conv.tokens(r).unwrap();
            let keep = if r == 0 { held.len() - 2 } else { 3 };
            let mut whole = held[..keep].to_vec();
            whole.extend([50 + r as i64, 61, 62]);
            (r, whole)
        })
        .collect();
    let fourth = g.continue_conversations(&m.lm, &mut conv, &turns, 2, &c).unwrap();
    let wholes: Vec<Vec<i64>> = turns.iter().flat_map(|(_, w)| [w.clone(), w.clone()]).collect();
    check(&wholes, &fourth, 4);
    // A sequence that adds nothing to the row, and one the cache cannot hold, are refused.
    let short = conv.tokens(0).unwrap()[..4].to_vec();
    let err = g
        .continue_conversations(&m.lm, &mut conv, &[(0, short)], 1, &c)
        .unwrap_err();
    assert!(err.to_string().contains("do not extend"), "{err}");
    let mut long = conv.tokens(0).unwrap().to_vec();
    long.extend(std::iter::repeat_n(9, 60));
    let err = g
        .continue_conversations(&m.lm, &mut conv, &[(0, long)], 1, &c)
        .unwrap_err();
    assert!(err.to_string().contains("slots left"), "{err}");
}

/// The shipped model's LM head has 2,048 rows for its tokenizer's 1,760 tokens: sampled hot,
/// it would draw padding rows that decode to nothing. Ids past the tokenizer's are never
/// chosen (what GRPO and `generate` set from the tokenizer), and nothing else changes.
#[test]
fn sampling_never_picks_ids_the_tokenizer_lacks() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/tiny-qwen3-sft");
    let m = Model::load(&dir, LoadOptions::default()).unwrap();
    let tok = treetrain::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let special = treetrain::model::SpecialTokens::resolve(Some(&tok), &m.lm.config);
    let limit = tok.id_limit();
    assert_eq!((special.token_limit, m.lm.config.vocab_size), (Some(limit), 2048));
    let prompts: Vec<Vec<i64>> = (0..16).map(|i| vec![5 + i, 17, 99, 3]).collect();
    let draw = |token_limit| {
        let c = GenerationConfig {
            sampling: SamplingConfig {
                do_sample: true,
                temperature: 4.0,
                seed: 5,
                token_limit,
                ..Default::default()
            },
            ..cfg(24, Vec::new(), 4)
        };
        let out = Generator::new().generate(&m.lm, &prompts, &c).unwrap();
        out.into_iter().flat_map(|c| c.output_ids).collect::<Vec<i64>>()
    };
    let unlimited = draw(None);
    assert!(
        unlimited.iter().any(|&t| t as usize >= limit),
        "hot sampling without the limit draws padding rows (the case this guards)"
    );
    let limited = draw(special.token_limit);
    assert!(limited.iter().all(|&t| (t as usize) < limit), "{limited:?}");
    let ids: Vec<u32> = limited.iter().map(|&t| t as u32).collect();
    tok.decode(&ids, false).expect("every sampled id decodes");
}
