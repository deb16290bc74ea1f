//! `scripts/gpu-check.sh dry-run`: the GPU check's whole plan run on a machine without CUDA,
//! with the binaries this test build made. Every CUDA step fails here ("no driver") with status
//! 1, within its limit, never as a usage error; the plan fits the budget (the step limits sum to
//! at most 450 s of the device's 600 s call), the results JSON lists every step with its status
//! and seconds, `--only` runs the steps it names, and OUT holds exactly the three files the
//! script promises, whatever happens. The CPU rehearsal of every step (`rehearse`, on release
//! binaries `prepare` packs) runs from `scripts/test.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The newest executable `target/debug/deps/NAME-*` that is the bench binary (a bench
/// `--all-targets` built; an integration test may share its name): its `--help` names `flag`.
fn bench_binary(name: &str, flag: &str) -> Option<PathBuf> {
    let deps = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/debug/deps");
    std::fs::read_dir(deps)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let file = p
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            file.starts_with(&format!("{name}-")) && !file.contains('.')
        })
        .filter(|p| {
            Command::new(p)
                .arg("--help")
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(flag))
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
}

fn script(args: &[&str], bin: &Path, limit: Duration) -> std::process::Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Command::new("timeout")
        .arg(limit.as_secs().to_string())
        .arg("bash")
        .arg(root.join("scripts/gpu-check.sh"))
        .args(args)
        .env("TREETRAIN_GPU_CHECK_BIN", bin)
        .env_remove("TREETRAIN_TORCH_CUDA")
        .output()
        .unwrap()
}

fn succeeds(out: std::process::Output, args: &[&str]) -> std::process::Output {
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The plan, in order.
const PLAN: [&str; 16] = [
    "env",
    "versions",
    "score",
    "generate",
    "sft_step",
    "release_shared_prompt",
    "release_nested_fork",
    "release_tree_kept",
    "bf16_tree_vs_flat",
    "score_bf16",
    "generate_bf16",
    "grpo_step_bf16",
    "nccl_sft_step",
    "gloo_2proc_sft_step",
    "generate_cuda_graph",
    "decode_vs_transformers",
];

/// A folder of this build's binaries with the CPU references `references` computes.
fn binaries(dir: &Path) -> PathBuf {
    let binaries = (
        bench_binary("tree_vs_flat", "--parity"),
        bench_binary("generation", "--cuda-graph"),
    );
    let (Some(tree_vs_flat), Some(generation)) = binaries else {
        panic!("no bench binaries in target/debug/deps: build with `cargo test --all-targets`");
    };
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_treetrain"), bin.join("treetrain")).unwrap();
    std::fs::copy(tree_vs_flat, bin.join("tree_vs_flat")).unwrap();
    std::fs::copy(generation, bin.join("generation")).unwrap();
    let args = ["references", bin.to_str().unwrap()];
    succeeds(script(&args, &bin, Duration::from_secs(300)), &args);
    bin
}

fn results(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("gpu-check.json")).unwrap()).unwrap()
}

fn step_names(json: &serde_json::Value) -> Vec<&str> {
    json["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect()
}

#[test]
#[ignore = "needs the bench binaries `cargo test --all-targets` builds; CI runs it"]
fn the_dry_run_keeps_its_budget_lists_every_step_and_returns_three_files() {
    let dir = std::env::temp_dir().join(format!("treetrain-gpu-check-{}", std::process::id()));
    let bin = binaries(&dir);
    let out = dir.join("out");
    let start = Instant::now();
    let args = ["dry-run", out.to_str().unwrap()];
    succeeds(script(&args, &bin, Duration::from_secs(500)), &args);
    let wall = start.elapsed().as_secs_f64();
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["details.tar.gz", "gpu-check.json", "gpu-check.log"]);
    let json = results(&out);
    let (budget, planned) = (
        json["budget_seconds"].as_f64().unwrap(),
        json["planned_seconds"].as_f64().unwrap(),
    );
    assert!(planned <= budget && budget <= 450.0, "{json}");
    assert!(
        wall <= planned,
        "the dry run took {wall:.0} s, more than the {planned} s planned"
    );
    assert_eq!(step_names(&json), PLAN);
    for s in json["steps"].as_array().unwrap() {
        let (limit, seconds, status) = (
            s["limit"].as_f64().unwrap(),
            s["seconds"].as_f64().unwrap(),
            s["status"].as_i64().unwrap(),
        );
        assert!(seconds <= limit + 1.0, "{s}");
        // Only `treetrain env` works without a GPU; the others fail as a missing GPU makes
        // them (an error, 1), not as a refused flag (2), by timing out (124), a panic (101)
        // or a missing command (127).
        match s["name"] == "env" {
            true => assert_eq!(status, 0, "{s}"),
            false => assert_eq!(status, 1, "{s}"),
        }
    }
    let log = std::fs::read_to_string(out.join("gpu-check.log")).unwrap();
    assert!(log.contains("CUDA device(s)"), "the CUDA steps say why they fail");
    assert_eq!(json["verdicts"]["score_ok"], false, "{json}");
    assert_eq!(json["verdicts"]["score_bf16_ok"], false, "{json}");
    assert!(json["returns"]["ok"].as_bool().unwrap(), "{json}");
    // A rerun of chosen steps runs those alone, in plan order, and plans their limits only.
    let args = ["dry-run", out.to_str().unwrap(), "--only", "score,env"];
    succeeds(script(&args, &bin, Duration::from_secs(60)), &args);
    let json = results(&out);
    assert_eq!(step_names(&json), ["env", "score"]);
    assert_eq!(json["planned_seconds"], 25, "{json}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Usage errors stop before any step with status 2 and say what is accepted; the carried-size
/// check fails naming the biggest files when what travels is over its limit.
#[test]
fn usage_errors_and_an_oversized_carry_are_refused() {
    let out = std::env::temp_dir().join(format!("treetrain-gpu-check-usage-{}", std::process::id()));
    let out_arg = out.to_str().unwrap();
    for args in [
        vec!["dry-run", out_arg, "--only", "score,nosuch"],
        vec!["dry-run"],
        vec!["rehearse", out_arg, "--nly", "score"],
        vec!["launch"],
    ] {
        let got = script(&args, Path::new("/nonexistent"), Duration::from_secs(30));
        let stderr = String::from_utf8_lossy(&got.stderr);
        assert_eq!(got.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("usage:") || stderr.contains("the steps: env versions"),
            "{stderr}"
        );
    }
    assert!(!out.join("gpu-check.json").exists(), "a usage error ran nothing");
    let got = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gpu-check.sh"))
        .arg("size")
        .env("TREETRAIN_GPU_CHECK_CARRY_MIB", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&got.stderr);
    assert_eq!(got.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("over 1 MiB") && stderr.contains("datasets/tiny-qwen3-sft/model.safetensors"),
        "{stderr}"
    );
}
