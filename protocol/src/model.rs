//! The models a deployment serves, and what each accepts.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::ErrorCode;
use crate::input::{InputError, ValidRequest};
pub use crate::Task;

/// The built-in deterministic model used to test and benchmark the pipeline.
pub const ECHO_MODEL: &str = "@lorry/echo";

/// The projection sizes of a decoder, which a LoRA adapter for it must fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterShape {
    /// Decoder layers.
    pub num_layers: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's inner projections.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
}

/// One served model: its manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// The name clients use, e.g. `@cf/meta/llama-3.1-8b-instruct`.
    pub name: String,
    /// What it does.
    pub task: Task,
    /// The shape LoRA adapters must fit, for models that take them.
    pub adapters: Option<AdapterShape>,
}

impl ModelSpec {
    /// Whether requests may name a LoRA adapter.
    pub fn takes_adapters(&self) -> bool {
        self.adapters.is_some()
    }

    /// The adapter shape, or the refusal of an adapter named by `param`.
    pub fn adapter_shape(&self, param: &str) -> Result<AdapterShape, InputError> {
        self.adapters.ok_or_else(|| no_adapters(&self.name, param))
    }

    /// Validate one request body for this model.
    pub fn validate(&self, body: &Value) -> Result<ValidRequest, InputError> {
        let request = ValidRequest::parse(self.task, body)?;
        if request.lora.is_some() {
            self.adapter_shape(request.adapter_field.as_str())?;
        }
        Ok(request)
    }
}

/// The refusal of an adapter, named by `param`, for `model`, which takes none.
pub fn no_adapters(model: &str, param: &str) -> InputError {
    InputError::new(
        ErrorCode::AdaptersNotSupported,
        param,
        format!("model {model} does not take LoRA adapters"),
    )
}

/// The served models by name.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    models: BTreeMap<String, ModelSpec>,
}

impl Catalog {
    /// The catalogue every deployment starts with: the echo model.
    pub fn builtin() -> Self {
        Catalog::with_models([])
    }

    /// The echo model and `models`.
    pub fn with_models(models: impl IntoIterator<Item = ModelSpec>) -> Self {
        let mut catalog = Catalog::default();
        catalog.insert(ModelSpec {
            name: ECHO_MODEL.to_string(),
            task: Task::Echo,
            adapters: None,
        });
        for spec in models {
            catalog.insert(spec);
        }
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

    /// The shape adapters for `name` must fit, when it takes adapters.
    pub fn adapter_base(&self, name: &str) -> Option<&AdapterShape> {
        self.models.get(name).and_then(|m| m.adapters.as_ref())
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
        assert_eq!(
            (err.code.as_str(), err.param.as_str()),
            ("adapters_not_supported", "lora")
        );
    }
}
