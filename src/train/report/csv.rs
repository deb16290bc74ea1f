//! `metrics.csv`: one header and one row per logged step or evaluation, what `pandas.read_csv`
//! expects. A metric that first appears mid-run (an evaluation, a reward function's first
//! score) adds a column: the file is rewritten with the wider header (atomically), earlier rows
//! left empty there, which pandas reads as NaN.

use std::io::Write;
use std::path::{Path, PathBuf};

/// An open `metrics.csv`.
#[derive(Debug)]
pub(crate) struct CsvLog {
    path: PathBuf,
    columns: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl CsvLog {
    /// Starts `path` anew, or, when resuming at `resumed_at`, keeps its rows up to that step.
    pub(crate) fn open(path: &Path, resumed_at: Option<u64>) -> std::io::Result<Self> {
        let mut log = CsvLog {
            path: path.into(),
            columns: vec!["step".into()],
            rows: Vec::new(),
        };
        if let (Some(at), Ok(text)) = (resumed_at, std::fs::read_to_string(path)) {
            let mut lines = text.lines().map(split_line);
            log.columns = lines.next().unwrap_or_else(|| vec!["step".into()]);
            log.rows = lines
                .filter(|cells| {
                    cells
                        .first()
                        .and_then(|s| s.parse::<u64>().ok())
                        .is_some_and(|s| s <= at)
                })
                .collect();
        }
        log.rewrite()?;
        Ok(log)
    }

    /// Adds the row of `step`: appended, or the whole file rewritten when it brings columns.
    pub(crate) fn append(&mut self, step: u64, scalars: &[(String, f64)]) -> std::io::Result<()> {
        let before = self.columns.len();
        for (tag, _) in scalars {
            if !self.columns.contains(tag) {
                self.columns.push(tag.clone());
            }
        }
        let mut row = vec![String::new(); self.columns.len()];
        row[0] = step.to_string();
        for (tag, v) in scalars {
            let at = self.columns.iter().position(|c| c == tag).expect("column added above");
            row[at] = number(*v);
        }
        self.rows.push(row);
        match self.columns.len() == before {
            true => {
                let mut f = std::fs::OpenOptions::new().append(true).open(&self.path)?;
                f.write_all(join_line(self.rows.last().expect("pushed")).as_bytes())
            }
            false => self.rewrite(),
        }
    }

    /// Writes header and rows over `path`, atomically.
    fn rewrite(&self) -> std::io::Result<()> {
        let mut text = join_line(&self.columns);
        for row in &self.rows {
            let mut padded = row.clone();
            padded.resize(self.columns.len(), String::new());
            text.push_str(&join_line(&padded));
        }
        crate::util::write_atomically(&self.path, text)
    }
}

/// pandas' spellings of the non-finite values.
fn number(v: f64) -> String {
    match v {
        v if v.is_nan() => "NaN".into(),
        v if v.is_infinite() => if v > 0.0 { "inf" } else { "-inf" }.into(),
        v => v.to_string(),
    }
}

/// One RFC 4180 line: cells holding a comma or a quote are quoted (newlines become spaces).
fn join_line(cells: &[String]) -> String {
    let cells: Vec<String> = cells
        .iter()
        .map(|c| {
            let c = c.replace(['\n', '\r'], " ");
            match c.contains([',', '"']) {
                true => format!("\"{}\"", c.replace('"', "\"\"")),
                false => c,
            }
        })
        .collect();
    cells.join(",") + "\n"
}

/// The cells of a line written by [`join_line`].
fn split_line(line: &str) -> Vec<String> {
    let (mut cells, mut cell, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => cells.push(std::mem::take(&mut cell)),
            (c, _) => cell.push(c),
        }
    }
    cells.push(cell);
    cells
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_grow_by_rewriting_the_header_and_a_resume_cuts_later_rows() {
        let dir = std::env::temp_dir().join(format!("treetrain-csv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.csv");
        let mut log = CsvLog::open(&path, None).unwrap();
        log.append(1, &[("train/loss".into(), 0.5)]).unwrap();
        log.append(2, &[("train/loss".into(), 0.25), ("eval/a,\"b\"".into(), f64::NAN)])
            .unwrap();
        log.append(3, &[("train/loss".into(), 1e-7)]).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "step,train/loss,\"eval/a,\"\"b\"\"\"\n1,0.5,\n2,0.25,NaN\n3,0.0000001,\n"
        );
        assert_eq!(split_line("2,\"eval/a,\"\"b\"\"\",x"), ["2", "eval/a,\"b\"", "x"]);
        drop(CsvLog::open(&path, Some(2)).unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "step,train/loss,\"eval/a,\"\"b\"\"\"\n1,0.5,\n2,0.25,NaN\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
