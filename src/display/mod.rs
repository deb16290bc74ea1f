//! Rich notebook output.
//!
//! Every notebook-facing type implements [`Rich`] (two pure renderers returning `String`, which
//! tests check) and gets an inherent `evcxr_display(&self)` through `rich_display!`; evcxr calls
//! that method on a cell's final value. Styling lives in [`style`] alone, in terms of the
//! JupyterLab theme variables so the same output reads in light and dark themes.

mod heatmap;
mod html;
mod plot;
pub mod style;

pub(crate) use heatmap::Heatmap;
pub(crate) use html::{escape, kv_table, prompt_tail};
pub use html::{section, table, tail};
pub use plot::{LineChart, Series};

/// A value with an HTML and a plain-text rendering.
pub trait Rich {
    /// A self-contained HTML fragment (styles included, no scripts).
    fn html(&self) -> String;
    /// The same content as plain text (terminals, logs, `text/plain`).
    fn text(&self) -> String;
}

/// Wraps an HTML fragment and its text twin in evcxr's content markers.
///
/// Pure, so tests can see exactly what a notebook receives.
pub fn evcxr_payload(html: &str, text: &str) -> String {
    format!(
        "EVCXR_BEGIN_CONTENT text/html\n{html}\nEVCXR_END_CONTENT\nEVCXR_BEGIN_CONTENT text/plain\n{text}\nEVCXR_END_CONTENT\n"
    )
}

/// The name a config file uses for a unit enum value (its serde name: `"dapo"`, `"tree"`).
pub fn serde_name(value: &impl serde::Serialize) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => "-".into(),
    }
}

/// `(field, value)` rows of a serializable value (a config), nested tables flattened to `a.b`.
pub fn fields(value: &impl serde::Serialize) -> Vec<(String, String)> {
    fn walk(value: &serde_json::Value, prefix: &str, out: &mut Vec<(String, String)>) {
        match value {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(v, &key, out);
                }
            }
            serde_json::Value::Array(items) => {
                let items: Vec<String> = items.iter().map(inline).collect();
                let shown = if items.is_empty() {
                    "none".into()
                } else {
                    items.join("; ")
                };
                out.push((prefix.to_string(), shown));
            }
            other => out.push((prefix.to_string(), inline(other))),
        }
    }
    /// A value on one line: `a=1, b=x` for an object, the text of a string, `-` for null.
    fn inline(value: &serde_json::Value) -> String {
        match value {
            serde_json::Value::Null => "-".into(),
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(map) => map
                .iter()
                .map(|(k, v)| format!("{k}={}", inline(v)))
                .collect::<Vec<_>>()
                .join(", "),
            serde_json::Value::Array(items) => items.iter().map(inline).collect::<Vec<_>>().join(", "),
            other => other.to_string(),
        }
    }
    let mut out = Vec::new();
    walk(&serde_json::to_value(value).unwrap_or_default(), "", &mut out);
    out
}

/// A config as a titled key/value table.
pub(crate) fn config_html(title: &str, value: &impl serde::Serialize) -> String {
    let rows = fields(value);
    kv_card(title, rows.iter().map(|(k, v)| (k.as_str(), v.as_str())))
}

/// A titled key/value table of plain-text values (escaped here), styled for a notebook.
pub(crate) fn kv_card<'a>(title: &str, rows: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let rows: Vec<(&str, String)> = rows.into_iter().map(|(k, v)| (k, escape(v))).collect();
    style::container(&section(title, &kv_table(&rows)))
}

/// A titled card of `(key, value)` rows: what a `rows()` method of a settings-like value gives.
pub(crate) fn rows_card(title: &str, rows: &[(&str, String)]) -> String {
    kv_card(title, rows.iter().map(|(k, v)| (*k, v.as_str())))
}

/// The same rows as `key: value` lines, the plain-text twin of [`rows_card`].
pub(crate) fn rows_text(rows: &[(&str, String)]) -> String {
    rows.iter()
        .map(|(k, v)| {
            format!(
                "{k}: {v}
"
            )
        })
        .collect()
}

/// A config as `field = value` lines.
pub(crate) fn config_text(value: &impl serde::Serialize) -> String {
    fields(value).iter().map(|(k, v)| format!("{k} = {v}\n")).collect()
}

/// Prints a [`Rich`] value for evcxr (what every `evcxr_display` does).
pub fn show<T: Rich + ?Sized>(value: &T) {
    print!("{}", evcxr_payload(&value.html(), &value.text()));
}

/// Adds the inherent `evcxr_display(&self)` evcxr looks for to types implementing [`Rich`].
macro_rules! rich_display {
    ($($ty:ty),+ $(,)?) => {$(
        impl $ty {
            /// Renders this value in an evcxr notebook cell (HTML with a plain-text twin).
            pub fn evcxr_display(&self) {
                $crate::display::show(self);
            }
        }
    )+};
}
pub(crate) use rich_display;
