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

use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use serde::Deserialize;

use crate::gemm::{Expand, PackedMatrix, Precision, RowProduct};
use crate::models::llama::Config;

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
    pub fn shape(self, base: &Config) -> (usize, usize) {
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
    pub code: &'static str,
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

fn refuse(code: &'static str, message: impl Into<String>) -> AdapterError {
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
}

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
    pub fn from_dir(dir: &std::path::Path, base: &Config, limits: AdapterLimits) -> Result<Self, AdapterError> {
        let read = |file: &str| {
            std::fs::read(dir.join(file))
                .map_err(|e| refuse("adapter_missing_file", format!("{}: {e}", dir.join(file).display())))
        };
        Adapter::parse(
            &read("adapter_config.json")?,
            &read("adapter_model.safetensors")?,
            base,
            limits,
        )
    }

    /// Parse and check an adapter's two files against the base model `base`.
    pub fn parse(config: &[u8], weights: &[u8], base: &Config, limits: AdapterLimits) -> Result<Self, AdapterError> {
        let settings = Settings::read(config, limits)?;
        check_size(weights, limits)?;
        let tensors = candle_core::safetensors::load_buffer(weights, &Device::Cpu)
            .map_err(|e| refuse("adapter_weights_invalid", format!("adapter_model.safetensors: {e}")))?;
        let mut halves: HashMap<(usize, Target), (Option<Tensor>, Option<Tensor>)> = HashMap::new();
        for (name, tensor) in tensors {
            let (layer, target, matrix) = parse_key(&name)?;
            if layer >= base.num_layers {
                return Err(refuse(
                    "adapter_shape_mismatch",
                    format!("{name}: the base model has {} layers", base.num_layers),
                ));
            }
            if !settings.targets.contains(&target) {
                return Err(refuse(
                    "adapter_unknown_target",
                    format!("{name}: {} is not in target_modules", target.name()),
                ));
            }
            let entry = halves.entry((layer, target)).or_default();
            match matrix {
                'A' => entry.0 = Some(tensor),
                _ => entry.1 = Some(tensor),
            }
        }
        if halves.is_empty() {
            return Err(refuse(
                "adapter_missing_tensor",
                "adapter_model.safetensors holds no LoRA weights",
            ));
        }
        let mut modules = BTreeMap::new();
        for ((layer, target), pair) in halves {
            let module = format!("model.layers.{layer}.{}.{}", target.block(), target.name());
            let (a, b) = match pair {
                (Some(a), Some(b)) => (a, b),
                (a, _) => {
                    let missing = if a.is_none() { "lora_A" } else { "lora_B" };
                    return Err(refuse(
                        "adapter_missing_tensor",
                        format!("base_model.model.{module}.{missing}.weight is missing"),
                    ));
                }
            };
            let (rank, alpha) = settings.rank_and_alpha(&module);
            if rank > limits.max_rank {
                return Err(refuse(
                    "adapter_rank_too_large",
                    format!("{module}: rank {rank}; the limit is {}", limits.max_rank),
                ));
            }
            let (out, inputs) = target.shape(base);
            // Both halves in one precision: theirs when they agree, f32 otherwise.
            let precision = if a.dtype() == b.dtype() {
                Precision::for_dtype(a.dtype())
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
            modules.insert(
                (layer, target),
                LoraWeights {
                    rank,
                    scale: scale as f32,
                    a,
                    b,
                    precision,
                },
            );
        }
        Ok(Adapter { modules })
    }
}

/// Check `adapter_config.json` alone (rank, alpha, targets, patterns), for
/// uploads that bring the two files one at a time. [`Adapter::parse`] checks
/// the pair against the base model once both are there.
pub fn check_config(config: &[u8], limits: AdapterLimits) -> Result<(), AdapterError> {
    Settings::read(config, limits).map(|_| ())
}

/// Check `adapter_model.safetensors` alone: size limit, a well-formed header
/// and data, LoRA weight names of the seven projections, finite values.
pub fn check_weights(weights: &[u8], limits: AdapterLimits) -> Result<(), AdapterError> {
    check_size(weights, limits)?;
    let tensors = candle_core::safetensors::load_buffer(weights, &Device::Cpu)
        .map_err(|e| refuse("adapter_weights_invalid", format!("adapter_model.safetensors: {e}")))?;
    if tensors.is_empty() {
        return Err(refuse(
            "adapter_missing_tensor",
            "adapter_model.safetensors holds no LoRA weights",
        ));
    }
    for (name, tensor) in tensors {
        parse_key(&name)?;
        let dims = tensor.dims().to_vec();
        let [rows, cols] = dims[..] else {
            return Err(refuse(
                "adapter_shape_mismatch",
                format!("{name}: shape {dims:?}; LoRA weights are matrices"),
            ));
        };
        matrix(tensor, (rows, cols), &name)?;
    }
    Ok(())
}

fn check_size(weights: &[u8], limits: AdapterLimits) -> Result<(), AdapterError> {
    if weights.len() > limits.max_bytes {
        return Err(refuse(
            "adapter_too_large",
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
            .map_err(|e| refuse("adapter_config_invalid", format!("adapter_config.json: {e}")).in_config())?;
        Settings::check(&config, limits).map_err(AdapterError::in_config)
    }

    fn check(config: &ConfigFile, limits: AdapterLimits) -> Result<Self, AdapterError> {
        let invalid = |m: String| refuse("adapter_config_invalid", m);
        let unsupported = |m: String| refuse("adapter_unsupported", m);
        match config.peft_type.as_deref() {
            None | Some("LORA") => {}
            Some(other) => return Err(unsupported(format!("peft_type {other}: only LORA adapters are served"))),
        }
        if config.use_dora {
            return Err(unsupported("use_dora: DoRA adapters are not served".into()));
        }
        if config.fan_in_fan_out {
            return Err(unsupported(
                "fan_in_fan_out: Llama-family projections are not Conv1D".into(),
            ));
        }
        if let Some(bias) = config.bias.as_deref().filter(|b| *b != "none") {
            return Err(unsupported(format!(
                "bias {bias}: adapters that train biases are not served"
            )));
        }
        if config
            .modules_to_save
            .as_ref()
            .is_some_and(|m| !m.is_null() && m.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(unsupported("modules_to_save: only LoRA weights are served".into()));
        }
        let rank = config
            .r
            .filter(|r| *r > 0)
            .ok_or_else(|| invalid("r: a positive rank is required".into()))?;
        if rank > limits.max_rank {
            return Err(refuse(
                "adapter_rank_too_large",
                format!("r: rank {rank}; the limit is {}", limits.max_rank),
            ));
        }
        let alpha = config
            .lora_alpha
            .filter(|a| a.is_finite())
            .ok_or_else(|| invalid("lora_alpha: a number is required".into()))?;
        let names: Vec<String> = match &config.target_modules {
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid("target_modules: a list of module names".into()))?,
            Some(serde_json::Value::String(s)) if s == "all-linear" => {
                Target::ALL.iter().map(|t| t.name().to_string()).collect()
            }
            Some(serde_json::Value::String(s)) => {
                return Err(unsupported(format!(
                    "target_modules {s:?}: a regular expression; list the module names instead"
                )))
            }
            _ => return Err(invalid("target_modules: a list of module names is required".into())),
        };
        let targets = names
            .iter()
            .map(|n| {
                Target::parse(n).ok_or_else(|| {
                    refuse(
                        "adapter_unknown_target",
                        format!(
                            "target_modules: {n} is not one of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj"
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let pattern_key = |field: &str, key: &str| {
            if key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') {
                Ok(key.to_string())
            } else {
                Err(unsupported(format!(
                    "{field}: key {key:?} is a regular expression; name modules by their dotted names"
                )))
            }
        };
        let rank_pattern = config
            .rank_pattern
            .iter()
            .map(|(k, r)| Ok((pattern_key("rank_pattern", k)?, *r)))
            .collect::<Result<_, AdapterError>>()?;
        let alpha_pattern = config
            .alpha_pattern
            .iter()
            .map(|(k, a)| Ok((pattern_key("alpha_pattern", k)?, *a)))
            .collect::<Result<_, AdapterError>>()?;
        Ok(Settings {
            rank,
            alpha,
            rslora: config.use_rslora,
            targets,
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

/// `base_model.model.model.layers.N.<block>.<target>.lora_{A,B}.weight` →
/// (N, target, 'A' | 'B').
fn parse_key(name: &str) -> Result<(usize, Target, char), AdapterError> {
    let unexpected = || {
        refuse(
            "adapter_unsupported",
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
    let layer: usize = layer.parse().map_err(|_| unexpected())?;
    let target = Target::parse(module).ok_or_else(|| {
        refuse(
            "adapter_unknown_target",
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

/// A tensor of `shape` as f32 values, every one finite.
fn matrix(tensor: Tensor, shape: (usize, usize), name: &str) -> Result<Vec<f32>, AdapterError> {
    if tensor.dims() != [shape.0, shape.1] {
        return Err(refuse(
            "adapter_shape_mismatch",
            format!(
                "{name}: shape {:?}, the base model needs {:?}",
                tensor.dims(),
                [shape.0, shape.1]
            ),
        ));
    }
    if !matches!(tensor.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Err(refuse(
            "adapter_weights_invalid",
            format!("{name}: {:?} weights; f32, f16 or bf16 are served", tensor.dtype()),
        ));
    }
    let values = tensor
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
        .map_err(|e| refuse("adapter_weights_invalid", format!("{name}: {e}")))?;
    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
        return Err(refuse(
            "adapter_nonfinite",
            format!("{name}: element {at} is {}", values[at]),
        ));
    }
    Ok(values)
}

/// One adapted projection laid out for the forward pass: `lora_A` and
/// `lora_B` packed for [`PackedMatrix::matmul`], so the shrink
/// (`x·Aᵀ`, rank outputs) and the expand (`·Bᵀ`) run on the same kernels as
/// the base model's products.
#[derive(Debug, Clone)]
pub struct PackedLora {
    /// `(rank, in)`.
    pub a: PackedMatrix,
    /// `(out, rank)`.
    pub b: PackedMatrix,
    /// `alpha / r` (or `/ √r`).
    pub scale: f32,
}

/// An adapter ready to serve: every module packed.
#[derive(Debug, Clone)]
pub struct PackedAdapter {
    modules: BTreeMap<(usize, Target), PackedLora>,
    key: [u8; 32],
}

impl PackedAdapter {
    /// A SHA-256 of everything the adapter computes with (every module's
    /// place, rank, scale, precision and weights): equal keys, equal outputs.
    /// The prefix cache keeps blocks computed under different keys apart.
    pub fn key(&self) -> &[u8; 32] {
        &self.key
    }

    /// Memory the packed weights take.
    pub fn bytes(&self) -> usize {
        self.modules.values().map(|m| m.a.bytes() + m.b.bytes()).sum()
    }

    /// The module adapting `target` in `layer`, if the adapter has one.
    pub fn module(&self, layer: usize, target: Target) -> Option<&PackedLora> {
        self.modules.get(&(layer, target))
    }
}

impl Adapter {
    /// The content key of [`PackedAdapter::key`].
    fn key(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for (&(layer, target), m) in &self.modules {
            h.update(format!("{layer}.{target:?}.{}.{:?}:", m.rank, m.precision));
            h.update(m.scale.to_le_bytes());
            let weights: Vec<u8> = m.a.iter().chain(&m.b).flat_map(|v| v.to_le_bytes()).collect();
            h.update(&weights);
        }
        h.finalize().into()
    }

    /// Pack every module for the forward pass.
    pub fn packed(&self) -> PackedAdapter {
        PackedAdapter {
            key: self.key(),
            modules: self
                .modules
                .iter()
                .map(|(&at, m)| {
                    let inputs = m.a.len() / m.rank;
                    let outputs = m.b.len() / m.rank;
                    let pack = |values: &[f32], n: usize, k: usize| match m.precision {
                        Precision::F32 => PackedMatrix::from_f32(values, n, k),
                        Precision::F16 => {
                            let halves: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
                            PackedMatrix::from_f16(&halves, n, k)
                        }
                        Precision::Bf16 => {
                            let halves: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
                            PackedMatrix::from_bf16(&halves, n, k)
                        }
                    };
                    let packed = PackedLora {
                        a: pack(&m.a, m.rank, inputs),
                        b: pack(&m.b, outputs, m.rank),
                        scale: m.scale,
                    };
                    (at, packed)
                })
                .collect(),
        }
    }
}

/// One segment of a segmented LoRA product: the rows of the batch that use
/// `module`, and the first column of `y` its projection writes.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    /// The adapted projection.
    pub module: &'a PackedLora,
    /// Rows of `x` and `y`, in order.
    pub rows: &'a [usize],
    /// Where the projection's outputs start in a row of `y`.
    pub offset: usize,
}

/// Heterogeneous batched LoRA, as Punica's SGMV: for every segment,
/// `y[rows, offset..] += scale · (x[rows]·Aᵀ)·Bᵀ` (shrink, then expand),
/// without merging weights or copying them per token. Rows in no segment are
/// left as they are. Implemented per device: [`CpuSgmv`] here.
pub trait Sgmv {
    /// Apply every segment to `y`, the base projection's output for `x`.
    fn apply(&self, x: &Tensor, y: Tensor, segments: &[Segment<'_>]) -> candle_core::Result<Tensor>;
}

/// [`Sgmv`] on the CPU, on the packed product kernels.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuSgmv;

/// Below this many rows an adapter's rows go one by one through
/// [`PackedMatrix::row_add`]; from it on, through tiles.
const FEW_ROWS: usize = 8;

impl Sgmv for CpuSgmv {
    fn apply(&self, x: &Tensor, y: Tensor, segments: &[Segment<'_>]) -> candle_core::Result<Tensor> {
        if segments.is_empty() {
            return Ok(y);
        }
        let ((tokens, inputs), width) = (x.dims2()?, y.dim(1)?);
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let mut ys = y.flatten_all()?.to_vec1::<f32>()?;
        self.apply_rows(&xs, inputs, &mut ys, width, segments)?;
        Tensor::from_vec(ys, (tokens, width), x.device())
    }
}

impl CpuSgmv {
    /// [`Sgmv::apply`] on row-major buffers, `y` updated where it lies:
    /// `x` is `tokens × inputs`, `y` is `tokens × width`. Segments over the
    /// same rows (one adapter's projections) run together; each group of rows
    /// is a task, and a group of many rows is cut into one task per thread,
    /// so a step's adapters run side by side on the cores in one parallel
    /// region. A row in two groups, or a projection reaching past `width`,
    /// is an error and changes nothing.
    pub fn apply_rows(
        &self,
        x: &[f32],
        inputs: usize,
        y: &mut [f32],
        width: usize,
        segments: &[Segment<'_>],
    ) -> candle_core::Result<()> {
        use rayon::prelude::*;
        if segments.is_empty() {
            return Ok(());
        }
        let tokens = x.len() / inputs.max(1);
        if x.len() != tokens * inputs || y.len() != tokens * width {
            candle_core::bail!(
                "sgmv: x is {} values for {inputs} inputs, y {} for {width} outputs",
                x.len(),
                y.len()
            );
        }
        let mut groups: Vec<(&[usize], Vec<&Segment<'_>>)> = Vec::new();
        for segment in segments {
            let (module, end) = (segment.module, segment.offset + segment.module.b.outputs());
            if module.a.inputs() != inputs || end > width || module.b.inputs() != module.a.outputs() {
                candle_core::bail!(
                    "sgmv: a ({}, {}) by ({}, {}) projection at column {} of {width} on {inputs} inputs",
                    module.a.outputs(),
                    module.a.inputs(),
                    module.b.outputs(),
                    module.b.inputs(),
                    segment.offset
                );
            }
            match groups.iter_mut().find(|(rows, _)| *rows == segment.rows) {
                Some((_, group)) => group.push(segment),
                None => groups.push((segment.rows, vec![segment])),
            }
        }
        // Each row's outputs are handed to the one task that writes them.
        let mut slots: Vec<Option<&mut [f32]>> = y.chunks_exact_mut(width.max(1)).map(Some).collect();
        let threads = rayon::current_num_threads();
        let mut tasks: Vec<RowsTask<'_, '_>> = Vec::new();
        for (rows, group) in &groups {
            let mut mine = Vec::with_capacity(rows.len());
            for &r in rows.iter() {
                match slots.get_mut(r).and_then(Option::take) {
                    Some(out) => mine.push((r, out)),
                    None => candle_core::bail!("sgmv: row {r} is out of range or in two segments' rows"),
                }
            }
            let per_task = if rows.len() < FEW_ROWS {
                rows.len()
            } else {
                rows.len().div_ceil(threads)
            };
            while !mine.is_empty() {
                let rest = mine.split_off(per_task.clamp(1, mine.len()));
                tasks.push((group.as_slice(), std::mem::replace(&mut mine, rest)));
            }
        }
        tasks.into_par_iter().for_each(|(group, mut rows)| {
            for segment in group {
                add_segment(x, inputs, segment, &mut rows);
            }
        });
        Ok(())
    }
}

impl CpuSgmv {
    /// Whether [`CpuSgmv::apply_fused`] can run `segments` on this CPU
    /// (every projection starts on a panel boundary of the product) and is
    /// the better way to: some adapter has few rows. Where every adapter has
    /// many, the tiles after the product read each `B` once for all its rows.
    pub fn fusable(segments: &[Segment<'_>]) -> bool {
        PackedMatrix::rows_direct()
            && segments.iter().all(|s| s.offset % crate::gemm::NR == 0)
            && segments.iter().any(|s| s.rows.len() < FEW_ROWS)
    }

    /// The base product `x·Wᵀ` (`w`) with every segment added, the expand
    /// fused into the product ([`PackedMatrix::matmul_expand`]): first each
    /// segment's shrink `x[rows]·Aᵀ`, side by side on the cores, then one
    /// product whose tasks add each row's `scale · shrunk·Bᵀ` to the panels
    /// they have just computed. The same sums as the product followed by
    /// [`CpuSgmv::apply_rows`], bit for bit. Needs [`CpuSgmv::fusable`].
    pub fn apply_fused(
        &self,
        w: &PackedMatrix,
        x: &[f32],
        tokens: usize,
        segments: &[Segment<'_>],
    ) -> candle_core::Result<Vec<f32>> {
        use rayon::prelude::*;
        let inputs = w.inputs();
        let mut rows_seen = vec![None; tokens];
        for (i, segment) in segments.iter().enumerate() {
            let module = segment.module;
            if module.a.inputs() != inputs
                || segment.offset + module.b.outputs() > w.outputs()
                || module.b.inputs() != module.a.outputs()
                || segment.offset % crate::gemm::NR != 0
            {
                candle_core::bail!("sgmv: a projection out of place at column {}", segment.offset);
            }
            for &r in segment.rows {
                // Segments over the same rows are one adapter's projections.
                match rows_seen.get_mut(r) {
                    Some(seen @ None) => *seen = Some(segment.rows),
                    Some(Some(rows)) if *rows == segment.rows => {}
                    _ => candle_core::bail!("sgmv: row {r} is out of range or in two adapters' rows (segment {i})"),
                }
            }
        }
        // The shrinks. A segment of few rows (one decoding row, the usual
        // case) goes row by row, every such row of every segment in one list
        // whose products run several at once; a segment of many rows goes
        // through tiles, cut into one task per thread.
        let threads = rayon::current_num_threads();
        let few: Vec<(usize, usize)> = segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.rows.len() < FEW_ROWS)
            .flat_map(|(i, s)| s.rows.iter().map(move |&r| (i, r)))
            .collect();
        let mut few_shrunk = vec![0f32; few.iter().map(|&(i, _)| segments[i].module.a.outputs()).sum()];
        let tiled: Vec<(usize, std::ops::Range<usize>)> = segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.rows.len() >= FEW_ROWS)
            .flat_map(|(i, s)| {
                let per_task = s.rows.len().div_ceil(threads);
                (0..s.rows.len())
                    .step_by(per_task)
                    .map(move |start| (i, start..(start + per_task).min(s.rows.len())))
            })
            .collect();
        let (_, tiled_shrunk) = rayon::join(
            || {
                let mut products = Vec::with_capacity(few.len());
                let mut rest = few_shrunk.as_mut_slice();
                for &(i, r) in &few {
                    let a = &segments[i].module.a;
                    let (out, tail) = std::mem::take(&mut rest).split_at_mut(a.outputs());
                    rest = tail;
                    products.push(RowProduct {
                        w: a,
                        x: &x[r * inputs..(r + 1) * inputs],
                        out,
                    });
                }
                let per_task = products.len().div_ceil(4 * threads).max(1);
                products.par_chunks_mut(per_task).for_each(|chunk| {
                    PackedMatrix::row_products(chunk);
                });
            },
            || {
                tiled
                    .par_iter()
                    .map(|(i, range)| shrink(x, inputs, &segments[*i].module.a, &segments[*i].rows[range.clone()]))
                    .collect::<Vec<_>>()
            },
        );
        let mut expand: Vec<Vec<Expand<'_>>> = vec![Vec::new(); tokens];
        let mut rest = few_shrunk.as_slice();
        for &(i, r) in &few {
            let segment = &segments[i];
            let (shrunk, tail) = rest.split_at(segment.module.a.outputs());
            rest = tail;
            expand[r].push(Expand {
                b: &segment.module.b,
                shrunk,
                first_column: segment.offset,
                scale: segment.module.scale,
            });
        }
        for ((i, range), shrunk) in tiled.iter().zip(&tiled_shrunk) {
            let segment = &segments[*i];
            let rank = segment.module.a.outputs();
            for (&r, shrunk) in segment.rows[range.clone()].iter().zip(shrunk.chunks_exact(rank)) {
                expand[r].push(Expand {
                    b: &segment.module.b,
                    shrunk,
                    first_column: segment.offset,
                    scale: segment.module.scale,
                });
            }
        }
        let expand: Vec<&[Expand<'_>]> = expand.iter().map(Vec::as_slice).collect();
        Ok(w.matmul_expand(x, tokens, &expand))
    }
}

/// `x[rows]·Aᵀ` (`rows × rank`, row-major) on this thread's tiles.
fn shrink(x: &[f32], inputs: usize, a: &PackedMatrix, rows: &[usize]) -> Vec<f32> {
    let gathered: Vec<f32> = rows
        .iter()
        .flat_map(|&r| &x[r * inputs..(r + 1) * inputs])
        .copied()
        .collect();
    a.matmul_here(&gathered, rows.len())
}

/// One task of [`CpuSgmv::apply_rows`]: an adapter's segments, and some of
/// its rows with their outputs.
type RowsTask<'s, 'y> = (&'s [&'s Segment<'s>], Vec<(usize, &'y mut [f32])>);

/// `y[r][offset..] += scale · (x[r]·Aᵀ)·Bᵀ` for every row `r` of `rows`, on
/// this thread: one by one where there are few (straight from `x`, no
/// gathering), through tiles otherwise. Both give every output the same sum,
/// bit for bit.
fn add_segment(x: &[f32], inputs: usize, segment: &Segment<'_>, rows: &mut [(usize, &mut [f32])]) {
    let module = segment.module;
    let (rank, out, scale) = (module.a.outputs(), module.b.outputs(), module.scale);
    let columns = segment.offset..segment.offset + out;
    if rows.len() < FEW_ROWS {
        let mut shrunk = vec![0f32; rank];
        // `row_add` does nothing and says so on a CPU without the SIMD kernel.
        let done = rows.iter_mut().all(|(r, y)| {
            shrunk.fill(0.0);
            module.a.row_add(&x[*r * inputs..(*r + 1) * inputs], &mut shrunk, 1.0)
                && module.b.row_add(&shrunk, &mut y[columns.clone()], scale)
        });
        if done {
            return;
        }
    }
    let gathered: Vec<f32> = rows
        .iter()
        .flat_map(|(r, _)| &x[r * inputs..(r + 1) * inputs])
        .copied()
        .collect();
    let delta = module
        .b
        .matmul_here(&module.a.matmul_here(&gathered, rows.len()), rows.len());
    for ((_, y), delta) in rows.iter_mut().zip(delta.chunks_exact(out)) {
        for (y, d) in y[columns.clone()].iter_mut().zip(delta) {
            *y += scale * d;
        }
    }
}
