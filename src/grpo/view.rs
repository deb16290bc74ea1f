//! Notebook displays of a GRPO run: reward curves, the step's time split, sample completions
//! with their rewards, and the prefix tree of the latest micro-batch.

use super::{GrpoState, GrpoStepMetrics, GrpoTrainer};
use crate::display::{self, LineChart, Rich, escape};
use crate::pack::TreeView;

fn fmt_reward(r: Option<f32>) -> String {
    r.map_or("failed".into(), |v| format!("{v:.2}"))
}

/// The last `n` characters of `s`.
fn tail(s: &str, n: usize) -> String {
    let count = s.chars().count();
    s.chars().skip(count.saturating_sub(n)).collect()
}

impl GrpoState {
    fn curve(&self, f: impl Fn(&GrpoStepMetrics) -> f64) -> Vec<(f64, f64)> {
        self.history.iter().map(|m| (m.step as f64, f(m))).collect()
    }

    /// Reward curves: the weighted total and each function.
    pub fn reward_chart(&self) -> LineChart {
        let mut chart =
            LineChart::new("Reward", "step", "mean reward").with_series("total", self.curve(|m| m.reward_mean));
        for (i, name) in self.reward_names.iter().enumerate() {
            chart = chart.with_series(name, self.curve(|m| m.rewards.get(i).map_or(0.0, |r| r.mean)));
        }
        chart
    }

    fn summary_rows(&self) -> Vec<(&'static str, String)> {
        let Some(m) = self.history.last() else {
            return vec![("step", format!("0 / {}", self.total_steps))];
        };
        let per_fn: Vec<String> = m
            .rewards
            .iter()
            .map(|r| format!("{} {:.3}±{:.3}", r.name, r.mean, r.std))
            .collect();
        vec![
            ("step", format!("{} / {}", self.global_step, self.total_steps)),
            (
                "reward",
                format!("{:.3} ± {:.3} ({})", m.reward_mean, m.reward_std, per_fn.join(", ")),
            ),
            (
                "completion length",
                format!(
                    "{:.1} mean, {} max, {:.0}% truncated",
                    m.completion_length,
                    m.completion_length_max,
                    100.0 * m.truncated_ratio
                ),
            ),
            ("loss / grad norm", format!("{:.4} / {:.3}", m.loss, m.grad_norm)),
            (
                "clip ratio / approx KL / entropy",
                format!("{:.3} / {:.2e} / {:.3}", m.clip_ratio, m.approx_kl, m.entropy),
            ),
            ("KL to reference", format!("{:.2e}", m.kl)),
            (
                "update packing",
                format!(
                    "{} rows, {} tokens forwarded of {} ({:.2}x)",
                    m.rows, m.forwarded_tokens, m.raw_tokens, m.packing_ratio
                ),
            ),
            (
                "time split",
                format!(
                    "generate {:.2}s (waited {:.2}s), rewards {:.3}s, pack {:.3}s, forward+backward {:.2}s, optimizer {:.3}s",
                    m.generation_s, m.wait_s, m.reward_s, m.pack_s, m.forward_backward_s, m.optimizer_s
                ),
            ),
            (
                "tokens/s",
                format!(
                    "{:.0} generated, {:.0} trained",
                    m.generation_tokens_per_s, m.training_tokens_per_s
                ),
            ),
            (
                "staleness",
                format!(
                    "{} (batch of v{}); {} dropped, {} forced syncs",
                    m.staleness, m.generated_by, self.dropped_stale, self.forced_syncs
                ),
            ),
            (
                "reward failures / skipped",
                format!(
                    "{} rollouts / {} steps, {} prompts",
                    self.total_failures, self.skipped_steps, self.skipped_prompts
                ),
            ),
        ]
    }

    /// The latest step's sample completions as an HTML table.
    pub fn samples_html(&self) -> String {
        let mut headers = vec!["row", "prompt", "completion"];
        headers.extend(self.reward_names.iter().map(String::as_str));
        headers.extend(["total", "advantage"]);
        let rows: Vec<Vec<String>> = self
            .samples
            .iter()
            .map(|s| {
                let mut row = vec![
                    s.dataset_row.to_string(),
                    format!("<code>{}</code>", escape(&tail(&s.prompt, 60))),
                    format!("<code>{}</code>", escape(&s.completion)),
                ];
                row.extend(s.rewards.iter().map(|&r| fmt_reward(r)));
                row.push(fmt_reward(s.total));
                row.push(format!("{:+.2}", s.advantage));
                row
            })
            .collect();
        display::section("Sample completions (latest step)", &display::table(&headers, &rows))
    }
}

impl Rich for GrpoState {
    fn html(&self) -> String {
        let rows: Vec<(&str, String)> = self.summary_rows().into_iter().map(|(k, v)| (k, escape(&v))).collect();
        let failures: String = if self.recent_failures.is_empty() {
            String::new()
        } else {
            let rows: Vec<Vec<String>> = self
                .recent_failures
                .iter()
                .take(10)
                .map(|f| {
                    vec![
                        escape(&f.function),
                        f.dataset_row.to_string(),
                        f.completion.to_string(),
                        escape(&f.reason),
                    ]
                })
                .collect();
            display::section(
                "Reward failures (latest step; advantage 0)",
                &display::table(&["function", "row", "completion", "reason"], &rows),
            )
        };
        let kl = LineChart::new("Policy", "step", "nats")
            .with_series("entropy", self.curve(|m| m.entropy))
            .with_series("approx KL", self.curve(|m| m.approx_kl))
            .with_series("KL to reference", self.curve(|m| m.kl));
        display::style::container(&format!(
            "{}{}{}{}{}",
            display::section("GRPO", &display::kv_table(&rows)),
            self.reward_chart().to_svg(),
            kl.to_svg(),
            self.samples_html(),
            failures
        ))
    }

    fn text(&self) -> String {
        let mut s = String::new();
        for (k, v) in self.summary_rows() {
            s.push_str(&format!("{k:>34}: {v}\n"));
        }
        for x in self.samples.iter().take(4) {
            s.push_str(&format!(
                "{:>34}: {} -> {}\n",
                format!("row {}", x.dataset_row),
                x.completion.replace('\n', "⏎"),
                fmt_reward(x.total)
            ));
        }
        s
    }
}

crate::rich_display!(GrpoState);

impl Rich for GrpoTrainer {
    fn html(&self) -> String {
        let tree = self
            .last_row
            .as_ref()
            .map(|row| {
                display::section(
                    "Latest micro-batch of the update",
                    &TreeView::new(row, Some(&self.tokenizer)).html(),
                )
            })
            .unwrap_or_default();
        format!("{}{}", self.state.html(), tree)
    }

    fn text(&self) -> String {
        self.state.text()
    }
}

crate::rich_display!(GrpoTrainer);
