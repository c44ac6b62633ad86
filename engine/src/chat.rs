//! Text generation models with their tokenizer and chat template: the model's
//! own Jinja template (from `chat_template.jinja` or `tokenizer_config.json`)
//! rendered with minijinja and Python-compatible methods, as Hugging Face
//! templates expect.

use std::path::Path;

use candle_core::Device;
use minijinja::{context, Environment, ErrorKind};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::input::{Message, Prompt};
use crate::models::llama::Llama;
use crate::models::ModelError;

/// A decoder with its tokenizer, template and special tokens.
pub struct TextModel {
    /// The network.
    pub model: Llama,
    tokenizer: Tokenizer,
    template: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
    /// The end-of-sequence token id, if the tokenizer knows it.
    pub eos_id: Option<u32>,
}

fn token_text(config: &Value, key: &str) -> String {
    match &config[key] {
        Value::String(s) => s.clone(),
        Value::Object(o) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

fn config_error(what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Config(format!("{what}: {e}"))
}

impl TextModel {
    /// Load the model, `tokenizer.json`, `tokenizer_config.json` and the chat template.
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        let model = Llama::from_dir(dir, device)?;
        let tokenizer =
            Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| config_error("tokenizer.json", e))?;
        let config: Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        let source = std::fs::read_to_string(dir.join("chat_template.jinja"))
            .ok()
            .or_else(|| config["chat_template"].as_str().map(str::to_string));
        let template = source.map(compile).transpose()?;
        let eos_token = token_text(&config, "eos_token");
        Ok(TextModel {
            eos_id: tokenizer.token_to_id(&eos_token),
            bos_token: token_text(&config, "bos_token"),
            model,
            tokenizer,
            template,
            eos_token,
        })
    }

    /// The text the model sees: the prompt as is when `raw` (or when there is
    /// no template), else the chat template with a generation prompt.
    pub fn render(&self, prompt: &Prompt, raw: bool) -> Result<String, ModelError> {
        let messages: Vec<Message> = match (prompt, raw, &self.template) {
            (Prompt::Text(t) | Prompt::Plain(t), true, _) | (Prompt::Text(t) | Prompt::Plain(t), _, None) => {
                return Ok(t.clone())
            }
            (Prompt::Messages(m), _, None) => {
                return Err(ModelError::Config(format!(
                    "the model has no chat template for {} messages; send a raw prompt",
                    m.len()
                )))
            }
            (Prompt::Messages(m), true, _) => {
                return Ok(m.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n"))
            }
            (Prompt::Messages(m), false, Some(_)) => m.clone(),
            (Prompt::Text(t) | Prompt::Plain(t), false, Some(_)) => vec![Message {
                role: "user".into(),
                content: t.clone(),
            }],
        };
        let env = self.template.as_ref().expect("matched Some above");
        let template = env.get_template("chat").map_err(|e| config_error("chat template", e))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| config_error("chat template", e))
    }

    /// Token ids of rendered text, without added special tokens (the template places them).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| config_error("tokenizing", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of generated ids, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| config_error("decoding", e))
    }
}

fn compile(source: String) -> Result<Environment<'static>, ModelError> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_template_owned("chat", source)
        .map_err(|e| config_error("chat template", e))?;
    Ok(env)
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens`, or the model's context.
    Length,
}

/// One finished generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Generated ids only (an end-of-sequence token included).
    pub token_ids: Vec<u32>,
    /// Their text, cut before a stop string.
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Tokens in the rendered prompt.
    pub prompt_tokens: usize,
}

/// `max_tokens` when a request gives none.
pub const DEFAULT_MAX_TOKENS: u32 = 256;

impl TextModel {
    /// Serve one request alone: render, tokenise, sample until a stop.
    pub fn generate(&self, request: &crate::ValidRequest) -> Result<Generation, ModelError> {
        use crate::sampling::{Sampler, SamplingParams};
        let prompt = self.encode(&self.render(&request.prompt, request.raw)?)?;
        if prompt.is_empty() {
            return Err(ModelError::Config("the prompt is empty after tokenisation".into()));
        }
        let s = &request.sampling;
        let room = self.model.config().max_position_embeddings.saturating_sub(prompt.len());
        let max_new = (s.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS) as usize).min(room);
        let mut sampler = Sampler::new(SamplingParams {
            temperature: s.temperature.unwrap_or(0.0),
            top_k: s.top_k.map(|k| k as usize),
            top_p: s.top_p,
            seed: s.seed.unwrap_or(0),
        });
        let mut cache = self.model.new_cache();
        let mut logits = self.model.forward(&prompt, &mut cache)?;
        let mut token_ids = Vec::new();
        let mut text = String::new();
        while token_ids.len() < max_new {
            let next = sampler.sample(&logits.to_vec1::<f32>()?);
            token_ids.push(next);
            if !s.ignore_eos && Some(next) == self.eos_id {
                return Ok(self.finish(token_ids, text, FinishReason::Stop, prompt.len()));
            }
            text = self.decode(&token_ids)?;
            if let Some(cut) = s.stop.iter().filter_map(|stop| text.find(stop.as_str())).min() {
                text.truncate(cut);
                return Ok(self.finish(token_ids, text, FinishReason::Stop, prompt.len()));
            }
            if token_ids.len() < max_new {
                logits = self.model.forward(&[next], &mut cache)?;
            }
        }
        Ok(self.finish(token_ids, text, FinishReason::Length, prompt.len()))
    }

    fn finish(
        &self,
        token_ids: Vec<u32>,
        text: String,
        finish_reason: FinishReason,
        prompt_tokens: usize,
    ) -> Generation {
        Generation {
            token_ids,
            text,
            finish_reason,
            prompt_tokens,
        }
    }
}
