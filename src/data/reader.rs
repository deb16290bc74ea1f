//! Streaming rows out of dataset files.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use serde_json::{Map, Value};

use super::DataError;
use super::example::Example;
use super::value::to_json;

/// A dataset: one file or every data file under a folder (sorted), read lazily.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// The data files, in reading order.
    pub files: Vec<PathBuf>,
}

use super::splits::{EXTENSIONS, splits_of};

impl Dataset {
    /// A file (`.parquet`, `.arrow`, `.jsonl`, `.json` lines) or a folder holding such files
    /// (a `save_to_disk` split, a hub snapshot's `data/`).
    pub fn open(path: &Path) -> Result<Self, DataError> {
        Self::open_split(path, None)
    }

    /// A file, or split `split` (default `train`) of a folder, split as
    /// `datasets.load_dataset(folder)` splits it (see [`crate::data`]'s folder rules).
    pub fn open_split(path: &Path, split: Option<&str>) -> Result<Self, DataError> {
        let err = |message: String| DataError::File {
            path: path.into(),
            message,
        };
        if !path.exists() {
            return Err(err("no such file or folder".into()));
        }
        if !path.is_dir() {
            return match split {
                Some(s) if s != "train" => Err(err(format!("is one file, one train split: it has no `{s}` split"))),
                _ => Ok(Dataset {
                    files: vec![path.to_path_buf()],
                }),
            };
        }
        let mut splits = splits_of(path).map_err(|e| err(e.to_string()))?;
        if splits.is_empty() {
            return Err(err(format!("holds no data file ({}, any case)", EXTENSIONS.join(", "))));
        }
        let wanted = split.unwrap_or("train");
        let names: Vec<String> = splits.keys().cloned().collect();
        match splits.remove(wanted) {
            Some(files) if !files.is_empty() => Ok(Dataset { files }),
            _ => Err(err(format!(
                "has no `{wanted}` split; its splits: {} (dataset_split names one)",
                names.join(", ")
            ))),
        }
    }

    /// Held-out data: a file, or a folder's `test` split, else its `validation` split, else
    /// its `train` split (a folder whose files name no split is all `train`).
    pub fn open_held_out(path: &Path) -> Result<Self, DataError> {
        if !path.is_dir() {
            return Self::open(path);
        }
        ["test", "validation"]
            .iter()
            .find_map(|s| Self::open_split(path, Some(s)).ok())
            .map_or_else(|| Self::open(path), Ok)
    }

    /// A dataset repo in the Hugging Face cache (`datasets--org--name`, `org/name[@revision]`),
    /// optionally one split: files under the snapshot whose path contains the split name
    /// (`data/train-00000-of-00001.parquet`, `train/...`).
    pub fn from_hub(cache: &crate::hub::HubCache, spec: &str, split: Option<&str>) -> Result<Self, DataError> {
        let err = |message: String| DataError::File {
            path: cache.root.clone(),
            message,
        };
        let (repo, revision) = crate::hub::parse_spec(spec).map_err(|e| err(e.to_string()))?;
        let snap = cache
            .snapshot(crate::hub::RepoType::Dataset, &repo, &revision)
            .ok_or_else(|| {
                err(format!(
                    "dataset repo `{repo}` at revision `{revision}` is not in the cache"
                ))
            })?;
        Dataset::open_split(&snap, split).map_err(|e| err(format!("dataset repo `{repo}`: {e}")))
    }

    /// Rows as JSON objects, file by file, batch by batch (never the whole dataset in memory).
    pub fn rows(&self) -> impl Iterator<Item = Result<Map<String, Value>, DataError>> + '_ {
        self.files
            .iter()
            .flat_map(|f| -> Box<dyn Iterator<Item = Result<Map<String, Value>, DataError>>> {
                match read_rows(f) {
                    Ok(it) => it,
                    Err(e) => Box::new(std::iter::once(Err(e))),
                }
            })
    }

    /// Rows as [`Example`]s; with `skip_invalid`, malformed rows are skipped and counted in
    /// `skipped` instead of ending the iteration with an error naming the row.
    pub fn examples<'a>(
        &'a self,
        skip_invalid: bool,
        skipped: &'a mut usize,
    ) -> impl Iterator<Item = Result<Example, DataError>> + 'a {
        self.rows().enumerate().filter_map(move |(i, row)| {
            let ex = row.and_then(|r| Example::from_row(i, &r));
            match ex {
                Err(DataError::Row { .. }) if skip_invalid => {
                    *skipped += 1;
                    None
                }
                other => Some(other),
            }
        })
    }
}

fn batch_rows(batch: RecordBatch, path: PathBuf) -> impl Iterator<Item = Result<Map<String, Value>, DataError>> {
    let schema = batch.schema();
    (0..batch.num_rows()).map(move |i| {
        let mut row = Map::new();
        for (field, col) in schema.fields().iter().zip(batch.columns()) {
            let v = to_json(col, i).ok_or_else(|| DataError::File {
                path: path.clone(),
                message: format!("column `{}` has unsupported type {}", field.name(), field.data_type()),
            })?;
            row.insert(field.name().clone(), v);
        }
        Ok(row)
    })
}

type Rows = Box<dyn Iterator<Item = Result<Map<String, Value>, DataError>>>;

fn batches_to_rows<I, E>(batches: I, path: &Path) -> Rows
where
    I: Iterator<Item = Result<RecordBatch, E>> + 'static,
    E: std::fmt::Display,
{
    let path = path.to_path_buf();
    Box::new(batches.flat_map(move |b| -> Rows {
        match b {
            Ok(batch) => Box::new(batch_rows(batch, path.clone())),
            Err(e) => Box::new(std::iter::once(Err(DataError::File {
                path: path.clone(),
                message: e.to_string(),
            }))),
        }
    }))
}

/// Rows of one data file.
pub(crate) fn read_rows(path: &Path) -> Result<Rows, DataError> {
    let err = |message: String| DataError::File {
        path: path.into(),
        message,
    };
    let open = || File::open(path).map_err(|e| err(e.to_string()));
    match path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("parquet") => {
            let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(open()?)
                .and_then(|b| b.with_batch_size(1024).build())
                .map_err(|e| err(e.to_string()))?;
            Ok(batches_to_rows(reader, path))
        }
        Some("arrow") => {
            // The `datasets` cache writes IPC streams; other tools write IPC files.
            if let Ok(r) = arrow::ipc::reader::FileReader::try_new(open()?, None) {
                return Ok(batches_to_rows(r, path));
            }
            let r = arrow::ipc::reader::StreamReader::try_new(BufReader::new(open()?), None)
                .map_err(|e| err(e.to_string()))?;
            Ok(batches_to_rows(r, path))
        }
        _ => {
            let lines = BufReader::new(open()?).lines();
            let path = path.to_path_buf();
            Ok(Box::new(lines.enumerate().filter_map(move |(i, line)| {
                let line = match line {
                    Ok(l) => l,
                    Err(e) => {
                        return Some(Err(DataError::File {
                            path: path.clone(),
                            message: e.to_string(),
                        }));
                    }
                };
                if line.trim().is_empty() {
                    return None;
                }
                Some(match serde_json::from_str::<Value>(&line) {
                    Ok(Value::Object(m)) => Ok(m),
                    Ok(_) => Err(DataError::File {
                        path: path.clone(),
                        message: format!("line {} is not a JSON object", i + 1),
                    }),
                    Err(e) => Err(DataError::File {
                        path: path.clone(),
                        message: format!("line {}: {e}", i + 1),
                    }),
                })
            })))
        }
    }
}

impl crate::display::Rich for Dataset {
    fn html(&self) -> String {
        use crate::display::{self, escape};
        let rows: Vec<Vec<String>> = self
            .files
            .iter()
            .map(|f| vec![format!("<code>{}</code>", escape(&f.display().to_string()))])
            .collect();
        display::style::container(&display::section(
            &format!("Dataset: {} file(s)", self.files.len()),
            &display::table(&["file"], &rows),
        ))
    }
    fn text(&self) -> String {
        let mut s = format!("Dataset: {} file(s)\n", self.files.len());
        for f in &self.files {
            s.push_str(&format!("  {}\n", f.display()));
        }
        s
    }
}

crate::display::rich_display!(Dataset);
