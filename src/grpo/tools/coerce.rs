//! A call's arguments checked against the schema the model was shown, and coerced by it only
//! where the meaning is certain: a string where the schema says string stays as written
//! (`"02134"` stays `"02134"`, never 2134); a number or boolean written as a string is
//! converted only when the string is exactly one (`"42"` for an integer, `"1.5"` for a number,
//! `"true"` / `"false"`); anything else is an error naming the argument, which the model reads
//! as the tool's reply.

use serde_json::{Map, Value};

/// `arguments` coerced by `parameters` (an object schema in transformers' form): every required
/// argument present, none unknown, each of its type.
pub(crate) fn coerce_arguments(parameters: &Value, arguments: &Value) -> Result<Value, String> {
    let Value::Object(given) = arguments else {
        return Err(format!("the arguments must be a JSON object, got {}", kind(arguments)));
    };
    coerce_object(parameters, given, "")
}

fn coerce_object(schema: &Value, given: &Map<String, Value>, at: &str) -> Result<Value, String> {
    let empty = Map::new();
    let properties = schema.get("properties").and_then(Value::as_object).unwrap_or(&empty);
    let required = schema.get("required").and_then(Value::as_array);
    for name in required.into_iter().flatten().filter_map(Value::as_str) {
        if !given.contains_key(name) {
            return Err(format!("missing required argument `{at}{name}`"));
        }
    }
    let mut out = Map::new();
    for (name, value) in given {
        let path = format!("{at}{name}");
        let Some(property) = properties.get(name) else {
            let known: Vec<&str> = properties.keys().map(String::as_str).collect();
            return Err(format!(
                "unknown argument `{path}` (the arguments are: {})",
                known.join(", ")
            ));
        };
        out.insert(name.clone(), coerce(property, value, &path)?);
    }
    Ok(Value::Object(out))
}

/// `value` as `schema` types it, or why not (naming the argument `path`).
fn coerce(schema: &Value, value: &Value, path: &str) -> Result<Value, String> {
    if value.is_null() {
        return match schema.get("nullable").and_then(Value::as_bool) == Some(true) || schema.get("type").is_none() {
            true => Ok(Value::Null),
            false => Err(format!("argument `{path}` must not be null")),
        };
    }
    let wrong = |want: &str| format!("argument `{path}` must be {want}, got {}", shown(value));
    let out = match schema.get("type").and_then(Value::as_str) {
        None => value.clone(),
        Some("string") => match value {
            Value::String(_) => value.clone(),
            _ => return Err(wrong("a string")),
        },
        Some("integer") => match value {
            Value::Number(n) if n.is_i64() || n.is_u64() => value.clone(),
            Value::String(s) if exact_integer(s).is_some() => exact_integer(s).unwrap_or_default().into(),
            _ => return Err(wrong("a whole number")),
        },
        Some("number") => match value {
            Value::Number(_) => value.clone(),
            Value::String(s) => match exact_number(s) {
                Some(n) => n,
                None => return Err(wrong("a number")),
            },
            _ => return Err(wrong("a number")),
        },
        Some("boolean") => match value {
            Value::Bool(_) => value.clone(),
            Value::String(s) if s == "true" || s == "false" => (s == "true").into(),
            _ => return Err(wrong("true or false")),
        },
        Some("array") => match value {
            Value::Array(items) => {
                let item = schema.get("items").cloned().unwrap_or(Value::Object(Map::new()));
                let coerced = (items.iter().enumerate())
                    .map(|(i, v)| coerce(&item, v, &format!("{path}[{i}]")))
                    .collect::<Result<Vec<_>, _>>()?;
                Value::Array(coerced)
            }
            _ => return Err(wrong("a list")),
        },
        Some("object") => match value {
            Value::Object(map) if schema.get("properties").is_some() => {
                coerce_object(schema, map, &format!("{path}."))?
            }
            Value::Object(map) => match schema.get("additionalProperties") {
                Some(each) => {
                    let coerced = (map.iter())
                        .map(|(k, v)| coerce(each, v, &format!("{path}.{k}")).map(|v| (k.clone(), v)))
                        .collect::<Result<Map<_, _>, _>>()?;
                    Value::Object(coerced)
                }
                None => value.clone(),
            },
            _ => return Err(wrong("an object")),
        },
        Some(other) => {
            return Err(format!(
                "argument `{path}`: the schema's type {other:?} is not one tools take"
            ));
        }
    };
    match schema.get("enum").and_then(Value::as_array) {
        Some(allowed) if !allowed.contains(&out) => {
            let names: Vec<String> = allowed.iter().map(Value::to_string).collect();
            Err(format!(
                "argument `{path}` must be one of {}, got {}",
                names.join(", "),
                shown(value)
            ))
        }
        _ => Ok(out),
    }
}

/// `s` as an integer when it is written exactly as one (no sign but `-`, no leading zeros, no
/// spaces): `"02134"` is not 2134.
fn exact_integer(s: &str) -> Option<i64> {
    let n: i64 = s.parse().ok()?;
    (n.to_string() == s).then_some(n)
}

/// `s` as a number when it is a JSON number as written (`"1.5"`, `"-2e3"`), finite.
fn exact_number(s: &str) -> Option<Value> {
    match serde_json::from_str::<Value>(s) {
        Ok(v @ Value::Number(_)) if s.trim() == s => Some(v),
        _ => None,
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A value as the error shows it: short values in full, long ones by kind.
fn shown(value: &Value) -> String {
    let text = value.to_string();
    match text.chars().count() <= 40 {
        true => text,
        false => kind(value).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn arguments_are_coerced_only_where_exact() {
        let schema = json!({"type": "object", "properties": {
            "zip": {"type": "string"},
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "flag": {"type": "boolean"},
            "unit": {"type": "string", "enum": ["km", "mi"]},
            "tags": {"type": "array", "items": {"type": "integer"}, "nullable": true},
            "table": {"type": "object", "additionalProperties": {"type": "integer"}},
        }, "required": ["zip"]});
        let ok = |args: Value| coerce_arguments(&schema, &args).unwrap();
        let err = |args: Value| coerce_arguments(&schema, &args).unwrap_err();
        assert_eq!(ok(json!({"zip": "02134"})), json!({"zip": "02134"}));
        assert_eq!(
            ok(json!({"zip": "1", "n": "42", "x": "1.5", "flag": "true", "tags": ["3"], "table": {"a": "7"}})),
            json!({"zip": "1", "n": 42, "x": 1.5, "flag": true, "tags": [3], "table": {"a": 7}})
        );
        assert_eq!(ok(json!({"zip": "1", "tags": null})), json!({"zip": "1", "tags": null}));
        assert_eq!(err(json!({"zip": 2134})), "argument `zip` must be a string, got 2134");
        assert_eq!(
            err(json!({"zip": "1", "n": "02134"})),
            "argument `n` must be a whole number, got \"02134\""
        );
        assert_eq!(
            err(json!({"zip": "1", "n": 4.5})),
            "argument `n` must be a whole number, got 4.5"
        );
        assert_eq!(
            err(json!({"zip": "1", "x": " 1.5"})),
            "argument `x` must be a number, got \" 1.5\""
        );
        assert_eq!(
            err(json!({"zip": "1", "flag": "yes"})),
            "argument `flag` must be true or false, got \"yes\""
        );
        assert_eq!(
            err(json!({"zip": "1", "unit": "m"})),
            "argument `unit` must be one of \"km\", \"mi\", got \"m\""
        );
        assert_eq!(
            err(json!({"zip": "1", "tags": ["a"]})),
            "argument `tags[0]` must be a whole number, got \"a\""
        );
        assert_eq!(
            err(json!({"zip": "1", "table": {"a": true}})),
            "argument `table.a` must be a whole number, got true"
        );
        assert_eq!(err(json!({"n": 1})), "missing required argument `zip`");
        assert_eq!(
            err(json!({"zip": "1", "color": "red"})),
            "unknown argument `color` (the arguments are: zip, n, x, flag, unit, tags, table)"
        );
        assert_eq!(err(json!({"zip": "1", "n": null})), "argument `n` must not be null");
        assert_eq!(err(json!(["02134"])), "the arguments must be a JSON object, got a list");
    }
}
