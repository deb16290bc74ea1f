//! Typed tools for multi-turn GRPO: a tool is a Rust function of one argument struct, and a
//! [`ToolEnvironment`] runs a model's calls to a list of them.
//!
//! The data contract:
//! - A tool's schema is what transformers' `get_json_schema` writes for the equivalent Python
//!   function (`schema`): its name, the argument struct's doc comment as the description, each
//!   field (its doc comment the field's description) as a parameter, `Option` fields and
//!   `#[serde(default)]` ones optional, and the result type as `return`. The chat template
//!   renders the schemas (`tools=`), as `apply_chat_template(..., tools=...)` does.
//! - Each assistant turn's calls are read in the format its template teaches (`calls`), run in
//!   order, and answered with one `tool` message each (`{"role": "tool", "name", "content"}`).
//!   A turn without calls ends the conversation with the environment's reward.
//! - Arguments are checked against the schema the model was shown and coerced only where exact
//!   (`coerce`). A schema violation, an unknown tool, malformed JSON, a tool's `Err` or panic:
//!   the model reads `{"error": "<what was wrong>"}` as that call's reply and the conversation
//!   goes on; every call and failure is counted per tool (`tools/call_frequency`,
//!   `tools/failure_frequency`, as TRL logs them).

mod calls;
mod coerce;
mod environment;
mod schema;

pub use calls::{CallFormat, ToolCall};
pub use environment::{ToolEnvironment, ToolTally};

use std::fmt::Display;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};

use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// A tool could not be made: its argument or result type has no schema transformers' form can
/// hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ToolError(String);

/// A tool a model may call: its schema (shown to the model) and what a call does.
pub trait Tool: Send + Sync {
    /// The name the model calls it by.
    fn name(&self) -> &str;
    /// Its schema in transformers' function format.
    fn schema(&self) -> &Value;
    /// Runs a call whose `arguments` were checked against the schema: the tool message's text,
    /// or what went wrong (the model is told).
    fn run(&self, arguments: Value) -> Result<String, String>;
}

/// A [`Tool`] from a function of a typed argument struct (see [`tool`]).
pub struct TypedTool<A, R, E, F> {
    name: String,
    schema: Value,
    function: F,
    types: PhantomData<fn(A) -> Result<R, E>>,
}

/// A tool named `name` that runs `function` on its arguments, deserialized into `A` (a struct
/// deriving `serde::Deserialize` and `schemars::JsonSchema`; its doc comments describe the
/// tool and each argument). The result is any `Serialize` value (a string is sent as written,
/// anything else as JSON); an `Err` is told to the model.
///
/// ```
/// use treetrain::grpo::tool;
/// use treetrain::schemars::{self, JsonSchema};
///
/// /// Adds two whole numbers.
/// #[derive(serde::Deserialize, JsonSchema)]
/// #[schemars(crate = "treetrain::schemars")]
/// struct Add {
///     /// The first number.
///     a: i64,
///     /// The second number.
///     b: i64,
/// }
///
/// let add = tool("add", |x: Add| x.a.checked_add(x.b).ok_or("overflow")).unwrap();
/// let schema = treetrain::grpo::Tool::schema(&add);
/// assert_eq!(schema["function"]["parameters"]["required"], serde_json::json!(["a", "b"]));
/// ```
pub fn tool<A, R, E, F>(name: &str, function: F) -> Result<TypedTool<A, R, E, F>, ToolError>
where
    A: DeserializeOwned + JsonSchema,
    R: Serialize + JsonSchema,
    E: Display,
    F: Fn(A) -> Result<R, E> + Send + Sync,
{
    let schema = schema::function_schema::<A, R>(name).map_err(ToolError)?;
    Ok(TypedTool {
        name: name.to_string(),
        schema,
        function,
        types: PhantomData,
    })
}

impl<A, R, E, F> Tool for TypedTool<A, R, E, F>
where
    A: DeserializeOwned + JsonSchema,
    R: Serialize + JsonSchema,
    E: Display,
    F: Fn(A) -> Result<R, E> + Send + Sync,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn schema(&self) -> &Value {
        &self.schema
    }

    fn run(&self, arguments: Value) -> Result<String, String> {
        let args: A = serde_json::from_value(arguments).map_err(|e| format!("the arguments do not fit: {e}"))?;
        let result = catch_unwind(AssertUnwindSafe(|| (self.function)(args)))
            .map_err(|p| format!("the tool failed: {}", super::panic_message(p.as_ref())))?
            .map_err(|e| e.to_string())?;
        match serde_json::to_value(&result).map_err(|e| format!("the result is not JSON: {e}"))? {
            Value::String(s) => Ok(s),
            other => Ok(other.to_string()),
        }
    }
}

impl<A, R, E, F> std::fmt::Debug for TypedTool<A, R, E, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TypedTool({})", self.name)
    }
}

impl<A, R, E, F> TypedTool<A, R, E, F> {
    fn rows(&self) -> Vec<(&'static str, String)> {
        vec![
            ("tool", self.name.clone()),
            (
                "schema, as the template sees it",
                crate::tokenizer::python_json(&self.schema, None, false),
            ),
        ]
    }
}

impl<A, R, E, F> crate::display::Rich for TypedTool<A, R, E, F> {
    fn html(&self) -> String {
        crate::display::rows_card(&format!("Tool {}", self.name), &self.rows())
    }
    fn text(&self) -> String {
        crate::display::rows_text(&self.rows())
    }
}

impl<A, R, E, F> TypedTool<A, R, E, F> {
    /// Renders this tool in an evcxr notebook cell (HTML with a plain-text twin).
    pub fn evcxr_display(&self) {
        crate::display::show(self);
    }
}
