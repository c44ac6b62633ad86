//! Text generation models with their tokenizer and chat template: the model's
//! own Jinja template (from `chat_template.jinja`, `tokenizer_config.json` —
//! a string, or a list of named templates of which `default` is used — or a
//! GGUF file's `tokenizer.chat_template`) rendered with minijinja and
//! Python-compatible methods, as Hugging Face templates expect. `raw` skips
//! the template; raw text gets the tokenizer's own special tokens, as
//! `tokenizer(text)` in transformers, where templated text gets only what the
//! template writes. `generation_config.json` adds its `eos_token_id`s to the
//! stop tokens and gives the sampling defaults.
//!
//! [`Decoding`] is one request's state (tokens, sampler, stop strings,
//! end-of-sequence, `finish_reason`, text held back from the stream while it
//! could still become a stop string, the grammar a structured output
//! follows, each token's log-probability where asked), the same whether the request runs alone
//! ([`TextModel::generate`], the tests' reference) or in a batch.

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use candle_core::Device;
use minijinja::{context, Environment, ErrorKind};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::input::{Constraint, InputError, Message, Prompt, ToolCall, Tools};
use crate::lora::PackedAdapter;
use crate::models::llama::{Llama, Products};
use crate::models::ModelError;
use crate::runtime::guide::{Grammars, Guide};
use crate::runtime::sampling::{Sampler, SamplingParams};
use crate::runtime::tools::{ToolSyntax, ToolTemplates};
use crate::EngineError;
use crate::ErrorCode;

/// A decoder with its tokenizer, template and special tokens; clones share the weights.
#[derive(Clone)]
pub struct TextModel {
    /// The network.
    pub model: Llama,
    /// Shared by clones and by the grammars' compiler: a vocabulary's maps
    /// are megabytes.
    tokenizer: Arc<Tokenizer>,
    template: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
    /// Tokens that end generation: the end-of-sequence token, every
    /// `eos_token_id` of `generation_config.json`, end-of-turn tokens.
    stop_ids: Vec<u32>,
    /// Sampling defaults from `generation_config.json`.
    defaults: GenerationDefaults,
    /// Constrained decoding's compiler and recent grammars, shared by clones.
    grammars: Arc<Grammars>,
    /// How the model's family writes tool calls, from its templates.
    tool_templates: ToolTemplates,
}

/// Sampling defaults a checkpoint ships (`generation_config.json`), for
/// requests that leave them unset.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GenerationDefaults {
    /// Applied only where the file also says `do_sample: true`, as transformers does.
    pub temperature: Option<f32>,
    #[allow(missing_docs)]
    pub top_p: Option<f32>,
    #[allow(missing_docs)]
    pub top_k: Option<u32>,
}

impl GenerationDefaults {
    /// From `generation_config.json` (`Null` where there is none); values
    /// out of the ranges requests may ask for are left out.
    fn read(generation: &Value) -> Self {
        let sampled = generation["do_sample"].as_bool() == Some(true);
        GenerationDefaults {
            temperature: generation["temperature"]
                .as_f64()
                .filter(|t| sampled && (0.0..=5.0).contains(t))
                .map(|t| t as f32),
            top_p: generation["top_p"]
                .as_f64()
                .filter(|p| *p > 0.0 && *p <= 1.0)
                .map(|p| p as f32),
            top_k: generation["top_k"].as_u64().filter(|k| *k > 0).map(|k| k as u32),
        }
    }
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

/// A JSON file of a checkpoint directory, `Null` where absent.
fn optional_json(path: &Path) -> Result<Value, ModelError> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| config_error(&path.display().to_string(), e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Value::Null),
        Err(source) => Err(ModelError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// The chat template of `tokenizer_config.json`: a string, or a list of
/// named templates (`default` is used).
fn config_template(config: &Value) -> Option<String> {
    match &config["chat_template"] {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// The template named `tool_use` of `tokenizer_config.json`'s list, which
/// transformers renders instead of the default when tools are given.
fn config_tool_template(config: &Value) -> Option<String> {
    config["chat_template"]
        .as_array()?
        .iter()
        .find(|t| t["name"] == "tool_use")
        .and_then(|t| t["template"].as_str())
        .map(str::to_string)
}

/// `eos_token_id` of `generation_config.json`: an id or a list of ids.
fn generation_eos(config: &Value) -> Vec<u32> {
    match &config["eos_token_id"] {
        Value::Number(n) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Value::Array(ids) => ids.iter().filter_map(Value::as_u64).map(|n| n as u32).collect(),
        _ => Vec::new(),
    }
}

impl TextModel {
    /// Load a checkpoint: a GGUF file or a Hugging Face directory, its
    /// quantized projections multiplied as they are ([`Products::Native`]).
    pub fn open(path: &Path, device: &Device) -> Result<Self, ModelError> {
        TextModel::open_with(path, device, Products::Native)
    }

    /// [`TextModel::open`], the products as `products` says.
    pub fn open_with(path: &Path, device: &Device, products: Products) -> Result<Self, ModelError> {
        let model = if crate::models::gguf::is_gguf(path) {
            TextModel::from_gguf(path, device, products)
        } else {
            TextModel::from_dir_with(path, device, products)
        };
        crate::models::release_free_memory();
        model
    }

    /// Load a GGUF file: weights, tokenizer and chat template from the one file.
    pub fn from_gguf(path: &Path, device: &Device, products: Products) -> Result<Self, ModelError> {
        let file = crate::models::gguf::GgufFile::open(path)?;
        // The tokenizer first: a file without one fails before its weights are read.
        let (tokenizer, specials) = crate::models::vocab::from_gguf(&file)?;
        let tokenizer = Arc::new(tokenizer);
        let text = |key: &str| match file.get(key) {
            Some(candle_core::quantized::gguf_file::Value::String(t)) => Some(t.clone()),
            _ => None,
        };
        let (template, tool_templates) = templates(
            text("tokenizer.chat_template"),
            text("tokenizer.chat_template.tool_use"),
        )?;
        let model = Llama::from_gguf(&file, device, products)?;
        let grammars = Grammars::new(
            Arc::clone(&tokenizer),
            specials.stop_ids.clone(),
            model.config().vocab_size,
        );
        Ok(TextModel {
            model,
            tokenizer,
            template,
            bos_token: specials.bos_token,
            eos_token: specials.eos_token,
            stop_ids: specials.stop_ids,
            defaults: GenerationDefaults::default(),
            grammars: Arc::new(grammars),
            tool_templates,
        })
    }

    /// Load a Hugging Face directory: the model, `tokenizer.json`,
    /// `tokenizer_config.json`, the chat template and `generation_config.json`.
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        TextModel::from_dir_with(dir, device, Products::Native)
    }

    /// [`TextModel::from_dir`], projections quantized at load where
    /// `products` says.
    pub fn from_dir_with(dir: &Path, device: &Device, products: Products) -> Result<Self, ModelError> {
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.exists() && dir.join("tokenizer.model").exists() {
            return Err(ModelError::Config(format!(
                "{}: only tokenizer.model (SentencePiece) is here; Lorry reads tokenizer.json — write one with \
                 transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)",
                dir.display()
            )));
        }
        let tokenizer = Arc::new(Tokenizer::from_file(&tokenizer_path).map_err(|e| config_error("tokenizer.json", e))?);
        let model = Llama::from_dir_with(dir, device, products)?;
        let config = optional_json(&dir.join("tokenizer_config.json"))?;
        let generation = optional_json(&dir.join("generation_config.json"))?;
        let template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(source) => Some(source),
            Err(_) => config_template(&config),
        };
        let (template, tool_templates) = templates(template, config_tool_template(&config))?;
        let eos_token = token_text(&config, "eos_token");
        let bos_token = token_text(&config, "bos_token");
        let mut stop_ids: Vec<u32> = tokenizer.token_to_id(&eos_token).into_iter().collect();
        for id in generation_eos(&generation) {
            if !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
        let defaults = GenerationDefaults::read(&generation);
        let grammars = Grammars::new(Arc::clone(&tokenizer), stop_ids.clone(), model.config().vocab_size);
        Ok(TextModel {
            model,
            tokenizer,
            template,
            bos_token,
            eos_token,
            stop_ids,
            defaults,
            grammars: Arc::new(grammars),
            tool_templates,
        })
    }

    /// How the model's family writes tool calls (its chat template's format).
    pub fn tool_syntax(&self) -> ToolSyntax {
        self.tool_templates.chat
    }

    /// The model's tool formats, its `tool_use` template's included.
    pub fn tool_templates(&self) -> ToolTemplates {
        self.tool_templates
    }

    /// The model's grammar compiler (constrained decoding), shared by its clones.
    pub fn grammars(&self) -> Arc<Grammars> {
        Arc::clone(&self.grammars)
    }

    /// Scored tokens as they are reported, each token and alternative spelled out.
    fn spell(&self, scored: &[Scored]) -> Vec<TokenLogprob> {
        let bytes = self.grammars.token_bytes();
        let word = |id: u32| bytes.get(id as usize).cloned().unwrap_or_default();
        scored
            .iter()
            .map(|s| {
                let own = word(s.token);
                TokenLogprob {
                    token: TokenLogprob::spell(&own),
                    bytes: own,
                    logprob: TokenLogprob::finite(s.logprob),
                    top_logprobs: s
                        .top
                        .iter()
                        .map(|&(id, logprob)| {
                            let alt = word(id);
                            TopLogprob {
                                token: TokenLogprob::spell(&alt),
                                bytes: alt,
                                logprob: TokenLogprob::finite(logprob),
                            }
                        })
                        .collect(),
                }
            })
            .collect()
    }

    /// Tokens that end generation.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The sampling defaults of the checkpoint.
    pub fn defaults(&self) -> GenerationDefaults {
        self.defaults
    }

    /// Whether `prompt` goes through the chat template (else it is raw text).
    pub(crate) fn templated(&self, prompt: &Prompt, raw: bool) -> bool {
        matches!(prompt, Prompt::Messages(_) | Prompt::Text(_)) && !raw && self.template.is_some()
    }

    /// The ids of a prompt: templated text as is (the template places its
    /// special tokens), raw text with the tokenizer's own (a BOS where the
    /// tokenizer adds one), as `tokenizer(prompt)` gives in transformers.
    pub fn prompt_ids(&self, prompt: &Prompt, raw: bool) -> Result<Vec<u32>, ModelError> {
        self.prompt_ids_with(prompt, raw, None)
    }

    /// [`TextModel::prompt_ids`] of a conversation that offers `tools`.
    pub fn prompt_ids_with(&self, prompt: &Prompt, raw: bool, tools: Option<&Tools>) -> Result<Vec<u32>, ModelError> {
        let text = self.render_with(prompt, raw, tools)?;
        if self.templated(prompt, raw) {
            self.encode(&text)
        } else {
            self.encode_raw(&text)
        }
    }

    /// Token ids of raw text with the tokenizer's special tokens added.
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| config_error("tokenizing", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text the model sees: the prompt as is when `raw` (or when there is
    /// no template), else the chat template with a generation prompt.
    pub fn render(&self, prompt: &Prompt, raw: bool) -> Result<String, ModelError> {
        self.render_with(prompt, raw, None)
    }

    /// [`TextModel::render`] of a conversation that offers `tools`: the
    /// template's own `tools` where it takes them, else a system message
    /// (see [`crate::runtime::tools`]).
    pub fn render_with(&self, prompt: &Prompt, raw: bool, tools: Option<&Tools>) -> Result<String, ModelError> {
        let messages: Vec<Message> = match (prompt, raw, &self.template) {
            (Prompt::Text(t) | Prompt::Plain(t), true, _) | (Prompt::Text(t) | Prompt::Plain(t), _, None) => {
                return Ok(t.clone())
            }
            (Prompt::Inputs(_) | Prompt::Tokens(_), _, _) => {
                return Err(ModelError::Config(
                    "a text-generation model takes a prompt or messages".into(),
                ))
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
            (Prompt::Text(t) | Prompt::Plain(t), false, Some(_)) => vec![Message::text("user", t.clone())],
        };
        let syntax = self.tool_templates.syntax(tools);
        let name = if self.tool_templates.uses_tool_template(tools) {
            "tool_use"
        } else {
            "chat"
        };
        let messages = syntax.messages(&messages, tools);
        let tools = syntax.template_tools(tools);
        let env = self.template.as_ref().expect("matched Some above");
        let template = env.get_template(name).map_err(|e| config_error("chat template", e))?;
        template
            .render(context! {
                messages => messages,
                tools => tools,
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

/// The chat template (and a `tool_use` one) compiled, with their tool formats.
fn templates(
    chat: Option<String>,
    tool_use: Option<String>,
) -> Result<(Option<Environment<'static>>, ToolTemplates), ModelError> {
    let tool_templates = ToolTemplates {
        chat: ToolSyntax::detect(chat.as_deref()),
        tool_use: tool_use
            .as_deref()
            .filter(|_| chat.is_some())
            .map(|t| ToolSyntax::detect(Some(t))),
    };
    let env = match chat {
        Some(source) => {
            let mut env = compile(source)?;
            if let Some(source) = tool_use {
                env.add_template_owned("tool_use", source)
                    .map_err(|e| config_error("tool_use chat template", e))?;
            }
            Some(env)
        }
        None => None,
    };
    Ok((env, tool_templates))
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
    // Python's `json.dumps`, as transformers' templates get it (minijinja's
    // own escapes HTML and leaves out the spaces Python writes).
    env.add_filter(
        "tojson",
        |value: minijinja::Value, kwargs: minijinja::value::Kwargs| -> Result<String, minijinja::Error> {
            let indent: Option<usize> = kwargs.get("indent")?;
            kwargs.assert_all_used()?;
            let value = serde_json::to_value(&value)
                .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            let mut out = String::new();
            write_python_json(&mut out, &value, indent, 0);
            Ok(out)
        },
    );
    env.add_template_owned("chat", source)
        .map_err(|e| config_error("chat template", e))?;
    Ok(env)
}

/// A value as Python's `json.dumps` writes it (`ensure_ascii=False`, keys
/// in their order): `", "` and `": "` between items.
pub(crate) fn python_json(value: &Value) -> String {
    let mut out = String::new();
    write_python_json(&mut out, value, None, 0);
    out
}

/// [`python_json`], each item on its own line indented by `indent` spaces a level where given.
fn write_python_json(out: &mut String, value: &Value, indent: Option<usize>, level: usize) {
    let (open, close, items): (char, char, Vec<(Option<&String>, &Value)>) = match value {
        Value::Array(items) => ('[', ']', items.iter().map(|v| (None, v)).collect()),
        Value::Object(map) => ('{', '}', map.iter().map(|(k, v)| (Some(k), v)).collect()),
        scalar => {
            out.push_str(&serde_json::to_string(scalar).unwrap_or_default());
            return;
        }
    };
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return;
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * level));
        }
    };
    for (i, (key, item)) in items.into_iter().enumerate() {
        if i > 0 {
            out.push_str(if indent.is_some() { "," } else { ", " });
        }
        newline(out, level + 1);
        if let Some(key) = key {
            out.push_str(&serde_json::to_string(key).unwrap_or_default());
            out.push_str(": ");
        }
        write_python_json(out, item, indent, level + 1);
    }
    newline(out, level);
    out.push(close);
}

/// `max_tokens` when a request gives none.
pub(crate) const DEFAULT_MAX_TOKENS: u32 = 256;

/// One request's decoding state: its tokens, its sampler and its stop rules.
/// The same state machine serves a request run alone and one in a batch.
#[derive(Debug, Clone)]
pub struct Decoding {
    /// The prompt's tokens, then the generated ones.
    pub tokens: Vec<u32>,
    prompt_len: usize,
    max_new: usize,
    sampler: Sampler,
    stop: Vec<String>,
    ignore_eos: bool,
    /// The model's end tokens and the request's `stop_token_ids`.
    stop_ids: Vec<u32>,
    /// Text of the generated tokens (cut before a stop string once stopped).
    text: String,
    /// Bytes of `text` already streamed.
    streamed: usize,
    finished: Option<FinishReason>,
    /// The grammar the output must follow (structured outputs).
    guide: Option<Guide>,
    /// Alternatives reported at each position, when log-probabilities are asked for.
    logprobs: Option<usize>,
    /// Each generated token's log-probability, when asked for.
    scored: Vec<Scored>,
    /// Entries of `scored` already streamed.
    scored_streamed: usize,
    /// The tools offered, in the model's format, whose calls the output is read for.
    tools: Option<(ToolSyntax, Box<Tools>)>,
}

/// A generated token's log-probability and its position's best alternatives.
#[derive(Debug, Clone, PartialEq)]
struct Scored {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

/// What a request's output must match: its structured output's format, or
/// for `tool_choice` `required` or a named function, calls in the model's format.
pub(crate) fn output_constraint(
    request: &crate::ValidRequest,
    templates: ToolTemplates,
) -> Option<Cow<'_, Constraint>> {
    if let Some(constraint) = &request.constraint {
        return Some(Cow::Borrowed(constraint));
    }
    request
        .tools
        .as_ref()
        .filter(|t| t.forced())
        .map(|t| Cow::Owned(templates.syntax(Some(t)).grammar(t)))
}

impl TextModel {
    /// Render and tokenise a request and set up its decoding, within `context`
    /// tokens in all (prompt and generated).
    pub fn start(&self, request: &crate::ValidRequest, context: usize) -> Result<Decoding, EngineError> {
        let guide = output_constraint(request, self.tool_templates)
            .map(|c| self.grammars.guide(&c))
            .transpose()?;
        self.start_guided(request, context, guide)
    }

    /// [`TextModel::start`] with the request's constraint already compiled (`None` without one).
    pub(crate) fn start_guided(
        &self,
        request: &crate::ValidRequest,
        context: usize,
        guide: Option<Guide>,
    ) -> Result<Decoding, EngineError> {
        let prompt = match &request.prompt {
            Prompt::Tokens(ids) => {
                let vocab = self.model.config().vocab_size;
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(EngineError::Input(InputError::new(
                        ErrorCode::TokenOutOfVocabulary,
                        "prompt",
                        format!("token {bad} is outside the vocabulary of {vocab}"),
                    )));
                }
                ids.clone()
            }
            _ => self
                .prompt_ids_with(&request.prompt, request.raw, request.tools.as_deref())
                .map_err(|e| {
                    EngineError::Input(InputError::new(ErrorCode::TemplateError, "messages", e.to_string()))
                })?,
        };
        if prompt.is_empty() {
            return Err(EngineError::Input(InputError::new(
                ErrorCode::EmptyPrompt,
                "prompt",
                "the prompt is empty after tokenisation",
            )));
        }
        let context = context.min(self.model.config().max_position_embeddings);
        if prompt.len() >= context {
            return Err(EngineError::Input(InputError::new(
                ErrorCode::ContextLengthExceeded,
                "prompt",
                format!(
                    "the prompt has {} tokens; this model serves at most {}",
                    prompt.len(),
                    context - 1
                ),
            )));
        }
        let s = &request.sampling;
        let mut stop_ids = self.stop_ids.clone();
        stop_ids.extend(s.stop_token_ids.iter().filter(|id| !self.stop_ids.contains(id)));
        let temperature = s.temperature.or(self.defaults.temperature).unwrap_or(0.0);
        Ok(Decoding {
            prompt_len: prompt.len(),
            max_new: (s.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS) as usize).min(context - prompt.len()),
            tokens: prompt,
            sampler: Sampler::new(SamplingParams {
                temperature,
                top_k: s.top_k.or(self.defaults.top_k).map(|k| k as usize),
                top_p: s.top_p.or(self.defaults.top_p),
                seed: s.seed.unwrap_or(0),
            }),
            stop: s.stop.clone(),
            ignore_eos: s.ignore_eos,
            stop_ids,
            text: String::new(),
            streamed: 0,
            finished: None,
            guide,
            logprobs: s.logprobs.map(|n| n as usize),
            scored: Vec::new(),
            scored_streamed: 0,
            tools: request
                .tools
                .clone()
                .filter(|t| t.active())
                .map(|t| (self.tool_templates.syntax(Some(&*t)), t)),
        })
    }

    /// Serve one request alone: render, tokenise, sample until a stop.
    pub fn generate(&self, request: &crate::ValidRequest) -> Result<Generation, EngineError> {
        self.generate_adapted(request, None)
    }

    /// [`TextModel::generate`] with a LoRA adapter.
    pub fn generate_adapted(
        &self,
        request: &crate::ValidRequest,
        adapter: Option<&PackedAdapter>,
    ) -> Result<Generation, EngineError> {
        let model_error = |e: ModelError| EngineError::Model(e.to_string());
        let mut decoding = self.start(request, usize::MAX)?;
        let mut cache = self.model.new_cache();
        let mut input = decoding.tokens.clone();
        loop {
            let logits = self
                .model
                .forward_adapted(&input, &mut cache, adapter)
                .map_err(model_error)?;
            let logits = logits.to_vec1::<f32>().map_err(|e| model_error(e.into()))?;
            if decoding.push(&logits, self)?.is_some() {
                return Ok(decoding.into_generation(self));
            }
            input = vec![decoding.last()];
        }
    }
}

impl Decoding {
    /// The generated tokens.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// The newest token.
    pub fn last(&self) -> u32 {
        self.tokens[self.tokens.len() - 1]
    }

    /// Why it finished, once it has.
    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// Sample the next token from `logits` (those the constraint allows,
    /// if there is one) and apply the stop rules.
    pub fn push(&mut self, logits: &[f32], model: &TextModel) -> Result<Option<FinishReason>, EngineError> {
        let next = match &mut self.guide {
            Some(guide) => self.sampler.sample(&guide.masked(logits)?),
            None => self.sampler.sample(logits),
        };
        self.push_token(next, logits, model)
    }

    /// The request's grammar, if it has one.
    pub(crate) fn guide_mut(&mut self) -> Option<&mut Guide> {
        self.guide.as_mut()
    }

    /// Take the grammar out (to compute its next mask elsewhere); [`Decoding::restore_guide`] puts it back.
    pub(crate) fn take_guide(&mut self) -> Option<Guide> {
        self.guide.take()
    }

    /// Put back what [`Decoding::take_guide`] took.
    pub(crate) fn restore_guide(&mut self, guide: Guide) {
        self.guide = Some(guide);
    }

    /// How many of `guesses`, in order, the constraint would take (all of them without one).
    pub(crate) fn admissible(&mut self, guesses: &[u32]) -> usize {
        match &mut self.guide {
            Some(guide) => guide.admissible(guesses),
            None => guesses.len(),
        }
    }

    /// Tokens that may still be generated.
    pub(crate) fn remaining(&self) -> usize {
        self.max_new.saturating_sub(self.tokens.len() - self.prompt_len)
    }

    /// Whether this request samples greedily.
    pub(crate) fn is_greedy(&self) -> bool {
        self.sampler.is_greedy()
    }

    /// A draft model's pick after `logits`: its argmax for a greedy request,
    /// else a draw from the request's own filtered distribution over the
    /// draft's logits, returned too for verification.
    pub(crate) fn draft_pick(&mut self, logits: &[f32]) -> (u32, Option<Vec<(u32, f64)>>) {
        if self.sampler.is_greedy() {
            return (crate::runtime::sampling::argmax(logits), None);
        }
        let q = self.sampler.distribution(logits);
        (self.sampler.draw(&q), Some(q))
    }

    /// Verify `drafts` against the target's logits (see [`Sampler::verify`]);
    /// under a constraint each row is masked by the grammar's state after
    /// the drafts before it, so the tokens are those decoding one at a time
    /// would give.
    pub fn verify(
        &mut self,
        drafts: &[u32],
        q: Option<&[Vec<(u32, f64)>]>,
        logits: &[&[f32]],
    ) -> Result<(Vec<u32>, usize), EngineError> {
        let Some(guide) = &mut self.guide else {
            return Ok(self.sampler.verify(drafts, q, logits));
        };
        let mut consumed = 0;
        let verified = self.sampler.verify_with(drafts, q, |i| {
            if i > 0 {
                guide.consume(drafts[i - 1])?;
                consumed += 1;
                if guide.is_done() {
                    // An accepted end: the tokens after it are dropped by the stop rules.
                    return Ok(Cow::Borrowed(logits[i]));
                }
            }
            guide.masked(logits[i]).map(Cow::Owned)
        });
        // The tokens kept are consumed again as they are pushed.
        guide.rollback(consumed)?;
        verified
    }

    /// Append a token chosen elsewhere (a verified draft) from the model's
    /// `logits` at its position and apply the stop rules.
    pub(crate) fn push_token(
        &mut self,
        next: u32,
        logits: &[f32],
        model: &TextModel,
    ) -> Result<Option<FinishReason>, EngineError> {
        if let Some(top) = self.logprobs {
            // The model's own distribution: before temperature, filters and the constraint's mask.
            let (logprob, top) = crate::runtime::sampling::log_probs(logits, next, top);
            self.scored.push(Scored {
                token: next,
                logprob,
                top,
            });
        }
        if let Some(guide) = &mut self.guide {
            guide.consume(next)?;
        }
        self.tokens.push(next);
        let generated = self.tokens.len() - self.prompt_len;
        if !self.ignore_eos && self.stop_ids.contains(&next) {
            self.finished = Some(FinishReason::Stop);
        } else if self.guide.as_ref().is_some_and(Guide::is_done) {
            // The grammar is complete and takes nothing more.
            self.finished = Some(FinishReason::Stop);
            if !self.stop.is_empty() {
                self.text = model
                    .decode(self.generated())
                    .map_err(|e| EngineError::Model(e.to_string()))?;
                if let Some(cut) = self.stop.iter().filter_map(|stop| self.text.find(stop.as_str())).min() {
                    self.text.truncate(cut);
                }
            }
        } else if !self.stop.is_empty() {
            self.text = model
                .decode(self.generated())
                .map_err(|e| EngineError::Model(e.to_string()))?;
            if let Some(cut) = self.stop.iter().filter_map(|stop| self.text.find(stop.as_str())).min() {
                self.text.truncate(cut);
                self.finished = Some(FinishReason::Stop);
            }
        }
        if self.finished.is_none() && generated >= self.max_new {
            self.finished = Some(FinishReason::Length);
        }
        Ok(self.finished)
    }

    /// Text generated since the last call that can no longer change: nothing
    /// that could still grow into a stop string, no half a character.
    pub(crate) fn stream_delta(&mut self, model: &TextModel) -> Result<Option<String>, EngineError> {
        if self.finished.is_none() || self.stop.is_empty() {
            self.text = self.current_text(model)?;
        }
        let mut end = self.content_end();
        if self.finished.is_none() {
            let settled = self.text.trim_end_matches('\u{fffd}').len();
            end = settled;
            for stop in &self.stop {
                // The longest tail of the text that begins a stop string is held back.
                let held = (1..stop.len()).rev().find(|&n| {
                    n <= settled
                        && self.text.is_char_boundary(settled - n)
                        && stop.starts_with(&self.text[settled - n..settled])
                });
                if let Some(n) = held {
                    end = end.min(settled - n);
                }
            }
        }
        if let (None, Some((syntax, _))) = (self.finished, &self.tools) {
            // Nothing that is or could become a tool call.
            end = end.min(syntax.streamable(&self.text));
        }
        if end <= self.streamed {
            return Ok(None);
        }
        let delta = self.text[self.streamed..end].to_string();
        self.streamed = end;
        Ok(Some(delta))
    }

    /// Where the text's content ends: all of it, or with tools offered the
    /// text before the calls of a finished output (trailing whitespace left out).
    fn content_end(&self) -> usize {
        match (&self.tools, self.finished) {
            (Some((syntax, tools)), Some(_)) => match syntax.split(&self.text, tools) {
                Some((end, _)) => end,
                None => self.text.trim_end().len(),
            },
            _ => self.text.len(),
        }
    }

    /// The log-probabilities of tokens generated since the last call, as
    /// they go out with streamed text (empty when none were asked for).
    pub(crate) fn stream_logprobs(&mut self, model: &TextModel) -> Vec<TokenLogprob> {
        let end = self.text_tokens();
        let start = self.scored_streamed.min(end);
        self.scored_streamed = end;
        model.spell(&self.scored[start..end])
    }

    /// Whether log-probabilities were asked for and some are not streamed yet.
    pub(crate) fn logprobs_pending(&self) -> bool {
        self.scored_streamed < self.text_tokens()
    }

    /// How many scored tokens belong to the text: all but an end token that finished it.
    fn text_tokens(&self) -> usize {
        let ended = matches!(
            (self.finished, self.generated().last()),
            (Some(FinishReason::Stop), Some(t)) if self.stop_ids.contains(t)
        );
        self.scored.len().saturating_sub(ended as usize)
    }

    fn current_text(&self, model: &TextModel) -> Result<String, EngineError> {
        let generated = self.generated();
        // An end-of-sequence token ends the text; it is not part of it.
        let generated = match (self.finished, generated.last()) {
            (Some(FinishReason::Stop), Some(t)) if self.stop_ids.contains(t) => &generated[..generated.len() - 1],
            _ => generated,
        };
        model.decode(generated).map_err(|e| EngineError::Model(e.to_string()))
    }

    /// The finished generation.
    pub(crate) fn into_generation(self, model: &TextModel) -> Generation {
        let text = if self.finished == Some(FinishReason::Stop)
            && !self.stop.is_empty()
            && !self.stop_ids.contains(&self.last())
        {
            self.text.clone()
        } else {
            self.current_text(model).unwrap_or_default()
        };
        let logprobs = self.logprobs.map(|_| model.spell(&self.scored[..self.text_tokens()]));
        let mut finish_reason = self.finished.unwrap_or(FinishReason::Length);
        let (text, tool_calls) = match &self.tools {
            Some((syntax, tools)) => match syntax.split(&text, tools) {
                Some((end, calls)) => {
                    finish_reason = FinishReason::ToolCalls;
                    (text[..end].to_string(), calls)
                }
                None => (text.trim_end().to_string(), Vec::new()),
            },
            None => (text, Vec::new()),
        };
        Generation {
            token_ids: self.generated().to_vec(),
            text,
            finish_reason,
            prompt_tokens: self.prompt_len,
            logprobs,
            tool_calls,
        }
    }
}

pub use lorry_protocol::{FinishReason, TokenLogprob, TopLogprob};

/// One finished generation.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Generation {
    /// Generated ids only (an end-of-sequence token included).
    pub token_ids: Vec<u32>,
    /// Their text, cut before a stop string.
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Tokens in the rendered prompt.
    pub prompt_tokens: usize,
    /// Each token of the text's log-probability (an end token that
    /// finished it left out), when the request asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The tools it called (its text is what came before them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn generation_config_gives_defaults_and_stop_ids() {
        let sampled = json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "eos_token_id": [2, 7]});
        assert_eq!(
            GenerationDefaults::read(&sampled),
            GenerationDefaults {
                temperature: Some(0.6),
                top_p: Some(0.9),
                top_k: Some(50)
            }
        );
        assert_eq!(generation_eos(&sampled), vec![2, 7]);
        // Without do_sample, transformers decodes greedily whatever the temperature.
        let greedy = json!({"temperature": 0.6, "top_p": 1.5, "top_k": 0, "eos_token_id": 3});
        assert_eq!(GenerationDefaults::read(&greedy), GenerationDefaults::default());
        assert_eq!(generation_eos(&greedy), vec![3]);
        assert_eq!(GenerationDefaults::read(&Value::Null), GenerationDefaults::default());
    }

    #[test]
    fn named_chat_templates_use_the_default_one() {
        let named =
            json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        assert_eq!(config_template(&named).as_deref(), Some("D"));
        assert_eq!(config_template(&json!({"chat_template": "S"})).as_deref(), Some("S"));
        assert_eq!(config_template(&json!({})), None);
    }
}
