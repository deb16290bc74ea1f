//! The one place where treetrain's notebook styling lives.
//!
//! Colours come from JupyterLab's theme variables with fallbacks, so output follows light and
//! dark themes; accent colours are mid-tones legible on both backgrounds.

/// CSS scoped to `.tt` containers; included once per rendered fragment (fragments must stand alone).
pub const CSS: &str = "<style>\
.tt{font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;color:var(--jp-ui-font-color1,inherit);line-height:1.4}\
.tt h4{margin:6px 0 4px;font-size:14px}\
.tt table{border-collapse:collapse;margin:2px 0 8px}\
.tt th,.tt td{padding:2px 10px;text-align:left;border-bottom:1px solid var(--jp-border-color2,rgba(128,128,128,.35));vertical-align:top}\
.tt th{font-weight:600;color:var(--jp-ui-font-color2,inherit)}\
.tt td.num{text-align:right;font-variant-numeric:tabular-nums}\
.tt .ok{color:#2e9d57}.tt .warn{color:#d08a00}.tt .bad{color:#d9534f}\
.tt .muted{opacity:.7}\
.tt code{font-family:var(--jp-code-font-family,monospace);font-size:12px}\
.tt svg text{fill:currentColor}\
</style>";

/// Series colours, distinguishable on light and dark backgrounds.
pub const PALETTE: [(u8, u8, u8); 6] = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (23, 190, 207),
];

/// Wraps a fragment in the styled container.
pub fn container(inner: &str) -> String {
    format!("{CSS}<div class=\"tt\">{inner}</div>")
}
