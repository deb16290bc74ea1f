use super::ledger::ShapeLedger;
use crate::display::{self, Rich, escape};

/// Ledgers of runs that differ in one setting (say `pad_to_multiple_of` none vs auto), side by
/// side: per graph, the distinct shapes (= compiles on Neuron) each run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerComparison {
    /// `(label, ledger)` per run, in column order.
    pub runs: Vec<(String, ShapeLedger)>,
}

impl LedgerComparison {
    /// The comparison of `runs`.
    pub fn new(runs: impl IntoIterator<Item = (impl Into<String>, ShapeLedger)>) -> Self {
        LedgerComparison {
            runs: runs.into_iter().map(|(l, g)| (l.into(), g)).collect(),
        }
    }

    /// Every graph any run called, in name order.
    fn graph_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .runs
            .iter()
            .flat_map(|(_, l)| l.graphs().map(|(n, _)| n.to_string()))
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// `distinct shapes / calls` of `graph` in each run.
    fn cells(&self, graph: &str) -> Vec<String> {
        self.runs
            .iter()
            .map(|(_, l)| match l.graph(graph) {
                Some(g) => format!("{} / {} calls", plural(g.shapes.len(), "shape"), g.calls),
                None => "not called".into(),
            })
            .collect()
    }
}

fn plural(n: usize, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

impl Rich for LedgerComparison {
    fn html(&self) -> String {
        let mut headers = vec!["graph".to_string()];
        headers.extend(self.runs.iter().map(|(label, _)| label.clone()));
        let mut rows: Vec<Vec<String>> = self
            .graph_names()
            .iter()
            .map(|g| {
                std::iter::once(escape(g))
                    .chain(self.cells(g).iter().map(|c| escape(c)))
                    .collect()
            })
            .collect();
        rows.push(
            std::iter::once("Neuron compile time".to_string())
                .chain(
                    self.runs
                        .iter()
                        .map(|(_, l)| format!("{:.0} min", l.predicted_compile_seconds() / 60.0)),
                )
                .collect(),
        );
        let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
        display::style::container(&display::section(
            "Measured shapes per graph",
            &display::table(&headers, &rows),
        ))
    }

    fn text(&self) -> String {
        let mut s = String::from("Measured shapes per graph\n");
        for g in self.graph_names() {
            let cells: Vec<String> = self
                .runs
                .iter()
                .zip(self.cells(&g))
                .map(|((label, _), c)| format!("{label}: {c}"))
                .collect();
            s.push_str(&format!("  {g}: {}\n", cells.join("; ")));
        }
        s
    }
}

crate::display::rich_display!(LedgerComparison);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graphs_line_up_across_runs() {
        let mut a = ShapeLedger::new(60.0);
        a.record("sft/forward", &[4, 100]);
        a.record("sft/forward", &[4, 101]);
        let mut b = ShapeLedger::new(60.0);
        b.record("sft/forward", &[4, 128]);
        b.record("sft/forward", &[4, 128]);
        b.record("decode", &[4, 1]);
        let c = LedgerComparison::new([("no padding", a), ("auto", b)]);
        let text = c.text();
        assert!(
            text.contains("sft/forward: no padding: 2 shapes / 2 calls; auto: 1 shape / 2 calls"),
            "{text}"
        );
        assert!(
            text.contains("decode: no padding: not called; auto: 1 shape / 1 calls"),
            "{text}"
        );
        let html = c.html();
        assert!(
            html.contains("<th>no padding</th>") && html.contains("Neuron compile time"),
            "{html}"
        );
    }
}
