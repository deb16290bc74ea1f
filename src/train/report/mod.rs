//! Where a run's metrics go (transformers' `report_to`): `log.jsonl` (one JSON line per step,
//! treetrain's own names), TensorBoard event files and `metrics.csv` (both under the tag names
//! transformers and TRL log: `train/loss`, `train/learning_rate`, `train/reward`,
//! `train/rewards/<name>/mean`, `eval/...`).
//!
//! Only the main rank writes. A run that resumes from step `s` cuts `log.jsonl` and
//! `metrics.csv` back to step `s` and opens a new event file that TensorBoard reads as a
//! restart at `s + 1`, so each step appears once however often a run was killed and resumed.
//! A log that cannot be written after the start is reported once and never stops training;
//! an unwritable `logging_dir` is refused before step 1.

mod csv;
mod scalars;
pub(crate) mod tensorboard;

use std::path::{Path, PathBuf};

pub use scalars::{EventScalars, Scalars};

use super::{TrainConfig, TrainError};

/// One place a run's metrics go (an entry of `report_to`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ReportTo {
    /// `output_dir/log.jsonl`, one JSON line per step (the default).
    Jsonl,
    /// TensorBoard event files in `logging_dir`.
    Tensorboard,
    /// `output_dir/metrics.csv`.
    Csv,
    /// Nothing (alone in the list).
    None,
}

/// `report_to` as a list or a single name (`"tensorboard"`), as transformers takes it.
pub(crate) mod one_or_many {
    use super::ReportTo;
    use serde::{Deserialize, Deserializer, Serializer};

    /// Always a list.
    pub(crate) fn serialize<S: Serializer>(value: &[ReportTo], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(value)
    }

    /// A name or a list of names.
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ReportTo>, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(ReportTo),
            Many(Vec<ReportTo>),
        }
        let raw = serde_json::Value::deserialize(d)?;
        match serde_json::from_value::<Raw>(raw.clone()) {
            Ok(Raw::One(r)) => Ok(vec![r]),
            Ok(Raw::Many(v)) => Ok(v),
            Err(_) => Err(serde::de::Error::custom(format!(
                "`report_to` = {raw}: expected \"jsonl\", \"tensorboard\", \"csv\" or \"none\", or a list of them"
            ))),
        }
    }
}

/// The run's open logs (main rank; an inactive one elsewhere).
#[derive(Debug, Default)]
pub(crate) struct RunLogs {
    jsonl: Option<PathBuf>,
    csv_path: Option<PathBuf>,
    logging_dir: Option<PathBuf>,
    explicit_dir: bool,
    /// `output_dir`, where a default log folder lives.
    out: Option<PathBuf>,
    resumed_at: Option<u64>,
    settings: Option<String>,
    open: Option<Writers>,
    warned: bool,
}

#[derive(Debug, Default)]
struct Writers {
    jsonl: Option<PathBuf>,
    csv: Option<csv::CsvLog>,
    tensorboard: Option<tensorboard::EventWriter>,
}

impl RunLogs {
    /// The logs `config` asks for, their folders created and probed (`main`: this process
    /// writes them; otherwise nothing is written).
    pub(crate) fn new(config: &TrainConfig, main: bool) -> Result<Self, TrainError> {
        if !main {
            return Ok(RunLogs::default());
        }
        let wants = |r| config.output.report_to.contains(&r);
        let out = config.output.output_dir.as_deref();
        let logging_dir = match wants(ReportTo::Tensorboard) {
            true => Some(
                config
                    .output
                    .logging_dir
                    .clone()
                    .or_else(|| out.map(default_logging_dir))
                    .ok_or_else(|| {
                        TrainError::config(
                            "logging_dir",
                            "is not set and neither is output_dir: report_to names tensorboard",
                        )
                    })?,
            ),
            false => None,
        };
        // The default folder is made at the first write, once a resume may have named the
        // checkpoint's own; `output_dir` is probed already.
        if let Some(dir) = config.output.logging_dir.as_deref().filter(|_| logging_dir.is_some()) {
            super::output_lock::check_writable("logging_dir", dir)?;
        }
        Ok(RunLogs {
            jsonl: out.filter(|_| wants(ReportTo::Jsonl)).map(|o| o.join("log.jsonl")),
            csv_path: out.filter(|_| wants(ReportTo::Csv)).map(|o| o.join("metrics.csv")),
            logging_dir,
            explicit_dir: config.output.logging_dir.is_some(),
            out: out.map(Path::to_path_buf),
            ..RunLogs::default()
        })
    }

    /// The TensorBoard folder, when the run writes one.
    pub(crate) fn logging_dir(&self) -> Option<&Path> {
        self.logging_dir.as_deref()
    }

    /// The run continues from a checkpoint at `step` whose run logged to `saved_dir`: the logs
    /// are cut back to `step` at the first write, and TensorBoard continues in that run's
    /// default folder (`runs/<name>`) under this run's `output_dir`, unless `logging_dir` was
    /// set. The saved path is never followed: a copied or moved run, or a checkpoint from
    /// elsewhere, writes only below its own `output_dir`.
    pub(crate) fn resume(&mut self, step: u64, saved_dir: Option<PathBuf>) {
        self.resumed_at = Some(step);
        let name = saved_dir.as_deref().and_then(default_folder_name);
        if let (Some(name), Some(out), Some(_), false) = (name, &self.out, &self.logging_dir, self.explicit_dir) {
            self.logging_dir = Some(out.join("runs").join(name));
        }
    }

    /// The log folder as a checkpoint keeps it: relative to `output_dir` when inside it.
    pub(crate) fn logging_dir_to_save(&self) -> Option<PathBuf> {
        let dir = self.logging_dir.as_deref()?;
        Some(match self.out.as_deref().and_then(|o| dir.strip_prefix(o).ok()) {
            Some(inside) => inside.to_path_buf(),
            None => dir.to_path_buf(),
        })
    }

    /// The run's settings, written once as text (`args`, as transformers does).
    pub(crate) fn set_settings(&mut self, settings: &impl serde::Serialize) {
        self.settings = serde_json::to_string_pretty(settings).ok();
    }

    /// A training step's metrics, everywhere `report_to` names.
    pub(crate) fn step<M: Scalars>(&mut self, metrics: &M) {
        let (step, scalars) = (metrics.step(), metrics.scalars());
        let result = self.writers().and_then(|w| {
            if let Some(path) = &w.jsonl {
                append_line(path, &serde_json::to_string(metrics).unwrap_or_default())?;
            }
            w.write(step, &scalars)
        });
        self.warn_once(result);
    }

    /// An evaluation's metrics (TensorBoard and CSV; `log.jsonl` holds training steps only).
    pub(crate) fn eval<M: Scalars>(&mut self, metrics: &M) {
        let (step, scalars) = (metrics.step(), metrics.scalars());
        let result = self.writers().and_then(|w| w.write(step, &scalars));
        self.warn_once(result);
    }

    /// Markdown under `tag` at `step` (TensorBoard's text tab).
    pub(crate) fn text(&mut self, tag: &str, step: u64, markdown: &str) {
        let result = self.writers().and_then(|w| match w.tensorboard.as_mut() {
            Some(tb) => tb.text(tag, step, markdown).and_then(|_| tb.flush()),
            None => Ok(()),
        });
        self.warn_once(result);
    }

    /// The writers, opened at the first write (a resume is known by then).
    fn writers(&mut self) -> std::io::Result<&mut Writers> {
        if self.open.is_none() {
            self.open = Some(self.open_writers()?);
        }
        Ok(self.open.as_mut().expect("opened above"))
    }

    fn open_writers(&self) -> std::io::Result<Writers> {
        if let Some(path) = &self.jsonl {
            cut_jsonl(path, self.resumed_at)?;
        }
        let csv = match &self.csv_path {
            Some(path) => Some(csv::CsvLog::open(path, self.resumed_at)?),
            None => None,
        };
        let tensorboard = match &self.logging_dir {
            Some(dir) => Some(self.open_event_file(dir)?),
            None => None,
        };
        Ok(Writers {
            jsonl: self.jsonl.clone(),
            csv,
            tensorboard,
        })
    }

    /// A new event file in `dir`: a resumed run's starts a session after the checkpoint; a
    /// folder's first file gets the settings.
    fn open_event_file(&self, dir: &Path) -> std::io::Result<tensorboard::EventWriter> {
        let first = !std::fs::read_dir(dir)
            .is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().contains("tfevents"))));
        let mut tb = tensorboard::EventWriter::create(dir)?;
        if let Some(step) = self.resumed_at {
            tb.session_start(step + 1)?;
        }
        if let (true, Some(settings)) = (first, &self.settings) {
            tb.text(
                "args",
                self.resumed_at.unwrap_or(0),
                &format!("```json\n{settings}\n```"),
            )?;
        }
        tb.flush()?;
        Ok(tb)
    }

    fn warn_once(&mut self, result: std::io::Result<()>) {
        if let Err(e) = result
            && !std::mem::replace(&mut self.warned, true)
        {
            eprintln!("treetrain: warning: a run log could not be written (training goes on): {e}");
        }
    }
}

impl Writers {
    fn write(&mut self, step: u64, scalars: &[(String, f64)]) -> std::io::Result<()> {
        if let Some(csv) = self.csv.as_mut() {
            csv.append(step, scalars)?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.scalars(step, scalars)?;
            tb.flush()?;
        }
        Ok(())
    }
}

/// The `<name>` of a default log folder `.../runs/<name>` (absolute, as older checkpoints kept
/// it, or relative), if `saved` is one.
fn default_folder_name(saved: &Path) -> Option<std::ffi::OsString> {
    let name = saved.file_name()?;
    let runs = saved.parent()?.file_name()?;
    (runs == "runs" && name != "..").then(|| name.to_os_string())
}

/// transformers' default: `runs/<Mon><DD>_<HH>-<MM>-<SS>_<host>` under the output folder.
fn default_logging_dir(out: &Path) -> PathBuf {
    let stamp = crate::util::clock::run_stamp(crate::util::clock::unix_seconds());
    out.join("runs").join(format!("{stamp}_{}", crate::util::host_name()))
}

fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    writeln!(f, "{line}")
}

/// Starts `log.jsonl` anew, or, resuming at `step`, keeps its lines up to that step.
fn cut_jsonl(path: &Path, resumed_at: Option<u64>) -> std::io::Result<()> {
    let kept = match (resumed_at, std::fs::read_to_string(path)) {
        (Some(at), Ok(text)) => text
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v.get("step")?.as_u64())
                    .is_some_and(|s| s <= at)
            })
            .map(|l| format!("{l}\n"))
            .collect(),
        _ => String::new(),
    };
    crate::util::write_atomically(path, kept)
}

/// Where the run's logs are, for a trainer's display: each file or folder it writes (a
/// TensorBoard folder with the command that opens it). Empty when nothing is written.
impl crate::display::Rich for RunLogs {
    fn html(&self) -> String {
        use crate::display::{escape, kv_table, section, style::container};
        let rows: Vec<(&str, String)> = self
            .entries()
            .into_iter()
            .map(|(label, path, shown)| {
                let link = format!(
                    "<a href=\"{}\"><code>{}</code></a>",
                    escape(&path.display().to_string()),
                    escape(&shown)
                );
                (label, link)
            })
            .collect();
        match rows.is_empty() {
            true => String::new(),
            false => container(&section("Run logs", &kv_table(&rows))),
        }
    }
    fn text(&self) -> String {
        self.entries()
            .into_iter()
            .map(|(label, _, shown)| format!("{label}: {shown}\n"))
            .collect()
    }
}

impl RunLogs {
    /// `(label, path, as shown)` of every log this run writes.
    fn entries(&self) -> Vec<(&'static str, &Path, String)> {
        let files = [("log", &self.jsonl), ("metrics", &self.csv_path)]
            .into_iter()
            .filter_map(|(label, path)| path.as_deref().map(|p| (label, p, p.display().to_string())));
        let tensorboard = self
            .logging_dir
            .as_deref()
            .map(|d| ("TensorBoard", d, format!("tensorboard --logdir {}", d.display())));
        files.chain(tensorboard).collect()
    }
}
