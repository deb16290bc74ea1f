//! One segment of a packed row token by token: what each position holds, what it predicts, and
//! whether that prediction is trained.

use super::row::PackedRow;
use crate::display::{self, Rich, escape};

/// One packed position of a [`SegmentTokens`] view.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenRow {
    /// Index in the packed row.
    pub packed: usize,
    /// Position id (depth in every rollout through it).
    pub position: i64,
    /// Token id at this position.
    pub id: i64,
    /// Its text (the id when no tokenizer was given).
    pub text: String,
    /// The token this position predicts where a rollout trains it: id and text.
    pub label: Option<(i64, String)>,
    /// The generator's log-prob of that label (the first loss term that uses it).
    pub old_log_prob: Option<f32>,
}

/// A segment of a packed row, token by token (from [`super::TreeView::tokens`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentTokens {
    /// Segment index in the row.
    pub segment: usize,
    /// Rollouts through the segment.
    pub rollouts: usize,
    /// Its positions in order.
    pub rows: Vec<TokenRow>,
}

impl SegmentTokens {
    /// Segment `segment` of `row`; `token_text` holds one string per packed position.
    pub(super) fn new(row: &PackedRow, segment: usize, token_text: &[String]) -> Option<Self> {
        let seg = row.segments.get(segment)?;
        let mut first_term = vec![None; row.len()];
        for (term, &p) in row.token_index.iter().enumerate().rev() {
            first_term[p as usize] = Some(term);
        }
        // A label is the next token of some rollout: at a fork it sits in a child segment.
        let mut position_of: std::collections::HashMap<i64, usize> = Default::default();
        for (p, &id) in row.input_ids.iter().enumerate().rev() {
            position_of.insert(id, p);
        }
        let text_of = |id: i64| position_of.get(&id).map_or(id.to_string(), |&p| token_text[p].clone());
        let rows = (seg.start..seg.start + seg.len)
            .map(|p| {
                let label = row.shift_labels[p];
                TokenRow {
                    packed: p,
                    position: row.position_ids[p],
                    id: row.input_ids[p],
                    text: token_text[p].clone(),
                    label: (label != -100).then(|| (label, text_of(label))),
                    old_log_prob: first_term[p].map(|t| row.old_log_probs[t]),
                }
            })
            .collect();
        Some(SegmentTokens {
            segment,
            rollouts: seg.rollouts,
            rows,
        })
    }

    fn title(&self) -> String {
        let trained = self.rows.iter().filter(|r| r.label.is_some()).count();
        format!(
            "Segment {}: {} tokens, {} rollout{}, {trained} trained positions",
            self.segment,
            self.rows.len(),
            self.rollouts,
            if self.rollouts == 1 { "" } else { "s" }
        )
    }

    /// The segment's text with trained positions highlighted, token by token.
    fn strip_html(&self) -> String {
        self.rows
            .iter()
            .map(|r| {
                let title = format!("position {} · id {}", r.position, r.id);
                display::style::token_span(&r.text, &title, r.label.is_some())
            })
            .collect()
    }
}

impl Rich for SegmentTokens {
    fn html(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .rows
            .iter()
            .map(|r| {
                let (label, trained) = match &r.label {
                    Some((id, text)) => (format!("{id} <code>{}</code>", escape(text)), "yes"),
                    None => ("-".into(), "no"),
                };
                vec![
                    r.packed.to_string(),
                    r.position.to_string(),
                    r.id.to_string(),
                    format!("<code>{}</code>", escape(&r.text.replace('\n', "⏎"))),
                    label,
                    trained.into(),
                    r.old_log_prob.map_or("-".into(), |lp| format!("{lp:.3}")),
                ]
            })
            .collect();
        let legend = display::style::token_legend("predicts a trained token", "context only");
        display::style::container(&format!(
            "{}{}<p>{}</p>{}",
            display::section(&self.title(), ""),
            legend,
            self.strip_html(),
            display::table(
                &[
                    "packed",
                    "position",
                    "id",
                    "text",
                    "predicts",
                    "trained",
                    "generator log-prob"
                ],
                &rows
            )
        ))
    }

    fn text(&self) -> String {
        let mut s = format!("{}\n", self.title());
        for r in &self.rows {
            let label = r
                .label
                .as_ref()
                .map_or("-".into(), |(id, t)| format!("{id} '{}'", t.replace('\n', "⏎")));
            let lp = r.old_log_prob.map_or("-".into(), |lp| format!("{lp:.3}"));
            s.push_str(&format!(
                "{:>6} pos {:>5} id {:>7} {:<16} -> {label} (log-prob {lp})\n",
                r.packed,
                r.position,
                r.id,
                format!("'{}'", r.text.replace('\n', "⏎"))
            ));
        }
        s
    }
}

crate::display::rich_display!(SegmentTokens);
