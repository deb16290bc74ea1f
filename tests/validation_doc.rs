//! The README's list of validated settings is generated from `treetrain::validation::RULES`,
//! and every rule with an out-of-range example is checked against the real config checks.
//! `TREETRAIN_BLESS=1 cargo test --test validation_doc` rewrites the README section.

use std::collections::BTreeMap;
use std::path::Path;

use treetrain::grpo::GrpoConfig;
use treetrain::sft::SftConfig;
use treetrain::validation::{RULES, Scope, markdown};

const BEGIN: &str = "<!-- validation:begin (generated from src/validation.rs) -->\n";
const END: &str = "<!-- validation:end -->";

#[test]
fn the_readme_lists_exactly_the_rules() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let (start, end) = (
        readme.find(BEGIN).expect("README lacks the validation markers") + BEGIN.len(),
        readme.find(END).expect("README lacks the validation end marker"),
    );
    let table = markdown();
    if std::env::var_os("TREETRAIN_BLESS").is_some() {
        let fresh = format!("{}{table}{}", &readme[..start], &readme[end..]);
        std::fs::write(&path, fresh).unwrap();
        return;
    }
    assert_eq!(
        &readme[start..end],
        table,
        "README's validation list is stale: TREETRAIN_BLESS=1 cargo test --test validation_doc"
    );
}

/// A config file of valid settings with `field = bad` written over them (dotted keys at the
/// top level), parsed and validated: the error must name the field.
fn error_of<T>(
    field: &str,
    bad: &str,
    parse: impl Fn(&Path) -> Result<T, treetrain::train::TrainError>,
    validate: impl Fn(&T) -> Result<(), treetrain::train::TrainError>,
) -> String {
    let mut keys: BTreeMap<&str, String> = BTreeMap::from([
        ("model", "\"m\"".to_string()),
        ("dataset", "\"d.jsonl\"".to_string()),
        ("learning_rate", "0.001".to_string()),
    ]);
    keys.insert(field, bad.to_string());
    let text: String = keys.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
    let dir = std::env::temp_dir().join(format!("treetrain-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{}.toml", field.replace('.', "_")));
    std::fs::write(&file, text).unwrap();
    let err = match parse(&file) {
        Err(e) => e.to_string(),
        Ok(cfg) => validate(&cfg)
            .expect_err(&format!("`{field} = {bad}` passed validation"))
            .to_string(),
    };
    let _ = std::fs::remove_file(&file);
    err
}

#[test]
fn every_rule_with_an_example_is_enforced_and_names_its_field() {
    let mut checked = 0;
    for rule in RULES {
        let Some(bad) = rule.bad else { continue };
        let sft = || error_of(rule.field, bad, SftConfig::from_toml_file, SftConfig::validate);
        let grpo = || error_of(rule.field, bad, GrpoConfig::from_toml_file, GrpoConfig::validate);
        let errors = match rule.scope {
            Scope::Train => vec![sft(), grpo()],
            Scope::Sft => vec![sft()],
            Scope::Grpo | Scope::Sampling => vec![grpo()],
            Scope::Start => continue,
        };
        for err in errors {
            assert!(err.contains(&format!("`{}`", rule.field)), "{}: {err}", rule.field);
        }
        checked += 1;
    }
    assert!(checked >= 25, "only {checked} rules checked");
}
