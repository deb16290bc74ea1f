//! JSON lines in and out: every subcommand that reads rows reads them here, with errors that
//! name `file:line`.

use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::{Context, Result};

/// One non-empty line of a JSONL file, parsed, with where it came from.
pub(crate) struct Line {
    /// `file:line` for error messages.
    pub(crate) at: String,
    /// The parsed value.
    pub(crate) value: serde_json::Value,
}

/// Every non-empty line of `path` (`-`: standard input) as JSON.
pub(crate) fn read(path: &Path) -> Result<Vec<Line>> {
    let reader: Box<dyn BufRead> = if path.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        Box::new(std::io::BufReader::new(file))
    };
    let mut lines = Vec::new();
    // Bounded: one endless line is an error, not an allocation that grows until an abort.
    for line in treetrain::data::BoundedLines::new(reader) {
        let (number, line) = line.map_err(|(n, why)| anyhow::anyhow!("{}:{n}: {why}", path.display()))?;
        let at = format!("{}:{number}", path.display());
        if line.trim().is_empty() {
            continue;
        }
        let value = serde_json::from_str(&line).with_context(|| format!("{at}: not JSON{}", non_json_hint(&line)))?;
        lines.push(Line { at, value });
    }
    Ok(lines)
}

/// Why a line that looks like Python's `json.dumps` output is not JSON: NaN and infinities
/// have no JSON spelling. Names the field holding the first one.
fn non_json_hint(line: &str) -> String {
    let bare = |word: &str| {
        line.match_indices(word)
            .find(|(i, _)| !line[..*i].ends_with(|c: char| c.is_alphanumeric() || c == '"'))
            .map(|(i, _)| i)
    };
    let Some(at) = bare("NaN").into_iter().chain(bare("Infinity")).min() else {
        return String::new();
    };
    // The nearest `"key":` before it.
    let before = &line[..at];
    let field = before.rfind("\":").and_then(|end| {
        let start = before[..end].rfind('"')?;
        Some(format!(" in field `{}`", &before[start + 1..end]))
    });
    format!(
        " (NaN and Infinity are not JSON numbers{}: write null, or a finite value)",
        field.unwrap_or_default()
    )
}

/// Writes each value as one line on standard output.
pub(crate) fn write(values: impl IntoIterator<Item = serde_json::Value>) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    for v in values {
        writeln!(stdout, "{v}")?;
    }
    Ok(())
}
