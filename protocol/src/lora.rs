//! LoRA adapters in PEFT's format, checked against the base model they are
//! for: `adapter_config.json` and `adapter_model.safetensors`, as `peft`
//! writes them (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`
//! of `(r, in)` and `…lora_B.weight` of `(out, r)`).
//!
//! Everything an adapter could get wrong is found here, before it is stored
//! or served, and named by a stable code: a bad configuration, an option Lorry
//! does not serve (DoRA, trained biases, `modules_to_save`, …), a rank over
//! the limit, a target outside the seven projections, a tensor missing, of the
//! wrong shape, for a layer the model does not have, not finite, or a file
//! that is not safetensors. Scales follow PEFT: `lora_alpha / r`, or
//! `lora_alpha / √r` with `use_rslora`, with `rank_pattern` and
//! `alpha_pattern` overriding rank and alpha per module.

use std::collections::{BTreeMap, HashMap};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::error::ErrorCode;
use crate::model::AdapterShape;

/// The precision weights are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// 4 bytes a weight.
    F32,
    /// IEEE half, 2 bytes a weight.
    F16,
    /// bfloat16, 2 bytes a weight.
    Bf16,
}

impl Precision {
    /// Bytes per weight.
    pub fn bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::F16 | Precision::Bf16 => 2,
        }
    }
}

/// The projections an adapter may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    #[allow(missing_docs)]
    Q,
    #[allow(missing_docs)]
    K,
    #[allow(missing_docs)]
    V,
    #[allow(missing_docs)]
    O,
    #[allow(missing_docs)]
    Gate,
    #[allow(missing_docs)]
    Up,
    #[allow(missing_docs)]
    Down,
}

impl Target {
    /// Every target, in checkpoint order.
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The module's name in a checkpoint (`q_proj`, …).
    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// `(out, in)` of this projection in the base model.
    pub fn shape(self, base: &AdapterShape) -> (usize, usize) {
        let (h, d, i) = (base.hidden_size, base.head_dim, base.intermediate_size);
        match self {
            Target::Q => (base.num_heads * d, h),
            Target::K | Target::V => (base.num_kv_heads * d, h),
            Target::O => (h, base.num_heads * d),
            Target::Gate | Target::Up => (i, h),
            Target::Down => (h, i),
        }
    }

    /// The block that holds the projection: `self_attn` or `mlp`.
    pub fn block(self) -> &'static str {
        match self {
            Target::Q | Target::K | Target::V | Target::O => "self_attn",
            _ => "mlp",
        }
    }
}

/// Why an adapter was refused: a stable `code` and a message naming the
/// field, module or tensor at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct AdapterError {
    /// Stable, for clients to match on.
    pub code: ErrorCode,
    /// What is wrong, and where.
    pub message: String,
    /// Whether `adapter_config.json` is at fault (else the weights file is).
    pub in_config: bool,
}

impl AdapterError {
    fn in_config(mut self) -> Self {
        self.in_config = true;
        self
    }
}

fn refuse(code: ErrorCode, message: impl Into<String>) -> AdapterError {
    AdapterError {
        code,
        message: message.into(),
        in_config: false,
    }
}

/// Limits an adapter must keep within.
#[derive(Debug, Clone, Copy)]
pub struct AdapterLimits {
    /// Largest rank of any module.
    pub max_rank: usize,
    /// Largest `adapter_model.safetensors`, in bytes.
    pub max_bytes: usize,
}

impl Default for AdapterLimits {
    fn default() -> Self {
        AdapterLimits {
            max_rank: 32,
            max_bytes: 300 * 1024 * 1024,
        }
    }
}

/// `adapter_config.json`, the fields that decide what the weights mean.
#[derive(Debug, Deserialize)]
struct ConfigFile {
    peft_type: Option<String>,
    r: Option<usize>,
    lora_alpha: Option<f64>,
    target_modules: Option<serde_json::Value>,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    bias: Option<String>,
    modules_to_save: Option<serde_json::Value>,
    #[serde(default)]
    rank_pattern: BTreeMap<String, usize>,
    #[serde(default)]
    alpha_pattern: BTreeMap<String, f64>,
    layers_to_transform: Option<serde_json::Value>,
    layers_pattern: Option<serde_json::Value>,
    layer_replication: Option<serde_json::Value>,
}

/// The largest `lora_alpha` (or `alpha_pattern` value) taken, in magnitude.
pub const MAX_ALPHA: f64 = 65_536.0;

/// The largest weight an adapter may hold, in magnitude: half precision's
/// largest, which no adapter trained in it exceeds.
pub const MAX_WEIGHT: f32 = 65_504.0;

/// The largest entry `scale · B · A` can reach (`scale · r · max|B| · max|A|`),
/// in magnitude: adapters whose update could overflow the activations
/// (and turn every answer into NaNs) are refused.
pub const MAX_UPDATE: f64 = 1.0e4;

/// One adapted projection of one layer: `ΔW = scale · B · A`.
#[derive(Debug, Clone)]
pub struct LoraWeights {
    /// Rank.
    pub rank: usize,
    /// `alpha / r` (or `/ √r`).
    pub scale: f32,
    /// `lora_A`, `(rank, in)` row-major.
    pub a: Vec<f32>,
    /// `lora_B`, `(out, rank)` row-major.
    pub b: Vec<f32>,
    /// The precision the file stored them in (the values above are exact
    /// widenings); they are packed in it, as the base model's weights are.
    pub precision: Precision,
}

/// A checked adapter: the weights of every adapted projection, by layer.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// `(layer, target)` → weights.
    pub modules: BTreeMap<(usize, Target), LoraWeights>,
}

impl Adapter {
    /// The highest rank of any module.
    pub fn max_rank(&self) -> usize {
        self.modules.values().map(|m| m.rank).max().unwrap_or(0)
    }

    /// The targets adapted in at least one layer.
    pub fn targets(&self) -> Vec<Target> {
        let mut targets: Vec<Target> = self.modules.keys().map(|(_, t)| *t).collect();
        targets.sort();
        targets.dedup();
        targets
    }

    /// Read and check the adapter in `dir` (`adapter_config.json` and
    /// `adapter_model.safetensors`) against the base model `base`.
    pub fn from_dir(dir: &std::path::Path, base: &AdapterShape, limits: AdapterLimits) -> Result<Self, AdapterError> {
        let read = |file: &str| {
            std::fs::read(dir.join(file)).map_err(|e| {
                refuse(
                    ErrorCode::AdapterMissingFile,
                    format!("{}: {e}", dir.join(file).display()),
                )
            })
        };
        Adapter::parse(
            &read("adapter_config.json")?,
            &read("adapter_model.safetensors")?,
            base,
            limits,
        )
    }

    /// Parse and check an adapter's two files against the base model `base`.
    pub fn parse(
        config: &[u8],
        weights: &[u8],
        base: &AdapterShape,
        limits: AdapterLimits,
    ) -> Result<Self, AdapterError> {
        let settings = Settings::read(config, limits)?;
        check_size(weights, limits)?;
        let tensors = read_safetensors(weights)?;
        let halves = halves(&tensors, base)?;
        if let Some((layer, target)) =
            (halves.keys()).find(|(layer, _)| settings.layers.as_ref().is_some_and(|only| !only.contains(layer)))
        {
            return Err(refuse(
                ErrorCode::AdapterUnknownTarget,
                format!(
                    "model.layers.{layer}.{}.{}: layer {layer} is not in layers_to_transform",
                    target.block(),
                    target.name()
                ),
            ));
        }
        if let Some((layer, target)) = halves.keys().find(|(_, t)| !settings.targets.contains(t)) {
            return Err(refuse(
                ErrorCode::AdapterUnknownTarget,
                format!(
                    "model.layers.{layer}.{}.{}: {} is not in target_modules",
                    target.block(),
                    target.name(),
                    target.name()
                ),
            ));
        }
        let modules = halves
            .into_iter()
            .map(|((layer, target), pair)| {
                let weights = module_weights(&settings, base, limits, layer, target, pair)?;
                Ok(((layer, target), weights))
            })
            .collect::<Result<_, AdapterError>>()?;
        Ok(Adapter { modules })
    }
}

/// One adapted projection's two halves, checked and scaled as PEFT does.
fn module_weights(
    settings: &Settings,
    base: &AdapterShape,
    limits: AdapterLimits,
    layer: usize,
    target: Target,
    pair: (Option<TensorView<'_>>, Option<TensorView<'_>>),
) -> Result<LoraWeights, AdapterError> {
    let module = format!("model.layers.{layer}.{}.{}", target.block(), target.name());
    let (a, b) = both_halves(pair, &module)?;
    let (rank, alpha) = settings.rank_and_alpha(&module);
    if rank > limits.max_rank {
        return Err(refuse(
            ErrorCode::AdapterRankTooLarge,
            format!("{module}: rank {rank}; the limit is {}", limits.max_rank),
        ));
    }
    let (out, inputs) = target.shape(base);
    // Both halves in one precision: theirs when they agree, f32 otherwise.
    let precision = if a.dtype() == b.dtype() {
        precision_of(a.dtype())
    } else {
        Precision::F32
    };
    let a = matrix(a, (rank, inputs), &format!("base_model.model.{module}.lora_A.weight"))?;
    let b = matrix(b, (out, rank), &format!("base_model.model.{module}.lora_B.weight"))?;
    let scale = if settings.rslora {
        alpha / (rank as f64).sqrt()
    } else {
        alpha / rank as f64
    };
    let largest = |m: &[f32]| m.iter().fold(0f32, |acc, v| acc.max(v.abs())) as f64;
    let update = scale.abs() * rank as f64 * largest(&a) * largest(&b);
    if update > MAX_UPDATE {
        return Err(refuse(
            ErrorCode::AdapterValueOutOfRange,
            format!("{module}: scale · B · A can reach {update:.3e}; the limit is {MAX_UPDATE:e}"),
        ));
    }
    Ok(LoraWeights {
        rank,
        scale: scale as f32,
        a,
        b,
        precision,
    })
}

/// Check `adapter_config.json` alone (rank, alpha, targets, patterns), for
/// uploads that bring the two files one at a time. [`Adapter::parse`] checks
/// the pair against the base model once both are there.
pub fn check_config(config: &[u8], limits: AdapterLimits) -> Result<(), AdapterError> {
    Settings::read(config, limits).map(|_| ())
}

/// Check `adapter_model.safetensors` alone against the base model `base`:
/// size limit, a well-formed header and data, LoRA weight names of the
/// seven projections for layers the model has (each once), both halves of
/// every module, their shapes (the rank read from `lora_A`, within the
/// limit) and values. The configuration, when it comes, is checked against
/// these weights by [`Adapter::parse`].
pub fn check_weights(weights: &[u8], base: &AdapterShape, limits: AdapterLimits) -> Result<(), AdapterError> {
    check_size(weights, limits)?;
    let tensors = read_safetensors(weights)?;
    for ((layer, target), pair) in halves(&tensors, base)? {
        let module = format!("model.layers.{layer}.{}.{}", target.block(), target.name());
        let (a, b) = both_halves(pair, &module)?;
        let rank = a.shape().first().copied().unwrap_or(0);
        if rank == 0 || rank > limits.max_rank {
            return Err(refuse(
                ErrorCode::AdapterRankTooLarge,
                format!(
                    "{module}: lora_A has rank {rank}; ranks from 1 to {} are served",
                    limits.max_rank
                ),
            ));
        }
        let (out, inputs) = target.shape(base);
        matrix(a, (rank, inputs), &format!("base_model.model.{module}.lora_A.weight"))?;
        matrix(b, (out, rank), &format!("base_model.model.{module}.lora_B.weight"))?;
    }
    Ok(())
}

/// Both halves of one module, by (layer, target).
type Halves<'a> = HashMap<(usize, Target), (Option<TensorView<'a>>, Option<TensorView<'a>>)>;

/// Every LoRA tensor of the file by module, each named once (`layers.01.`
/// and `layers.1.` are one layer: the first spelling is refused), for
/// layers the base model has; at least one.
fn halves<'a>(tensors: &'a SafeTensors<'a>, base: &AdapterShape) -> Result<Halves<'a>, AdapterError> {
    let mut halves = Halves::new();
    for (name, tensor) in tensors.tensors() {
        let (layer, target, matrix) = parse_key(&name)?;
        if layer >= base.num_layers {
            return Err(refuse(
                ErrorCode::AdapterShapeMismatch,
                format!("{name}: the base model has {} layers", base.num_layers),
            ));
        }
        let entry = halves.entry((layer, target)).or_default();
        let slot = if matrix == 'A' { &mut entry.0 } else { &mut entry.1 };
        if slot.replace(tensor).is_some() {
            return Err(refuse(
                ErrorCode::AdapterWeightsInvalid,
                format!("{name}: the same weight is given twice"),
            ));
        }
    }
    if halves.is_empty() {
        return Err(refuse(
            ErrorCode::AdapterMissingTensor,
            "adapter_model.safetensors holds no LoRA weights",
        ));
    }
    Ok(halves)
}

fn both_halves<'a>(
    pair: (Option<TensorView<'a>>, Option<TensorView<'a>>),
    module: &str,
) -> Result<(TensorView<'a>, TensorView<'a>), AdapterError> {
    match pair {
        (Some(a), Some(b)) => Ok((a, b)),
        (a, _) => {
            let missing = if a.is_none() { "lora_A" } else { "lora_B" };
            Err(refuse(
                ErrorCode::AdapterMissingTensor,
                format!("base_model.model.{module}.{missing}.weight is missing"),
            ))
        }
    }
}

fn check_size(weights: &[u8], limits: AdapterLimits) -> Result<(), AdapterError> {
    if weights.len() > limits.max_bytes {
        return Err(refuse(
            ErrorCode::AdapterTooLarge,
            format!(
                "adapter_model.safetensors is {} bytes; the limit is {}",
                weights.len(),
                limits.max_bytes
            ),
        ));
    }
    Ok(())
}

/// What the configuration says, checked.
struct Settings {
    /// `layers_to_transform`: the only layers the adapter may change (all when `None`).
    layers: Option<Vec<usize>>,
    rank: usize,
    alpha: f64,
    rslora: bool,
    targets: Vec<Target>,
    rank_pattern: Vec<(String, usize)>,
    alpha_pattern: Vec<(String, f64)>,
}

impl Settings {
    fn read(config: &[u8], limits: AdapterLimits) -> Result<Self, AdapterError> {
        let config: ConfigFile = serde_json::from_slice(config)
            .map_err(|e| refuse(ErrorCode::AdapterConfigInvalid, format!("adapter_config.json: {e}")).in_config())?;
        Settings::check(&config, limits).map_err(AdapterError::in_config)
    }

    fn check(config: &ConfigFile, limits: AdapterLimits) -> Result<Self, AdapterError> {
        let invalid = |m: String| refuse(ErrorCode::AdapterConfigInvalid, m);
        refuse_unserved_options(config)?;
        let rank = config
            .r
            .filter(|r| *r > 0)
            .ok_or_else(|| invalid("r: a positive rank is required".into()))?;
        if rank > limits.max_rank {
            return Err(refuse(
                ErrorCode::AdapterRankTooLarge,
                format!("r: rank {rank}; the limit is {}", limits.max_rank),
            ));
        }
        let alpha = config
            .lora_alpha
            .ok_or_else(|| invalid("lora_alpha: a number is required".into()))?;
        check_alpha("lora_alpha", alpha)?;
        let rank_pattern = pattern("rank_pattern", &config.rank_pattern)?;
        for (key, r) in &rank_pattern {
            if *r == 0 || *r > limits.max_rank {
                return Err(refuse(
                    ErrorCode::AdapterRankTooLarge,
                    format!(
                        "rank_pattern.{key}: rank {r}; ranks from 1 to {} are served",
                        limits.max_rank
                    ),
                ));
            }
        }
        let alpha_pattern = pattern("alpha_pattern", &config.alpha_pattern)?;
        for (key, a) in &alpha_pattern {
            check_alpha(&format!("alpha_pattern.{key}"), *a)?;
        }
        Ok(Settings {
            layers: layers_to_transform(config)?,
            rank,
            alpha,
            rslora: config.use_rslora,
            targets: targets(config)?,
            rank_pattern,
            alpha_pattern,
        })
    }

    /// Rank and alpha for `module` (`model.layers.3.self_attn.q_proj`): a
    /// pattern key applies when it is the module's name or a dotted suffix of
    /// it, as PEFT matches them; the longest such key wins.
    fn rank_and_alpha(&self, module: &str) -> (usize, f64) {
        fn lookup<T: Copy>(pattern: &[(String, T)], module: &str) -> Option<T> {
            pattern
                .iter()
                .filter(|(key, _)| module == key || module.ends_with(&format!(".{key}")))
                .max_by_key(|(key, _)| key.len())
                .map(|(_, v)| *v)
        }
        (
            lookup(&self.rank_pattern, module).unwrap_or(self.rank),
            lookup(&self.alpha_pattern, module).unwrap_or(self.alpha),
        )
    }
}

/// `layers_to_transform`: a layer index or a list of them (PEFT's two forms).
fn layers_to_transform(config: &ConfigFile) -> Result<Option<Vec<usize>>, AdapterError> {
    let invalid = || {
        refuse(
            ErrorCode::AdapterConfigInvalid,
            "layers_to_transform: a layer index or a list of layer indices",
        )
    };
    match &config.layers_to_transform {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Number(n)) => Ok(Some(vec![n.as_u64().ok_or_else(invalid)? as usize])),
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().map(|n| n as usize).ok_or_else(invalid))
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(invalid()),
    }
}

fn check_alpha(field: &str, alpha: f64) -> Result<(), AdapterError> {
    if alpha.is_finite() && alpha.abs() <= MAX_ALPHA {
        Ok(())
    } else {
        Err(refuse(
            ErrorCode::AdapterValueOutOfRange,
            format!("{field}: {alpha}; values from -{MAX_ALPHA} to {MAX_ALPHA} are served"),
        ))
    }
}

/// PEFT's options whose adapters Lorry does not serve.
fn refuse_unserved_options(config: &ConfigFile) -> Result<(), AdapterError> {
    let unsupported = |m: String| Err(refuse(ErrorCode::AdapterUnsupported, m));
    match config.peft_type.as_deref() {
        None | Some("LORA") => {}
        Some(other) => return unsupported(format!("peft_type {other}: only LORA adapters are served")),
    }
    if config.use_dora {
        return unsupported("use_dora: DoRA adapters are not served".into());
    }
    if config.layer_replication.as_ref().is_some_and(|v| !v.is_null()) {
        return unsupported("layer_replication: adapters over replicated layers are not served".into());
    }
    match &config.layers_pattern {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(p)) if p == "layers" => {}
        Some(serde_json::Value::Array(p)) if p.iter().all(|v| v == "layers") => {}
        Some(other) => return unsupported(format!("layers_pattern {other}: Llama-family layers are `layers`")),
    }
    if config.fan_in_fan_out {
        return unsupported("fan_in_fan_out: Llama-family projections are not Conv1D".into());
    }
    if let Some(bias) = config.bias.as_deref().filter(|b| *b != "none") {
        return unsupported(format!("bias {bias}: adapters that train biases are not served"));
    }
    if config
        .modules_to_save
        .as_ref()
        .is_some_and(|m| !m.is_null() && m.as_array().is_none_or(|a| !a.is_empty()))
    {
        return unsupported("modules_to_save: only LoRA weights are served".into());
    }
    Ok(())
}

/// `target_modules`: a list of the seven projections' names, or `all-linear`.
fn targets(config: &ConfigFile) -> Result<Vec<Target>, AdapterError> {
    let invalid = |m: &str| refuse(ErrorCode::AdapterConfigInvalid, m);
    let names: Vec<String> = match &config.target_modules {
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| invalid("target_modules: a list of module names"))?,
        Some(serde_json::Value::String(s)) if s == "all-linear" => {
            Target::ALL.iter().map(|t| t.name().to_string()).collect()
        }
        Some(serde_json::Value::String(s)) => {
            return Err(refuse(
                ErrorCode::AdapterUnsupported,
                format!("target_modules {s:?}: a regular expression; list the module names instead"),
            ))
        }
        _ => return Err(invalid("target_modules: a list of module names is required")),
    };
    names
        .iter()
        .map(|n| {
            Target::parse(n).ok_or_else(|| {
                refuse(
                    ErrorCode::AdapterUnknownTarget,
                    format!(
                        "target_modules: {n} is not one of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"
                    ),
                )
            })
        })
        .collect()
}

/// `rank_pattern` or `alpha_pattern`, keyed by dotted module names (PEFT's
/// regular-expression keys are refused).
fn pattern<T: Copy>(field: &str, entries: &BTreeMap<String, T>) -> Result<Vec<(String, T)>, AdapterError> {
    entries
        .iter()
        .map(|(key, value)| {
            if key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') {
                Ok((key.clone(), *value))
            } else {
                Err(refuse(
                    ErrorCode::AdapterUnsupported,
                    format!("{field}: key {key:?} is a regular expression; name modules by their dotted names"),
                ))
            }
        })
        .collect()
}

/// `base_model.model.model.layers.N.<block>.<target>.lora_{A,B}.weight` →
/// (N, target, 'A' | 'B').
fn parse_key(name: &str) -> Result<(usize, Target, char), AdapterError> {
    let unexpected = || {
        refuse(
            ErrorCode::AdapterUnsupported,
            format!("{name}: not a LoRA weight of a Llama-family projection"),
        )
    };
    let rest = name
        .strip_prefix("base_model.model.model.layers.")
        .ok_or_else(unexpected)?;
    let parts: Vec<&str> = rest.split('.').collect();
    let [layer, block, module, matrix, "weight"] = parts.as_slice() else {
        return Err(unexpected());
    };
    // One spelling per layer: `01` would be the same layer as `1`.
    if (layer.len() > 1 && layer.starts_with('0')) || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return Err(unexpected());
    }
    let layer: usize = layer.parse().map_err(|_| unexpected())?;
    let target = Target::parse(module).ok_or_else(|| {
        refuse(
            ErrorCode::AdapterUnknownTarget,
            format!("{name}: {module} is not one of the seven projections"),
        )
    })?;
    if *block != target.block() {
        return Err(unexpected());
    }
    let matrix = match *matrix {
        "lora_A" => 'A',
        "lora_B" => 'B',
        _ => return Err(unexpected()),
    };
    Ok((layer, target, matrix))
}

/// The largest safetensors header taken: room for a LoRA of every projection
/// of a model of hundreds of layers; parsing a larger one would cost memory
/// many times its size before anything could refuse it.
pub const MAX_HEADER_BYTES: u64 = 4 << 20;

/// A safetensors file's header and data, checked for consistency.
fn read_safetensors(weights: &[u8]) -> Result<SafeTensors<'_>, AdapterError> {
    let header = weights
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("eight bytes")));
    if header.is_some_and(|n| n > MAX_HEADER_BYTES) {
        return Err(refuse(
            ErrorCode::AdapterWeightsInvalid,
            format!(
                "adapter_model.safetensors: a header of {} bytes; the limit is {MAX_HEADER_BYTES}",
                header.unwrap_or_default()
            ),
        ));
    }
    SafeTensors::deserialize(weights).map_err(|e| {
        refuse(
            ErrorCode::AdapterWeightsInvalid,
            format!("adapter_model.safetensors: {e}"),
        )
    })
}

/// The precision weights of `dtype` are kept in: their own where it is one of
/// the three, f32 otherwise.
fn precision_of(dtype: Dtype) -> Precision {
    match dtype {
        Dtype::F16 => Precision::F16,
        Dtype::BF16 => Precision::Bf16,
        _ => Precision::F32,
    }
}

/// A tensor of `shape` as f32 values, every one finite.
fn matrix(tensor: TensorView<'_>, shape: (usize, usize), name: &str) -> Result<Vec<f32>, AdapterError> {
    if tensor.shape() != [shape.0, shape.1] {
        return Err(refuse(
            ErrorCode::AdapterShapeMismatch,
            format!(
                "{name}: shape {:?}, the base model needs {:?}",
                tensor.shape(),
                [shape.0, shape.1]
            ),
        ));
    }
    let bytes = tensor.data();
    let values: Vec<f32> = match tensor.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(refuse(
                ErrorCode::AdapterWeightsInvalid,
                format!("{name}: {other:?} weights; f32, f16 or bf16 are served"),
            ))
        }
    };
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(refuse(
            ErrorCode::AdapterNonfinite,
            format!("{name}: element {at} is {}", values[at]),
        ));
    }
    if let Some(at) = values.iter().position(|v| v.abs() > MAX_WEIGHT) {
        return Err(refuse(
            ErrorCode::AdapterValueOutOfRange,
            format!(
                "{name}: element {at} is {}; weights within ±{MAX_WEIGHT} are served",
                values[at]
            ),
        ));
    }
    Ok(values)
}
