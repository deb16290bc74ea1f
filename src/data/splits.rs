//! Which files of a local folder form a split, as `datasets.load_dataset(folder)` decides: a
//! `save_to_disk` DatasetDict's split folders (`dataset_dict.json`), else split keywords in
//! folder names or file names (`train/...`, `test.parquet`, `data/train-00000-of-00001.parquet`,
//! `my-validation-set.jsonl`). When any file names a split, files that name none are not part
//! of the dataset; when none does, every file is the `train` split. Hidden entries (`.name`,
//! `.ipynb_checkpoints/`) and `__name` ones are skipped; extensions match without case. Links
//! are followed once: a folder or file reached twice (`latest -> v1`, `again -> .`) is read the
//! first time only, as `load_dataset` reads it.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use super::reader::DataFormat;

/// `datasets`' split keywords: a name token equal to one of them puts a file in that split.
const KEYWORDS: [(&str, &[&str]); 3] = [
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// The data files under `dir`, by split, each list sorted.
pub(crate) fn splits_of(dir: &Path) -> std::io::Result<BTreeMap<String, Vec<PathBuf>>> {
    if let Some(names) = saved_dict_splits(dir) {
        let mut splits = BTreeMap::new();
        for name in names {
            let mut files = Files::default();
            files.collect(&dir.join(&name))?;
            splits.insert(name, files.found);
        }
        return Ok(splits);
    }
    let mut found = Files::default();
    found.collect(dir)?;
    let files = found.found;
    let mut splits: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for f in &files {
        if let Some(split) = split_named(f.strip_prefix(dir).unwrap_or(f)) {
            splits.entry(split.into()).or_default().push(f.clone());
        }
    }
    if splits.is_empty() && !files.is_empty() {
        splits.insert("train".into(), files);
    }
    Ok(splits)
}

/// A `save_to_disk` DatasetDict's split names (`dataset_dict.json`'s `splits`).
fn saved_dict_splits(dir: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(dir.join("dataset_dict.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    serde_json::from_value(v.get("splits")?.clone()).ok()
}

/// The split a path under the folder names: a folder component or a file-name token that is a
/// split keyword (tokens are split at `-`, `.`, `_`, spaces and digits), the first one found.
fn split_named(rel: &Path) -> Option<&'static str> {
    let stem = rel.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    let dirs = rel
        .parent()
        .into_iter()
        .flat_map(|p| p.iter())
        .filter_map(|c| c.to_str());
    let tokens = dirs.chain(stem.split(|c: char| "-._ ".contains(c) || c.is_ascii_digit()));
    for token in tokens {
        let token = token.to_ascii_lowercase();
        if let Some((split, _)) = KEYWORDS.iter().find(|(_, words)| words.contains(&token.as_str())) {
            return Some(split);
        }
    }
    None
}

/// Data files found so far, and the folders and files already reached (by their real path).
#[derive(Default)]
struct Files {
    found: Vec<PathBuf>,
    seen: HashSet<PathBuf>,
}

impl Files {
    /// Data files under `dir`, sorted, skipping hidden and `__` entries, metadata files, and
    /// whatever was reached already.
    fn collect(&mut self, dir: &Path) -> std::io::Result<()> {
        if !self.seen.insert(dir.canonicalize()?) {
            return Ok(());
        }
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| !n.starts_with('.') && !n.starts_with("__"))
            })
            .collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                self.collect(&p)?;
            } else if is_data_file(&p) && p.canonicalize().is_ok_and(|real| self.seen.insert(real)) {
                self.found.push(p);
            }
        }
        Ok(())
    }
}

/// A file of a format read (any case) that is not `datasets`' metadata.
fn is_data_file(p: &Path) -> bool {
    let metadata = p
        .file_name()
        .is_some_and(|n| n == "dataset_info.json" || n == "state.json" || n == "dataset_dict.json");
    DataFormat::of(p).is_some() && !metadata
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keywords_are_read_from_folders_and_file_name_tokens() {
        let cases = [
            ("train.parquet", Some("train")),
            ("data/train-00000-of-00001.parquet", Some("train")),
            ("my-validation-set.jsonl", Some("validation")),
            ("dev.json", Some("validation")),
            ("test/part.arrow", Some("test")),
            ("TEST.JSONL", Some("test")),
            ("train-calculator.parquet", Some("train")),
            ("calculator.parquet", None),
            ("contest.jsonl", None),
        ];
        for (path, want) in cases {
            assert_eq!(split_named(Path::new(path)), want, "{path}");
        }
    }
}
