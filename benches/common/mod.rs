//! Shared by the bench binaries.

use std::path::Path;
use std::process::Command;

/// A Python that can `import modules` (e.g. `"transformers, torch"`): `--python`, else
/// `$TREETRAIN_BENCH_PYTHON`, else the fixture venv made by scripts/fixtures/venv.sh.
pub fn python(arg: Option<String>, modules: &str) -> Option<String> {
    let home = std::env::var("HOME").unwrap_or_default();
    let venv = Path::new(&home).join(".cache/treetrain/fixture-venv/bin/python");
    let check = format!("import {modules}");
    [
        arg,
        std::env::var("TREETRAIN_BENCH_PYTHON").ok(),
        venv.exists().then(|| venv.display().to_string()),
    ]
    .into_iter()
    .flatten()
    .find(|p| {
        Command::new(p)
            .args(["-c", &check])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}
