//! The notebook display of a [`Model`]: its config and its parameter table.

use super::loaded::Model;
use super::save::kind_name;
use crate::display::{self, Rich, escape};

impl Model {
    fn parameter_rows(&self) -> Vec<(String, Vec<i64>, i64)> {
        let mut rows: Vec<(String, Vec<i64>, i64)> = self
            .vs
            .variables()
            .into_iter()
            .map(|(k, t)| (k, t.size(), t.numel() as i64))
            .collect();
        rows.sort_by_key(|r| natural_key(&r.0));
        rows
    }
}

fn natural_key(name: &str) -> Vec<(u64, String)> {
    name.split('.')
        .map(|p| {
            p.parse::<u64>()
                .map_or((u64::MAX, p.to_string()), |n| (n, String::new()))
        })
        .collect()
}

impl Rich for Model {
    fn html(&self) -> String {
        let c = &self.lm.config;
        let cfg_rows = vec![
            (
                "architecture",
                format!("{} ({})", c.arch.name(), escape(&self.hf_config.model_type)),
            ),
            ("parameters", parameters(c)),
            (
                "experts",
                c.mixture.as_ref().map_or("none (dense)".into(), |m| m.describe()),
            ),
            ("dtype", kind_name(self.kind()).to_string()),
            (
                "layers / hidden / intermediate",
                format!("{} / {} / {}", c.num_layers, c.hidden_size, c.intermediate_size),
            ),
            (
                "heads / kv heads / head dim",
                format!("{} / {} / {}", c.num_heads, c.num_kv_heads, c.head_dim),
            ),
            ("vocab", c.vocab_size.to_string()),
            ("RoPE", format!("theta {}, {}", c.rope_theta, c.rope_scaling.describe())),
            ("tied embeddings", c.tie_word_embeddings.to_string()),
            (
                "LoRA adapter",
                self.adapter.as_ref().map_or("none".into(), |a| escape(&a.summary())),
            ),
            (
                "source",
                escape(
                    &self
                        .source
                        .as_ref()
                        .map_or("(in memory)".into(), |p| p.display().to_string()),
                ),
            ),
        ];
        // Layer 0 and, in a mixture, the first layer of the other kind stand for the rest.
        let other_kind = c
            .mixture
            .as_ref()
            .and_then(|m| (1..c.num_layers as usize).find(|&j| m.is_sparse(j) != m.is_sparse(0)));
        let shown: Vec<String> = std::iter::once(0)
            .chain(other_kind)
            .map(|i| format!("model.layers.{i}."))
            .collect();
        let rows: Vec<Vec<String>> = self
            .parameter_rows()
            .into_iter()
            .filter(|(n, _, _)| !n.starts_with("model.layers.") || shown.iter().any(|p| n.starts_with(p)))
            .map(|(n, s, k)| {
                vec![
                    format!("<code>{}</code>", escape(&n)),
                    format!("<code class=\"chip\">{s:?}</code>"),
                    k.to_string(),
                ]
            })
            .collect();
        let note = match (c.num_layers > 1, other_kind) {
            (false, _) => String::new(),
            (true, None) => format!(
                "<p class=\"muted\">model.layers.1 to model.layers.{} have the same parameters as layer 0.</p>",
                c.num_layers - 1
            ),
            (true, Some(j)) => format!(
                "<p class=\"muted\">Every other layer has the parameters of layer 0 or of layer {j}, by its kind (dense or sparse).</p>"
            ),
        };
        display::style::container(&format!(
            "{}{}",
            display::section("Model", &display::kv_table(&cfg_rows)),
            display::section(
                "Parameters",
                &format!("{}{note}", display::table(&["name", "shape", "numel"], &rows))
            )
        ))
    }

    fn text(&self) -> String {
        let c = &self.lm.config;
        let adapter = self
            .adapter
            .as_ref()
            .map_or(String::new(), |a| format!("LoRA adapter: {}\n", a.summary()));
        format!(
            "{} model: {} parameters{}, {}, {} layers, hidden {}, heads {}/{} x {}, vocab {}\n{adapter}",
            c.arch.name(),
            parameters(c),
            c.mixture
                .as_ref()
                .map_or(String::new(), |m| format!(", {}", m.describe())),
            kind_name(self.kind()),
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size
        )
    }
}

/// `3.41 M`, or for a mixture `1.20 M active of 3.41 M`.
fn parameters(c: &super::ModelConfig) -> String {
    let total = c.num_parameters() as f64 / 1e6;
    match c.mixture {
        Some(_) => format!("{:.2} M active of {total:.2} M", c.active_parameters() as f64 / 1e6),
        None => format!("{total:.2} M"),
    }
}

crate::display::rich_display!(Model);
