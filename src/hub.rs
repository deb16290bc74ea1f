//! Resolving Hugging Face repo ids to files in the local hub cache, offline first.
//!
//! Layout (as `huggingface_hub` writes it): `<cache>/models--org--name/refs/<revision>` holds a
//! commit hash and `<cache>/models--org--name/snapshots/<commit>/<file>` the files (datasets:
//! `datasets--org--name`). The cache is `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`. With `HF_HUB_OFFLINE=1`
//! nothing is downloaded; otherwise missing files are fetched with hf-hub into the same cache.

use std::path::{Path, PathBuf};

use crate::device::HostProbe;

/// Errors from hub resolution.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// A file is not in the cache and could not be downloaded.
    #[error("{0}")]
    Missing(Box<MissingFile>),
    /// The spec is neither an existing folder nor a repo id.
    #[error("`{0}` is neither a local folder nor a repo id of the form org/name[@revision]")]
    BadSpec(String),
    /// The spec names a local path that is not a model folder.
    #[error("{path}: {reason}")]
    NotAFolder {
        /// The path as given.
        path: String,
        /// What is there instead.
        reason: &'static str,
    },
}

/// A repo file that is neither cached nor downloadable.
#[derive(Debug)]
pub struct MissingFile {
    /// `model` or `dataset`.
    pub kind: &'static str,
    /// Repo id.
    pub repo: String,
    /// Revision asked for.
    pub revision: String,
    /// The missing file.
    pub file: String,
    /// Cache searched.
    pub cache: PathBuf,
    /// Why it was not downloaded.
    pub why: String,
}

impl std::fmt::Display for MissingFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} repo `{}` at revision `{}`: file `{}` is not in the cache {}{}",
            self.kind,
            self.repo,
            self.revision,
            self.file,
            self.cache.display(),
            self.why
        )
    }
}

/// Model or dataset repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepoType {
    /// `models--...`
    Model,
    /// `datasets--...`
    Dataset,
}

impl RepoType {
    fn prefix(self) -> &'static str {
        match self {
            RepoType::Model => "models",
            RepoType::Dataset => "datasets",
        }
    }
    fn name(self) -> &'static str {
        match self {
            RepoType::Model => "model",
            RepoType::Dataset => "dataset",
        }
    }
}

/// Finds repo files in the hub cache, downloading only when allowed.
#[derive(Debug, Clone)]
pub struct HubCache {
    /// The hub cache folder.
    pub root: PathBuf,
    /// `HF_HUB_OFFLINE`: never download.
    pub offline: bool,
}

fn truthy(v: Option<&str>) -> bool {
    matches!(
        v.map(|s| s.trim().to_ascii_lowercase()).as_deref(),
        Some("1" | "true" | "yes" | "on")
    )
}

impl HubCache {
    /// The cache this process's environment points at.
    pub fn from_env() -> Self {
        Self::from_probe(&HostProbe::system())
    }

    /// The cache an environment points at (tests pass a fake one).
    pub fn from_probe(probe: &HostProbe) -> Self {
        let root = if let Some(c) = probe.var("HF_HUB_CACHE").or(probe.var("HUGGINGFACE_HUB_CACHE")) {
            PathBuf::from(c)
        } else if let Some(h) = probe.var("HF_HOME") {
            Path::new(h).join("hub")
        } else if let Some(x) = probe.var("XDG_CACHE_HOME") {
            Path::new(x).join("huggingface/hub")
        } else {
            Path::new(probe.var("HOME").unwrap_or("/")).join(".cache/huggingface/hub")
        };
        HubCache {
            root,
            offline: truthy(probe.var("HF_HUB_OFFLINE")) || truthy(probe.var("TRANSFORMERS_OFFLINE")),
        }
    }

    fn repo_dir(&self, kind: RepoType, repo: &str) -> PathBuf {
        self.root
            .join(format!("{}--{}", kind.prefix(), repo.replace('/', "--")))
    }

    /// The snapshot folder of `repo` at `revision` (a branch, tag or commit), if cached.
    pub fn snapshot(&self, kind: RepoType, repo: &str, revision: &str) -> Option<PathBuf> {
        let dir = self.repo_dir(kind, repo);
        let commit = if revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit()) {
            revision.to_string()
        } else {
            std::fs::read_to_string(dir.join("refs").join(revision))
                .ok()?
                .trim()
                .to_string()
        };
        let snap = dir.join("snapshots").join(commit);
        snap.is_dir().then_some(snap)
    }

    /// The path of `file` in `repo` at `revision`: from the cache, else downloaded (unless
    /// offline), else an error naming repo, revision and file.
    pub fn file(&self, kind: RepoType, repo: &str, revision: &str, file: &str) -> Result<PathBuf, HubError> {
        if let Some(snap) = self.snapshot(kind, repo, revision) {
            let p = snap.join(file);
            if p.exists() {
                return Ok(p);
            }
        }
        let missing = |why: String| {
            HubError::Missing(Box::new(MissingFile {
                kind: kind.name(),
                repo: repo.into(),
                revision: revision.into(),
                file: file.into(),
                cache: self.root.clone(),
                why,
            }))
        };
        if self.offline {
            return Err(missing(" (HF_HUB_OFFLINE is set, so nothing is downloaded)".into()));
        }
        self.download(kind, repo, revision, file)
            .map_err(|e| missing(format!(" and downloading it failed: {e}")))
    }

    fn download(&self, kind: RepoType, repo: &str, revision: &str, file: &str) -> Result<PathBuf, String> {
        let api = hf_hub::api::sync::ApiBuilder::new()
            .with_cache_dir(self.root.clone())
            .with_progress(false)
            .build()
            .map_err(|e| e.to_string())?;
        let repo_type = match kind {
            RepoType::Model => hf_hub::RepoType::Model,
            RepoType::Dataset => hf_hub::RepoType::Dataset,
        };
        api.repo(hf_hub::Repo::with_revision(repo.into(), repo_type, revision.into()))
            .get(file)
            .map_err(|e| e.to_string())
    }

    /// A model folder for `spec`: an existing local folder as is, or `org/name[@revision]`
    /// resolved in the cache with `config.json`, the weights (every shard of an index) and
    /// the tokenizer files that exist upstream.
    pub fn model_dir(&self, spec: &str) -> Result<PathBuf, HubError> {
        let local = Path::new(spec);
        if local.is_dir() {
            return Ok(local.to_path_buf());
        }
        let not_a_folder = |reason| HubError::NotAFolder {
            path: spec.into(),
            reason,
        };
        if local.exists() {
            return Err(not_a_folder(
                "is a file; a model is a folder holding config.json and weights",
            ));
        }
        // A path-like spec is never a repo id (`./m/x` must not go to the network).
        if spec.starts_with(['/', '.', '~']) {
            return Err(not_a_folder("no such folder"));
        }
        let (repo, revision) = parse_spec(spec)?;
        let config = self.file(RepoType::Model, &repo, &revision, "config.json")?;
        let snap = config.parent().map(Path::to_path_buf).unwrap_or_default();
        // Weights: an index names its shards; otherwise a single file.
        match self.file(RepoType::Model, &repo, &revision, "model.safetensors.index.json") {
            Ok(index) => {
                let text = std::fs::read_to_string(&index).unwrap_or_default();
                let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                let mut shards: Vec<String> = json["weight_map"]
                    .as_object()
                    .map(|m| m.values().filter_map(|v| v.as_str().map(str::to_string)).collect())
                    .unwrap_or_default();
                shards.sort();
                shards.dedup();
                for shard in shards {
                    self.file(RepoType::Model, &repo, &revision, &shard)?;
                }
            }
            Err(_) => {
                self.file(RepoType::Model, &repo, &revision, "model.safetensors")?;
            }
        }
        // Tokenizer files are optional (token-id inputs need none).
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "chat_template.jinja",
        ] {
            let _ = self.file(RepoType::Model, &repo, &revision, f);
        }
        Ok(snap)
    }
}

/// Splits `org/name@revision` (revision defaults to `main`).
pub fn parse_spec(spec: &str) -> Result<(String, String), HubError> {
    let (repo, revision) = spec.split_once('@').unwrap_or((spec, "main"));
    let valid = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    match repo.split_once('/') {
        Some((org, name)) if valid(org) && valid(name) && !revision.is_empty() => Ok((repo.into(), revision.into())),
        _ => Err(HubError::BadSpec(spec.into())),
    }
}

impl crate::display::Rich for HubCache {
    fn html(&self) -> String {
        use crate::display::{self, escape};
        let rows = vec![
            ("cache", escape(&self.root.display().to_string())),
            ("offline", self.offline.to_string()),
        ];
        display::style::container(&display::section("Hugging Face cache", &display::kv_table(&rows)))
    }
    fn text(&self) -> String {
        format!(
            "Hugging Face cache {} (offline: {})\n",
            self.root.display(),
            self.offline
        )
    }
}

crate::display::rich_display!(HubCache);
