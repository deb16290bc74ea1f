//! Metrics as tagged scalars, under the names transformers' and TRL's loggers use, and the
//! scalars of an event folder read back ([`EventScalars`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::display::{LineChart, Rich};
use crate::train::TrainError;

/// Metrics that log as scalars: every number of their JSON form (booleans as 0/1) under
/// `<SECTION>/<name>`, `name` renamed by [`Scalars::RENAMES`] to the metric names TRL logs;
/// a list of named entries (`rewards`) becomes `<name>/<entry>/<field>`, a nested object
/// `<name>/<field>`. `step` is the step, not a scalar; text fields are not logged.
pub trait Scalars: serde::Serialize {
    /// `train` or `eval`.
    const SECTION: &'static str;
    /// treetrain's field names and the names TRL (or transformers) logs them under.
    const RENAMES: &'static [(&'static str, &'static str)] = &[];

    /// The step the metrics belong to.
    fn step(&self) -> u64;

    /// The tagged scalars, in field order.
    fn scalars(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        if let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(self) {
            for (key, value) in fields.iter().filter(|(k, _)| *k != "step") {
                let name = Self::RENAMES.iter().find(|r| r.0 == key).map_or(key.as_str(), |r| r.1);
                push_leaves(format!("{}/{name}", Self::SECTION), value, &mut out);
            }
        }
        out
    }
}

fn push_leaves(tag: String, value: &serde_json::Value, out: &mut Vec<(String, f64)>) {
    use serde_json::Value;
    match value {
        Value::Number(n) => out.extend(n.as_f64().map(|x| (tag, x))),
        Value::Bool(b) => out.push((tag, f64::from(u8::from(*b)))),
        Value::Array(items) => {
            for item in items {
                if let Some(name) = item.get("name").and_then(Value::as_str) {
                    for (k, v) in item.as_object().into_iter().flatten().filter(|(k, _)| *k != "name") {
                        push_leaves(format!("{tag}/{name}/{k}"), v, out);
                    }
                }
            }
        }
        Value::Object(fields) => {
            for (k, v) in fields {
                push_leaves(format!("{tag}/{k}"), v, out);
            }
        }
        Value::Null | Value::String(_) => {}
    }
}

/// The scalars of a TensorBoard event folder (a run's `logging_dir`), read back the way
/// TensorBoard reads them: `(step, value)` per tag, a resumed run's restart replacing the
/// steps an earlier file logged after its checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct EventScalars {
    /// The folder read.
    pub dir: PathBuf,
    /// Points per tag, in step order.
    pub tags: BTreeMap<String, Vec<(u64, f64)>>,
}

impl EventScalars {
    /// Reads every event file in `dir`.
    pub fn read(dir: &Path) -> Result<Self, TrainError> {
        let tags = super::tensorboard::read_scalars(dir).map_err(|e| TrainError::Log {
            path: dir.into(),
            message: e.to_string(),
        })?;
        Ok(EventScalars { dir: dir.into(), tags })
    }

    /// The points of `tag` (empty when it was never logged).
    pub fn series(&self, tag: &str) -> &[(u64, f64)] {
        self.tags.get(tag).map_or(&[], Vec::as_slice)
    }

    /// A chart of `tags` against the step.
    pub fn chart(&self, title: &str, tags: &[&str]) -> LineChart {
        tags.iter().fold(LineChart::new(title, "step", "value"), |chart, tag| {
            let points = self.series(tag).iter().map(|&(s, v)| (s as f64, v)).collect();
            chart.with_series(tag, points)
        })
    }

    fn rows(&self) -> Vec<[String; 4]> {
        self.tags
            .iter()
            .map(|(tag, points)| {
                let last = points.last().copied().unwrap_or_default();
                [
                    tag.clone(),
                    points.len().to_string(),
                    last.0.to_string(),
                    format!("{:.6}", last.1),
                ]
            })
            .collect()
    }
}

const HEADERS: [&str; 4] = ["tag", "points", "last step", "last value"];

impl Rich for EventScalars {
    fn html(&self) -> String {
        use crate::display::{escape, style::container, table};
        let rows: Vec<Vec<String>> = self
            .rows()
            .into_iter()
            .map(|r| r.map(|c| escape(&c)).to_vec())
            .collect();
        let chart = self.chart("train/loss", &["train/loss"]);
        let plot = if chart.is_drawable() {
            chart.to_svg()
        } else {
            String::new()
        };
        container(&format!(
            "<h4>TensorBoard scalars in {}</h4>{plot}{}",
            escape(&self.dir.display().to_string()),
            table(&HEADERS, &rows)
        ))
    }
    fn text(&self) -> String {
        let mut s = format!("TensorBoard scalars in {}\n", self.dir.display());
        for r in self.rows() {
            s.push_str(&format!(
                "  {:<40} {:>5} points, last step {} = {}\n",
                r[0], r[1], r[2], r[3]
            ));
        }
        s
    }
}

crate::display::rich_display!(EventScalars);

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize)]
    struct Demo {
        step: u64,
        lr: f64,
        skipped: bool,
        note: String,
        rewards: Vec<serde_json::Value>,
        nan: f64,
    }

    impl Scalars for Demo {
        const SECTION: &'static str = "train";
        const RENAMES: &'static [(&'static str, &'static str)] = &[("lr", "learning_rate")];
        fn step(&self) -> u64 {
            self.step
        }
    }

    #[test]
    fn fields_become_trl_tags_and_named_lists_nest() {
        let d = Demo {
            step: 7,
            lr: 0.5,
            skipped: true,
            note: "text".into(),
            rewards: vec![serde_json::json!({"name": "fmt", "mean": 1.0, "std": 0.0})],
            nan: f64::NAN,
        };
        let tags: Vec<(String, f64)> = d.scalars();
        let want = [
            ("train/learning_rate", 0.5),
            ("train/skipped", 1.0),
            ("train/rewards/fmt/mean", 1.0),
            ("train/rewards/fmt/std", 0.0),
        ];
        assert_eq!(tags, want.map(|(t, v)| (t.to_string(), v)).to_vec());
        let html = EventScalars {
            dir: "runs/x".into(),
            tags: BTreeMap::from([("train/loss".into(), vec![(1, 2.0), (2, 1.0)])]),
        }
        .html();
        assert!(html.contains("<svg") && html.contains("train/loss") && html.contains("runs/x"));
    }
}
