//! TensorBoard event files, written by treetrain itself: TFRecord framing ([`record`]) around
//! `Event` protobuf messages ([`proto`]). Scalars are `simple_value`s (what every TensorBoard
//! reader takes); text is a string tensor under the `text` plugin (markdown, tables included).
//!
//! A resumed run appends a new file to the same folder and opens it with a `SessionLog START`
//! at its first step: TensorBoard then drops whatever an earlier file logged from that step on
//! (the steps a killed run took after its last checkpoint), so no step shows twice.

pub(crate) mod proto;
pub(crate) mod record;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use prost::Message;
use proto::{Event, PluginData, SessionLog, Summary, SummaryMetadata, SummaryValue, TensorProto, TensorShape};

/// An open event file.
#[derive(Debug)]
pub(crate) struct EventWriter {
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<seconds>.<host>.<pid>.<n>` (TensorBoard's naming, so
    /// its reader orders the files of a folder by creation) and writes the file-version record.
    pub(crate) fn create(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = wall_time();
        let host = crate::util::host_name();
        let pid = std::process::id();
        let file = (0..1000)
            .find_map(|n| {
                let path = dir.join(format!("events.out.tfevents.{}.{host}.{pid}.{n}", now as u64));
                File::options().write(true).create_new(true).open(&path).ok()
            })
            .ok_or_else(|| io::Error::other(format!("{}: no free event file name", dir.display())))?;
        let mut writer = EventWriter {
            file: BufWriter::new(file),
        };
        writer.write(Event {
            wall_time: now,
            file_version: Some("brain.Event:2".into()),
            ..Event::default()
        })?;
        writer.flush()?;
        Ok(writer)
    }

    /// Marks a (resumed) session starting at `step`: earlier files' events at or after it are
    /// orphans TensorBoard purges.
    pub(crate) fn session_start(&mut self, step: u64) -> io::Result<()> {
        self.write(Event {
            wall_time: wall_time(),
            step: step as i64,
            session_log: Some(SessionLog {
                status: proto::SESSION_START,
            }),
            ..Event::default()
        })
    }

    /// One event holding `scalars` at `step`.
    pub(crate) fn scalars(&mut self, step: u64, scalars: &[(String, f64)]) -> io::Result<()> {
        let value = scalars
            .iter()
            .map(|(tag, v)| SummaryValue {
                tag: tag.clone(),
                simple_value: Some(*v as f32),
                ..SummaryValue::default()
            })
            .collect();
        self.summary(step, value)
    }

    /// `markdown` under `tag` at `step`, for the text plugin.
    pub(crate) fn text(&mut self, tag: &str, step: u64, markdown: &str) -> io::Result<()> {
        let value = SummaryValue {
            tag: tag.into(),
            tensor: Some(TensorProto {
                dtype: proto::DT_STRING,
                tensor_shape: Some(TensorShape::default()),
                string_val: vec![markdown.as_bytes().to_vec()],
            }),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                    content: Vec::new(),
                }),
            }),
            ..SummaryValue::default()
        };
        self.summary(step, vec![value])
    }

    /// Pushes what was written to the file, so a live TensorBoard sees the step.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }

    fn summary(&mut self, step: u64, value: Vec<SummaryValue>) -> io::Result<()> {
        self.write(Event {
            wall_time: wall_time(),
            step: step as i64,
            summary: Some(Summary { value }),
            ..Event::default()
        })
    }

    fn write(&mut self, event: Event) -> io::Result<()> {
        record::write_record(&mut self.file, &event.encode_to_vec())
    }
}

/// Every scalar of the event files in `dir`, by tag, as `(step, value)` in step order, read
/// as TensorBoard reads them: files in name order, a `SessionLog START` dropping what earlier
/// files logged at or after its step.
pub(crate) fn read_scalars(dir: &Path) -> io::Result<BTreeMap<String, Vec<(u64, f64)>>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().contains("tfevents")))
        .collect();
    files.sort();
    let mut tags: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    for path in files {
        let records = record::read_records(&mut File::open(&path)?)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        for bytes in records {
            let event = Event::decode(&bytes[..])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))?;
            let step = event.step.max(0) as u64;
            if event.session_log.is_some_and(|s| s.status == proto::SESSION_START) {
                tags.values_mut().for_each(|points| points.retain(|p| p.0 < step));
            }
            for v in event.summary.map(|s| s.value).unwrap_or_default() {
                if let Some(x) = v.simple_value {
                    tags.entry(v.tag).or_default().push((step, f64::from(x)));
                }
            }
        }
    }
    tags.values_mut().for_each(|points| points.sort_by_key(|p| p.0));
    Ok(tags)
}

fn wall_time() -> f64 {
    crate::util::clock::since_epoch().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_read_back_and_a_resumed_session_replaces_the_orphaned_steps() {
        let dir = std::env::temp_dir().join(format!("treetrain-tb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut first = EventWriter::create(&dir).unwrap();
        for step in 1..=4 {
            first.scalars(step, &[("train/loss".into(), step as f64)]).unwrap();
        }
        first.text("args", 0, "| a |\n|---|\n| 1 |").unwrap();
        first.flush().unwrap();
        drop(first);
        let mut resumed = EventWriter::create(&dir).unwrap();
        resumed.session_start(3).unwrap();
        resumed.scalars(3, &[("train/loss".into(), 30.0)]).unwrap();
        resumed.flush().unwrap();
        let read = read_scalars(&dir).unwrap();
        assert_eq!(read["train/loss"], vec![(1, 1.0), (2, 2.0), (3, 30.0)]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
