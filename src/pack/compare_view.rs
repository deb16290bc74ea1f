//! The same rollouts packed as a prefix tree and flat, side by side at one scale.

use super::draw::{self, OWN, SHARED, TRAINED};
use super::error::PackError;
use super::rollout::Rollout;
use super::row::PackedRow;
use super::sequence::pack_flat;
use super::tree::pack_tree;
use crate::display::{self, Rich, escape};

/// Tree and flat packings of the same rollouts (from [`PackComparison::new`]).
#[derive(Debug, Clone)]
pub struct PackComparison {
    /// The prefix-tree row.
    pub tree: PackedRow,
    /// The flat row (rollouts end to end).
    pub flat: PackedRow,
}

/// The longer strip is drawn this wide.
const STRIP_PX: f64 = 900.0;

impl PackComparison {
    /// Packs `rollouts` both ways; errors name the rollout that is malformed.
    pub fn new(rollouts: &[Rollout]) -> Result<Self, PackError> {
        Ok(PackComparison {
            tree: pack_tree(rollouts)?,
            flat: pack_flat(rollouts)?,
        })
    }

    fn rows(&self) -> [(&'static str, &PackedRow); 2] {
        [("prefix tree", &self.tree), ("flat", &self.flat)]
    }

    fn facts(row: &PackedRow) -> Vec<(&'static str, String)> {
        vec![
            ("tokens forwarded", row.len().to_string()),
            ("segments", row.segments.len().to_string()),
            ("attention pairs", row.attention_pairs().to_string()),
            ("loss terms", row.token_index.len().to_string()),
        ]
    }
}

impl Rich for PackComparison {
    fn html(&self) -> String {
        let px = STRIP_PX / self.flat.len().max(self.tree.len()).max(1) as f64;
        let mut body = display::section(
            &format!(
                "{} rollouts: the tree forwards {} of {} tokens ({:.2}x fewer), {:.2}x fewer attention pairs",
                self.tree.rollouts,
                self.tree.len(),
                self.flat.len(),
                self.tree.packing_ratio(),
                self.flat.attention_pairs() as f64 / self.tree.attention_pairs().max(1) as f64
            ),
            &display::style::legend(&[
                (SHARED, "forwarded once for several rollouts"),
                (OWN, "serves one rollout"),
                (TRAINED, "trained positions"),
            ]),
        );
        for (name, row) in self.rows() {
            body.push_str(&format!("<div><b>{}</b>: {} tokens</div>", escape(name), row.len()));
            body.push_str(&draw::strip_svg(row, px));
        }
        let cards: Vec<String> = self
            .rows()
            .iter()
            .map(|(name, row)| {
                let facts: Vec<(&str, String)> = Self::facts(row).into_iter().map(|(k, v)| (k, escape(&v))).collect();
                let mask = draw::mask_svg(row).unwrap_or_default();
                format!(
                    "<div>{}{mask}</div>",
                    display::section(name, &display::kv_table(&facts))
                )
            })
            .collect();
        body.push_str(&display::style::row(&cards));
        display::style::container(&body)
    }

    fn text(&self) -> String {
        let mut s = String::new();
        for (name, row) in self.rows() {
            let facts: Vec<String> = Self::facts(row).iter().map(|(k, v)| format!("{k} {v}")).collect();
            s.push_str(&format!("{name:>12}: {}\n", facts.join(", ")));
        }
        s
    }
}

crate::display::rich_display!(PackComparison);

#[cfg(test)]
mod tests {
    use super::*;

    fn rollout(ids: &[i64]) -> Rollout {
        Rollout {
            input_ids: ids.to_vec(),
            completion_mask: (0..ids.len()).map(|p| u8::from(p >= 3)).collect(),
            old_log_probs: vec![-0.5; ids.len()],
            advantage: 1.0,
            group_id: "0".into(),
        }
    }

    #[test]
    fn both_packings_of_the_same_rollouts_side_by_side() {
        let rollouts = [rollout(&[1, 2, 3, 4, 5]), rollout(&[1, 2, 3, 6, 7])];
        let cmp = PackComparison::new(&rollouts).unwrap();
        assert_eq!(cmp.flat.len(), 10);
        assert!(cmp.tree.len() < cmp.flat.len());
        assert_eq!(
            cmp.tree.token_index.len(),
            cmp.flat.token_index.len(),
            "same loss terms"
        );
        let html = cmp.html();
        assert_eq!(html.matches("<svg").count(), 4, "two strips and two masks");
        assert!(html.contains("the tree forwards") && html.contains(&format!("of {} tokens", cmp.flat.len())));
        let bad = Rollout {
            completion_mask: vec![1],
            ..rollout(&[1, 2])
        };
        assert!(PackComparison::new(&[bad]).is_err());
    }
}
