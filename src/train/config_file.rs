//! Trainer config files: TOML, with relative paths taken from the file's folder.

use std::path::{Path, PathBuf};

/// A parsed TOML config and the folder its relative paths are anchored to; errors name the file.
pub(crate) fn read_toml<T: serde::de::DeserializeOwned>(path: &Path) -> Result<(T, &Path), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let cfg = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok((cfg, path.parent().unwrap_or(Path::new("."))))
}

/// A relative `path` becomes `base/path`.
pub(crate) fn anchor(base: &Path, path: &mut PathBuf) {
    if path.is_relative() {
        *path = base.join(&*path);
    }
}

/// A model given as a relative folder that exists under `base` becomes that folder (anything
/// else, such as a hub repo id, is left alone).
pub(crate) fn anchor_model(base: &Path, model: &mut String) {
    if Path::new(model.as_str()).is_relative() && base.join(model.as_str()).is_dir() {
        *model = base.join(model.as_str()).display().to_string();
    }
}
