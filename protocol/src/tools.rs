//! Tool calls: the functions a chat request offers the model
//! (`tools`, `tool_choice`, `parallel_tool_calls`), read at the edge from
//! OpenAI's shape (`{"type": "function", "function": {name, description,
//! parameters}}`) or Workers AI's (`{name, description, parameters}`), and
//! the calls a model made, as the answer shapes carry them.
//!
//! Each function's `parameters` schema is compiled at the edge as a
//! structured output's schema is, so a schema that `required` or a named
//! `tool_choice` could not enforce is refused before anything is stored.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::constraint::{self, Constraint};
use crate::error::ErrorCode;
use crate::input::{Fields, InputError};

/// The most functions one request may offer.
pub const MAX_TOOLS: usize = 128;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Function {
    /// Its name: 1 to 64 letters, digits, underscores or dashes.
    pub name: String,
    /// What it does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON schema of its arguments (an object schema).
    pub parameters: Value,
}

/// Whether and which tool the model must call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model answers in text or calls tools, as it sees fit.
    Auto,
    /// The model answers in text; the tools are not shown to it.
    None,
    /// The model calls at least one tool (enforced by a grammar).
    Required,
    /// The model calls this function (enforced by a grammar).
    Function(String),
}

/// The tools a request offers and how they may be used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tools {
    /// The functions, in the request's order.
    pub functions: Vec<Function>,
    /// `tool_choice`; `auto` when absent.
    pub choice: ToolChoice,
    /// Whether one answer may hold several calls (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

impl Tools {
    /// Whether the model is shown the tools and its output read for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The functions a call may name: the named one for a named choice, else all.
    pub fn callable(&self) -> impl Iterator<Item = &Function> {
        self.functions.iter().filter(move |f| match &self.choice {
            ToolChoice::Function(name) => &f.name == name,
            _ => true,
        })
    }

    /// Whether the output must be calls (`required` or a named function).
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }

    /// The functions in the shape chat templates take:
    /// `[{"type": "function", "function": {name, description, parameters}}]`.
    pub fn template_json(&self) -> Value {
        Value::Array(
            self.functions
                .iter()
                .map(|f| {
                    // In OpenAI's order, which templates print as they find it.
                    let mut function = serde_json::Map::new();
                    function.insert("name".into(), json!(f.name));
                    if let Some(d) = &f.description {
                        function.insert("description".into(), json!(d));
                    }
                    function.insert("parameters".into(), f.parameters.clone());
                    json!({"type": "function", "function": function})
                })
                .collect(),
        )
    }

    /// The JSON schema one call must match: `{"name": <a callable
    /// function>, <arguments>: <its parameters>}`, the arguments under the
    /// key the model family writes them with (`arguments` or `parameters`).
    pub fn call_schema(&self, arguments: &str) -> Value {
        let alternatives: Vec<Value> = self
            .callable()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f.name}, arguments: f.parameters},
                    "required": ["name", arguments],
                    "additionalProperties": false,
                })
            })
            .collect();
        match alternatives.len() {
            1 => alternatives.into_iter().next().unwrap_or_default(),
            _ => json!({"anyOf": alternatives}),
        }
    }
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which a `tool` message answering it names.
    pub id: String,
    /// The function called.
    pub name: String,
    /// Its arguments: a JSON object's text, as OpenAI carries them.
    pub arguments: String,
}

impl ToolCall {
    /// OpenAI's shape: `{"id", "type": "function", "function": {"name", "arguments"}}`.
    pub fn openai_json(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }

    /// Workers AI's shape, as results store it: `{"id", "name", "arguments": {…}}`.
    pub fn result_json(&self) -> Value {
        let arguments = serde_json::from_str(&self.arguments).unwrap_or_else(|_| json!(self.arguments));
        json!({"id": self.id, "name": self.name, "arguments": arguments})
    }

    /// Calls as results store them (see [`ToolCall::result_json`]).
    pub fn results_json(calls: &[ToolCall]) -> Value {
        Value::Array(calls.iter().map(ToolCall::result_json).collect())
    }

    /// A call read back from [`ToolCall::result_json`] or [`ToolCall::openai_json`].
    pub fn from_json(value: &Value) -> Option<ToolCall> {
        let function = value.get("function").unwrap_or(value);
        let name = function.get("name")?.as_str()?.to_string();
        let arguments = match function.get("arguments") {
            Some(Value::String(text)) => text.clone(),
            Some(other) => other.to_string(),
            None => "{}".to_string(),
        };
        let id = value.get("id").and_then(Value::as_str).unwrap_or_default().to_string();
        Some(ToolCall { id, name, arguments })
    }
}

/// Every call of a list read back (see [`ToolCall::from_json`]).
pub fn calls_from_json(value: Option<&Value>) -> Vec<ToolCall> {
    value
        .and_then(Value::as_array)
        .map(|items| items.iter().filter_map(ToolCall::from_json).collect())
        .unwrap_or_default()
}

fn invalid(code: ErrorCode, path: impl Into<String>, message: impl Into<String>) -> InputError {
    InputError::new(code, path, message)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a request body.
pub fn parse(f: &mut Fields<'_>) -> Result<Option<Tools>, InputError> {
    let tools = f.raw("tools");
    let choice = f.raw("tool_choice");
    let parallel: Option<bool> = f.optional("parallel_tool_calls", "a boolean")?;
    let Some(tools) = tools else {
        if choice.is_some() {
            return Err(invalid(
                ErrorCode::InvalidValue,
                "tool_choice",
                "tool_choice is only allowed when tools are given",
            ));
        }
        return Ok(None);
    };
    let items = tools
        .as_array()
        .ok_or_else(|| invalid(ErrorCode::InvalidType, "tools", "tools must be an array"))?;
    if items.is_empty() || items.len() > MAX_TOOLS {
        return Err(invalid(
            ErrorCode::InvalidValue,
            "tools",
            format!("tools takes 1 to {MAX_TOOLS} functions"),
        ));
    }
    let mut functions: Vec<Function> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let function = function(item, &format!("tools[{i}]"))?;
        if functions.iter().any(|f| f.name == function.name) {
            return Err(invalid(
                ErrorCode::InvalidValue,
                format!("tools[{i}]"),
                format!("tools[{i}] repeats the function name {}", function.name),
            ));
        }
        functions.push(function);
    }
    let choice =
        match choice {
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => ToolChoice::Auto,
                "none" => ToolChoice::None,
                "required" | "any" => ToolChoice::Required,
                _ => return Err(invalid(
                    ErrorCode::InvalidValue,
                    "tool_choice",
                    "tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": …}}",
                )),
            },
            Some(value) => {
                let mut c = Fields::new(value, "tool_choice")?;
                let kind: String = c.required("type", "a string")?;
                if kind != "function" {
                    return Err(invalid(
                        ErrorCode::InvalidValue,
                        "tool_choice.type",
                        "tool_choice.type must be function",
                    ));
                }
                let Some(named) = c.raw("function") else {
                    return Err(invalid(
                        ErrorCode::MissingField,
                        "tool_choice.function",
                        "tool_choice.function is required",
                    ));
                };
                let mut n = Fields::new(named, "tool_choice.function")?;
                let name: String = n.required("name", "a string")?;
                n.deny_unknown()?;
                c.deny_unknown()?;
                if !functions.iter().any(|f| f.name == name) {
                    return Err(invalid(
                        ErrorCode::InvalidValue,
                        "tool_choice.function.name",
                        format!("tool_choice.function.name names {name}, which is not among tools"),
                    ));
                }
                ToolChoice::Function(name)
            }
        };
    Ok(Some(Tools {
        functions,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

/// One function: OpenAI's `{"type": "function", "function": {…}}` or the bare `{…}`.
fn function(item: &Value, path: &str) -> Result<Function, InputError> {
    let mut outer = Fields::new(item, path)?;
    let wrapped = item.get("type").is_some() || item.get("function").is_some();
    let (body, at) = if wrapped {
        let kind: String = outer.required("type", "a string")?;
        if kind != "function" {
            let at = outer.path_of("type");
            return Err(invalid(
                ErrorCode::UnsupportedParameter,
                at.clone(),
                format!("{at} must be function; no other kind of tool is served"),
            ));
        }
        let at = outer.path_of("function");
        let body = outer
            .raw("function")
            .ok_or_else(|| invalid(ErrorCode::MissingField, at.clone(), format!("{at} is required")))?;
        outer.deny_unknown()?;
        (body, at)
    } else {
        (item, path.to_string())
    };
    let mut f = Fields::new(body, &at)?;
    let name: String = f.required("name", "a string")?;
    if !valid_name(&name) {
        let at = f.path_of("name");
        return Err(invalid(
            ErrorCode::InvalidValue,
            at.clone(),
            format!("{at} must be 1 to 64 letters, digits, underscores or dashes"),
        ));
    }
    let description: Option<String> = f.optional("description", "a string")?;
    f.optional::<bool>("strict", "a boolean")?;
    let schema_at = f.path_of("parameters");
    let parameters = match f.raw("parameters") {
        None => json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(_) => {
            return Err(invalid(
                ErrorCode::InvalidType,
                schema_at.clone(),
                format!("{schema_at} must be a JSON schema (an object)"),
            ))
        }
    };
    f.deny_unknown()?;
    constraint::check(
        &Constraint::JsonSchema {
            schema: parameters.clone(),
        },
        &schema_at,
    )?;
    Ok(Function {
        name,
        description,
        parameters,
    })
}

/// The calls an assistant message of the conversation made, in either shape
/// (see [`ToolCall::from_json`]); their arguments must be a JSON object's text
/// (or the object).
pub fn parse_message_calls(value: &Value, path: &str) -> Result<Vec<ToolCall>, InputError> {
    let items = value
        .as_array()
        .ok_or_else(|| invalid(ErrorCode::InvalidType, path, format!("{path} must be an array")))?;
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let at = format!("{path}[{i}]");
            let call = ToolCall::from_json(item).ok_or_else(|| {
                invalid(
                    ErrorCode::InvalidValue,
                    at.clone(),
                    format!("{at} must name its function: {{\"function\": {{\"name\", \"arguments\"}}}}"),
                )
            })?;
            let arguments: Result<Value, _> = serde_json::from_str(&call.arguments);
            if !matches!(arguments, Ok(Value::Object(_))) {
                return Err(invalid(
                    ErrorCode::InvalidValue,
                    format!("{at}.function.arguments"),
                    format!("{at}.function.arguments must hold a JSON object"),
                ));
            }
            Ok(call)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: Value) -> Result<Option<Tools>, InputError> {
        let mut f = Fields::new(&body, "")?;
        let tools = parse(&mut f)?;
        f.deny_unknown()?;
        Ok(tools)
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn both_shapes_and_every_choice_are_read() {
        let tools = read(json!({"tools": [weather(), {"name": "now", "parameters": {"type": "object"}}]}))
            .unwrap()
            .unwrap();
        assert_eq!(tools.functions.len(), 2);
        assert_eq!(tools.functions[1].name, "now");
        assert_eq!(tools.choice, ToolChoice::Auto);
        assert!(tools.parallel && tools.active() && !tools.forced());
        for (choice, expected) in [
            (json!("none"), ToolChoice::None),
            (json!("required"), ToolChoice::Required),
            (
                json!({"type": "function", "function": {"name": "get_weather"}}),
                ToolChoice::Function("get_weather".into()),
            ),
        ] {
            let tools = read(json!({"tools": [weather()], "tool_choice": choice, "parallel_tool_calls": false}))
                .unwrap()
                .unwrap();
            assert_eq!(tools.choice, expected);
            assert!(!tools.parallel);
        }
        assert_eq!(read(json!({})).unwrap(), None);
    }

    #[test]
    fn bad_tools_are_refused_naming_the_field() {
        let cases = [
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (json!({"tools": []}), "tools"),
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [weather()], "tool_choice": "sometimes"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "other"}}}),
                "tool_choice.function.name",
            ),
            (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
            ),
            (json!({"tools": [weather(), weather()]}), "tools[1]"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}),
                "tools[0].function.extra",
            ),
        ];
        for (body, param) in cases {
            let error = read(body.clone()).expect_err(&body.to_string());
            assert_eq!(error.param, param, "{body}: {error:?}");
        }
    }

    #[test]
    fn the_call_schema_names_what_may_be_called() {
        let tools = read(json!({"tools": [weather(), {"name": "now"}], "tool_choice": {"type": "function", "function": {"name": "now"}}}))
            .unwrap()
            .unwrap();
        let schema = tools.call_schema("arguments");
        assert_eq!(schema["properties"]["name"]["const"], "now");
        assert_eq!(schema["required"], json!(["name", "arguments"]));
        let all = Tools {
            choice: ToolChoice::Required,
            ..tools
        };
        assert_eq!(all.call_schema("parameters")["anyOf"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn calls_read_back_from_either_shape() {
        let call = ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: "{\"city\":\"Paris\"}".into(),
        };
        assert_eq!(ToolCall::from_json(&call.openai_json()), Some(call.clone()));
        let stored = call.result_json();
        assert_eq!(stored["arguments"]["city"], "Paris");
        assert_eq!(ToolCall::from_json(&stored), Some(call.clone()));
        let sent = json!([{"id": "x", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]);
        assert_eq!(
            parse_message_calls(&sent, "messages[1].tool_calls").unwrap_err().param,
            "messages[1].tool_calls[0].function.arguments"
        );
    }
}
