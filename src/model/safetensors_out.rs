//! A safetensors file written as its tensors come: the header (every name, shape and offset)
//! first, then each tensor's bytes in the header's order, a bounded chunk at a time. Saving a
//! model this way never holds a second copy of it, and a sharded model's units can be gathered,
//! written and freed one after another.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use super::error::ModelError;

/// Bytes converted and written at a time.
const CHUNK_BYTES: i64 = 64 << 20;

/// An open safetensors file expecting its tensors in order.
pub(crate) struct SafetensorsOut {
    path: PathBuf,
    file: BufWriter<File>,
    entries: Vec<(String, Vec<i64>)>,
    kind: Kind,
    next: usize,
}

/// safetensors' name of `kind`.
fn dtype_name(kind: Kind) -> Result<&'static str, String> {
    match kind {
        Kind::Float => Ok("F32"),
        Kind::BFloat16 => Ok("BF16"),
        Kind::Half => Ok("F16"),
        other => Err(format!("cannot save dtype {other:?}")),
    }
}

impl SafetensorsOut {
    /// Creates `path` and writes the header of `entries` (name, shape), stored in that order
    /// as `kind`, with `{"format": "pt"}` (which transformers checks) and `metadata`.
    pub(crate) fn create(
        path: &Path,
        entries: Vec<(String, Vec<i64>)>,
        kind: Kind,
        metadata: &[(&str, String)],
    ) -> Result<Self, ModelError> {
        let fail = |message: String| ModelError::Safetensors {
            file: path.into(),
            message,
        };
        let dtype = dtype_name(kind).map_err(fail)?;
        let mut meta = serde_json::Map::new();
        meta.insert("format".into(), "pt".into());
        for (k, v) in metadata {
            meta.insert((*k).into(), v.clone().into());
        }
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), meta.into());
        let mut at = 0u64;
        for (name, shape) in &entries {
            let bytes = shape.iter().product::<i64>() as u64 * kind.elt_size_in_bytes() as u64;
            let info = serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + bytes]});
            if header.insert(name.clone(), info).is_some() {
                return Err(fail(format!("`{name}` is named twice")));
            }
            at += bytes;
        }
        let mut text = serde_json::Value::Object(header).to_string().into_bytes();
        // The data starts 8-aligned, as safetensors' own writer pads it.
        text.resize(text.len().next_multiple_of(8), b' ');
        let file = File::create(path).map_err(|e| ModelError::io(path, e))?;
        let mut file = BufWriter::new(file);
        file.write_all(&(text.len() as u64).to_le_bytes())
            .and_then(|()| file.write_all(&text))
            .map_err(|e| ModelError::io(path, e))?;
        Ok(Self {
            path: path.into(),
            file,
            entries,
            kind,
            next: 0,
        })
    }

    /// The name of the tensor [`SafetensorsOut::write`] takes next.
    pub(crate) fn next_name(&self) -> Option<&str> {
        self.entries.get(self.next).map(|(n, _)| n.as_str())
    }

    /// Writes the next tensor's bytes (in the file's dtype; it must have the header's shape).
    pub(crate) fn write(&mut self, t: &Tensor) -> Result<(), ModelError> {
        let Some((name, shape)) = self.entries.get(self.next) else {
            return Err(self.fail("more tensors written than its header names".into()));
        };
        if t.size() != *shape {
            let message = format!("`{name}` has shape {:?}; the header says {shape:?}", t.size());
            return Err(self.fail(message));
        }
        let flat = t.f_reshape([-1])?;
        let step = (CHUNK_BYTES / self.kind.elt_size_in_bytes() as i64).max(1);
        let numel = flat.numel() as i64;
        let mut data = Vec::new();
        for start in (0..numel).step_by(step as usize) {
            let len = step.min(numel - start);
            let chunk = flat
                .f_narrow(0, start, len)?
                .f_to_kind(self.kind)?
                .f_to_device(tch::Device::Cpu)?
                .f_contiguous()?;
            data.resize(len as usize * self.kind.elt_size_in_bytes(), 0);
            chunk.f_copy_data_u8(&mut data, len as usize)?;
            self.file.write_all(&data).map_err(|e| ModelError::io(&self.path, e))?;
        }
        self.next += 1;
        Ok(())
    }

    /// Flushes the file to disk; every tensor of the header must have been written.
    pub(crate) fn finish(mut self) -> Result<(), ModelError> {
        if let Some(name) = self.next_name() {
            let message = format!("closed before `{name}` was written");
            return Err(self.fail(message));
        }
        self.file.flush().map_err(|e| ModelError::io(&self.path, e))?;
        let file = self.file.get_ref();
        file.sync_all().map_err(|e| ModelError::io(&self.path, e))
    }

    fn fail(&self, message: String) -> ModelError {
        ModelError::Safetensors {
            file: self.path.clone(),
            message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file written in pieces, in an order that is not the names', with a tensor larger
    /// than a chunk: safetensors' own reader finds every tensor's values.
    #[test]
    fn a_streamed_file_reads_back_through_safetensors() {
        let path = std::env::temp_dir().join(format!("treetrain-streamed-{}.safetensors", std::process::id()));
        let big = Tensor::arange(CHUNK_BYTES / 2 + 3, (Kind::Float, tch::Device::Cpu))
            .f_sin()
            .unwrap();
        let small = Tensor::from_slice(&[1.5f32, -2.0, 3.25, 0.0, 7.0, 8.0]).view([2, 3]);
        let entries = vec![("z.small".to_string(), vec![2, 3]), ("a.big".to_string(), big.size())];
        let mut out = SafetensorsOut::create(&path, entries, Kind::BFloat16, &[("rank", "1".into())]).unwrap();
        assert_eq!(out.next_name(), Some("z.small"));
        assert!(out.write(&big).is_err(), "a tensor of another shape is refused");
        out.write(&small).unwrap();
        out.write(&big).unwrap();
        out.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
        assert_eq!(meta.metadata().as_ref().unwrap()["rank"], "1");
        let read = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, want) in [("z.small", &small), ("a.big", &big)] {
            let view = read.tensor(name).unwrap();
            assert_eq!(view.dtype(), safetensors::Dtype::BF16);
            let got = Tensor::from_data_size(view.data(), &want.size(), Kind::BFloat16);
            assert!(
                got.to_kind(Kind::Float)
                    .equal(&want.to_kind(Kind::BFloat16).to_kind(Kind::Float)),
                "{name}"
            );
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn closing_before_every_tensor_is_written_is_an_error() {
        let path = std::env::temp_dir().join(format!("treetrain-short-{}.safetensors", std::process::id()));
        let out = SafetensorsOut::create(&path, vec![("w".into(), vec![2])], Kind::Float, &[]).unwrap();
        let err = out.finish().unwrap_err().to_string();
        assert!(err.contains("closed before `w` was written"), "{err}");
        let _ = std::fs::remove_file(&path);
    }
}
