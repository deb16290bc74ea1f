//! Notebook displays of packed rows: the tree as SVG, the segment table, the attention mask and
//! a packing summary.

use super::{PackKind, PackedRow};
use crate::display::{self, Rich, escape};
use crate::tokenizer::Tokenizer;

/// A packed row with the text of each segment, for display.
#[derive(Debug, Clone)]
pub struct TreeView {
    /// The row.
    pub row: PackedRow,
    /// Decoded text per segment (token ids when no tokenizer was given).
    pub segment_text: Vec<String>,
}

/// Largest row whose attention mask is drawn cell by cell.
const MASK_MAX: usize = 160;

impl TreeView {
    /// A view of `row`; with a tokenizer, segments show their text.
    pub fn new(row: &PackedRow, tokenizer: Option<&Tokenizer>) -> Self {
        let segment_text = row
            .segments
            .iter()
            .map(|s| {
                let ids = &row.input_ids[s.start..s.start + s.len];
                let decoded = tokenizer.and_then(|t| {
                    let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
                    t.decode(&ids, false).ok()
                });
                decoded.unwrap_or_else(|| {
                    let shown: Vec<String> = ids.iter().take(12).map(i64::to_string).collect();
                    format!("{}{}", shown.join(" "), if ids.len() > 12 { " …" } else { "" })
                })
            })
            .collect();
        TreeView {
            row: row.clone(),
            segment_text,
        }
    }

    fn trained_per_segment(&self) -> Vec<usize> {
        self.row
            .segments
            .iter()
            .map(|s| {
                self.row.shift_labels[s.start..s.start + s.len]
                    .iter()
                    .filter(|&&l| l != -100)
                    .count()
            })
            .collect()
    }

    /// The tree as SVG: one box per segment (width ~ tokens, x = depth), children below their
    /// parent; blue = shared by several rollouts, orange = one rollout; the green bar marks
    /// positions that predict trained tokens.
    pub fn tree_svg(&self) -> String {
        let segs = &self.row.segments;
        let max_depth = segs
            .iter()
            .map(|s| self.row.position_ids[s.start] as usize + s.len)
            .max()
            .unwrap_or(1)
            .max(1);
        let (width, row_h, left) = (760.0, 30.0, 8.0);
        let scale = (width - 2.0 * left) / max_depth as f64;
        let height = row_h * segs.len() as f64 + 10.0;
        let trained = self.trained_per_segment();
        let mut svg = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">"
        );
        for (i, s) in segs.iter().enumerate() {
            let x = left + self.row.position_ids[s.start] as f64 * scale;
            let y = 5.0 + i as f64 * row_h;
            let w = (s.len as f64 * scale).max(3.0);
            if let Some(p) = s.parent {
                let ps = &segs[p];
                let px = left + (self.row.position_ids[ps.start] as usize + ps.len) as f64 * scale;
                let py = 5.0 + p as f64 * row_h + 11.0;
                svg.push_str(&format!(
                    "<path d=\"M{px:.1},{py:.1} L{px:.1},{:.1} L{x:.1},{:.1}\" fill=\"none\" stroke=\"currentColor\" stroke-opacity=\"0.5\"/>",
                    y + 11.0,
                    y + 11.0
                ));
            }
            let color = if s.rollouts > 1 { "#1f77b4" } else { "#ff7f0e" };
            svg.push_str(&format!(
                "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"22\" rx=\"3\" fill=\"{color}\" fill-opacity=\"0.35\" stroke=\"{color}\"><title>segment {i}: {} tokens, {} rollouts, path {}</title></rect>",
                s.len, s.rollouts, s.path_len
            ));
            if trained[i] > 0 {
                let tw = w * trained[i] as f64 / s.len as f64;
                svg.push_str(&format!(
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{tw:.1}\" height=\"3\" fill=\"#2ca02c\"/>",
                    x + w - tw,
                    y + 19.0
                ));
            }
            let label: String = self.segment_text[i].chars().take(60).collect();
            svg.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"currentColor\">{} tok ×{} · {}</text>",
                x + 3.0,
                y + 15.0,
                s.len,
                s.rollouts,
                escape(&label.replace('\n', "⏎"))
            ));
        }
        svg.push_str("</svg>");
        svg
    }

    /// The attention mask as SVG cells (rows: queries, columns: keys), for rows of at most
    /// 160 tokens.
    pub fn mask_svg(&self) -> Option<String> {
        let n = self.row.len();
        if n == 0 || n > MASK_MAX {
            return None;
        }
        let (_, leave) = self.row.intervals();
        let cell = (320.0 / n as f64).clamp(2.0, 14.0);
        let side = cell * n as f64;
        let mut svg = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{side:.0}\" height=\"{side:.0}\">");
        svg.push_str(&format!(
            "<rect width=\"{side:.1}\" height=\"{side:.1}\" fill=\"currentColor\" fill-opacity=\"0.06\"/>"
        ));
        for q in 0..n {
            for (k, &l) in leave.iter().enumerate().take(q + 1) {
                if (q as i64) < l {
                    svg.push_str(&format!(
                        "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{cell:.1}\" height=\"{cell:.1}\" fill=\"#1f77b4\"/>",
                        k as f64 * cell,
                        q as f64 * cell
                    ));
                }
            }
        }
        svg.push_str("</svg>");
        Some(svg)
    }

    fn summary_rows(&self) -> Vec<(&'static str, String)> {
        let r = &self.row;
        let flat_pairs: u64 = r
            .rollout_positions
            .iter()
            .map(|p| {
                let l = p.len() as u64;
                l * (l + 1) / 2
            })
            .sum();
        vec![
            ("packing", format!("{:?}", r.kind)),
            ("rollouts", r.rollouts.to_string()),
            ("tokens: flat / forwarded", format!("{} / {}", r.raw_tokens, r.len())),
            ("packing ratio", format!("{:.2}", r.packing_ratio())),
            (
                "segments / longest path",
                format!("{} / {}", r.segments.len(), r.tree_max_seqlens[1]),
            ),
            ("loss terms", r.token_index.len().to_string()),
            ("K/V rows gathered", r.tree_kv_index.len().to_string()),
            (
                "attention pairs: flat / this row",
                format!(
                    "{flat_pairs} / {} ({:.2}x)",
                    r.attention_pairs(),
                    flat_pairs as f64 / r.attention_pairs().max(1) as f64
                ),
            ),
        ]
    }
}

impl Rich for TreeView {
    fn html(&self) -> String {
        let rows: Vec<(&str, String)> = self.summary_rows().into_iter().map(|(k, v)| (k, escape(&v))).collect();
        let trained = self.trained_per_segment();
        let table: Vec<Vec<String>> = self
            .row
            .segments
            .iter()
            .enumerate()
            .map(|(i, s)| {
                vec![
                    i.to_string(),
                    s.parent.map_or("-".into(), |p| p.to_string()),
                    format!("{}..{}", s.start, s.start + s.len),
                    self.row.position_ids[s.start].to_string(),
                    s.path_len.to_string(),
                    s.rollouts.to_string(),
                    trained[i].to_string(),
                    format!(
                        "<code>{}</code>",
                        escape(&self.segment_text[i].chars().take(80).collect::<String>())
                    ),
                ]
            })
            .collect();
        let mut body = display::section("Packed row", &display::kv_table(&rows));
        if self.row.kind == PackKind::Tree {
            body.push_str(&display::section("Prefix tree", &self.tree_svg()));
        }
        body.push_str(&display::section(
            "Segments",
            &display::table(
                &[
                    "segment",
                    "parent",
                    "positions",
                    "depth",
                    "path",
                    "rollouts",
                    "trained",
                    "text",
                ],
                &table,
            ),
        ));
        if let Some(mask) = self.mask_svg() {
            body.push_str(&display::section("Attention mask (query rows, key columns)", &mask));
        }
        display::style::container(&body)
    }

    fn text(&self) -> String {
        let mut s = String::new();
        for (k, v) in self.summary_rows() {
            s.push_str(&format!("{k:<34} {v}\n"));
        }
        for (i, seg) in self.row.segments.iter().enumerate() {
            let indent = {
                let mut d = 0;
                let mut p = seg.parent;
                while let Some(x) = p {
                    d += 1;
                    p = self.row.segments[x].parent;
                }
                d
            };
            s.push_str(&format!(
                "{}[{i}] {} tok x{}: {}\n",
                "  ".repeat(indent),
                seg.len,
                seg.rollouts,
                self.segment_text[i]
                    .chars()
                    .take(60)
                    .collect::<String>()
                    .replace('\n', "⏎")
            ));
        }
        s
    }
}

crate::rich_display!(TreeView);

impl Rich for PackedRow {
    fn html(&self) -> String {
        TreeView::new(self, None).html()
    }
    fn text(&self) -> String {
        TreeView::new(self, None).text()
    }
}

crate::rich_display!(PackedRow);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::{PrefixTree, Rollout};

    fn fixture_row() -> PackedRow {
        let mut t = PrefixTree::new();
        for (i, (tail, adv)) in [
            (vec![201, 202], 1.0),
            (vec![301, 302], -1.0),
            (vec![201, 202, 401], 0.5),
        ]
        .into_iter()
        .enumerate()
        {
            let ids: Vec<i64> = [vec![101, 102, 103], tail].concat();
            let n = ids.len();
            t.add(
                Rollout {
                    completion_mask: (0..n).map(|p| u8::from(p >= 3)).collect(),
                    old_log_probs: vec![-0.5; n],
                    input_ids: ids,
                    advantage: adv,
                    group_id: "0".into(),
                },
                i,
            )
            .unwrap();
        }
        t.pack()
    }

    #[test]
    fn renders_tree_segments_mask_and_summary() {
        let view = TreeView::new(&fixture_row(), None);
        let html = view.html();
        assert!(html.contains("packing ratio") && html.contains("1.60"));
        assert_eq!(view.tree_svg().matches("<title>segment").count(), 5);
        assert!(
            view.tree_svg().contains("#1f77b4") && view.tree_svg().contains("#ff7f0e"),
            "shared and unique colours"
        );
        // Each packed token sees its depth + 1 keys: positions 0 1 2 3 4 4 5 2 3 4.
        let mask = view.mask_svg().unwrap();
        assert_eq!(
            mask.matches("fill=\"#1f77b4\"").count(),
            1 + 2 + 3 + 4 + 5 + 5 + 6 + 3 + 4 + 5
        );
        let text = view.text();
        assert!(
            text.contains("[0] 2 tok x3") && text.contains("    [2] 1 tok x1"),
            "{text}"
        );
        assert!(text.contains("attention pairs: flat / this row"));
    }
}

impl Rich for super::PrefixTree {
    fn html(&self) -> String {
        TreeView::new(&self.pack(), None).html()
    }
    fn text(&self) -> String {
        TreeView::new(&self.pack(), None).text()
    }
}

crate::rich_display!(super::PrefixTree);
