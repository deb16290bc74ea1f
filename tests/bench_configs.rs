//! The published configs the real-size benches build random models from parse, validate, and
//! give the parameter counts their model cards state.

use std::path::Path;

use treetrain::model::HfConfig;

#[test]
fn published_configs_validate_with_their_stated_sizes() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/configs");
    // (file, total parameters, non-embedding parameters) as the model cards state them (the
    // SmolLM2 card states the total only).
    for (file, total, body) in [
        ("smollm2-135m.json", 134.5e6, None),
        ("qwen3-0.6b.json", 0.6e9, Some(0.44e9)),
        ("qwen3-1.7b.json", 1.7e9, Some(1.4e9)),
        ("qwen3-30b-a3b.json", 30.5e9, Some(29.9e9)),
    ] {
        let cfg = HfConfig::from_file(&dir.join(file)).unwrap().validate().unwrap();
        let n = cfg.num_parameters() as f64;
        let embedding = (cfg.vocab_size * cfg.hidden_size) as f64;
        assert!(
            (n / total - 1.0).abs() < 0.05,
            "{file}: {n:e} parameters, card says {total:e}"
        );
        if let Some(body) = body {
            assert!(
                ((n - embedding) / body - 1.0).abs() < 0.05,
                "{file}: {:e} non-embedding",
                n - embedding
            );
        }
    }
}

/// Qwen3-30B-A3B's card: 3.3 B of its 30.5 B parameters active a token.
#[test]
fn the_mixture_config_gives_the_active_parameters_its_card_states() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/configs");
    let cfg = HfConfig::from_file(&dir.join("qwen3-30b-a3b.json"))
        .unwrap()
        .validate()
        .unwrap();
    let active = cfg.active_parameters() as f64;
    assert!((active / 3.3e9 - 1.0).abs() < 0.05, "{active:e} active");
}
