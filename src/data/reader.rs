//! Streaming rows out of dataset files.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use serde_json::{Map, Value};

use super::DataError;
use super::example::Example;
use super::lines::json_lines;
use super::value::to_json;

/// A dataset: one file or every data file under a folder (sorted), read lazily.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// The data files, in reading order.
    pub files: Vec<PathBuf>,
}

use super::splits::splits_of;

impl Dataset {
    /// A file (`.parquet`, `.arrow`, `.jsonl` or `.json` lines, gzipped or not, `.csv`) or a
    /// folder holding such files (a `save_to_disk` split, a hub snapshot's `data/`).
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
            return Err(err(format!("holds no data file ({}, any case)", DataFormat::NAMES)));
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

/// The file formats read, by file name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DataFormat {
    /// `.parquet`.
    Parquet,
    /// `.arrow` (an IPC file or stream, as `datasets` caches write).
    Arrow,
    /// `.jsonl`, `.json`: one JSON object a line.
    JsonLines,
    /// `.jsonl.gz`, `.json.gz`.
    GzippedJsonLines,
    /// `.csv`, with a header; column types inferred as `datasets` (pandas) infers them.
    Csv,
}

impl DataFormat {
    /// What every format's files are named, for messages.
    pub(crate) const NAMES: &str = ".parquet, .arrow, .jsonl, .json, .jsonl.gz, .json.gz or .csv";

    /// The format of a file named `path` (any case), if one treetrain reads.
    pub(crate) fn of(path: &Path) -> Option<Self> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        let ends = |suffix: &str| name.len() > suffix.len() && name.ends_with(suffix);
        Some(match () {
            _ if ends(".parquet") => DataFormat::Parquet,
            _ if ends(".arrow") => DataFormat::Arrow,
            _ if ends(".jsonl") || ends(".json") => DataFormat::JsonLines,
            _ if ends(".jsonl.gz") || ends(".json.gz") => DataFormat::GzippedJsonLines,
            _ if ends(".csv") => DataFormat::Csv,
            _ => return None,
        })
    }
}

/// Rows of one data file.
pub(crate) fn read_rows(path: &Path) -> Result<Rows, DataError> {
    let err = |message: String| DataError::File {
        path: path.into(),
        message,
    };
    let open = || File::open(path).map_err(|e| err(e.to_string()));
    let format = DataFormat::of(path).ok_or_else(|| {
        err(format!(
            "is not a data file treetrain reads: it reads {} files (as datasets.load_dataset does for these)",
            DataFormat::NAMES
        ))
    })?;
    match format {
        DataFormat::Parquet => {
            let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(open()?)
                .and_then(|b| b.with_batch_size(1024).build())
                .map_err(|e| err(e.to_string()))?;
            Ok(batches_to_rows(reader, path))
        }
        DataFormat::Arrow => {
            // The `datasets` cache writes IPC streams; other tools write IPC files.
            if let Ok(r) = arrow::ipc::reader::FileReader::try_new(open()?, None) {
                return Ok(batches_to_rows(r, path));
            }
            let r = arrow::ipc::reader::StreamReader::try_new(BufReader::new(open()?), None)
                .map_err(|e| err(e.to_string()))?;
            Ok(batches_to_rows(r, path))
        }
        DataFormat::JsonLines => Ok(json_lines(Box::new(BufReader::new(open()?)), path)),
        DataFormat::GzippedJsonLines => {
            let gz = flate2::read::MultiGzDecoder::new(open()?);
            Ok(json_lines(Box::new(BufReader::new(gz)), path))
        }
        DataFormat::Csv => {
            let format = arrow::csv::reader::Format::default().with_header(true);
            let (schema, _) = format
                .infer_schema(BufReader::new(open()?), Some(INFER_ROWS))
                .map_err(|e| err(format!("cannot infer the columns: {e}")))?;
            let reader = arrow::csv::ReaderBuilder::new(std::sync::Arc::new(schema))
                .with_format(format)
                .with_batch_size(1024)
                .build(BufReader::new(open()?))
                .map_err(|e| err(e.to_string()))?;
            Ok(batches_to_rows(reader, path))
        }
    }
}

/// Rows a CSV's column types are inferred from.
const INFER_ROWS: usize = 10_000;

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
