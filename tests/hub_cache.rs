//! Repo ids resolved offline against a fake Hugging Face cache.

use std::path::{Path, PathBuf};

use treetrain::device::HostProbe;
use treetrain::hub::{HubCache, HubError, RepoType, parse_spec};
use treetrain::model::{LoadOptions, Model};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn fake_cache(name: &str, files: &[&str]) -> PathBuf {
    let root = std::env::temp_dir().join(format!("treetrain-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let repo = root.join("hub/models--acme--tiny-qwen3");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    let snap = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snap).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3");
    for f in files {
        std::fs::copy(src.join(f), snap.join(f)).unwrap();
    }
    root
}

#[test]
fn cache_location_follows_the_environment() {
    let p = |env: &[(&str, &str)]| HubCache::from_probe(&HostProbe::fake("/", env));
    assert_eq!(
        p(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h")]).root,
        PathBuf::from("/c")
    );
    assert_eq!(p(&[("HF_HOME", "/h")]).root, PathBuf::from("/h/hub"));
    assert_eq!(p(&[("XDG_CACHE_HOME", "/x")]).root, PathBuf::from("/x/huggingface/hub"));
    assert_eq!(
        p(&[("HOME", "/home/u")]).root,
        PathBuf::from("/home/u/.cache/huggingface/hub")
    );
    assert!(p(&[("HF_HUB_OFFLINE", "1")]).offline);
    assert!(!p(&[("HF_HUB_OFFLINE", "0")]).offline);
}

#[test]
fn repo_id_resolves_offline_and_loads() {
    let root = fake_cache("ok", &["config.json", "model.safetensors"]);
    let cache = HubCache::from_probe(&HostProbe::fake(
        "/",
        &[("HF_HOME", root.to_str().unwrap()), ("HF_HUB_OFFLINE", "1")],
    ));
    let dir = cache.model_dir("acme/tiny-qwen3").unwrap();
    assert!(dir.ends_with(format!("snapshots/{COMMIT}")));
    assert_eq!(cache.model_dir(&format!("acme/tiny-qwen3@{COMMIT}")).unwrap(), dir);
    let model = Model::load(&dir, LoadOptions::default()).unwrap();
    assert_eq!(model.lm.config.num_layers, 2);
    // A local folder is taken as is.
    assert_eq!(cache.model_dir(dir.to_str().unwrap()).unwrap(), dir);
}

#[test]
fn missing_file_names_repo_revision_and_file() {
    let root = fake_cache("missing", &["config.json"]);
    let cache = HubCache {
        root: root.join("hub"),
        offline: true,
    };
    let err = cache.model_dir("acme/tiny-qwen3").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, HubError::Missing(_)));
    assert!(
        msg.contains("acme/tiny-qwen3") && msg.contains("`main`") && msg.contains("model.safetensors"),
        "{msg}"
    );
    assert!(msg.contains("HF_HUB_OFFLINE"), "{msg}");
    let err = cache
        .file(RepoType::Model, "acme/tiny-qwen3", "v2", "config.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("`v2`") && err.contains("config.json"), "{err}");
    let err = cache
        .file(RepoType::Dataset, "acme/data", "main", "train.parquet")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("dataset repo `acme/data`"), "{err}");
}

#[test]
fn specs_are_validated() {
    assert_eq!(
        parse_spec("Qwen/Qwen3-0.6B").unwrap(),
        ("Qwen/Qwen3-0.6B".into(), "main".into())
    );
    assert_eq!(parse_spec("a/b@v1.0").unwrap().1, "v1.0");
    for bad in ["no-slash", "a/b/c", "/b", "a/b@", "a b/c"] {
        assert!(matches!(parse_spec(bad), Err(HubError::BadSpec(_))), "{bad}");
    }
}
