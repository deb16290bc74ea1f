//! What a notebook receives from `evcxr_display`.

use treetrain::device::{PadTo, Platform};
use treetrain::display::{Rich, evcxr_payload};
use treetrain::shapes::{PaddingComparison, ShapeLedger};

#[test]
fn payload_has_html_and_text_blocks_in_evcxr_markers() {
    let mut ledger = ShapeLedger::default();
    ledger.record("decode", &[8, 1]);
    let p = evcxr_payload(&ledger.html(), &ledger.text());
    let lines: Vec<&str> = p.lines().collect();
    assert_eq!(lines[0], "EVCXR_BEGIN_CONTENT text/html");
    assert!(p.contains("EVCXR_END_CONTENT\nEVCXR_BEGIN_CONTENT text/plain\nShape ledger"));
    assert_eq!(p.matches("EVCXR_END_CONTENT").count(), 2);
}

#[test]
fn html_is_theme_aware_and_self_contained() {
    let lengths: Vec<usize> = (1..=64).map(|i| i * 37 % 700 + 5).collect();
    let c = PaddingComparison::new(&lengths, 4, PadTo::Multiple(64), Platform::Cpu, 60.0).unwrap();
    let html = c.html();
    assert!(html.starts_with("<style>") && html.contains("var(--jp-ui-font-color1"));
    assert!(!html.contains("<script"));
    assert!(!html.contains("\"#000000\""), "black strokes vanish on dark themes");
    assert!(html.contains("pad to 64"));
}

#[test]
fn every_notebook_type_renders() {
    use treetrain::display::LineChart;
    let chart = LineChart::new("loss", "step", "loss").with_series("train", vec![(1.0, 2.0), (2.0, 1.5)]);
    let m = treetrain::sft::StepMetrics {
        step: 3,
        epoch: 0.5,
        loss: 1.25,
        lr: 1e-3,
        grad_norm: 0.5,
        tokens_per_s: 1000.0,
        padding_fraction: 0.25,
        skipped: true,
        aux_loss: None,
    };
    assert_eq!(
        m.text(),
        "step 3: loss 1.2500, lr 1.00e-3, grad norm 0.500, 1000 tokens/s, padding 25.0% (skipped)\n"
    );
    assert!(m.html().contains("<th>grad_norm</th><td>0.5</td>"));
    let cfg = treetrain::sft::SftConfig::default();
    assert!(cfg.text().contains("tokenize.max_length = ") && cfg.html().contains("SFT config"));
    assert!(chart.html().contains("<svg") && chart.text().contains("train: 2 points, last 1.5000 at 2"));
    // The shipped SFT folder's train split: both of its files.
    let ds =
        treetrain::data::Dataset::open(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/sft")).unwrap();
    assert!(ds.html().contains("train-calculator.parquet") && ds.text().starts_with("Dataset: 2 file(s)"));
    let cache = treetrain::hub::HubCache {
        root: "/tmp/hf <x>".into(),
        offline: true,
    };
    assert!(cache.html().contains("/tmp/hf &lt;x&gt;") && cache.text().contains("offline: true"));
    let mut tree = treetrain::pack::PrefixTree::new();
    let r = treetrain::pack::Rollout {
        input_ids: vec![1, 2, 3],
        completion_mask: vec![0, 1, 1],
        old_log_probs: vec![0.0; 3],
        advantage: 1.0,
        group_id: "g".into(),
    };
    tree.add(r, 0).unwrap();
    assert!(tree.html().contains("Packed row") && tree.text().contains("[0] 3 tok x1"));
    let g = treetrain::generate::Generator::new();
    assert!(g.text().contains("0 distinct shapes"));
}

#[test]
fn the_training_core_types_render() {
    use treetrain::display::Rich;
    let cfg = treetrain::train::TrainConfig {
        optimizer: treetrain::train::OptimizerSettings {
            learning_rate: 3e-4,
            ..Default::default()
        },
        ..Default::default()
    };
    assert!(cfg.text().contains("learning_rate = 0.0003\n") && cfg.html().contains("Training settings"));
    assert!(cfg.text().contains("device = cpu\n") && cfg.text().contains("on_nan = skip\n"));
    let p = treetrain::train::Progress { done: 3, total: 40 };
    assert_eq!(p.text(), "step 3 / 40\n");
    assert!(p.html().contains("3 / 40"));
    let o = treetrain::grpo::GrpoObjective {
        beta: 0.04,
        loss_type: treetrain::grpo::LossType::DrGrpo,
        ..Default::default()
    };
    assert!(o.text().contains("beta = 0.04\n") && o.text().contains("loss_type = dr_grpo\n"));
    assert!(o.html().contains("GRPO objective") && o.html().contains("<td>0.04</td>"));
    assert!(
        !o.text().contains("sapo") && !o.text().contains("entropy_coef"),
        "only the options in use"
    );
    let sapo = treetrain::grpo::GrpoObjective {
        loss_type: treetrain::grpo::LossType::Sapo,
        entropy_coef: 0.01,
        off_policy_mask_threshold: Some(0.5),
        ..Default::default()
    };
    let text = sapo.text();
    assert!(text.contains("sapo temperatures (pos, neg) = [1.0, 1.05]\n"), "{text}");
    assert!(text.contains("off_policy_mask_threshold = 0.5\n") && text.contains("entropy_coef (this step) = 0.0100\n"));
    let control = treetrain::grpo::EntropyControl {
        coef: Some(0.12),
        last_entropy: None,
    };
    assert_eq!(control.text(), "coefficient: 0.1200\nlast step's entropy: not yet\n");
    assert!(control.html().contains("Adaptive entropy bonus"));
    let e = treetrain::sft::SftEval {
        step: 5,
        loss: 1.25,
        tokens: 80,
    };
    assert_eq!(
        e.text(),
        "eval at step 5: loss 1.2500 per token over 80 held-out tokens\n"
    );
}
