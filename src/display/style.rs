//! The one place where treetrain's notebook styling lives.
//!
//! Colours come from JupyterLab's theme variables with fallbacks, so output follows light and
//! dark themes; accent colours are mid-tones legible on both backgrounds.

/// CSS scoped to `.tt` containers; included once per rendered fragment (fragments must stand alone).
///
/// Every rule is written `.tt.tt …`: JupyterLab's `.jp-RenderedHTMLCommon td` (right-aligned,
/// zebra rows, `white-space: normal`) has the specificity of `.tt td` and is loaded later in some
/// front ends, so a single class loses; two classes win in JupyterLab, VS Code and nbconvert pages.
pub const CSS: &str = "<style>\
.tt.tt{font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:13px;color:var(--jp-ui-font-color1,inherit);line-height:1.4;max-width:100%;overflow-x:auto}\
.tt.tt h4{margin:8px 0 4px;font-size:14px;font-weight:600}\
.tt.tt table{border-collapse:collapse;margin:2px 0 8px;table-layout:auto;width:auto}\
.tt.tt th,.tt.tt td{padding:2px 10px;text-align:left;border:none;border-bottom:1px solid var(--jp-border-color2,rgba(128,128,128,.35));vertical-align:top;line-height:1.4;max-width:none}\
.tt.tt th{font-weight:600;color:var(--jp-ui-font-color2,inherit);white-space:nowrap}\
.tt.tt tbody tr,.tt.tt tbody tr:nth-child(odd),.tt.tt tbody tr:hover{background:transparent}\
.tt.tt td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}\
.tt.tt .ok{color:#2e9d57}.tt.tt .warn{color:#d08a00}.tt.tt .bad{color:#d9534f}\
.tt.tt .muted{opacity:.7}\
.tt.tt code{font-family:var(--jp-code-font-family,monospace);font-size:12px;background:none;padding:0}\
.tt.tt code.chip{white-space:nowrap}\
.tt.tt td.text code{white-space:pre-wrap;word-break:break-word}\
.tt.tt svg text{fill:currentColor}\
.tt.tt .row{display:flex;flex-wrap:wrap;gap:4px 24px;align-items:flex-start}\
.tt.tt .legend{display:flex;flex-wrap:wrap;gap:4px 16px;margin:2px 0 6px}\
.tt.tt .swatch{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-1px}\
.tt.tt details>summary{cursor:pointer;font-weight:600;margin:6px 0 4px}\
.tt.tt .tok{display:inline-block;margin:1px;padding:0 3px;border-radius:3px;white-space:pre;font-family:var(--jp-code-font-family,monospace);font-size:12px}\
.tt.tt .tok.on{background:rgba(44,160,44,.28);outline:1px solid rgba(44,160,44,.7)}\
.tt.tt .tok.off{background:rgba(128,128,128,.12)}\
</style>";

/// Series colours, distinguishable on light and dark backgrounds.
pub(crate) const PALETTE: [(u8, u8, u8); 6] = [
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

/// A row of fragments (charts) that wraps when the output area is narrow.
pub fn row(items: &[String]) -> String {
    format!("<div class=\"row\">{}</div>", items.concat())
}

/// A legend: one coloured swatch and its meaning per entry (`(css colour, text)`).
pub fn legend(entries: &[(&str, &str)]) -> String {
    let items: String = entries
        .iter()
        .map(|(colour, text)| {
            format!(
                "<span><span class=\"swatch\" style=\"background:{colour}\"></span>{}</span>",
                super::escape(text)
            )
        })
        .collect();
    format!("<div class=\"legend\">{items}</div>")
}

/// One token as a highlighted span (`.tok.on` trained, `.tok.off` context), newlines shown as ⏎,
/// `title` on hover.
pub(crate) fn token_span(text: &str, title: &str, trained: bool) -> String {
    let class = if trained { "tok on" } else { "tok off" };
    format!(
        "<span class=\"{class}\" title=\"{}\">{}</span>",
        super::escape(title),
        super::escape(&text.replace('\n', "⏎"))
    )
}

/// The legend of [`token_span`]s: what a trained and a context token mean here.
pub(crate) fn token_legend(trained: &str, context: &str) -> String {
    legend(&[("rgba(44,160,44,.45)", trained), ("rgba(128,128,128,.25)", context)])
}

/// A collapsible block, closed unless `open`.
pub fn details(summary: &str, body: &str, open: bool) -> String {
    let open = if open { " open" } else { "" };
    format!(
        "<details{open}><summary>{}</summary>{body}</details>",
        super::escape(summary)
    )
}
