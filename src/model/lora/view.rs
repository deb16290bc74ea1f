//! How an adapter shows itself in a notebook: what it wraps, its rank and scale, and how much of
//! the model it trains.

use std::collections::BTreeMap;

use super::adapter::LoraAdapter;
use super::config::TargetModules;
use crate::display::Rich;

impl LoraAdapter {
    /// The wrapped layers grouped by their short name: `q_proj x 2, v_proj x 2`.
    pub(crate) fn targets_summary(&self) -> String {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for m in &self.modules {
            *counts.entry(m.rsplit('.').next().unwrap_or(m)).or_default() += 1;
        }
        let list: Vec<String> = counts.iter().map(|(n, c)| format!("{n} x {c}")).collect();
        format!("{} layers: {}", self.modules.len(), list.join(", "))
    }

    /// One line: rank, what it wraps, what it trains (`r = 16, 28 layers: ...; trains 311.3 K of
    /// 3.67 M (8.48%)`).
    pub fn summary(&self) -> String {
        format!(
            "r = {}, {}; trains {}",
            self.config.r,
            self.targets_summary(),
            self.trainable_summary()
        )
    }

    /// Trainable parameters, and their share of the base model's.
    pub(crate) fn trainable_summary(&self) -> String {
        let n = self.num_parameters();
        format!(
            "{} of {} ({:.2}%)",
            count(n),
            count(self.base_parameters),
            100.0 * n as f64 / self.base_parameters.max(1) as f64
        )
    }

    fn rows(&self) -> Vec<(&'static str, String)> {
        let c = &self.config;
        let scale = match c.use_rslora {
            true => format!("{:.4} (rsLoRA: lora_alpha / sqrt(r))", c.scale()),
            false => format!("{:.4} (lora_alpha / r)", c.scale()),
        };
        let targets = match &c.target_modules {
            TargetModules::AllLinear => "all-linear".to_string(),
            TargetModules::Names(n) => n.join(", "),
        };
        let mut rows = vec![
            ("rank r", c.r.to_string()),
            ("lora_alpha", format!("{}", c.lora_alpha)),
            ("scale", scale),
            ("dropout", format!("{}", c.lora_dropout)),
            ("target_modules", targets),
            ("wraps", self.targets_summary()),
            ("trainable parameters", self.trainable_summary()),
            (
                "state",
                if self.merged {
                    "merged into the base weights"
                } else {
                    "applied beside the base weights"
                }
                .into(),
            ),
        ];
        if !self.saved_modules.is_empty() {
            rows.push(("trained whole (modules_to_save)", self.saved_modules.join(", ")));
        }
        if !self.base_model.is_empty() {
            rows.push(("base model", self.base_model.clone()));
        }
        rows
    }
}

/// `1.23 M`, `45.6 K`, `789`.
fn count(n: i64) -> String {
    match n {
        n if n >= 1_000_000 => format!("{:.2} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

impl Rich for LoraAdapter {
    fn html(&self) -> String {
        crate::display::rows_card("LoRA adapter", &self.rows())
    }

    fn text(&self) -> String {
        crate::display::rows_text(&self.rows())
    }
}

crate::display::rich_display!(LoraAdapter);
