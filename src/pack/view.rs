//! Notebook displays of packed rows: a summary, the prefix tree with a legend (collapsed past a
//! size), the segment table (collapsible), the attention mask with axes, a segment token by token,
//! and tree and flat packings of the same rollouts side by side.

use super::draw::{self, OWN, SHARED, TRAINED};
use super::row::{PackKind, PackedRow};
use super::token_view::SegmentTokens;
use crate::display::{self, Rich, escape};
use crate::tokenizer::Tokenizer;

/// A packed row with the text of each segment and token, for display.
#[derive(Debug, Clone)]
pub struct TreeView {
    /// The row.
    pub row: PackedRow,
    /// Decoded text per segment (token ids when no tokenizer was given).
    pub segment_text: Vec<String>,
    /// Decoded text per packed position (the id when no tokenizer was given).
    pub token_text: Vec<String>,
}

/// Segment tables longer than this start collapsed.
const OPEN_TABLE_MAX: usize = 12;
/// Segment tables list at most this many segments (the tree picture and the token view cover all).
const TABLE_MAX: usize = 200;

impl TreeView {
    /// A view of `row`; with a tokenizer, segments and tokens show their text.
    pub fn new(row: &PackedRow, tokenizer: Option<&Tokenizer>) -> Self {
        let decode = |ids: &[i64]| {
            let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
            tokenizer.and_then(|t| t.decode(&ids, false).ok())
        };
        let segment_text = row
            .segments
            .iter()
            .map(|s| {
                let ids = &row.input_ids[s.start..s.start + s.len];
                decode(ids).unwrap_or_else(|| {
                    let shown: Vec<String> = ids.iter().take(12).map(i64::to_string).collect();
                    format!("{}{}", shown.join(" "), if ids.len() > 12 { " …" } else { "" })
                })
            })
            .collect();
        let token_text = row
            .input_ids
            .iter()
            .map(|&id| decode(&[id]).unwrap_or_else(|| id.to_string()))
            .collect();
        TreeView {
            row: row.clone(),
            segment_text,
            token_text,
        }
    }

    /// Segment `segment` token by token (id, text, position, the label it predicts, whether
    /// that is trained, the generator's log-prob); `None` past the last segment.
    pub fn tokens(&self, segment: usize) -> Option<SegmentTokens> {
        SegmentTokens::new(&self.row, segment, &self.token_text)
    }

    /// The tree as SVG (see `draw::tree_svg`).
    pub(crate) fn tree_svg(&self) -> String {
        draw::tree_svg(&self.row, &self.segment_text)
    }

    /// The attention mask as SVG, for rows of at most 160 tokens.
    pub(crate) fn mask_svg(&self) -> Option<String> {
        draw::mask_svg(&self.row)
    }

    /// The summary table alone (what a trainer shows of its latest row).
    pub(crate) fn summary_html(&self) -> String {
        let rows: Vec<(&str, String)> = self.summary_rows().into_iter().map(|(k, v)| (k, escape(&v))).collect();
        display::kv_table(&rows)
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
            (
                "packing",
                match r.kind {
                    PackKind::Tree => "prefix tree".into(),
                    PackKind::Flat => "flat (rollouts end to end)".into(),
                },
            ),
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
        let mut body = display::section("Packed row", &self.summary_html());
        if self.row.kind == PackKind::Tree {
            let lines = draw::tree_lines(&self.row);
            let drawn = lines.iter().filter(|l| matches!(l, draw::Line::Segment(_))).count();
            let title = match drawn == self.row.segments.len() {
                true => "Prefix tree".to_string(),
                false => format!("Prefix tree ({drawn} of {} segments drawn)", self.row.segments.len()),
            };
            body.push_str(&display::section(
                &title,
                &format!("{}{}", tree_legend(), self.tree_svg()),
            ));
        }
        let n = self.row.segments.len();
        let table = display::table(
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
            &self.segment_rows(),
        );
        let shown = n.min(TABLE_MAX);
        let summary = match shown == n {
            true => format!("Segments ({n}; view.tokens(i) shows one token by token)"),
            false => format!("Segments (the first {shown} of {n}; view.tokens(i) shows any token by token)"),
        };
        body.push_str(&display::style::details(&summary, &table, n <= OPEN_TABLE_MAX));
        if let Some(mask) = self.mask_svg() {
            body.push_str(&display::section(
                "Attention mask (filled: the query attends to the key)",
                &mask,
            ));
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

crate::display::rich_display!(TreeView);

fn tree_legend() -> String {
    display::style::legend(&[
        (SHARED, "forwarded once, shared by several rollouts"),
        (OWN, "one rollout's own tokens"),
        (TRAINED, "bar: positions that predict trained tokens"),
    ])
}

impl TreeView {
    fn segment_rows(&self) -> Vec<Vec<String>> {
        let trained = draw::trained_per_segment(&self.row);
        self.row
            .segments
            .iter()
            .enumerate()
            .take(TABLE_MAX)
            .map(|(i, s)| {
                vec![
                    i.to_string(),
                    s.parent.map_or("-".into(), |p| p.to_string()),
                    format!("<code class=\"chip\">{}..{}</code>", s.start, s.start + s.len),
                    self.row.position_ids[s.start].to_string(),
                    s.path_len.to_string(),
                    s.rollouts.to_string(),
                    trained[i].to_string(),
                    format!("<code>{}</code>", escape(&draw::fit(&self.segment_text[i], 80))),
                ]
            })
            .collect()
    }
}

impl Rich for PackedRow {
    fn html(&self) -> String {
        TreeView::new(self, None).html()
    }
    fn text(&self) -> String {
        TreeView::new(self, None).text()
    }
}

crate::display::rich_display!(PackedRow);

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
        assert!(
            html.contains("<details open><summary>Segments (5;"),
            "a short table starts open"
        );
        assert!(
            html.contains("forwarded once, shared by several rollouts"),
            "the legend"
        );
    }

    #[test]
    fn a_segment_token_by_token() {
        let view = TreeView::new(&fixture_row(), None);
        // Segment 1 is `103 201`: 103 predicts the trained 201, 201 predicts 202 (trained in
        // two rollouts: two loss terms, the first one's log-prob shown).
        let seg = view.tokens(1).unwrap();
        let places: Vec<[i64; 3]> = seg.rows.iter().map(|r| [r.packed as i64, r.position, r.id]).collect();
        assert_eq!(places, vec![[2, 2, 103], [3, 3, 201]]);
        let labels: Vec<Option<i64>> = seg.rows.iter().map(|r| r.label.as_ref().map(|l| l.0)).collect();
        assert_eq!(labels, vec![Some(201), Some(202)]);
        assert!(seg.rows.iter().all(|r| r.old_log_prob == Some(-0.5)));
        assert_eq!(seg.rollouts, 2);
        assert!(seg.html().contains("2 trained positions"));
        let untrained = view.tokens(0).unwrap();
        assert!(
            untrained
                .rows
                .iter()
                .all(|r| r.label.is_none() && r.old_log_prob.is_none())
        );
        assert!(view.tokens(5).is_none());
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

crate::display::rich_display!(super::PrefixTree);
