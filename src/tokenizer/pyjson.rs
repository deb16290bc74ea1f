//! JSON text exactly as Python's `json.dumps(..., ensure_ascii=False)` writes it, which is what
//! transformers' `tojson` filter produces inside chat templates (`", "` and `": "` separators,
//! insertion order, `indent` support).

use serde_json::Value;

/// Formats `v` like `json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
pub fn dumps(v: &Value, indent: Option<usize>, sort_keys: bool) -> String {
    let mut out = String::new();
    write(v, indent, sort_keys, 0, &mut out);
    out
}

fn write(v: &Value, indent: Option<usize>, sort_keys: bool, level: usize, out: &mut String) {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&py_number(n)),
        Value::String(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write(item, indent, sort_keys, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                write(item, indent, sort_keys, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
    }
}

/// Python's float repr: `1.0`, `0.5`, `1e-05`, `1e+16`.
fn py_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(0.0);
    if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
        return format!("{f:.1}");
    }
    let r = format!("{f:e}"); // e.g. "1e-5", "1.5e16"
    match r.split_once('e') {
        Some((mant, exp)) if f.abs() < 1e-4 || f.abs() >= 1e16 => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mant}e{sign}{digits:0>2}")
        }
        _ => f.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_formatting() {
        let v = json!({"name": "get_weather", "parameters": {"type": "object", "required": ["city"], "x": 1.0, "y": 0.25, "n": 3, "e": []}, "ü": "é\n\"q\""});
        assert_eq!(
            dumps(&v, None, false),
            r#"{"name": "get_weather", "parameters": {"type": "object", "required": ["city"], "x": 1.0, "y": 0.25, "n": 3, "e": []}, "ü": "é\n\"q\""}"#
        );
        assert_eq!(
            dumps(&json!({"a": [1, 2]}), Some(2), false),
            "{\n  \"a\": [\n    1,\n    2\n  ]\n}"
        );
        assert_eq!(dumps(&json!({"b": 1, "a": 2}), None, true), r#"{"a": 2, "b": 1}"#);
        assert_eq!(dumps(&json!(1e-5), None, false), "1e-05");
        assert_eq!(dumps(&json!(2.5e16), None, false), "2.5e+16");
    }
}
