//! The library's layers, as the crate docs draw them, kept true: a module may use modules of
//! lower layers only. Reads every `crate::` path in the code of `src/` (comments and doc text
//! left out; the CLI binary, `main.rs` and `cli/`, sits above everything and is not read).

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::rust_files;

/// Lowest first. Modules of one layer do not use each other.
const LAYERS: &[&[&str]] = &[
    &["util", "display"],
    &["device"],
    &["shapes", "hub", "distributed"],
    &["data", "tokenizer"],
    &["model"],
    &["pack", "generate"],
    &["train"],
    &["sft", "grpo"],
    &["shipped", "validation", "env_report"],
    &["demo", "guide", "bench_support"],
];

/// Names the crate root exports (macros and re-exports) and the module each comes from.
const ROOT_NAMES: &[(&str, &str)] = &[("EnvReport", "env_report"), ("TCH_VERSION", "env_report")];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// The top-level module a file of `src/` belongs to (`src/grpo/update.rs` -> `grpo`).
fn module_of(src: &Path, file: &Path) -> String {
    let first = file.strip_prefix(src).unwrap().components().next().unwrap();
    first.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string()
}

/// Every `crate::NAME` (or `$crate::NAME`) in the code of `text`, with its line number.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let name: String = rest[at + 7..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            found.push((n + 1, name));
            rest = &rest[at + 7..];
        }
    }
    found
}

#[test]
fn every_import_runs_down_the_declared_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let root: BTreeMap<&str, &str> = ROOT_NAMES.iter().copied().collect();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for file in &files {
        let from = module_of(&src, file);
        if matches!(from.as_str(), "lib" | "main" | "cli") {
            continue;
        }
        let from_layer = layer_of(&from).unwrap_or_else(|| panic!("module `{from}` is in no layer"));
        let text = std::fs::read_to_string(file).unwrap();
        for (line, name) in crate_paths(&text) {
            let to = root.get(name.as_str()).copied().unwrap_or(name.as_str());
            if to == from || matches!(to, "tch" | "serde_json") {
                continue;
            }
            let to_layer =
                layer_of(to).unwrap_or_else(|| panic!("{}:{line}: `crate::{to}` is in no layer", file.display()));
            checked += 1;
            if to_layer >= from_layer {
                wrong.push(format!("{}:{line}: `{from}` uses `{to}`", file.display()));
            }
        }
    }
    assert!(checked > 100, "only {checked} imports read: is the reader broken?");
    assert!(
        wrong.is_empty(),
        "imports that run up (or across) the layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_reader_sees_code_and_skips_comments() {
    let text = "use crate::model::Dtype; // crate::grpo in a comment\n/// [`crate::sft::SftConfig`]\nlet x = $crate::util::f();";
    let names: Vec<String> = crate_paths(text).into_iter().map(|(_, n)| n).collect();
    assert_eq!(names, ["model", "util"]);
}
