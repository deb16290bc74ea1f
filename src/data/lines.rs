//! JSON lines, plain or gzipped, read one bounded line at a time: a line longer than
//! [`MAX_LINE_BYTES`] (an endless line, a binary file named `.jsonl`) is an error naming the
//! file and the line, never an allocation that grows until the process aborts.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::DataError;

/// The longest line read: far above any row a trainer takes, far below the memory it has.
pub const MAX_LINE_BYTES: u64 = 256 * 1024 * 1024;

type Rows = Box<dyn Iterator<Item = Result<Map<String, Value>, DataError>>>;

/// The rows of `reader`'s JSON lines (blank lines skipped), each an object, errors naming
/// `path` and the line.
pub(crate) fn json_lines(reader: Box<dyn BufRead>, path: &Path) -> Rows {
    let path = path.to_path_buf();
    let mut lines = BoundedLines::new(reader);
    Box::new(std::iter::from_fn(move || {
        loop {
            let (n, line) = match lines.next()? {
                Ok(l) => l,
                Err((n, what)) => return Some(Err(file_error(&path, format!("line {n} {what}")))),
            };
            if line.trim().is_empty() {
                continue;
            }
            return Some(match serde_json::from_str::<Value>(&line) {
                Ok(Value::Object(m)) => Ok(m),
                Ok(_) => Err(file_error(&path, format!("line {n} is not a JSON object"))),
                Err(e) => Err(file_error(&path, format!("line {n}: {e}"))),
            });
        }
    }))
}

fn file_error(path: &Path, message: String) -> DataError {
    DataError::File {
        path: PathBuf::from(path),
        message,
    }
}

/// The lines of a reader, each at most [`MAX_LINE_BYTES`], numbered from 1; a longer line, a
/// line that is not UTF-8 or a read error ends them with an error: the line's number and what
/// is wrong with it (`is longer than 256 MiB: ...`).
pub struct BoundedLines<R> {
    reader: R,
    number: u64,
    done: bool,
}

impl<R: BufRead> BoundedLines<R> {
    /// The lines of `reader`.
    pub fn new(reader: R) -> Self {
        BoundedLines {
            reader,
            number: 0,
            done: false,
        }
    }
}

impl<R: BufRead> Iterator for BoundedLines<R> {
    /// `(line number, line)` (with its newline), or `(line number, what is wrong with it)`.
    type Item = Result<(u64, String), (u64, String)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        self.number += 1;
        let mut buf = Vec::new();
        let read = (&mut self.reader).take(MAX_LINE_BYTES + 1).read_until(b'\n', &mut buf);
        match read {
            Err(e) => {
                self.done = true;
                Some(Err((self.number, format!("cannot be read: {e}"))))
            }
            Ok(0) => {
                self.done = true;
                None
            }
            Ok(_) if buf.len() as u64 > MAX_LINE_BYTES => {
                self.done = true;
                Some(Err((
                    self.number,
                    format!(
                        "is longer than {} MiB: not a JSON line a row fits in",
                        MAX_LINE_BYTES >> 20
                    ),
                )))
            }
            Ok(_) => match String::from_utf8(buf) {
                Ok(line) => Some(Ok((self.number, line))),
                Err(_) => {
                    self.done = true;
                    Some(Err((self.number, "cannot be read as UTF-8 text".into())))
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_read_and_an_overlong_line_is_an_error_naming_it() {
        let text = "{\"a\": 1}\n\n{\"a\": 2}\n[3]\n";
        let rows: Vec<_> = json_lines(Box::new(std::io::Cursor::new(text)), Path::new("x.jsonl")).collect();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].as_ref().unwrap()["a"], 1);
        assert_eq!(rows[1].as_ref().unwrap()["a"], 2);
        assert!(
            rows[2]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("line 4 is not a JSON object")
        );
        // An endless line: the reader stops after the bound, it does not hold the whole line.
        let endless = std::io::repeat(b'x').take(MAX_LINE_BYTES + 10);
        let mut rows = json_lines(Box::new(std::io::BufReader::new(endless)), Path::new("y.jsonl"));
        let err = rows.next().unwrap().unwrap_err().to_string();
        assert!(err.contains("line 1 is longer than 256 MiB"), "{err}");
        assert!(rows.next().is_none());
    }
}
