//! Structured outputs: what a request's generated text must match.
//!
//! A [`Constraint`] is read at the edge from any of the shapes clients send —
//! OpenAI's `response_format` (`json_object`, `json_schema` with its `name`,
//! `schema` and `strict`), Workers AI's `response_format` (the schema itself
//! under `json_schema`), and the fields other OpenAI-compatible servers take
//! (vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
//! and `structured_outputs: {json | regex | choice | grammar}`) — and compiled
//! once there by llguidance, without a tokenizer, so that a schema, regular
//! expression or grammar it cannot serve is refused before anything is
//! stored. The engine compiles it again against its model's tokenizer and
//! masks each step's logits with it.
//!
//! JSON is generated compact (no whitespace between tokens) unless the
//! schema's own `x-guidance` options say otherwise: a model free to add
//! whitespace anywhere can spend its whole `max_tokens` on it.

use std::collections::HashMap;
use std::sync::Mutex;

use llguidance::api::{GrammarInit, ParserLimits, TopLevelGrammar};
use llguidance::earley::ValidationResult;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::ErrorCode;
use crate::input::{Fields, InputError};

/// The longest constraint accepted, serialised, in bytes.
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;
/// The most strings a choice may offer.
pub const MAX_CHOICES: usize = 1024;
/// The deepest a schema's objects and arrays may nest: well inside the 128
/// levels JSON is read to, wherever a request travels wrapped.
pub const MAX_SCHEMA_DEPTH: usize = 64;

/// What the generated text must match.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under a schema.
    JsonSchema {
        /// The schema.
        schema: Value,
    },
    /// Text the whole of which a regular expression matches.
    Regex {
        /// The expression, in Rust's `regex` syntax.
        pattern: String,
    },
    /// Exactly one of these strings.
    Choice {
        /// The strings.
        choices: Vec<String>,
    },
    /// Text a Lark grammar (llguidance's dialect) derives.
    Grammar {
        /// The grammar.
        grammar: String,
    },
}

/// The request fields that carry a constraint, in the order they are read.
pub const FIELDS: [&str; 6] = [
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
];

impl Constraint {
    /// The grammar llguidance compiles for it.
    pub fn grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonObject => TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}))),
            Constraint::JsonSchema { schema } => TopLevelGrammar::from_json_schema(compact(schema.clone())),
            Constraint::Regex { pattern } => TopLevelGrammar::from_regex(pattern),
            Constraint::Choice { choices } => {
                let alternatives: Vec<String> = choices.iter().map(|c| escape_regex(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            Constraint::Grammar { grammar } => TopLevelGrammar::from_lark(grammar.clone()),
        }
    }

    /// A key naming this constraint exactly (for caches of compiled grammars).
    pub fn key(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The refusal's code for a constraint llguidance cannot compile.
    pub fn invalid_code(&self) -> ErrorCode {
        match self {
            Constraint::JsonObject | Constraint::JsonSchema { .. } => ErrorCode::InvalidSchema,
            _ => ErrorCode::InvalidGrammar,
        }
    }
}

/// The limits every compilation and every step's mask keeps within: a
/// hostile grammar runs out of fuel, it does not stall a worker.
pub fn limits() -> ParserLimits {
    ParserLimits {
        max_grammar_size: 200_000,
        initial_lexer_fuel: 1_000_000,
        step_lexer_fuel: 400_000,
        max_lexer_states: 100_000,
        ..ParserLimits::default()
    }
}

/// JSON without whitespace between tokens, unless the schema says otherwise.
fn compact(mut schema: Value) -> Value {
    if let Value::Object(fields) = &mut schema {
        fields
            .entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false}));
    }
    schema
}

/// `text` as a regular expression matching exactly it.
fn escape_regex(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Read the request's constraint, if it gives one, with the path of the
/// field that held it; `param` paths are the client's. At most one of
/// [`FIELDS`] may be given.
pub(crate) fn parse(f: &mut Fields<'_>) -> Result<Option<(Constraint, String)>, InputError> {
    let mut found: Vec<(Constraint, String)> = Vec::new();
    let mut given: Vec<&str> = Vec::new();
    for name in FIELDS {
        let Some(value) = f.raw(name) else { continue };
        given.push(name);
        let path = f.path_of(name);
        let read = match name {
            "response_format" => response_format(value, &path)?,
            "structured_outputs" => structured_outputs(value, &path)?,
            "guided_json" => Some((
                Constraint::JsonSchema {
                    schema: schema_value(value, &path)?,
                },
                path,
            )),
            "guided_regex" => Some((
                Constraint::Regex {
                    pattern: string(value, &path)?,
                },
                path,
            )),
            "guided_choice" => Some((choice(value, &path)?, path)),
            _ => Some((
                Constraint::Grammar {
                    grammar: string(value, &path)?,
                },
                path,
            )),
        };
        found.extend(read);
    }
    if given.len() > 1 {
        return Err(InputError::new(
            ErrorCode::ConflictingFields,
            f.path_of(given[1]),
            format!("give at most one of {}", given.join(", ")),
        ));
    }
    let Some((constraint, at)) = found.pop() else {
        return Ok(None);
    };
    check(&constraint, &at)?;
    Ok(Some((constraint, at)))
}

/// `{"type": "text" | "json_object" | "json_schema", "json_schema"?: …}`:
/// OpenAI's `json_schema` wraps the schema (`name`, `schema`, `strict`,
/// `description`); Workers AI's is the schema itself.
fn response_format(value: &Value, path: &str) -> Result<Option<(Constraint, String)>, InputError> {
    let mut f = Fields::new(value, path)?;
    let kind: String = f.required("type", "a string")?;
    let result = match kind.as_str() {
        "text" => None,
        "json_object" => Some((Constraint::JsonObject, path.to_string())),
        "json_schema" => {
            let Some(inner) = f.raw("json_schema") else {
                let at = f.path_of("json_schema");
                return Err(InputError::new(
                    ErrorCode::MissingField,
                    at.clone(),
                    format!("{at} is required with type json_schema"),
                ));
            };
            let at = f.path_of("json_schema");
            Some(json_schema(inner, &at)?)
        }
        _ => {
            let at = f.path_of("type");
            return Err(InputError::new(
                ErrorCode::InvalidValue,
                at.clone(),
                format!("{at} must be one of text, json_object, json_schema"),
            ));
        }
    };
    f.deny_unknown()?;
    Ok(result)
}

/// OpenAI's wrapper, recognised by its `name` or `schema`, or a schema itself.
fn json_schema(value: &Value, path: &str) -> Result<(Constraint, String), InputError> {
    let wrapped = value
        .as_object()
        .is_some_and(|o| o.get("name").is_some_and(Value::is_string) || o.get("schema").is_some_and(Value::is_object));
    if !wrapped {
        let schema = schema_value(value, path)?;
        return Ok((Constraint::JsonSchema { schema }, path.to_string()));
    }
    let mut f = Fields::new(value, path)?;
    let name: Option<String> = f.optional("name", "a string")?;
    if name.as_deref().is_some_and(|n| {
        n.is_empty() || n.len() > 64 || !n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    }) {
        let at = f.path_of("name");
        return Err(InputError::new(
            ErrorCode::InvalidValue,
            at.clone(),
            format!("{at} must be 1 to 64 letters, digits, underscores or dashes"),
        ));
    }
    f.optional::<String>("description", "a string")?;
    f.optional::<bool>("strict", "a boolean")?;
    let at = f.path_of("schema");
    let schema = match f.raw("schema") {
        Some(schema) => schema_value(schema, &at)?,
        // OpenAI's default: any JSON object.
        None => json!({"type": "object"}),
    };
    f.deny_unknown()?;
    Ok((Constraint::JsonSchema { schema }, at))
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`.
fn structured_outputs(value: &Value, path: &str) -> Result<Option<(Constraint, String)>, InputError> {
    let mut f = Fields::new(value, path)?;
    let mut read: Vec<(Constraint, String)> = Vec::new();
    for name in ["json", "regex", "choice", "grammar"] {
        let Some(item) = f.raw(name) else { continue };
        let at = f.path_of(name);
        let constraint = match name {
            "json" => Constraint::JsonSchema {
                schema: schema_value(item, &at)?,
            },
            "regex" => Constraint::Regex {
                pattern: string(item, &at)?,
            },
            "choice" => choice(item, &at)?,
            _ => Constraint::Grammar {
                grammar: string(item, &at)?,
            },
        };
        read.push((constraint, at));
    }
    f.deny_unknown()?;
    if read.len() > 1 {
        return Err(InputError::new(
            ErrorCode::ConflictingFields,
            path,
            format!("{path} takes one of json, regex, choice or grammar"),
        ));
    }
    Ok(read.pop())
}

/// A schema: an object or a boolean, or a string holding one (vLLM takes both).
fn schema_value(value: &Value, path: &str) -> Result<Value, InputError> {
    let schema = match value {
        Value::String(text) => serde_json::from_str(text).map_err(|e| {
            InputError::new(
                ErrorCode::InvalidSchema,
                path,
                format!("{path} is a string that does not hold JSON: {e}"),
            )
        })?,
        other => other.clone(),
    };
    if !schema.is_object() && !schema.is_boolean() {
        return Err(InputError::new(
            ErrorCode::InvalidType,
            path,
            format!("{path} must be a JSON schema (an object)"),
        ));
    }
    if depth(&schema) > MAX_SCHEMA_DEPTH {
        return Err(InputError::new(
            ErrorCode::InvalidSchema,
            path,
            format!("{path} is nested deeper than {MAX_SCHEMA_DEPTH} levels"),
        ));
    }
    Ok(schema)
}

/// How deeply a value's arrays and objects nest (a scalar is 0).
fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(fields) => 1 + fields.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn string(value: &Value, path: &str) -> Result<String, InputError> {
    match value {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        Value::String(_) => Err(InputError::new(
            ErrorCode::InvalidValue,
            path,
            format!("{path} must not be empty"),
        )),
        _ => Err(InputError::new(
            ErrorCode::InvalidType,
            path,
            format!("{path} must be a string"),
        )),
    }
}

fn choice(value: &Value, path: &str) -> Result<Constraint, InputError> {
    let choices: Vec<String> = serde_json::from_value(value.clone()).map_err(|_| {
        InputError::new(
            ErrorCode::InvalidType,
            path,
            format!("{path} must be an array of strings"),
        )
    })?;
    if choices.is_empty() || choices.len() > MAX_CHOICES || choices.iter().any(String::is_empty) {
        return Err(InputError::new(
            ErrorCode::InvalidValue,
            path,
            format!("{path} takes 1 to {MAX_CHOICES} non-empty strings"),
        ));
    }
    Ok(Constraint::Choice { choices })
}

/// Constraints checked lately, by key, with the outcome: a batch of
/// thousands of requests under one schema compiles it once.
static CHECKED: Mutex<Option<HashMap<String, Result<(), String>>>> = Mutex::new(None);
const CHECKED_ENTRIES: usize = 256;

/// Compile `constraint` without a tokenizer, within [`limits`]; `path` names
/// the field it came from.
pub fn check(constraint: &Constraint, path: &str) -> Result<(), InputError> {
    let key = constraint.key();
    if key.len() > MAX_CONSTRAINT_BYTES {
        return Err(InputError::new(
            ErrorCode::InvalidValue,
            path,
            format!("{path} is larger than {} KiB", MAX_CONSTRAINT_BYTES / 1024),
        ));
    }
    let known = CHECKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&key).cloned());
    let outcome = match known {
        Some(outcome) => outcome,
        None => {
            let outcome = compile(constraint);
            let mut cache = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
            let cache = cache.get_or_insert_with(HashMap::new);
            if cache.len() >= CHECKED_ENTRIES {
                cache.clear();
            }
            cache.insert(key, outcome.clone());
            outcome
        }
    };
    outcome.map_err(|reason| {
        InputError::new(
            constraint.invalid_code(),
            path,
            format!("{path} cannot be served: {reason}"),
        )
    })
}

fn compile(constraint: &Constraint) -> Result<(), String> {
    // llguidance reports what it cannot compile as errors; a panic inside it
    // is a refusal too, never a failed request handler.
    let grammar = constraint.grammar();
    let result = std::panic::catch_unwind(|| GrammarInit::Serialized(grammar).validate(None, limits()));
    match result {
        Ok(ValidationResult::Valid | ValidationResult::Warnings(_)) => Ok(()),
        Ok(ValidationResult::Error(reason)) => Err(first_line(&reason)),
        Err(_) => Err("the grammar compiler failed on it".to_string()),
    }
}

/// An error's first line, bounded: what a client reads in a refusal.
pub fn first_line(reason: &str) -> String {
    let line = reason.lines().next().unwrap_or_default();
    let mut end = line.len().min(300);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    line[..end].to_string()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{Task, ValidRequest};

    fn parse(body: Value) -> Result<Option<Constraint>, InputError> {
        ValidRequest::parse(Task::TextGeneration, &body).map(|r| r.constraint)
    }

    #[test]
    fn every_shape_reads_as_its_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]});
        let expected = Some(Constraint::JsonSchema { schema: schema.clone() });
        let openai = json!({"prompt": "p", "response_format": {"type": "json_schema",
            "json_schema": {"name": "thing", "strict": true, "schema": schema}}});
        assert_eq!(parse(openai).unwrap(), expected);
        let workers = json!({"prompt": "p", "response_format": {"type": "json_schema", "json_schema": schema}});
        assert_eq!(parse(workers).unwrap(), expected);
        let vllm = json!({"prompt": "p", "guided_json": schema.to_string()});
        assert_eq!(parse(vllm).unwrap(), expected);
        let nested = json!({"prompt": "p", "structured_outputs": {"json": schema}});
        assert_eq!(parse(nested).unwrap(), expected);
        assert_eq!(
            parse(json!({"prompt": "p", "response_format": {"type": "json_object"}})).unwrap(),
            Some(Constraint::JsonObject)
        );
        assert_eq!(
            parse(json!({"prompt": "p", "response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(
            parse(json!({"prompt": "p", "guided_regex": "[0-9]{3}"})).unwrap(),
            Some(Constraint::Regex {
                pattern: "[0-9]{3}".into()
            })
        );
        assert_eq!(
            parse(json!({"prompt": "p", "structured_outputs": {"choice": ["yes", "no"]}})).unwrap(),
            Some(Constraint::Choice {
                choices: vec!["yes".into(), "no".into()]
            })
        );
        assert_eq!(
            parse(json!({"prompt": "p", "guided_grammar": "start: \"a\"+"})).unwrap(),
            Some(Constraint::Grammar {
                grammar: "start: \"a\"+".into()
            })
        );
    }

    #[test]
    fn what_cannot_be_compiled_is_refused_naming_the_field() {
        let cases = [
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
                "invalid_schema",
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["a"]}}}),
                "invalid_schema",
                "response_format.json_schema",
            ),
            (json!({"guided_regex": "(unclosed"}), "invalid_grammar", "guided_regex"),
            (
                json!({"guided_grammar": "start: undefined_rule"}),
                "invalid_grammar",
                "guided_grammar",
            ),
            (json!({"guided_json": "{not json"}), "invalid_schema", "guided_json"),
            (json!({"guided_choice": []}), "invalid_value", "guided_choice"),
            (
                json!({"response_format": {"type": "xml"}}),
                "invalid_value",
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "missing_field",
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "conflicting_fields",
                "guided_regex",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}),
                "conflicting_fields",
                "structured_outputs",
            ),
        ];
        for (mut body, code, param) in cases {
            body["prompt"] = json!("p");
            let error = parse(body.clone()).unwrap_err();
            assert_eq!((error.code.as_str(), error.param.as_str()), (code, param), "{body}");
        }
    }

    #[test]
    fn a_constraint_travels_with_its_request() {
        let body = json!({"prompt": "p", "guided_choice": ["a", "b.c"]});
        let request = ValidRequest::parse(Task::TextGeneration, &body).unwrap();
        let travelled: ValidRequest = serde_json::from_value(serde_json::to_value(&request).unwrap()).unwrap();
        assert_eq!(travelled, request);
        let plain = ValidRequest::parse(Task::TextGeneration, &json!({"prompt": "p"})).unwrap();
        assert!(!serde_json::to_string(&plain).unwrap().contains("constraint"));
    }

    #[test]
    fn hostile_constraints_are_refused_within_the_limits() {
        // A schema as deep as client JSON may be (serde_json's 128 levels), as an object and as a string.
        let mut deep = json!({"type": "string"});
        for _ in 0..120 {
            deep = json!({"type": "array", "items": deep, "maxItems": 3});
        }
        let error = parse(json!({"prompt": "p", "guided_json": deep.to_string()})).unwrap_err();
        assert_eq!(
            (error.code.as_str(), error.param.as_str()),
            ("invalid_schema", "guided_json")
        );
        let mut within = json!({"type": "string", "maxLength": 2});
        for _ in 0..30 {
            within = json!({"type": "array", "items": within, "maxItems": 3});
        }
        assert!(parse(json!({"prompt": "p", "guided_json": within})).unwrap().is_some());
        // Over the size bound.
        let huge = json!({"prompt": "p", "guided_choice": vec!["x".repeat(1000); 100]});
        assert_eq!(parse(huge).unwrap_err().code.as_str(), "invalid_value");
    }

    #[test]
    fn choices_match_their_strings_literally() {
        assert_eq!(escape_regex("a.b|c(d)"), "a\\.b\\|c\\(d\\)");
        check(
            &Constraint::Choice {
                choices: vec!["x+y".into(), "[z]".into()],
            },
            "c",
        )
        .unwrap();
    }
}
