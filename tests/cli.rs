//! The `treetrain` binary, run as a user would.

use std::process::Command;

fn treetrain(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_treetrain"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn env_json_reports_versions_and_policies() {
    let (ok, out, err) = treetrain(&["env", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["versions"]["libtorch"], "2.11.0");
    assert_eq!(v["versions"]["tch"], "0.24.0");
    assert!(v["accelerators"]["CUDA"].as_str().is_some());
    assert!(v["policies"]["platform"].as_str().is_some());
}

#[test]
fn shapes_reads_a_lengths_file() {
    let dir = std::env::temp_dir().join(format!("treetrain-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("lengths.jsonl");
    std::fs::write(
        &file,
        "100\n{\"length\": 130}\n{\"input_ids\": [1,2,3]}\n\n300\n",
    )
    .unwrap();
    let (ok, out, err) = treetrain(&[
        "shapes",
        "--lengths",
        file.to_str().unwrap(),
        "--batch-size",
        "2",
        "--pad",
        "128",
    ]);
    assert!(ok, "{err}");
    // batches [100,130] [3,300]: two shapes unpadded; [2,256] and [2,384] padded.
    assert!(out.contains("4 sequences, batch 2"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("no padding") || l.starts_with("pad to"))
        .collect();
    assert!(rows[0].split_whitespace().nth(2) == Some("2"), "{out}");
    assert!(rows[1].split_whitespace().nth(3) == Some("2"), "{out}");
}

#[test]
fn bad_arguments_fail_with_a_message() {
    let (ok, _, err) = treetrain(&["shapes", "--pad", "sometimes"]);
    assert!(
        !ok && err.contains("invalid pad_to_multiple_of \"sometimes\""),
        "{err}"
    );
    let (ok, _, err) = treetrain(&["shapes", "--batch-size", "0"]);
    assert!(
        !ok && err.contains("batch_size must be at least 1"),
        "{err}"
    );
    let (ok, _, err) = treetrain(&["shapes", "--lengths", "/nonexistent.txt"]);
    assert!(!ok && err.contains("/nonexistent.txt"), "{err}");
}
