//! Notebook displays of a GRPO run: reward curves, the step's time split, sample completions
//! with their rewards, and the prefix tree of the latest micro-batch.

mod results;

use super::{GrpoState, GrpoStepMetrics, GrpoTrainer};
use crate::display::{self, LineChart, Rich, escape, prompt_tail};
use crate::model::ModelError;
use crate::model::moe::ExpertLoad;
use crate::pack::TreeView;

fn fmt_reward(r: Option<f32>) -> String {
    r.map_or("failed".into(), |v| format!("{v:.2}"))
}

impl GrpoState {
    fn curve(&self, f: impl Fn(&GrpoStepMetrics) -> f64) -> Vec<(f64, f64)> {
        self.history.iter().map(|m| (m.step as f64, f(m))).collect()
    }

    /// Reward curves: the weighted total and each function.
    pub(crate) fn reward_chart(&self) -> LineChart {
        let mut chart = LineChart::new("Reward", "step", "mean reward")
            .with_series("total", self.curve(|m| m.rollouts.reward_mean));
        for (i, name) in self.reward_names.iter().enumerate() {
            chart = chart.with_series(name, self.curve(|m| m.rollouts.rewards.get(i).map_or(0.0, |r| r.mean)));
        }
        chart
    }

    /// The run's charts: reward, the policy's entropy, and KL on its own axis (it is often
    /// 1e-4 of the entropy, invisible on a shared one).
    pub fn charts(&self) -> [LineChart; 3] {
        let entropy = LineChart::new("Entropy", "step", "nats per token")
            .with_series("entropy", self.curve(|m| m.update.entropy));
        let kl = LineChart::new("KL", "step", "nats per token")
            .with_series("approx KL (old policy)", self.curve(|m| m.update.approx_kl))
            .with_series("KL to reference", self.curve(|m| m.update.kl));
        // Three to a row in a notebook's output area (about 1,120 px at a 1,300 px window).
        [self.reward_chart(), entropy, kl].map(|c| c.with_size(356, 250))
    }

    fn summary_rows(&self) -> Vec<(&'static str, String)> {
        let Some(m) = self.history.last() else {
            return vec![("step", format!("0 / {}", self.total_steps))];
        };
        let (r, u, t) = (&m.rollouts, &m.update, &m.times);
        let per_fn: Vec<String> = r
            .rewards
            .iter()
            .map(|r| format!("{} {:.3}±{:.3}", r.name, r.mean, r.std))
            .collect();
        vec![
            ("step", format!("{} / {}", self.global_step, self.total_steps)),
            (
                "reward",
                format!("{:.3} ± {:.3} ({})", r.reward_mean, r.reward_std, per_fn.join(", ")),
            ),
            (
                "groups with equal rewards",
                format!("{:.0}% (no gradient from them)", 100.0 * r.frac_reward_zero_std),
            ),
            (
                "completion length",
                format!(
                    "{:.1} mean, {} min, {} max, {:.0}% truncated",
                    r.completion_length,
                    r.completion_length_min,
                    r.completion_length_max,
                    100.0 * r.truncated_ratio
                ),
            ),
            ("loss / grad norm", format!("{:.4} / {:.3}", u.loss, u.grad_norm)),
            (
                "clip ratio (low, high) / approx KL / entropy",
                format!(
                    "{:.3} ({:.3}, {:.3}) / {:.2e} / {:.3}",
                    u.clip_ratio, u.clip_ratio_low, u.clip_ratio_high, u.approx_kl, u.entropy
                ),
            ),
            ("KL to reference", format!("{:.2e}", u.kl)),
            (
                "update packing",
                format!(
                    "{} rows, {} tokens forwarded of {} ({:.2}x)",
                    u.rows, u.forwarded_tokens, u.raw_tokens, u.packing_ratio
                ),
            ),
            (
                "time split",
                format!(
                    "generate {:.2}s (waited {:.2}s), rewards {:.3}s, pack {:.3}s, forward+backward {:.2}s, optimizer {:.3}s",
                    t.generation_s, t.wait_s, t.reward_s, t.pack_s, t.forward_backward_s, t.optimizer_s
                ),
            ),
            (
                "tokens/s",
                format!(
                    "{:.0} generated, {:.0} trained",
                    t.generation_tokens_per_s, t.training_tokens_per_s
                ),
            ),
            (
                "staleness",
                format!(
                    "{} (batch of v{}); {} dropped, {} forced syncs",
                    m.origin.staleness, m.origin.generated_by, self.dropped_stale, self.forced_syncs
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
    pub(crate) fn samples_html(&self) -> String {
        let mut headers = vec!["row", "prompt", "completion"];
        headers.extend(self.reward_names.iter().map(String::as_str));
        headers.extend(["total", "advantage"]);
        let rows: Vec<Vec<String>> = self
            .samples
            .iter()
            .map(|s| {
                let mut row = vec![
                    s.dataset_row.to_string(),
                    format!("<code>{}</code>", escape(&prompt_tail(&s.prompt, 60))),
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
        display::style::container(&format!(
            "{}{}{}{}",
            display::section("GRPO", &display::kv_table(&rows)),
            display::style::row(&self.charts().map(|c| c.fragment())),
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

crate::display::rich_display!(GrpoState);

impl Rich for GrpoTrainer {
    fn html(&self) -> String {
        // The whole tree of a real step is 100+ segments: the summary here, the tree on request.
        let tree = self
            .latest_tree()
            .map(|view| {
                display::style::container(&display::section(
                    "Latest micro-batch of the update (trainer.latest_tree() draws it)",
                    &view.summary_html(),
                ))
            })
            .unwrap_or_default();
        format!(
            "{}{}{}{}{}",
            self.state.html(),
            card("LoRA", &self.lora_rows()),
            card("Whole weights under full_shard", &self.generation_rows()),
            self.core.logs.html(),
            tree
        )
    }

    fn text(&self) -> String {
        let lora = self
            .lora_rows()
            .iter()
            .chain(&self.generation_rows())
            .map(|(k, v)| format!("{k}: {v}\n"))
            .collect::<String>();
        self.state.text() + &lora + &self.core.logs.text()
    }
}

impl GrpoTrainer {
    /// The last packed row of the latest update with its text: the prefix tree, segment table,
    /// token view (`.tokens(i)`).
    pub fn latest_tree(&self) -> Option<TreeView> {
        self.last_row
            .as_ref()
            .map(|row| TreeView::new(row, Some(self.tokenizer())))
    }

    /// How the last packed row of the latest update routes its tokens (a mixture model),
    /// under the weights after that update: each sparse layer's choices per expert, each
    /// prefix-tree token counted once for every rollout through it. An error before the first
    /// update or for a dense model.
    pub fn expert_load(&self) -> Result<ExpertLoad, ModelError> {
        let Some(row) = self.last_row.as_ref() else {
            return Err(ModelError::Input("expert_load: no update has run yet".into()));
        };
        let model = &self.core.model;
        let weights: Vec<i64> = row.token_rollouts().iter().map(|&w| w as i64).collect();
        let (ids, pos, layout) = row.layout(model.device())?;
        model.expert_load_of((&ids, &pos, &layout), &weights)
    }

    /// The config with the reward functions this trainer runs.
    pub fn settings(&self) -> GrpoSettings {
        GrpoSettings {
            config: self.config().clone(),
            rewards: self.rewards().iter().map(|r| (r.name.clone(), r.weight)).collect(),
        }
    }

    /// With LoRA: what trains, what the KL term compares against, what a weight sync moves.
    fn lora_rows(&self) -> Vec<(&'static str, String)> {
        let Some(adapter) = &self.model().adapter else {
            return Vec::new();
        };
        let mut rows = vec![("adapter", adapter.summary())];
        if self.reference().is_some() {
            rows.push((
                "KL reference",
                "the base with the adapter off: the policy's own weights, none copied".into(),
            ));
        }
        if let Some(a) = self.async_rollouts() {
            rows.push((
                "weight sync to the generator",
                format!(
                    "{:.1} KiB a sync (the adapter alone)",
                    a.published_bytes() as f64 / 1024.0
                ),
            ));
        }
        rows
    }

    /// Under `full_shard`: what generation costs ([`generation_weight_rows`]).
    fn generation_rows(&self) -> Vec<(&'static str, String)> {
        let published = self.async_rollouts().map(|a| a.published_bytes());
        generation_weight_rows(self.core.model.lm.is_sharded(), published)
    }
}

crate::display::rich_display!(GrpoTrainer);

/// A card of `rows` titled `title`; nothing without rows.
fn card(title: &str, rows: &[(&'static str, String)]) -> String {
    match rows.is_empty() {
        true => String::new(),
        false => display::rows_card(title, rows),
    }
}

/// What generation costs a run whose parameters are sharded (`full_shard`; nothing otherwise):
/// the generator reads whole weights, so they are gathered for it. `published`: the bytes an
/// async publish hands the generator thread.
fn generation_weight_rows(sharded: bool, published: Option<usize>) -> Vec<(&'static str, String)> {
    if !sharded {
        return Vec::new();
    }
    let row = match published {
        None => {
            "every rank gathers the whole model for each generation round (one all-gather of it) and frees it after: \
                 the round holds the whole weights while it runs"
                .to_string()
        }
        Some(bytes) => format!(
            "every rank gathers the whole model for each publish (one all-gather of it), and the generator thread keeps \
             its own whole copy ({:.1} MiB a sync); a stale generator is published to at a step's start, all ranks at once",
            bytes as f64 / (1 << 20) as f64
        ),
    };
    vec![("generation", row)]
}

#[cfg(test)]
mod tests {
    use super::generation_weight_rows;

    #[test]
    fn sharded_runs_say_what_generation_costs() {
        assert!(generation_weight_rows(false, Some(10)).is_empty());
        let sync = generation_weight_rows(true, None);
        assert!(sync[0].1.contains("each generation round"), "{sync:?}");
        let published = generation_weight_rows(true, Some(3 << 20));
        assert!(
            published[0].1.contains("own whole copy (3.0 MiB a sync)"),
            "{published:?}"
        );
    }
}

/// A run's settings as it runs: its config with the reward functions the trainer holds (a
/// trainer built with [`super::GrpoTrainerBuilder::rewards`] runs its own list, not the built-ins the config names).
#[derive(Debug, Clone)]
pub struct GrpoSettings {
    /// The configuration.
    pub config: super::GrpoConfig,
    /// `(name, weight)` of every reward function the run calls.
    pub rewards: Vec<(String, f32)>,
}

impl GrpoSettings {
    /// `(field, value, differs from the default)` rows, the rewards as run first.
    fn rows(&self) -> Vec<(String, String, bool)> {
        let defaults: std::collections::HashMap<String, String> =
            display::fields(&super::GrpoConfig::default()).into_iter().collect();
        let rewards: Vec<String> = self.rewards.iter().map(|(n, w)| format!("{n} × {w}")).collect();
        let mut rows = vec![("rewards (as run)".to_string(), rewards.join(", "), true)];
        rows.extend(
            display::fields(&self.config)
                .into_iter()
                .filter(|(k, _)| k != "rewards")
                .map(|(k, v)| {
                    let changed = defaults.get(&k) != Some(&v);
                    (k, v, changed)
                }),
        );
        rows
    }
}

impl Rich for GrpoSettings {
    /// The settings that differ from `GrpoConfig::default()` in a table; the others folded.
    fn html(&self) -> String {
        let rows = self.rows();
        let table = |changed: bool| {
            let rows: Vec<(&str, String)> = rows
                .iter()
                .filter(|r| r.2 == changed)
                .map(|(k, v, _)| (k.as_str(), escape(v)))
                .collect();
            display::kv_table(&rows)
        };
        let defaults = rows.iter().filter(|r| !r.2).count();
        display::style::container(&format!(
            "{}{}",
            display::section("GRPO settings (those set, differing from the defaults)", &table(true)),
            display::style::details(
                &format!("the other {defaults} settings, at their defaults"),
                &table(false),
                false
            )
        ))
    }

    fn text(&self) -> String {
        self.rows().iter().map(|(k, v, _)| format!("{k} = {v}\n")).collect()
    }
}

crate::display::rich_display!(GrpoSettings);

impl Rich for super::GrpoConfig {
    fn html(&self) -> String {
        display::config_html("GRPO config", self)
    }

    fn text(&self) -> String {
        display::config_text(self)
    }
}

crate::display::rich_display!(super::GrpoConfig);

/// Each group of a [`super::GrpoConfig`] renders as the settings it holds, under TRL's names
/// (a notebook cell may end with `config.loss`).
macro_rules! config_group_display {
    ($($group:ident => $title:literal),* $(,)?) => {$(
        impl Rich for super::$group {
            fn html(&self) -> String {
                display::config_html($title, self)
            }

            fn text(&self) -> String {
                display::config_text(self)
            }
        }

        crate::display::rich_display!(super::$group);
    )*};
}

config_group_display!(
    Rollouts => "GRPO rollouts",
    Sampling => "GRPO sampling",
    Loss => "GRPO loss",
    KlReference => "GRPO KL reference",
    EntropyBonus => "GRPO entropy bonus",
    ImportanceCorrection => "GRPO sampling correction",
    Update => "GRPO update",
    MultiTurnLimits => "GRPO multi-turn limits",
    Eval => "GRPO evaluation",
);

impl Rich for super::GrpoTrainerBuilder {
    /// What `build()` will be given: the rewards, environment and checkpoint set so far, then
    /// the config.
    fn html(&self) -> String {
        let rows: Vec<(&str, String)> = self.summary().into_iter().map(|(k, v)| (k, escape(&v))).collect();
        display::style::container(&format!(
            "{}{}",
            display::section("GRPO trainer to build", &display::kv_table(&rows)),
            display::config_html("config", self.config())
        ))
    }

    fn text(&self) -> String {
        let head: String = self.summary().iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
        head + &display::config_text(self.config())
    }
}

crate::display::rich_display!(super::GrpoTrainerBuilder);

/// Rows of a rollout-batch table shown open; the rest sit in a closed block.
const BATCH_ROWS_OPEN: usize = 8;

impl Rich for super::RolloutBatch {
    fn html(&self) -> String {
        let mut headers = vec!["row", "prompt (end)", "completion", "tokens", "finish"];
        headers.extend(self.reward_names.iter().map(String::as_str));
        headers.extend(["total", "advantage"]);
        let rows: Vec<Vec<String>> = self
            .groups
            .iter()
            .flat_map(|g| {
                g.completions.iter().enumerate().map(move |(i, c)| {
                    // The prompt once per group: its first completion's row.
                    let prompt = match i {
                        0 => format!("<code>{}</code>", escape(&prompt_tail(&g.prompt_text, 48))),
                        _ => String::new(),
                    };
                    let mut row = vec![
                        g.dataset_row.to_string(),
                        prompt,
                        format!("<code>{}</code>", escape(&g.texts[i])),
                        c.output_ids.len().to_string(),
                        c.finish_reason.as_str().to_string(),
                    ];
                    row.extend(g.rewards.per_function.iter().map(|f| fmt_reward(f[i])));
                    row.push(fmt_reward(g.rewards.total[i]));
                    row.push(format!("{:+.2}", g.advantages[i]));
                    row
                })
            })
            .collect();
        let (open, rest) = rows.split_at(rows.len().min(BATCH_ROWS_OPEN));
        let mut body = display::section(&self.title(), &display::table(&headers, open));
        if !rest.is_empty() {
            body.push_str(&display::style::details(
                &format!("the other {} completions", rest.len()),
                &display::table(&headers, rest),
                false,
            ));
        }
        display::style::container(&body)
    }

    fn text(&self) -> String {
        let mut s = format!("{}\n", self.title());
        for g in &self.groups {
            let totals: Vec<String> = g.rewards.total.iter().map(|&r| fmt_reward(r)).collect();
            s.push_str(&format!("row {:>5}: rewards [{}]\n", g.dataset_row, totals.join(", ")));
        }
        s
    }
}

impl super::RolloutBatch {
    fn title(&self) -> String {
        let n: usize = self.groups.iter().map(|g| g.completions.len()).sum();
        format!(
            "Rollout batch {} (weights v{}): {} prompts, {n} completions, {} tokens generated in {:.2} s",
            self.index,
            self.version,
            self.groups.len(),
            self.generated_tokens,
            self.generation_s
        )
    }
}

crate::display::rich_display!(super::RolloutBatch);

#[cfg(test)]
mod settings_tests {
    use super::*;

    #[test]
    fn config_groups_and_the_builder_render_their_settings() {
        let mut config = super::super::GrpoConfig::default();
        config.reference.beta = 0.04;
        let reference = &config.reference;
        assert!(
            reference.html().contains("GRPO KL reference") && reference.html().contains("<th>beta</th>"),
            "{}",
            reference.html()
        );
        assert!(reference.text().contains("beta = 0.04\n") && !reference.text().contains("num_generations"));
        assert!(config.loss.text().contains("epsilon_low = 0.2\n") && !config.loss.text().contains("beta"));
        assert!(config.rollouts.text().contains("num_generations = 8\n"));
        let builder = super::super::GrpoTrainer::builder(config)
            .rewards(vec![super::super::RewardFn::exact_answer()])
            .resume("out/checkpoint-4");
        let (html, text) = (builder.html(), builder.text());
        assert!(
            html.contains("GRPO trainer to build") && html.contains("out/checkpoint-4"),
            "{html}"
        );
        assert!(
            text.starts_with("rewards: exact_answer\nenvironment: none (single-turn)\n"),
            "{text}"
        );
        assert!(text.contains("resume from: out/checkpoint-4\n") && text.contains("beta = 0.04\n"));
    }

    #[test]
    fn settings_show_what_was_set_and_fold_the_defaults() {
        let settings = GrpoSettings {
            config: super::super::GrpoConfig {
                max_steps: 3,
                ..Default::default()
            },
            rewards: vec![("exact_answer".into(), 1.0), ("brevity".into(), 0.1)],
        };
        let html = settings.html();
        let (shown, folded) = html.split_once("<details>").expect("defaults folded");
        assert!(shown.contains("exact_answer × 1, brevity × 0.1"), "{shown}");
        assert!(shown.contains("<th>max_steps</th><td>3</td>"), "{shown}");
        assert!(!shown.contains("<th>temperature</th>") && folded.contains("<th>temperature</th>"));
        assert!(settings.text().contains("max_steps = 3\n"));
    }
}
