//! The tensors of a checkpoint that treetrain reads past but must write back: a multimodal
//! checkpoint's towers (Muse Spark's vision and audio towers and their projections), which the
//! text decoder never loads. A save copies them from the folder the model came from, so the
//! folder it writes loads in transformers with nothing missing.
//!
//! Only the headers of the source files are parsed, and only the towers' byte ranges read: the
//! decoder's tensors, most of a checkpoint, are never read twice.

use std::collections::HashSet;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use serde_json::Value;
use tch::{Kind, Tensor};

use super::error::ModelError;
use super::loaded::Model;
use super::weights::weight_files;

impl Model {
    /// The source checkpoint's tensors of `model` outside the decoder's own prefix, by name
    /// (none for a model whose decoder is the whole checkpoint, or that came from no folder).
    pub(crate) fn passthrough_tensors(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        let (Some(dir), true) = (&self.source, self.lm.config.parts.language_model) else {
            return Ok(Vec::new());
        };
        let prefix = format!("{}.", self.lm.prefix());
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for file in weight_files(dir)? {
            for (name, tensor) in read_where(&file, |n| n.starts_with("model.") && !n.starts_with(&prefix))? {
                if seen.insert(name.clone()) {
                    out.push((name, tensor));
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

/// The tensors of safetensors `file` whose names `keep` accepts, read from their byte ranges.
fn read_where(file: &Path, keep: impl Fn(&str) -> bool) -> Result<Vec<(String, Tensor)>, ModelError> {
    let bad = |message: String| ModelError::Safetensors {
        file: file.into(),
        message,
    };
    let mut f = File::open(file).map_err(|e| ModelError::io(file, e))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| ModelError::io(file, e))?;
    let len = u64::from_le_bytes(len);
    let mut header = vec![0u8; usize::try_from(len).map_err(|_| bad(format!("header of {len} bytes")))?];
    f.read_exact(&mut header).map_err(|e| ModelError::io(file, e))?;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let mut out = Vec::new();
    for (name, entry) in header.iter().filter(|(n, _)| n.as_str() != "__metadata__" && keep(n)) {
        let field = |key: &str| entry.get(key).ok_or_else(|| bad(format!("{name}: no {key}")));
        let kind = match field("dtype")?.as_str() {
            Some("F32") => Kind::Float,
            Some("BF16") => Kind::BFloat16,
            Some("F16") => Kind::Half,
            Some("F64") => Kind::Double,
            other => return Err(bad(format!("{name}: unsupported dtype {other:?}"))),
        };
        let shape: Vec<i64> =
            serde_json::from_value(field("shape")?.clone()).map_err(|e| bad(format!("{name}: {e}")))?;
        let [start, end]: [u64; 2] =
            serde_json::from_value(field("data_offsets")?.clone()).map_err(|e| bad(format!("{name}: {e}")))?;
        let mut bytes =
            vec![0u8; usize::try_from(end.saturating_sub(start)).map_err(|_| bad(format!("{name}: size")))?];
        f.seek(SeekFrom::Start(8 + len + start))
            .map_err(|e| ModelError::io(file, e))?;
        f.read_exact(&mut bytes).map_err(|e| ModelError::io(file, e))?;
        let tensor = Tensor::f_from_data_size(&bytes, &shape, kind).map_err(|e| bad(format!("{name}: {e}")))?;
        out.push((name.clone(), tensor));
    }
    Ok(out)
}
