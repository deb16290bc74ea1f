//! Trainer config files: TOML over the config type's own defaults, with relative paths taken
//! from the file's folder and unknown keys refused.

use std::path::{Path, PathBuf};

use super::error::TrainError;

/// Reads a TOML config of `T`: every key the file sets replaces `T::default()`'s value (nested
/// tables merge key by key), so a field flattened in from a shared section still gets the
/// default of the trainer it belongs to. A key `T` does not know is an error naming it, never a
/// silently ignored typo. Returns the config and the folder relative paths are anchored to.
pub(crate) fn read_toml<T>(path: &Path) -> Result<(T, &Path), TrainError>
where
    T: Default + serde::Serialize + serde::de::DeserializeOwned,
{
    read_toml_with_aliases(path, &[])
}

/// Another trainer's spelling of a setting: `(alias, field, value)`, the alias's value made
/// the field's by `value` (`None`: a value the alias cannot take).
pub(crate) type Alias = (&'static str, &'static str, fn(&toml::Value) -> Option<toml::Value>);

/// The same value under another name.
pub(crate) fn same(v: &toml::Value) -> Option<toml::Value> {
    Some(v.clone())
}

/// [`read_toml`] where each top-level alias of `aliases` (another trainer's spelling, e.g.
/// TRL's) is read as its field; both at once is an error naming them.
pub(crate) fn read_toml_with_aliases<'p, T>(path: &'p Path, aliases: &[Alias]) -> Result<(T, &'p Path), TrainError>
where
    T: Default + serde::Serialize + serde::de::DeserializeOwned,
{
    let fail = |message: String| TrainError::ConfigFile {
        path: path.into(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let mut file: toml::Table = toml::from_str(&text).map_err(|e| fail(e.to_string()))?;
    for &(alias, field, value) in aliases {
        if let Some(v) = file.remove(alias) {
            if file.contains_key(field) {
                return Err(fail(format!("`{alias}` and `{field}` name the same setting: keep one")));
            }
            let converted = value(&v).ok_or_else(|| fail(format!("`{alias}` = {v} is not a value it takes")))?;
            file.insert(field.to_string(), converted);
        }
    }
    let defaults = toml::Table::try_from(T::default()).map_err(|e| fail(e.to_string()))?;
    let mut merged = defaults.clone();
    merge(&mut merged, file.clone());
    let cfg: T = toml::Value::Table(merged).try_into().map_err(|e: toml::de::Error| {
        // The merged table has no positions: find the setting whose value was refused, and
        // its line in the file.
        let message = e.to_string();
        let message = message.trim_end();
        match refused_key::<T>(&defaults, &file, &[]) {
            Some(key) => {
                let hint = what_to_write(&key, value_at(&file, &key), message);
                fail(format!("`{}`{}: {message}{hint}", key.join("."), line_of(&text, &key)))
            }
            None => fail(message.to_string()),
        }
    })?;
    let known = toml::Table::try_from(&cfg).map_err(|e| fail(e.to_string()))?;
    if let Some((key, hint)) = unknown_key(&file, &known, &known, "") {
        return Err(fail(format!("unknown key `{key}`{hint}")));
    }
    Ok((cfg, path.parent().unwrap_or(Path::new("."))))
}

/// Writes `config` as a TOML file that [`read_toml`] reads back to the same value (the way a
/// notebook's run is handed to `treetrain launch`). Written to a temporary file renamed into
/// place, so a failed write leaves any earlier file whole.
pub(crate) fn write_toml<T: serde::Serialize>(config: &T, path: &Path) -> Result<(), TrainError> {
    let fail = |message: String| TrainError::ConfigFile {
        path: path.into(),
        message,
    };
    let text = toml::to_string(config).map_err(|e| fail(e.to_string()))?;
    crate::util::write_atomically(path, text).map_err(|e| fail(e.to_string()))
}

/// The path of the first setting of `file` (under `path`) that `T` refuses on its own over
/// the defaults: a table's own key where one of its keys is refused.
fn refused_key<T: serde::de::DeserializeOwned>(
    defaults: &toml::Table,
    file: &toml::Table,
    path: &[String],
) -> Option<Vec<String>> {
    for (k, v) in file {
        let mut key = path.to_vec();
        key.push(k.clone());
        // Only this setting over the defaults: `{a: {b: v}}` for the key `a.b`.
        let alone = key.iter().rev().fold(v.clone(), |inner, name| {
            toml::Value::Table(toml::Table::from_iter([(name.clone(), inner)]))
        });
        let mut merged = defaults.clone();
        if let toml::Value::Table(t) = alone {
            merge(&mut merged, t);
        }
        if toml::Value::Table(merged).try_into::<T>().is_ok() {
            continue;
        }
        return match v {
            toml::Value::Table(inner) => refused_key::<T>(defaults, inner, &key).or(Some(key)),
            _ => Some(key),
        };
    }
    None
}

/// The value of `key` (a path of table names) in `file`.
fn value_at<'a>(file: &'a toml::Table, key: &[String]) -> Option<&'a toml::Value> {
    let (last, tables) = key.split_last()?;
    let mut table = file;
    for name in tables {
        table = table.get(name)?.as_table()?;
    }
    table.get(last)
}

/// What to write instead of `value`, refused for `key` with serde's `message`: a number or
/// boolean in quotes (as YAML and the command line hand TRL everything), a whole number
/// written as a float, a negative count. Empty when there is nothing to add.
fn what_to_write(key: &[String], value: Option<&toml::Value>, message: &str) -> String {
    let name = key.last().map_or("", String::as_str);
    let whole = ["usize", "u64", "u32", "u16", "u8", "i64", "i32"]
        .iter()
        .any(|t| message.ends_with(&format!("expected {t}")));
    let number = whole || message.ends_with("expected f64") || message.ends_with("expected f32");
    match value {
        Some(toml::Value::String(s)) if number && s.trim().parse::<f64>().is_ok() => {
            format!("; write the number without quotes: {name} = {}", s.trim())
        }
        Some(toml::Value::String(s))
            if message.ends_with("expected a boolean") && matches!(s.to_lowercase().trim(), "true" | "false") =>
        {
            format!(
                "; write the boolean without quotes: {name} = {}",
                s.to_lowercase().trim()
            )
        }
        Some(toml::Value::Float(f)) if whole && f.fract() == 0.0 && f.is_finite() => {
            format!("; write a whole number: {name} = {}", *f as i64)
        }
        Some(toml::Value::Integer(i)) if *i < 0 && name == "top_k" => {
            "; write top_k = 0 to keep every token (what vLLM spells -1), or a positive count".into()
        }
        Some(toml::Value::Integer(i)) if *i < 0 && whole => "; write a whole number, 0 or more".into(),
        _ => String::new(),
    }
}

/// ` (line N)` where `key` is set in `text` (after its table's header when nested), or nothing.
fn line_of(text: &str, key: &[String]) -> String {
    let Some((name, tables)) = key.split_last() else {
        return String::new();
    };
    let header = format!("[{}]", tables.join("."));
    let mut in_table = tables.is_empty();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.starts_with('[') {
            in_table = line == header;
            continue;
        }
        let assigned = line
            .strip_prefix(name.as_str())
            .is_some_and(|rest| rest.trim_start().starts_with('='));
        if in_table && assigned {
            return format!(" (line {})", i + 1);
        }
    }
    String::new()
}

/// `over`'s keys written into `base`, tables merged recursively.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// The first key of `file` (dotted, under `prefix`; `rewards[1].weight` inside an array of
/// tables) that the parsed config does not hold, with a hint: the closest known key at that
/// level (a typo), or, for a top-level setting TOML read into a table because it was written
/// after the table's header, where to move it.
fn unknown_key(file: &toml::Table, known: &toml::Table, root: &toml::Table, prefix: &str) -> Option<(String, String)> {
    use toml::Value::{Array, Table};
    file.iter().find_map(|(k, v)| match (known.get(k), v) {
        (None, _) if !prefix.is_empty() && root.contains_key(k) => Some((
            format!("{prefix}{k}"),
            format!(
                " (`{k}` is a top-level setting: TOML puts every key after a `[table]` or `[[array]]` header into that table; move it above the first header)"
            ),
        )),
        (None, _) => {
            let near = closest(k, known.keys().map(String::as_str));
            Some((
                format!("{prefix}{k}"),
                near.map_or(String::new(), |n| format!(" (did you mean `{prefix}{n}`?)")),
            ))
        }
        (Some(Table(kn)), Table(f)) => unknown_key(f, kn, root, &format!("{prefix}{k}.")),
        (Some(Array(kn)), Array(f)) => f.iter().zip(kn).enumerate().find_map(|(i, pair)| match pair {
            (Table(f), Table(kn)) => unknown_key(f, kn, root, &format!("{prefix}{k}[{i}].")),
            _ => None,
        }),
        _ => None,
    })
}

/// The candidate nearest to `word` by edit distance, when within a third of its length.
fn closest<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .map(|c| (edit_distance(word, c), c))
        .filter(|(d, _)| *d <= (word.len() / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Levenshtein distance over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let here = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(here + 1);
            prev = here;
        }
    }
    row[b.len()]
}

/// A relative `path` becomes `base/path`.
pub(crate) fn anchor(base: &Path, path: &mut PathBuf) {
    if path.is_relative() {
        *path = base.join(&*path);
    }
}

/// A relative `path` that exists under `base` becomes `base/path`; anything else (a hub repo
/// id, an absolute path) is left alone.
pub(crate) fn anchor_if_exists(base: &Path, path: &mut PathBuf) {
    if path.is_relative() && base.join(&*path).exists() {
        *path = base.join(&*path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(default)]
    struct Outer {
        #[serde(flatten)]
        shared: Shared,
        own: u32,
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(default)]
    struct Shared {
        rate: f64,
        nested: Nested,
    }

    #[derive(Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
    #[serde(default)]
    struct Nested {
        a: u32,
        b: u32,
    }

    impl Default for Shared {
        fn default() -> Self {
            Shared {
                rate: 0.5,
                nested: Nested { a: 1, b: 2 },
            }
        }
    }

    fn read(text: &str) -> Result<Outer, TrainError> {
        let dir = std::env::temp_dir().join(format!("treetrain-toml-{}-{}", std::process::id(), text.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(&file, text).unwrap();
        let out = read_toml::<Outer>(&file).map(|(c, _)| c);
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    #[test]
    fn file_keys_override_defaults_and_nested_tables_merge() {
        let c = read("own = 3\n[nested]\nb = 9\n").unwrap();
        assert_eq!(
            c,
            Outer {
                shared: Shared {
                    rate: 0.5,
                    nested: Nested { a: 1, b: 9 }
                },
                own: 3
            }
        );
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = read("rat = 0.1\n").unwrap_err().to_string();
        assert!(err.contains("unknown key `rat`"), "{err}");
        let err = read("[nested]\nc = 1\n").unwrap_err().to_string();
        assert!(err.contains("unknown key `nested.c`"), "{err}");
    }
}
