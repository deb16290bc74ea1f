//! Displays of what a GRPO step and an evaluation produce: evaluation results, update
//! statistics, step metrics and their groups, prompt sets and reward functions.

use super::super::GrpoStepMetrics;
use crate::display::{self, Rich, escape, prompt_tail};

impl Rich for super::super::EvalResult {
    fn html(&self) -> String {
        let mut rows = vec![
            ("step", self.step.to_string()),
            ("completions", self.completions.to_string()),
            ("reward", format!("{:.3} ± {:.3}", self.reward_mean, self.reward_std)),
        ];
        let per: Vec<(String, String)> = self
            .per_function
            .iter()
            .map(|r| (r.name.clone(), format!("{:.3} ± {:.3}", r.mean, r.std)))
            .collect();
        rows.extend(per.iter().map(|(k, v)| (k.as_str(), v.clone())));
        let rows: Vec<(&str, String)> = rows.into_iter().map(|(k, v)| (k, escape(&v))).collect();
        display::style::container(&display::section("Evaluation", &display::kv_table(&rows)))
    }

    fn text(&self) -> String {
        let per: Vec<String> = self
            .per_function
            .iter()
            .map(|r| format!("{} {:.3}", r.name, r.mean))
            .collect();
        format!(
            "eval at step {}: reward {:.3} ± {:.3} over {} completions ({})\n",
            self.step,
            self.reward_mean,
            self.reward_std,
            self.completions,
            per.join(", ")
        )
    }
}

crate::display::rich_display!(super::super::EvalResult);

impl super::super::EvalBreakdown {
    fn header(&self) -> Vec<String> {
        let mut h = vec![self.column.clone(), "completions".into(), "reward".into()];
        if let Some((_, e)) = self.parts.first() {
            h.extend(e.per_function.iter().map(|r| r.name.clone()));
        }
        h
    }

    fn cells(&self) -> Vec<Vec<String>> {
        self.parts
            .iter()
            .map(|(value, e)| {
                let mut row = vec![
                    value.clone(),
                    e.completions.to_string(),
                    format!("{:.3}", e.reward_mean),
                ];
                row.extend(e.per_function.iter().map(|r| format!("{:.3}", r.mean)));
                row
            })
            .collect()
    }
}

impl Rich for super::super::EvalBreakdown {
    fn html(&self) -> String {
        let header = self.header();
        let headers: Vec<&str> = header.iter().map(String::as_str).collect();
        let rows: Vec<Vec<String>> = self
            .cells()
            .into_iter()
            .map(|r| r.iter().map(|c| escape(c)).collect())
            .collect();
        let step = self.parts.first().map_or(0, |(_, e)| e.step);
        let title = format!("Evaluation by {} at step {step}", self.column);
        display::style::container(&display::section(&title, &display::table(&headers, &rows)))
    }

    fn text(&self) -> String {
        let mut out = self.header().join("\t") + "\n";
        for row in self.cells() {
            out.push_str(&row.join("\t"));
            out.push('\n');
        }
        out
    }
}

crate::display::rich_display!(super::super::EvalBreakdown);

impl Rich for super::super::UpdateStats {
    fn html(&self) -> String {
        let rows = [
            ("loss", format!("{:.6}", self.loss)),
            ("loss terms", self.terms.to_string()),
            ("rows", self.rows.to_string()),
            (
                "tokens forwarded / raw",
                format!(
                    "{} / {} ({:.2}x)",
                    self.forwarded_tokens,
                    self.raw_tokens,
                    self.packing_ratio()
                ),
            ),
            (
                "clip ratio (low, high)",
                format!(
                    "{:.4} ({:.4}, {:.4})",
                    self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high
                ),
            ),
            (
                "approx KL / KL to reference",
                format!("{:.2e} / {:.2e}", self.approx_kl, self.ref_kl),
            ),
            ("entropy", format!("{:.4}", self.entropy)),
            ("forward + backward", format!("{:.1} ms", self.forward_backward_s * 1e3)),
        ];
        let rows: Vec<(&str, String)> = rows.into_iter().map(|(k, v)| (k, escape(&v))).collect();
        display::style::container(&display::section("Policy update", &display::kv_table(&rows)))
    }

    fn text(&self) -> String {
        format!(
            "update: loss {:.6}, {} terms in {} rows, {} of {} tokens forwarded ({:.2}x), {:.1} ms\n",
            self.loss,
            self.terms,
            self.rows,
            self.forwarded_tokens,
            self.raw_tokens,
            self.packing_ratio(),
            self.forward_backward_s * 1e3
        )
    }
}

crate::display::rich_display!(super::super::UpdateStats);

impl Rich for GrpoStepMetrics {
    fn html(&self) -> String {
        let rows = display::fields(self);
        let rows: Vec<(&str, String)> = rows.iter().map(|(k, v)| (k.as_str(), escape(v))).collect();
        display::style::container(&display::section(
            &format!("GRPO step {}", self.step),
            &display::kv_table(&rows),
        ))
    }

    fn text(&self) -> String {
        format!(
            "step {}: reward {:.3} ± {:.3}, completion {:.1} tokens, loss {:+.4}, clip {:.3}, approx KL {:.1e}, entropy {:.2}, packing {:.2}x, staleness {}, {:.2} s\n",
            self.step,
            self.rollouts.reward_mean,
            self.rollouts.reward_std,
            self.rollouts.completion_length,
            self.update.loss,
            self.update.clip_ratio,
            self.update.approx_kl,
            self.update.entropy,
            self.update.packing_ratio,
            self.origin.staleness,
            self.times.step_s
        )
    }
}

crate::display::rich_display!(GrpoStepMetrics);

/// Each group of a [`GrpoStepMetrics`] renders as the metrics it holds, under their
/// `log.jsonl` names (a notebook cell may end with `m.update`).
macro_rules! metrics_group_display {
    ($($group:ident => $title:literal),* $(,)?) => {$(
        impl Rich for super::super::$group {
            fn html(&self) -> String {
                display::config_html($title, self)
            }

            fn text(&self) -> String {
                display::config_text(self)
            }
        }

        crate::display::rich_display!(super::super::$group);
    )*};
}

metrics_group_display!(
    BatchOrigin => "Batch origin",
    RolloutMetrics => "Rollout metrics",
    UpdateMetrics => "Update metrics",
    StepTimes => "Step times",
    TurnDrift => "Multi-turn drift",
);

impl Rich for super::super::PromptSet {
    fn html(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .prompts
            .iter()
            .take(8)
            .map(|p| {
                vec![
                    p.dataset_row.to_string(),
                    p.ids.len().to_string(),
                    format!("<code>{}</code>", escape(&prompt_tail(&p.text, 100))),
                ]
            })
            .collect();
        display::style::container(&display::section(
            &format!("{} prompts ({} skipped); the first 8", self.prompts.len(), self.skipped),
            &display::table(&["row", "tokens", "prompt (end)"], &rows),
        ))
    }

    fn text(&self) -> String {
        let longest = self.prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
        format!(
            "{} prompts ({} skipped), longest {longest} tokens\n",
            self.prompts.len(),
            self.skipped
        )
    }
}

crate::display::rich_display!(super::super::PromptSet);

impl Rich for super::super::RewardFn {
    fn html(&self) -> String {
        display::style::container(&display::kv_table(&[
            ("reward", escape(&self.name)),
            ("weight", format!("{}", self.weight)),
        ]))
    }

    fn text(&self) -> String {
        format!("reward {} x {}\n", self.name, self.weight)
    }
}

crate::display::rich_display!(super::super::RewardFn);
