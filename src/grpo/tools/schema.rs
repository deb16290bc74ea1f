//! A tool's schema as transformers' `get_json_schema` writes one for a Python function, from
//! the JSON Schema schemars derives for the tool's argument struct: `{"type": "function",
//! "function": {"name", "description", "parameters": {"type": "object", "properties",
//! "required"}, "return"}}`. What a model never saw in training is left out (`$schema`,
//! `title`, `format`, `minimum`, `default`, `$ref`s: definitions are written in place), an
//! `Option` is `"nullable": true`, and each property's keys come in transformers' order (type,
//! enum, items, additionalProperties, nullable, description), since chat templates print the
//! schemas key by key.
//!
//! One departure, by necessity: a nested struct keeps its `properties` and `required`, which
//! `get_json_schema` (whose nested objects are bare `dict`s) has no way to write.

use schemars::JsonSchema;
use serde_json::{Map, Value, json};

/// The schema transformers' `get_json_schema` would give a function named `name` taking the
/// fields of `A` (its doc comment the description) and returning `R`.
pub(crate) fn function_schema<A: JsonSchema, R: JsonSchema>(name: &str) -> Result<Value, String> {
    let args = schemars::schema_for!(A).to_value();
    let defs = args
        .get("$defs")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    if args.get("type").and_then(Value::as_str) != Some("object") || args.get("additionalProperties").is_some() {
        return Err(format!(
            "tool `{name}`: its arguments must be a struct with named fields"
        ));
    }
    let mut parameters = Map::new();
    parameters.insert("type".into(), "object".into());
    parameters.insert("properties".into(), properties(&args, &defs)?);
    if let Some(required) = args
        .get("required")
        .filter(|r| r.as_array().is_some_and(|r| !r.is_empty()))
    {
        parameters.insert("required".into(), required.clone());
    }
    let mut function = Map::new();
    function.insert("name".into(), name.into());
    if let Some(d) = args.get("description") {
        function.insert("description".into(), d.clone());
    }
    function.insert("parameters".into(), Value::Object(parameters));
    let ret = schemars::schema_for!(R).to_value();
    let ret_defs = ret.get("$defs").and_then(Value::as_object).cloned().unwrap_or_default();
    let ret = convert(&ret, &ret_defs)?;
    // `()` (a tool that returns nothing) has no return type to state, as a Python function
    // without one.
    if ret.get("type").and_then(Value::as_str) != Some("null") {
        function.insert("return".into(), ret);
    }
    Ok(json!({"type": "function", "function": function}))
}

/// An object schema's properties, each converted.
fn properties(node: &Value, defs: &Map<String, Value>) -> Result<Value, String> {
    let mut out = Map::new();
    for (name, schema) in node.get("properties").and_then(Value::as_object).into_iter().flatten() {
        out.insert(
            name.clone(),
            convert(schema, defs).map_err(|e| format!("argument `{name}`: {e}"))?,
        );
    }
    Ok(Value::Object(out))
}

/// One schemars node in transformers' form.
fn convert(node: &Value, defs: &Map<String, Value>) -> Result<Value, String> {
    let description = node.get("description").cloned();
    let (mut out, nullable) = shape(node, defs)?;
    if nullable {
        out.insert("nullable".into(), true.into());
    }
    if let Some(d) = description {
        out.insert("description".into(), d);
    }
    Ok(Value::Object(out))
}

/// The type-describing keys of `node` (a reference followed, `null` alternatives folded into
/// the flag returned).
fn shape(node: &Value, defs: &Map<String, Value>) -> Result<(Map<String, Value>, bool), String> {
    if let Some(r) = node.get("$ref").and_then(Value::as_str) {
        let name = r.rsplit('/').next().unwrap_or(r);
        let def = defs.get(name).ok_or_else(|| format!("unresolved reference {r}"))?;
        return shape(def, defs);
    }
    for key in ["anyOf", "oneOf"] {
        let Some(alternatives) = node.get(key).and_then(Value::as_array) else {
            continue;
        };
        let is_null = |a: &Value| a.get("type").and_then(Value::as_str) == Some("null");
        let others: Vec<&Value> = alternatives.iter().filter(|a| !is_null(a)).collect();
        let nullable = others.len() < alternatives.len();
        // An enum whose variants carry doc comments: one `const` each.
        if !others.is_empty() && others.iter().all(|a| a.get("const").is_some()) {
            let values: Vec<Value> = others.iter().map(|a| a["const"].clone()).collect();
            return Ok((enum_of(values), nullable));
        }
        return match others[..] {
            [one] => shape(one, defs).map(|(s, n)| (s, n || nullable)),
            _ => {
                Err("a value of several shapes (an untagged or data-carrying enum) has no get_json_schema form".into())
            }
        };
    }
    let mut out = Map::new();
    let mut nullable = false;
    match node.get("type") {
        Some(Value::String(t)) => drop(out.insert("type".into(), t.as_str().into())),
        Some(Value::Array(types)) => {
            let named: Vec<&Value> = types.iter().filter(|t| t.as_str() != Some("null")).collect();
            nullable = named.len() < types.len();
            match named[..] {
                [one] => drop(out.insert("type".into(), one.clone())),
                _ => return Err(format!("a value of several types {types:?}")),
            }
        }
        _ if node.get("const").is_some() => return Ok((enum_of(vec![node["const"].clone()]), false)),
        _ if node.get("enum").is_some() => {}
        // `serde_json::Value`: anything.
        _ => return Ok((out, false)),
    }
    if let Some(values) = node.get("enum").and_then(Value::as_array) {
        let values: Vec<Value> = values.iter().filter(|v| !v.is_null()).cloned().collect();
        nullable |= values.len() < node["enum"].as_array().map_or(0, Vec::len);
        let typed = enum_of(values);
        for (k, v) in typed {
            out.entry(k).or_insert(v);
        }
    }
    if let Some(items) = node.get("items") {
        out.insert("items".into(), convert(items, defs)?);
    }
    if let Some(prefix) = node.get("prefixItems").and_then(Value::as_array) {
        let items = prefix.iter().map(|p| convert(p, defs)).collect::<Result<Vec<_>, _>>()?;
        out.insert("prefixItems".into(), Value::Array(items));
    }
    if let Some(extra) = node.get("additionalProperties").filter(|a| a.is_object()) {
        out.insert("additionalProperties".into(), convert(extra, defs)?);
    }
    if node.get("properties").is_some() {
        out.insert("properties".into(), properties(node, defs)?);
        if let Some(required) = node
            .get("required")
            .filter(|r| r.as_array().is_some_and(|r| !r.is_empty()))
        {
            out.insert("required".into(), required.clone());
        }
    }
    Ok((out, nullable))
}

/// `{"type", "enum"}` of a list of allowed values (their JSON type, as transformers writes a
/// `Literal`).
fn enum_of(values: Vec<Value>) -> Map<String, Value> {
    let kind = |v: &Value| match v {
        Value::String(_) => "string",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        _ => "object",
    };
    let mut out = Map::new();
    if let Some(first) = values.first()
        && values.iter().all(|v| kind(v) == kind(first))
    {
        out.insert("type".into(), kind(first).into());
    }
    out.insert("enum".into(), Value::Array(values));
    out
}
