//! That every rank runs the same run: before any collective whose shape depends on the
//! settings (the weights' broadcast, a step's reductions), the ranks exchange what must agree
//! (the resolved config, the world layout, the trained variables) and every rank refuses a
//! difference, naming its first setting and each rank's value. Without it, ranks whose configs
//! differ either abort inside Gloo (a collective of another size) or, worse, train diverging
//! replicas to a clean exit.

use std::collections::BTreeMap;

use super::{DistError, World};

/// Settings as `(name, value)` rows, compared by name: what one rank has and another lacks is
/// a difference too.
pub(crate) type Settings = Vec<(String, String)>;

impl World {
    /// Every rank's `settings` (one of `what`: "settings", "model") gathered and compared with
    /// rank 0's; the first difference, in rank 0's order, is an error every rank returns alike.
    pub(crate) fn agree(&self, what: &str, settings: &Settings) -> Result<(), DistError> {
        if !self.is_distributed() {
            return Ok(());
        }
        let text: Vec<String> = settings.iter().map(|(k, v)| format!("{k}\t{v}")).collect();
        let all = self.all_gather_bytes(text.join("\n").as_bytes())?;
        let tables: Vec<BTreeMap<String, String>> = all.iter().map(|b| table(b)).collect();
        let mut names: Vec<&String> = settings.iter().map(|(k, _)| k).collect();
        names.extend(tables.iter().flat_map(|t| t.keys()));
        for name in names {
            let values: Vec<Option<&String>> = tables.iter().map(|t| t.get(name)).collect();
            if values.iter().all(|v| *v == values[0]) {
                continue;
            }
            let each: Vec<String> = (values.iter().enumerate())
                .map(|(rank, v)| format!("{} on rank {rank}", v.map_or("unset".to_string(), |v| v.clone())))
                .collect();
            let message = format!(
                "the ranks' {what} differ at `{name}`: {}; every rank must run the same config file, flags and model",
                each.join(", ")
            );
            return Err(DistError::new(self.rank, "agreement", message));
        }
        Ok(())
    }
}

fn table(bytes: &[u8]) -> BTreeMap<String, String> {
    let text = String::from_utf8_lossy(bytes);
    (text.lines())
        .filter_map(|l| l.split_once('\t'))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `value`'s leaves as rows named by their dotted path (`lora.r`); arrays and scalars are
/// compact JSON, so a row never holds a tab or a line break.
pub(crate) fn settings_of(value: &serde_json::Value) -> Settings {
    fn walk(prefix: &str, value: &serde_json::Value, out: &mut Settings) {
        match value {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let name = match prefix {
                        "" => k.clone(),
                        _ => format!("{prefix}.{k}"),
                    };
                    walk(&name, v, out);
                }
            }
            leaf => out.push((prefix.to_string(), leaf.to_string())),
        }
    }
    let mut out = Vec::new();
    walk("", value, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    /// Each rank's result of agreeing on `cases[i][rank]`, case after case, in one world.
    fn two_ranks(cases: Vec<[Settings; 2]>) -> Vec<Vec<Result<(), DistError>>> {
        let store = std::env::temp_dir().join(format!("treetrain-agree-{}", std::process::id()));
        let _ = std::fs::remove_file(&store);
        let cases = Arc::new(cases);
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (store, cases) = (store.clone(), cases.clone());
                std::thread::spawn(move || {
                    let world = World::with_file_store(&store, rank, 2, Duration::from_secs(30)).unwrap();
                    let agreed: Vec<_> = cases.iter().map(|c| world.agree("settings", &c[rank])).collect();
                    world.barrier().unwrap();
                    agreed
                })
            })
            .collect();
        let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let _ = std::fs::remove_file(&store);
        out
    }

    #[test]
    fn every_rank_names_the_first_difference() {
        let a = settings_of(&serde_json::json!({"learning_rate": 1e-5, "lora": {"r": 8, "alpha": 16}, "name": "a\tb"}));
        let mut b =
            settings_of(&serde_json::json!({"learning_rate": 1e-5, "lora": {"r": 4, "alpha": 16}, "name": "a\tb"}));
        b.push(("extra".into(), "1".into()));
        assert!(a.contains(&("lora.r".to_string(), "8".to_string())), "{a:?}");
        let c: Settings = a.iter().filter(|(k, _)| k != "name").cloned().collect();
        let cases = vec![[a.clone(), b], [a.clone(), c], [a.clone(), a]];
        for [differ, unset, same] in two_ranks(cases).into_iter().map(|r| <[_; 3]>::try_from(r).unwrap()) {
            let e = differ.unwrap_err().to_string();
            assert!(
                e.contains("the ranks' settings differ at `lora.r`: 8 on rank 0, 4 on rank 1"),
                "{e}"
            );
            let e = unset.unwrap_err().to_string();
            assert!(e.contains("at `name`: \"a\\tb\" on rank 0, unset on rank 1"), "{e}");
            same.unwrap();
        }
    }
}
