//! scripts/setup-libtorch.sh on bad machines: each failure must say what to do.

use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("treetrain-setup-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the setup script with a private cache and libtorch folder; returns (success, stderr).
fn run_setup(dir: &Path, python: &str) -> (bool, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-libtorch.sh");
    let out = Command::new("bash")
        .arg(script)
        .env("PYTHON", python)
        .env("TREETRAIN_CACHE", dir.join("cache"))
        .env("TREETRAIN_LIBTORCH", dir.join("libtorch"))
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A stand-in python whose pip works but whose downloads are refused.
fn refusing_python(dir: &Path) -> String {
    let path = dir.join("python3");
    std::fs::write(
        &path,
        "#!/bin/sh\nif [ \"$2\" = pip ] && [ \"$3\" = download ]; then echo 'ERROR: 403 Forbidden' >&2; exit 1; fi\nexit 0\n",
    )
    .unwrap();
    Command::new("chmod").arg("+x").arg(&path).status().unwrap();
    path.display().to_string()
}

#[test]
fn missing_python_says_how_to_install_it() {
    let dir = scratch("nopython");
    let (ok, err) = run_setup(&dir, "/nonexistent/python3");
    assert!(!ok);
    assert!(
        err.contains("not found") && err.contains("apt-get install python3"),
        "{err}"
    );
}

#[test]
fn refused_download_names_the_wheel_and_the_way_out() {
    let dir = scratch("refused");
    let python = refusing_python(&dir);
    let (ok, err) = run_setup(&dir, &python);
    assert!(!ok);
    assert!(
        err.contains("could not download the torch 2.11.0 wheel") && err.contains("PIP_INDEX_URL"),
        "{err}"
    );
    assert!(
        !dir.join("libtorch").exists(),
        "a failed setup must not leave a half-made libtorch"
    );
}

#[test]
fn foreign_libtorch_of_the_wrong_version_is_not_touched() {
    let dir = scratch("foreign");
    std::fs::create_dir_all(dir.join("libtorch")).unwrap();
    std::fs::write(dir.join("libtorch/build-version"), "2.10.0\n").unwrap();
    let (ok, err) = run_setup(&dir, "python3");
    assert!(!ok);
    assert!(
        err.contains("libtorch version: 2.10.0; need 2.11.0") && err.contains("rm -rf"),
        "{err}"
    );
    assert!(dir.join("libtorch/build-version").exists());
}

#[test]
fn own_layout_of_an_old_version_is_rebuilt() {
    let dir = scratch("stale");
    std::fs::create_dir_all(dir.join("libtorch")).unwrap();
    std::fs::write(dir.join("libtorch/build-version"), "2.10.0\n").unwrap();
    std::fs::write(dir.join("libtorch/.treetrain-layout"), "old\n").unwrap();
    let python = refusing_python(&dir);
    let (ok, err) = run_setup(&dir, &python);
    assert!(!ok, "the refusing pip stops the rebuild");
    assert!(err.contains("is version 2.10.0, need 2.11.0: rebuilding"), "{err}");
}

#[test]
fn a_finished_layout_returns_at_once() {
    let dir = scratch("done");
    std::fs::create_dir_all(dir.join("libtorch")).unwrap();
    std::fs::write(dir.join("libtorch/build-version"), "2.11.0\n").unwrap();
    std::fs::write(dir.join("libtorch/.treetrain-layout"), "ok\n").unwrap();
    let (ok, err) = run_setup(&dir, "/nonexistent/python3");
    assert!(ok, "{err}");
}
