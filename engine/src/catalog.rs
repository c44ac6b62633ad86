//! The models a deployment serves, and which input each accepts.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::input::{InputError, ValidRequest};

/// The built-in deterministic model used to test and benchmark the pipeline.
pub const ECHO_MODEL: &str = "@lorry/echo";

/// What a model does, which decides the input it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Returns its input's text: the pipeline's test and benchmark model.
    Echo,
    /// Text generation from a prompt or chat messages.
    TextGeneration,
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// The name clients use, e.g. `@cf/meta/llama-3.1-8b-instruct`.
    pub name: String,
    /// What it does.
    pub task: Task,
    /// Whether requests may name a LoRA adapter.
    pub takes_adapters: bool,
}

impl ModelSpec {
    /// Validate one request body for this model.
    pub fn validate(&self, body: &Value) -> Result<ValidRequest, InputError> {
        let request = ValidRequest::parse(self.task, body)?;
        if request.lora.is_some() && !self.takes_adapters {
            return Err(InputError::new(
                "adapters_not_supported",
                "lora",
                format!("model {} does not take LoRA adapters", self.name),
            ));
        }
        Ok(request)
    }
}

/// The served models by name.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    models: BTreeMap<String, ModelSpec>,
}

impl Catalog {
    /// The catalogue every deployment starts with: the echo model.
    pub fn builtin() -> Self {
        let mut catalog = Catalog::default();
        catalog.insert(ModelSpec {
            name: ECHO_MODEL.to_string(),
            task: Task::Echo,
            takes_adapters: false,
        });
        catalog
    }

    /// Add or replace a model.
    pub fn insert(&mut self, spec: ModelSpec) {
        self.models.insert(spec.name.clone(), spec);
    }

    /// Look a model up by its served name.
    pub fn get(&self, name: &str) -> Option<&ModelSpec> {
        self.models.get(name)
    }

    /// All served model names.
    pub fn names(&self) -> Vec<String> {
        self.models.keys().cloned().collect()
    }

    /// All served models, by name.
    pub fn iter(&self) -> impl Iterator<Item = &ModelSpec> {
        self.models.values()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_model_without_adapters_refuses_a_lora() {
        let catalog = Catalog::builtin();
        let echo = catalog.get(ECHO_MODEL).unwrap();
        assert!(echo.validate(&json!({"prompt": "a"})).is_ok());
        let err = echo.validate(&json!({"prompt": "a", "lora": "mine"})).unwrap_err();
        assert_eq!((err.code, err.param.as_str()), ("adapters_not_supported", "lora"));
    }
}
