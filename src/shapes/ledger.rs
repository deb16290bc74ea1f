use std::collections::BTreeMap;

use crate::display::{self, Rich, escape};

/// Distinct shapes seen by one named graph (`forward`, `prefill`, `decode`, ...).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GraphShapes {
    /// Calls per distinct shape.
    pub shapes: BTreeMap<Vec<i64>, u64>,
    /// Total calls.
    pub calls: u64,
    /// The call index (0-based) at which each new shape first appeared, in order.
    pub first_seen: Vec<u64>,
}

/// Records every distinct input shape per named graph and prices them as Neuron compiles.
#[derive(Debug, Clone, PartialEq)]
pub struct ShapeLedger {
    /// Seconds one compile costs (default 60, the order TRL v1.16 reports for Trainium2).
    pub seconds_per_compile: f64,
    graphs: BTreeMap<String, GraphShapes>,
}

impl Default for ShapeLedger {
    fn default() -> Self {
        Self::new(60.0)
    }
}

impl ShapeLedger {
    /// An empty ledger pricing each compile at `seconds_per_compile`.
    pub fn new(seconds_per_compile: f64) -> Self {
        Self {
            seconds_per_compile,
            graphs: BTreeMap::new(),
        }
    }

    /// Records one call of `graph` with input `shape`; returns true when the shape is new
    /// (a compile on Neuron).
    pub fn record(&mut self, graph: &str, shape: &[i64]) -> bool {
        let g = self.graphs.entry(graph.to_string()).or_default();
        let call = g.calls;
        g.calls += 1;
        let count = g.shapes.entry(shape.to_vec()).or_insert(0);
        *count += 1;
        let new = *count == 1;
        if new {
            g.first_seen.push(call);
        }
        new
    }

    /// One graph's record, if it was ever called.
    pub fn graph(&self, name: &str) -> Option<&GraphShapes> {
        self.graphs.get(name)
    }

    /// All graphs by name.
    pub fn graphs(&self) -> impl Iterator<Item = (&str, &GraphShapes)> {
        self.graphs.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Distinct shapes of one graph (0 if never called).
    pub fn distinct(&self, graph: &str) -> usize {
        self.graphs.get(graph).map_or(0, |g| g.shapes.len())
    }

    /// Distinct shapes over all graphs = compiles a Neuron run would pay.
    pub fn total_distinct(&self) -> usize {
        self.graphs.values().map(|g| g.shapes.len()).sum()
    }

    /// Calls over all graphs.
    pub(crate) fn total_calls(&self) -> u64 {
        self.graphs.values().map(|g| g.calls).sum()
    }

    /// Predicted compile time on Neuron, seconds.
    pub(crate) fn predicted_compile_seconds(&self) -> f64 {
        self.total_distinct() as f64 * self.seconds_per_compile
    }

    /// `(call, distinct shapes so far)` after every call of `graph`: the compile curve.
    pub(crate) fn compile_curve(&self, graph: &str) -> Vec<(u64, usize)> {
        let Some(g) = self.graphs.get(graph) else {
            return Vec::new();
        };
        let mut curve = Vec::with_capacity(g.calls as usize);
        let mut seen = 0;
        for call in 0..g.calls {
            if g.first_seen.get(seen) == Some(&call) {
                seen += 1;
            }
            curve.push((call, seen));
        }
        curve
    }

    /// Forgets everything (the compile price stays).
    pub fn clear(&mut self) {
        self.graphs.clear();
    }
}

fn shape_str(shape: &[i64]) -> String {
    let dims: Vec<String> = shape.iter().map(i64::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// Shapes listed per graph beyond which renderers summarise.
const LISTED: usize = 12;

impl Rich for ShapeLedger {
    fn html(&self) -> String {
        let mut rows = Vec::new();
        for (name, g) in &self.graphs {
            let mut by_calls: Vec<_> = g.shapes.iter().collect();
            by_calls.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            let listed: Vec<String> = by_calls
                .iter()
                .take(LISTED)
                .map(|(s, c)| format!("<code>{}</code>&times;{c}", escape(&shape_str(s))))
                .collect();
            let more = g.shapes.len().saturating_sub(LISTED);
            let tail = if more > 0 {
                format!(" <span class=\"muted\">+{more} more</span>")
            } else {
                String::new()
            };
            rows.push(vec![
                escape(name),
                g.calls.to_string(),
                g.shapes.len().to_string(),
                format!("{:.0}", g.shapes.len() as f64 * self.seconds_per_compile),
                format!("{}{tail}", listed.join(" ")),
            ]);
        }
        let summary = format!(
            "<p>{} distinct shapes over {} calls &rarr; about <b>{:.1} min</b> of Neuron compiles at {:.0} s each.</p>",
            self.total_distinct(),
            self.total_calls(),
            self.predicted_compile_seconds() / 60.0,
            self.seconds_per_compile
        );
        display::style::container(&display::section(
            "Shape ledger",
            &format!(
                "{summary}{}",
                display::table(
                    &["graph", "calls", "distinct shapes", "compile s", "shapes (calls)"],
                    &rows
                )
            ),
        ))
    }

    fn text(&self) -> String {
        let mut s = format!(
            "Shape ledger: {} distinct shapes over {} calls, ~{:.1} min of Neuron compiles at {:.0} s each\n",
            self.total_distinct(),
            self.total_calls(),
            self.predicted_compile_seconds() / 60.0,
            self.seconds_per_compile
        );
        for (name, g) in &self.graphs {
            s.push_str(&format!(
                "  {name}: {} calls, {} distinct shapes\n",
                g.calls,
                g.shapes.len()
            ));
        }
        s
    }
}

crate::display::rich_display!(ShapeLedger);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_distinct_shapes_per_graph() {
        let mut l = ShapeLedger::new(60.0);
        assert!(l.record("forward", &[4, 128]));
        assert!(!l.record("forward", &[4, 128]));
        assert!(l.record("forward", &[4, 256]));
        assert!(l.record("decode", &[4, 1]));
        assert!(!l.record("decode", &[4, 1]));
        assert_eq!(l.distinct("forward"), 2);
        assert_eq!(l.distinct("decode"), 1);
        assert_eq!(l.distinct("prefill"), 0);
        assert_eq!(l.total_distinct(), 3);
        assert_eq!(l.total_calls(), 5);
        assert_eq!(l.predicted_compile_seconds(), 180.0);
        assert_eq!(l.compile_curve("forward"), vec![(0, 1), (1, 1), (2, 2)]);
        assert_eq!(l.graph("forward").unwrap().shapes[&vec![4, 128]], 2);
    }

    #[test]
    fn renders_counts_and_escapes_names() {
        let mut l = ShapeLedger::new(30.0);
        l.record("<fwd>", &[2, 8]);
        let html = l.html();
        assert!(html.contains("&lt;fwd&gt;") && !html.contains("<fwd>"));
        assert!(html.contains("[2, 8]"));
        assert!(html.contains("0.5 min"));
        assert!(l.text().contains("1 distinct shapes over 1 calls"));
    }
}
