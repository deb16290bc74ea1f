//! `scripts/gpu-check.sh dry-run`: the GPU check's whole plan run on a machine without CUDA,
//! with the binaries this test build made. Every CUDA step fails here ("no driver"), within its
//! limit; the plan fits the budget (the step limits sum to at most the budget, which is under 6
//! minutes), the results JSON lists every step with its status and seconds, and OUT holds
//! exactly the three files the script promises, whatever happens.

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
    let out = Command::new("timeout")
        .arg(limit.as_secs().to_string())
        .arg("bash")
        .arg(root.join("scripts/gpu-check.sh"))
        .args(args)
        .env("TREETRAIN_GPU_CHECK_BIN", bin)
        .env_remove("TREETRAIN_TORCH_CUDA")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
#[ignore = "needs the bench binaries `cargo test --all-targets` builds; CI runs it"]
fn the_dry_run_keeps_its_budget_lists_every_step_and_returns_three_files() {
    let binaries = (
        bench_binary("tree_vs_flat", "--parity"),
        bench_binary("generation", "--cuda-graph"),
    );
    let (Some(tree_vs_flat), Some(generation)) = binaries else {
        panic!("no bench binaries in target/debug/deps: build with `cargo test --all-targets`");
    };
    let dir = std::env::temp_dir().join(format!("treetrain-gpu-check-{}", std::process::id()));
    let (bin, out) = (dir.join("bin"), dir.join("out"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_treetrain"), bin.join("treetrain")).unwrap();
    std::fs::copy(tree_vs_flat, bin.join("tree_vs_flat")).unwrap();
    std::fs::copy(generation, bin.join("generation")).unwrap();
    script(&["references"], &bin, Duration::from_secs(300));
    let start = Instant::now();
    script(&["dry-run", out.to_str().unwrap()], &bin, Duration::from_secs(400));
    let wall = start.elapsed().as_secs_f64();
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["details.tar.gz", "gpu-check.json", "gpu-check.log"]);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("gpu-check.json")).unwrap()).unwrap();
    let (budget, planned) = (
        json["budget_seconds"].as_f64().unwrap(),
        json["planned_seconds"].as_f64().unwrap(),
    );
    assert!(planned <= budget && budget < 360.0, "{json}");
    assert!(
        wall <= planned,
        "the dry run took {wall:.0} s, more than the {planned} s planned"
    );
    let steps = json["steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
    let plan = [
        "env",
        "versions",
        "score",
        "generate",
        "sft_step",
        "release_tree_vs_flat",
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
    assert_eq!(names, plan);
    for s in steps {
        let (limit, seconds, status) = (
            s["limit"].as_f64().unwrap(),
            s["seconds"].as_f64().unwrap(),
            s["status"].as_i64().unwrap(),
        );
        assert!(seconds <= limit + 1.0, "{s}");
        // Only `treetrain env` works without a GPU; the others fail as a missing GPU makes
        // them (an error, 1, or a refused `--device`, 2), not by timing out (124), a panic
        // (101) or a missing command (127).
        match s["name"] == "env" {
            true => assert_eq!(status, 0, "{s}"),
            false => assert!([1, 2].contains(&status), "{s}"),
        }
    }
    let log = std::fs::read_to_string(out.join("gpu-check.log")).unwrap();
    assert!(log.contains("CUDA device(s)"), "the CUDA steps say why they fail");
    assert_eq!(json["parity"]["score_ok"], false, "{json}");
    assert_eq!(json["parity"]["score_bf16_ok"], false, "{json}");
    let _ = std::fs::remove_dir_all(&dir);
}
