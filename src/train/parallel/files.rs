//! A sharded run's optimizer state in a checkpoint: each rank writes its own shards to
//! `optimizer.shard-<rank>-of-<size>.safetensors` (`exp_avg.unit<i>`, `exp_avg_sq.unit<i>` and,
//! where kept, `master.unit<i>`: fp32 `[shard]` each; under `full_shard` the master shard is the
//! rank's parameter shard), and rank 0, once every file is there, the manifest
//! `optimizer.shards.json`: the world size, each unit's parameters (name, shape) and shard
//! length, and each file with its size. No process ever holds another rank's state.
//!
//! A run of the same world size and units reads its own file back; any other run (another
//! `fsdp`, no sharding, other ranks) gets the whole tensors assembled from every file under the
//! names `optimizer.safetensors` uses, and shards them its own way.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::shards::Shards;
use crate::model::{ModelError, SafetensorsOut};
use crate::train::adamw::{moment_from, read_step, read_whole, write_step};

/// The manifest's file name.
pub(crate) const MANIFEST_FILE: &str = "optimizer.shards.json";

/// What rank 0 writes last: how the state was cut and where each rank's part is.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Manifest {
    world_size: usize,
    units: Vec<UnitLayout>,
    files: Vec<ShardFile>,
}

/// One unit: its parameters in flattening order, and the elements of each rank's shard.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct UnitLayout {
    params: Vec<(String, Vec<i64>)>,
    shard: i64,
}

/// One rank's file and its size in bytes.
#[derive(Debug, Serialize, Deserialize)]
struct ShardFile {
    rank: usize,
    file: String,
    bytes: u64,
}

/// The file name of rank `rank`'s shards of `size`.
fn shard_file(rank: usize, size: usize) -> String {
    format!("optimizer.shard-{rank}-of-{size}.safetensors")
}

const PREFIXES: [&str; 3] = ["exp_avg", "exp_avg_sq", "master"];

impl Shards {
    fn layout(&self) -> Vec<UnitLayout> {
        let unit = |(u, shard): (&super::units::Unit, &i64)| UnitLayout {
            params: u.names.iter().cloned().zip(u.params.iter().map(|p| p.size())).collect(),
            shard: *shard,
        };
        self.units.iter().zip(&self.shard).map(unit).collect()
    }

    /// This rank's part of a checkpoint in the folder `dir` every rank writes into: its shards
    /// (the moments and `masters`), a tensor at a time; rank 0 writes `optimizer.json` too.
    pub(crate) fn write_state(&self, dir: &Path, masters: &[Option<&Tensor>]) -> Result<(), ModelError> {
        let (rank, size) = (self.world.rank, self.world.size);
        let tensors = self.tensors(masters);
        let entries = tensors.iter().map(|(n, t)| (n.clone(), t.size())).collect();
        let meta = [
            ("rank", rank.to_string()),
            ("world_size", size.to_string()),
            ("step", self.step.to_string()),
        ];
        let path = dir.join(shard_file(rank, size));
        let mut out = SafetensorsOut::create(&path, entries, Kind::Float, &meta)?;
        for (_, t) in &tensors {
            out.write(t)?;
        }
        out.finish()?;
        match self.world.is_main() {
            true => write_step(dir, self.step, &self.config),
            false => Ok(()),
        }
    }

    /// Rank 0, once every rank has written its file into `dir`: the manifest naming them. A
    /// file missing is an error naming its rank.
    pub(crate) fn write_manifest(&self, dir: &Path) -> Result<(), ModelError> {
        let size = self.world.size;
        let mut files = Vec::new();
        for rank in 0..size {
            let file = shard_file(rank, size);
            let path = dir.join(&file);
            let bytes = std::fs::metadata(&path)
                .map_err(|e| {
                    let why = format!("rank {rank}'s shard: {e} (is output_dir on a filesystem every rank sees?)");
                    ModelError::io(&path, std::io::Error::other(why))
                })?
                .len();
            files.push(ShardFile { rank, file, bytes });
        }
        let manifest = Manifest {
            world_size: size,
            units: self.layout(),
            files,
        };
        let value = serde_json::to_value(&manifest).map_err(|e| ModelError::Json {
            path: dir.join(MANIFEST_FILE),
            message: e.to_string(),
        })?;
        crate::model::write_json(&dir.join(MANIFEST_FILE), &value)
    }

    /// Reads the optimizer state of the checkpoint folder `dir`, whatever cut it: the update
    /// count, and this rank's own file into the moments and `masters` when cut as this state
    /// (`None` returned), else the whole tensors by their names in `optimizer.safetensors`
    /// (every name of [`Shards::named_shapes`]) for the mode to take its shards from.
    pub(crate) fn read_state(
        &mut self,
        dir: &Path,
        masters: &[Option<&Tensor>],
    ) -> Result<Option<BTreeMap<String, Tensor>>, ModelError> {
        self.step = read_step(dir)?;
        if !dir.join(MANIFEST_FILE).is_file() {
            return read_whole(dir, &self.named_shapes()).map(Some);
        }
        let manifest = Manifest::read(dir)?;
        if manifest.world_size == self.world.size && manifest.units == self.layout() {
            self.load_own(dir, &manifest, masters)?;
            return Ok(None);
        }
        manifest.assemble(dir, self.step, &self.named_shapes()).map(Some)
    }

    /// Reads this rank's file of a checkpoint cut as this state. A unit's master shard the
    /// file lacks (an fp32 run without sharded parameters) stays as made from the checkpoint's
    /// weights.
    fn load_own(&self, dir: &Path, manifest: &Manifest, masters: &[Option<&Tensor>]) -> Result<(), ModelError> {
        let rank = self.world.rank;
        let bytes = manifest.read_file(dir, rank, self.step)?;
        let path = dir.join(shard_file(rank, self.world.size));
        let st = open(&bytes, &path)?;
        for (key, dst) in self.tensors(masters) {
            let Ok(view) = st.tensor(&key) else {
                if key.starts_with("master.") {
                    continue;
                }
                return Err(missing(&key, dir, &path));
            };
            let src = moment_from(&view, &key, &dst.size()).map_err(|m| bad(&path, m))?;
            tch::no_grad(|| dst.shallow_clone().f_copy_(&src))?;
        }
        Ok(())
    }

    /// The whole state's names in `optimizer.safetensors` (`exp_avg.<name>`, `exp_avg_sq.<name>`,
    /// `master.<name>` of parameters that are not fp32) and their shapes.
    pub(crate) fn named_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let mut out = Vec::new();
        for prefix in PREFIXES {
            for (name, p) in self.units.iter().flat_map(|u| u.named()) {
                if stored(prefix, p) {
                    out.push((format!("{prefix}.{name}"), p.size()));
                }
            }
        }
        out
    }

    /// This rank's moment shards taken from the whole tensors `named`.
    pub(crate) fn load_moments(&self, named: &BTreeMap<String, Tensor>) -> Result<(), ModelError> {
        for (prefix, moments) in [("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)] {
            for (u, dst) in moments.iter().enumerate() {
                // Every moment is there (the readers check); never read a sharded parameter.
                let pick = |name: &str, p: &Tensor| match named.get(&format!("{prefix}.{name}")) {
                    Some(t) => t.f_to_kind(Kind::Float),
                    None => p.f_zeros_like()?.f_to_kind(Kind::Float),
                };
                let src = self.flat(u, &pick)?;
                tch::no_grad(|| dst.shallow_clone().f_copy_(&src))?;
            }
        }
        Ok(())
    }
}

/// Whether a checkpoint holds the state `prefix` (`exp_avg`, `exp_avg_sq`, `master`) of
/// parameter `p`: the moments always, a master weight only for a half-precision parameter (as
/// the replicated optimizer keeps them).
fn stored(prefix: &str, p: &Tensor) -> bool {
    prefix != "master" || p.kind() != Kind::Float
}

impl Manifest {
    /// The manifest of the checkpoint folder `dir`.
    pub(crate) fn read(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        serde_json::from_str(&text).map_err(|e| ModelError::Json {
            path,
            message: e.to_string(),
        })
    }

    /// Rank `rank`'s file (always its own name in the folder, which the manifest must list),
    /// checked against the size the manifest recorded and for the origin it records (the
    /// checkpoint's update count `step`).
    fn read_file(&self, dir: &Path, rank: usize, step: u64) -> Result<Vec<u8>, ModelError> {
        let name = shard_file(rank, self.world_size);
        let path = dir.join(&name);
        let Some(entry) = self.files.iter().find(|f| f.rank == rank && f.file == name) else {
            return Err(bad(&path, format!("rank {rank}'s file is not in {MANIFEST_FILE}")));
        };
        let bytes = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
        if entry.bytes != bytes.len() as u64 {
            let m = format!("is {} bytes; the manifest says {}", bytes.len(), entry.bytes);
            return Err(bad(&path, m));
        }
        check_origin(
            &bytes,
            &path,
            [
                ("rank", rank as u64),
                ("world_size", self.world_size as u64),
                ("step", step),
            ],
        )?;
        Ok(bytes)
    }

    /// The whole state under `optimizer.safetensors`' names, assembled from every rank's file
    /// (each written at update `step`): each of `wanted` (name, shape), checked as a whole file's tensors are. A parameter the
    /// manifest holds but `wanted` does not is an error (another model's state); master
    /// weights nobody wants (an fp32 run reading a `full_shard` one's) are skipped.
    pub(crate) fn assemble(
        &self,
        dir: &Path,
        step: u64,
        wanted: &[(String, Vec<i64>)],
    ) -> Result<BTreeMap<String, Tensor>, ModelError> {
        let bytes = (0..self.world_size)
            .map(|r| self.read_file(dir, r, step))
            .collect::<Result<Vec<_>, _>>()?;
        // Each file's header parsed once, for every unit and kind read from it.
        let files = (bytes.iter().enumerate())
            .map(|(r, b)| {
                let path = dir.join(shard_file(r, self.world_size));
                let st = open(b, &path)?;
                Ok((path, st))
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let path = dir.join(MANIFEST_FILE);
        let shapes: BTreeMap<&str, &Vec<i64>> = wanted.iter().map(|(k, s)| (k.as_str(), s)).collect();
        let mut out = BTreeMap::new();
        for (u, unit) in self.units.iter().enumerate() {
            for prefix in PREFIXES {
                let Some(whole) = unit_whole(&files, &format!("{prefix}.unit{u}"), unit.shard)? else {
                    continue;
                };
                let mut at = 0;
                for (name, shape) in &unit.params {
                    let key = format!("{prefix}.{name}");
                    let n: i64 = shape.iter().product();
                    match shapes.get(key.as_str()) {
                        Some(want) if *want != shape => {
                            let m = format!("`{key}` has shape {shape:?}; its parameter has {want:?}");
                            return Err(bad(&path, m));
                        }
                        Some(_) => drop(out.insert(key, whole.f_narrow(0, at, n)?.f_view(shape.as_slice())?)),
                        None if prefix == "master" => {}
                        None => {
                            let m = format!("holds `{key}`, a state of no parameter this run trains");
                            return Err(bad(&path, m));
                        }
                    }
                    at += n;
                }
            }
        }
        match wanted.iter().find(|(k, _)| !out.contains_key(k)) {
            Some((key, _)) => Err(missing(key, dir, &path)),
            None => Ok(out),
        }
    }
}

/// One unit's `key` from every rank's file (path, parsed), concatenated (`None` when the files
/// lack it).
fn unit_whole(
    files: &[(std::path::PathBuf, safetensors::SafeTensors<'_>)],
    key: &str,
    shard: i64,
) -> Result<Option<Tensor>, ModelError> {
    let mut parts = Vec::new();
    for (path, st) in files {
        let Ok(view) = st.tensor(key) else {
            return Ok(None);
        };
        parts.push(moment_from(&view, key, &[shard]).map_err(|m| bad(path, m))?);
    }
    Ok(Some(Tensor::f_cat(&parts, 0)?))
}

/// Checks that the file `path` (its `bytes`) records each of `want` (the rank that wrote it,
/// the world size, the update count) as its name and the checkpoint say: two ranks' files
/// swapped, or a file copied from another checkpoint, have the right sizes but the wrong
/// state. A file without `step` (written before it was recorded) is checked for the rest.
fn check_origin(bytes: &[u8], path: &Path, want: [(&str, u64); 3]) -> Result<(), ModelError> {
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(path, e.to_string()))?;
    let meta = header.metadata().clone().unwrap_or_default();
    for (key, value) in want {
        let recorded = meta.get(key);
        if recorded.is_none() && key == "step" {
            continue;
        }
        if recorded.and_then(|v| v.parse::<u64>().ok()) != Some(value) {
            let found = recorded.map_or("nothing".to_string(), |v| format!("{v:?}"));
            let m = format!(
                "records {key} {found}; this file must hold {key} {value} (files swapped between ranks or copied from another checkpoint?)"
            );
            return Err(bad(path, m));
        }
    }
    Ok(())
}

fn open<'a>(bytes: &'a [u8], path: &Path) -> Result<safetensors::SafeTensors<'a>, ModelError> {
    safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad(path, e.to_string()))
}

fn bad(path: &Path, message: String) -> ModelError {
    ModelError::Safetensors {
        file: path.into(),
        message,
    }
}

fn missing(key: &str, dir: &Path, path: &Path) -> ModelError {
    ModelError::MissingTensor {
        name: key.into(),
        dir: dir.into(),
        files: path.file_name().unwrap_or_default().to_string_lossy().into(),
    }
}
