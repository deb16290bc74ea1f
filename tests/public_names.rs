//! The library's public face, pinned: every `pub` item of `src/` (the CLI binary, `main.rs`
//! and `cli/`, is a user of the library, not part of it; test modules are left out) as
//! `file: kind name`, against `tests/fixtures/public_names.txt`. A new `pub` is a decision that
//! shows up in review as a line added there; what only the library itself uses is
//! `pub(crate)`. Regenerate the list with `TREETRAIN_BLESS=1 cargo test --test public_names`.

mod common;

use std::path::Path;

use common::rust_files;

/// The `pub` items of one file's text outside its test module: `kind name` (a `pub use` as
/// the names it lists).
fn public_items(text: &str) -> Vec<String> {
    const KINDS: [&str; 9] = ["fn", "struct", "enum", "trait", "type", "const", "static", "mod", "use"];
    let mut out = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let code = line.trim_start();
        if code.starts_with("#[cfg(test)]") {
            break;
        }
        let Some(rest) = code.strip_prefix("pub ") else {
            continue;
        };
        let rest = rest.strip_prefix("async ").unwrap_or(rest);
        let Some(kind) = KINDS.iter().find(|k| rest.starts_with(&format!("{k} "))) else {
            continue;
        };
        let mut rest = rest[kind.len() + 1..].to_string();
        let name = match *kind {
            // A `pub use` as written, its lines joined.
            "use" => {
                while !rest.contains(';') {
                    let Some(next) = lines.next() else { break };
                    rest.push(' ');
                    rest.push_str(next.trim());
                }
                let joined = rest
                    .trim_end_matches(';')
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                joined.replace("{ ", "{").replace(", }", "}").replace(" }", "}")
            }
            _ => rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect(),
        };
        out.push(format!("{kind} {name}"));
    }
    out
}

fn current() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    files.sort();
    let mut lines = Vec::new();
    for file in files {
        let rel = file.strip_prefix(root).unwrap().to_string_lossy().replace('\\', "/");
        if rel == "src/main.rs" || rel.starts_with("src/cli/") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        lines.extend(public_items(&text).into_iter().map(|item| format!("{rel}: {item}")));
    }
    lines.join("\n") + "\n"
}

#[test]
fn the_public_names_are_the_pinned_ones() {
    let pinned = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/public_names.txt");
    let now = current();
    if std::env::var_os("TREETRAIN_BLESS").is_some() {
        std::fs::write(&pinned, &now).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&pinned).unwrap_or_default();
    if now == want {
        return;
    }
    let (now_lines, want_lines): (Vec<&str>, Vec<&str>) = (now.lines().collect(), want.lines().collect());
    let added: Vec<&&str> = now_lines.iter().filter(|l| !want_lines.contains(l)).collect();
    let gone: Vec<&&str> = want_lines.iter().filter(|l| !now_lines.contains(l)).collect();
    panic!(
        "the public face changed (make it pub(crate) unless a notebook user, a bench or the CLI needs it; \
         otherwise TREETRAIN_BLESS=1 cargo test --test public_names and commit the list)\nadded:\n{}\ngone:\n{}",
        added.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n"),
        gone.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n"),
    );
}

#[test]
fn the_reader_sees_items_and_stops_at_the_tests() {
    let text = "pub fn a() {}\n    pub(crate) fn b() {}\npub async fn c() {}\npub use x::{Y, Z};\npub use w::{\n    V,\n    U,\n};\n/// pub fn d\n#[cfg(test)]\npub fn e() {}";
    assert_eq!(public_items(text), ["fn a", "fn c", "use x::{Y, Z}", "use w::{V, U}"]);
}
