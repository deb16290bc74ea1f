//! SVG pictures of a packed row: the prefix tree (collapsed past a size), the row as a strip of
//! tokens, and the attention mask with axes. Pure functions of the row and its segment labels.

use super::row::PackedRow;
use crate::display::escape;

/// Colour of a segment forwarded once for several rollouts.
pub(crate) const SHARED: &str = "#1f77b4";
/// Colour of a segment that belongs to one rollout.
pub(crate) const OWN: &str = "#ff7f0e";
/// Colour of the bar marking positions that predict trained tokens.
pub(crate) const TRAINED: &str = "#2ca02c";

/// A node with more children than this shows the first `MAX_CHILDREN - 1` and a "+k more" line.
const MAX_CHILDREN: usize = 6;
/// The tree picture draws at most this many lines; the rest is one "+k more segments" line.
const MAX_LINES: usize = 28;
const WIDTH: f64 = 960.0;
/// Boxes are laid out in this share of the width; labels run to the right of their box.
const BOX_SHARE: f64 = 0.55;
const LINE_H: f64 = 24.0;
const BOX_H: f64 = 16.0;
/// Average advance of an 11 px sans-serif glyph (labels are cut to fit with an ellipsis).
const CHAR_PX: f64 = 6.4;

/// One line of the tree picture.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Line {
    /// A drawn segment.
    Segment(usize),
    /// `segments` hidden segments (with their subtrees) under `parent`.
    More { parent: Option<usize>, segments: usize },
}

/// The lines of the tree picture in DFS order, collapsed past [`MAX_CHILDREN`] siblings and
/// [`MAX_LINES`] lines.
pub(crate) fn tree_lines(row: &PackedRow) -> Vec<Line> {
    let n = row.segments.len();
    let mut children = vec![Vec::new(); n];
    let mut roots = Vec::new();
    for (i, s) in row.segments.iter().enumerate() {
        match s.parent {
            Some(p) => children[p].push(i),
            None => roots.push(i),
        }
    }
    let mut subtree = vec![1usize; n];
    for i in (0..n).rev() {
        if let Some(p) = row.segments[i].parent {
            subtree[p] += subtree[i];
        }
    }
    let mut lines = Vec::new();
    let mut drawn = 0;
    let mut hidden = 0;
    let mut stack: Vec<Line> = siblings(None, &roots, &subtree).into_iter().rev().collect();
    while let Some(line) = stack.pop() {
        if lines.len() >= MAX_LINES - 1 {
            break;
        }
        match line {
            Line::Segment(i) => {
                drawn += 1;
                stack.extend(siblings(Some(i), &children[i], &subtree).into_iter().rev());
            }
            Line::More { segments, .. } => hidden += segments,
        }
        lines.push(line);
    }
    let rest = n - drawn - hidden;
    if rest > 0 {
        lines.push(Line::More {
            parent: None,
            segments: rest,
        });
    }
    lines
}

/// The lines for one node's children: all of them, or the first few and a "+k more" line.
fn siblings(parent: Option<usize>, kids: &[usize], subtree: &[usize]) -> Vec<Line> {
    if kids.len() <= MAX_CHILDREN {
        return kids.iter().map(|&k| Line::Segment(k)).collect();
    }
    let (shown, rest) = kids.split_at(MAX_CHILDREN - 1);
    let mut lines: Vec<Line> = shown.iter().map(|&k| Line::Segment(k)).collect();
    lines.push(Line::More {
        parent,
        segments: rest.iter().map(|&k| subtree[k]).sum(),
    });
    lines
}

/// Trained positions (predicting a trained token) in each segment.
pub(crate) fn trained_per_segment(row: &PackedRow) -> Vec<usize> {
    row.segments
        .iter()
        .map(|s| {
            row.shift_labels[s.start..s.start + s.len]
                .iter()
                .filter(|&&l| l != -100)
                .count()
        })
        .collect()
}

/// `text` cut to `max_chars` with an ellipsis, newlines shown as ⏎.
pub(super) fn fit(text: &str, max_chars: usize) -> String {
    let flat = text.replace('\n', "⏎");
    if flat.chars().count() <= max_chars {
        return flat;
    }
    let kept: String = flat.chars().take(max_chars.saturating_sub(1)).collect();
    format!("{kept}…")
}

/// The tree as SVG: one box per segment (x = depth, width ~ tokens), its label to its right,
/// children on the lines below joined to the end of their parent.
pub(crate) fn tree_svg(row: &PackedRow, segment_text: &[String]) -> String {
    let segs = &row.segments;
    let depth_end = |i: usize| row.position_ids[segs[i].start] as f64 + segs[i].len as f64;
    let max_depth = (0..segs.len()).map(depth_end).fold(1.0, f64::max);
    let left = 6.0;
    let scale = (WIDTH * BOX_SHARE - left) / max_depth;
    let lines = tree_lines(row);
    let height = LINE_H * lines.len() as f64 + 6.0;
    let trained = trained_per_segment(row);
    let mut line_of = vec![None; segs.len()];
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">"
    );
    for (l, line) in lines.iter().enumerate() {
        let y = 4.0 + l as f64 * LINE_H;
        let parent = match line {
            Line::Segment(i) => segs[*i].parent,
            Line::More { parent, .. } => *parent,
        };
        let x = parent.map_or(left, |p| left + depth_end(p) * scale);
        if let Some(p) = parent.and_then(|p| line_of[p].map(|pl: usize| (p, pl))) {
            let py = 4.0 + p.1 as f64 * LINE_H + BOX_H;
            let mid = y + BOX_H / 2.0;
            svg.push_str(&format!(
                "<path d=\"M{x:.1},{py:.1} L{x:.1},{mid:.1} L{:.1},{mid:.1}\" fill=\"none\" stroke=\"currentColor\" stroke-opacity=\"0.45\"/>",
                x + 2.0
            ));
        }
        match line {
            Line::Segment(i) => {
                line_of[*i] = Some(l);
                svg.push_str(&segment_box(row, *i, (x, y), scale, trained[*i], &segment_text[*i]));
            }
            Line::More { segments, .. } => svg.push_str(&format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"currentColor\" fill-opacity=\"0.7\" font-style=\"italic\">+{segments} more segment{}</text>",
                x + 6.0,
                y + 12.0,
                if *segments == 1 { "" } else { "s" }
            )),
        }
    }
    svg.push_str("</svg>");
    svg
}

fn segment_box(row: &PackedRow, i: usize, (x, y): (f64, f64), scale: f64, trained: usize, text: &str) -> String {
    let s = &row.segments[i];
    let w = (s.len as f64 * scale).max(3.0);
    let color = if s.rollouts > 1 { SHARED } else { OWN };
    let mut out = format!(
        "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{BOX_H}\" rx=\"2\" fill=\"{color}\" fill-opacity=\"0.35\" stroke=\"{color}\"><title>segment {i}: {} tokens, {} rollouts, path {}</title></rect>",
        s.len, s.rollouts, s.path_len
    );
    if trained > 0 {
        let tw = w * trained as f64 / s.len as f64;
        out.push_str(&format!(
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{tw:.1}\" height=\"3\" fill=\"{TRAINED}\"/>",
            x + w - tw,
            y + BOX_H - 3.0
        ));
    }
    let label_x = x + w + 5.0;
    let room = ((WIDTH - 4.0 - label_x) / CHAR_PX).max(0.0) as usize;
    let label = fit(&format!("[{i}] {} tok ×{} · {text}", s.len, s.rollouts), room);
    out.push_str(&format!(
        "<text x=\"{label_x:.1}\" y=\"{:.1}\" fill=\"currentColor\">{}</text>",
        y + 12.0,
        escape(&label)
    ));
    out
}

/// The row as one strip of tokens at `px_per_token`: blue where a token is forwarded once for
/// several rollouts, orange where it serves one, a green tick under positions that are trained.
pub(crate) fn strip_svg(row: &PackedRow, px_per_token: f64) -> String {
    let width = (row.len() as f64 * px_per_token).max(1.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0}\" height=\"24\">",
        width + 2.0
    );
    for (i, s) in row.segments.iter().enumerate() {
        let color = if s.rollouts > 1 { SHARED } else { OWN };
        svg.push_str(&format!(
            "<rect x=\"{:.2}\" y=\"2\" width=\"{:.2}\" height=\"14\" fill=\"{color}\" fill-opacity=\"0.45\" stroke=\"{color}\" stroke-width=\"0.5\"><title>segment {i}: {} tokens</title></rect>",
            1.0 + s.start as f64 * px_per_token,
            s.len as f64 * px_per_token,
            s.len
        ));
    }
    for (p, &label) in row.shift_labels.iter().enumerate() {
        if label != -100 {
            svg.push_str(&format!(
                "<rect x=\"{:.2}\" y=\"18\" width=\"{:.2}\" height=\"4\" fill=\"{TRAINED}\"/>",
                1.0 + p as f64 * px_per_token,
                px_per_token.max(0.5)
            ));
        }
    }
    svg.push_str("</svg>");
    svg
}

/// Largest row whose attention mask is drawn cell by cell.
pub(crate) const MASK_MAX: usize = 160;

/// The attention mask as SVG (query rows, key columns, packed positions on both axes), for rows
/// of at most [`MASK_MAX`] tokens.
pub(crate) fn mask_svg(row: &PackedRow) -> Option<String> {
    let n = row.len();
    if n == 0 || n > MASK_MAX {
        return None;
    }
    let (_, leave) = row.intervals();
    let cell = (360.0 / n as f64).clamp(2.0, 16.0);
    let side = cell * n as f64;
    let (ox, oy) = (44.0, 34.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0}\" height=\"{:.0}\" font-family=\"sans-serif\" font-size=\"11\">",
        ox + side + 8.0,
        oy + side + 8.0
    );
    svg.push_str(&format!(
        "<text x=\"{ox}\" y=\"11\" fill=\"currentColor\">key (packed position) →</text><text x=\"11\" y=\"{oy}\" fill=\"currentColor\" transform=\"rotate(90 11 {oy})\">query ↓</text>"
    ));
    svg.push_str(&format!(
        "<rect x=\"{ox}\" y=\"{oy}\" width=\"{side:.1}\" height=\"{side:.1}\" fill=\"currentColor\" fill-opacity=\"0.06\"/>"
    ));
    let every = [1usize, 2, 5, 10, 20, 50]
        .into_iter()
        .find(|&k| n / k <= 12)
        .unwrap_or(50);
    for t in (0..n).step_by(every) {
        let c = t as f64 * cell + cell / 2.0;
        svg.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"currentColor\" text-anchor=\"middle\">{t}</text><text x=\"{:.1}\" y=\"{:.1}\" fill=\"currentColor\" text-anchor=\"end\">{t}</text>",
            ox + c,
            oy - 5.0,
            ox - 5.0,
            oy + c + 4.0
        ));
    }
    for q in 0..n {
        for (k, &l) in leave.iter().enumerate().take(q + 1) {
            if (q as i64) < l {
                svg.push_str(&format!(
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{cell:.1}\" height=\"{cell:.1}\" fill=\"{SHARED}\"/>",
                    ox + k as f64 * cell,
                    oy + q as f64 * cell
                ));
            }
        }
    }
    svg.push_str("</svg>");
    Some(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::{PrefixTree, Rollout};

    /// `n` rollouts of a shared 4-token prompt, each with its own 2-token completion.
    fn fan(n: usize) -> PackedRow {
        let mut t = PrefixTree::new();
        for i in 0..n {
            let ids = vec![1, 2, 3, 4, 100 + i as i64, 500 + i as i64];
            t.add(
                Rollout {
                    completion_mask: vec![0, 0, 0, 0, 1, 1],
                    old_log_probs: vec![-0.5; 6],
                    input_ids: ids,
                    advantage: 1.0,
                    group_id: "0".into(),
                },
                i,
            )
            .unwrap();
        }
        t.pack()
    }

    fn accounted(lines: &[Line]) -> usize {
        lines
            .iter()
            .map(|l| match l {
                Line::Segment(_) => 1,
                Line::More { segments, .. } => *segments,
            })
            .sum()
    }

    #[test]
    fn wide_groups_collapse_into_a_more_line() {
        let row = fan(20);
        let lines = tree_lines(&row);
        let drawn = lines.iter().filter(|l| matches!(l, Line::Segment(_))).count();
        assert_eq!(drawn, MAX_CHILDREN, "the shared prompt and the first five children");
        assert!(
            matches!(
                lines.last(),
                Some(Line::More {
                    parent: Some(_),
                    segments: 15
                })
            ),
            "{lines:?}"
        );
        assert_eq!(accounted(&lines), row.segments.len());
        let svg = tree_svg(&row, &vec![String::new(); row.segments.len()]);
        assert!(svg.contains("+15 more segments"));
        assert_eq!(svg.matches("<title>segment").count(), MAX_CHILDREN);
    }

    #[test]
    fn big_trees_stop_at_the_line_limit_and_count_the_rest() {
        // Forks at every depth: many lines, no node with more than two children.
        let mut t = PrefixTree::new();
        for i in 0..60i64 {
            let ids: Vec<i64> = (0..8).map(|d| 1 + ((i >> d) & 1) + 2 * d).collect();
            let n = ids.len();
            t.add(
                Rollout {
                    completion_mask: (0..n).map(|p| u8::from(p > 0)).collect(),
                    old_log_probs: vec![-0.5; n],
                    input_ids: ids,
                    advantage: 1.0,
                    group_id: "0".into(),
                },
                i as usize,
            )
            .unwrap();
        }
        let row = t.pack();
        assert!(row.segments.len() > MAX_LINES, "{} segments", row.segments.len());
        let lines = tree_lines(&row);
        assert_eq!(lines.len(), MAX_LINES);
        assert!(matches!(lines.last(), Some(Line::More { parent: None, .. })));
        assert_eq!(accounted(&lines), row.segments.len());
    }

    #[test]
    fn labels_are_cut_to_fit_with_an_ellipsis() {
        assert_eq!(fit("a\nb", 10), "a⏎b");
        assert_eq!(fit("abcdefghij", 5), "abcd…");
        let row = fan(2);
        let long = "x".repeat(500);
        let svg = tree_svg(&row, &vec![long; row.segments.len()]);
        for label in svg.split("<text").skip(1) {
            let x: f64 = label
                .split("x=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            let text = label.split('>').nth(1).unwrap().split('<').next().unwrap();
            assert!(
                x + text.chars().count() as f64 * CHAR_PX <= WIDTH,
                "label past the edge at x={x}"
            );
        }
    }
}
