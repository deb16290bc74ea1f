//! How SFT values show themselves in a notebook (HTML) and a terminal (text).

use super::config::SftConfig;
use super::trainer::{SftEval, SftTrainer, StepMetrics, TrainerState};
use crate::display::{self, LineChart, Rich, escape};

impl Rich for TrainerState {
    fn html(&self) -> String {
        let pts = |f: fn(&StepMetrics) -> f64| -> Vec<(f64, f64)> {
            self.history
                .iter()
                .filter(|m| !m.skipped)
                .map(|m| (m.step as f64, f(m)))
                .collect()
        };
        let mut loss = LineChart::new("Loss", "step", "loss per token").with_series("train", pts(|m| m.loss));
        if !self.eval_history.is_empty() {
            loss = loss.with_series("eval", self.eval_history.iter().map(|&(s, l)| (s as f64, l)).collect());
        }
        let lr = LineChart::new("Learning rate", "step", "lr").with_series("lr", pts(|m| m.lr));
        let last = self.history.last();
        let rows = vec![
            ("step", format!("{} / {}", self.global_step, self.total_steps)),
            ("epoch", format!("{:.2}", last.map_or(0.0, |m| m.epoch))),
            ("loss", last.map_or("-".into(), |m| format!("{:.4}", m.loss))),
            ("grad norm", last.map_or("-".into(), |m| format!("{:.3}", m.grad_norm))),
            (
                "tokens/s",
                last.map_or("-".into(), |m| format!("{:.0}", m.tokens_per_s)),
            ),
            (
                "padding",
                last.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m.padding_fraction)),
            ),
            (
                "skipped steps / rows",
                format!("{} / {}", self.skipped_steps, self.skipped_rows),
            ),
        ];
        let rows: Vec<(&str, String)> = rows.into_iter().map(|(k, v)| (k, escape(&v))).collect();
        display::style::container(&format!(
            "{}{}",
            display::section("Training", &display::kv_table(&rows)),
            display::style::row(&[loss.fragment(), lr.fragment()])
        ))
    }

    fn text(&self) -> String {
        match self.history.last() {
            Some(m) => format!(
                "step {}/{} epoch {:.2}: loss {:.4}, lr {:.2e}, grad norm {:.3}, {:.0} tokens/s\n",
                self.global_step, self.total_steps, m.epoch, m.loss, m.lr, m.grad_norm, m.tokens_per_s
            ),
            None => format!("step 0/{}: not started\n", self.total_steps),
        }
    }
}

crate::display::rich_display!(TrainerState);

impl Rich for SftTrainer {
    fn html(&self) -> String {
        let adapter = self.model().adapter.as_ref().map_or(String::new(), Rich::html);
        self.state.html() + &adapter + &crate::train::Trainer::core(self).logs.html()
    }
    fn text(&self) -> String {
        let adapter = self.model().adapter.as_ref().map_or(String::new(), Rich::text);
        self.state.text() + &adapter + &crate::train::Trainer::core(self).logs.text()
    }
}

impl Rich for SftEval {
    fn html(&self) -> String {
        display::config_html(&format!("SFT evaluation at step {}", self.step), self)
    }
    fn text(&self) -> String {
        format!(
            "eval at step {}: loss {:.4} per token over {} held-out tokens\n",
            self.step, self.loss, self.tokens
        )
    }
}

crate::display::rich_display!(SftEval);

crate::display::rich_display!(SftTrainer);

impl Rich for StepMetrics {
    fn html(&self) -> String {
        display::config_html(&format!("SFT step {}", self.step), self)
    }
    fn text(&self) -> String {
        format!(
            "step {}: loss {:.4}, lr {:.2e}, grad norm {:.3}, {:.0} tokens/s, padding {:.1}%{}{}\n",
            self.step,
            self.loss,
            self.lr,
            self.grad_norm,
            self.tokens_per_s,
            100.0 * self.padding_fraction,
            self.aux_loss.map_or(String::new(), |a| format!(", aux loss {a:.4}")),
            if self.skipped { " (skipped)" } else { "" }
        )
    }
}

crate::display::rich_display!(StepMetrics);

impl Rich for SftConfig {
    fn html(&self) -> String {
        display::config_html("SFT config", self)
    }
    fn text(&self) -> String {
        display::config_text(self)
    }
}

crate::display::rich_display!(SftConfig);
