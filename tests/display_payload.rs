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
