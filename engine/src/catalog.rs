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
}

impl ModelSpec {
    /// Validate one request body for this model.
    pub fn validate(&self, body: &Value) -> Result<ValidRequest, InputError> {
        ValidRequest::parse(self.task, body)
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

    /// All served models, by name.
    pub fn iter(&self) -> impl Iterator<Item = &ModelSpec> {
        self.models.values()
    }
}
