//! JSON lines in and out: every subcommand that reads rows reads them here, with errors that
//! name `file:line`.

use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::{Context, Result};

/// One non-empty line of a JSONL file, parsed, with where it came from.
pub struct Line {
    /// `file:line` for error messages.
    pub at: String,
    /// The parsed value.
    pub value: serde_json::Value,
}

/// Every non-empty line of `path` (`-`: standard input) as JSON.
pub fn read(path: &Path) -> Result<Vec<Line>> {
    let reader: Box<dyn BufRead> = if path.as_os_str() == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        Box::new(std::io::BufReader::new(file))
    };
    let mut lines = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), i + 1);
        let value = serde_json::from_str(&line).with_context(|| format!("{at}: not JSON"))?;
        lines.push(Line { at, value });
    }
    Ok(lines)
}

/// Writes each value as one line on standard output.
pub fn write(values: impl IntoIterator<Item = serde_json::Value>) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    for v in values {
        writeln!(stdout, "{v}")?;
    }
    Ok(())
}
