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

use crate::gemm::{PackedMatrix, Precision};
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

impl Sgmv for CpuSgmv {
    fn apply(&self, x: &Tensor, y: Tensor, segments: &[Segment<'_>]) -> candle_core::Result<Tensor> {
        use rayon::prelude::*;
        if segments.is_empty() {
            return Ok(y);
        }
        let ((tokens, inputs), width) = (x.dims2()?, y.dim(1)?);
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let mut ys = y.flatten_all()?.to_vec1::<f32>()?;
        // A segment with few rows is a small product: those run side by
        // side on the cores, each on one thread; a segment with many rows
        // runs across the cores by itself.
        let delta = |segment: &Segment<'_>, here: bool| {
            let (module, rows) = (segment.module, segment.rows);
            let (rank, out) = (module.a.outputs(), module.b.outputs());
            if here {
                // Row by row, straight from `x`: the usual case of one decoding row.
                let mut delta = vec![0f32; rows.len() * out];
                let mut shrunk = vec![0f32; rank];
                let done = rows.iter().zip(delta.chunks_exact_mut(out)).all(|(&r, delta)| {
                    shrunk.fill(0.0);
                    module.a.row_add(&xs[r * inputs..(r + 1) * inputs], &mut shrunk, 1.0)
                        && module.b.row_add(&shrunk, delta, 1.0)
                });
                if done {
                    return delta;
                }
            }
            let gathered: Vec<f32> = rows
                .iter()
                .flat_map(|&r| &xs[r * inputs..(r + 1) * inputs])
                .copied()
                .collect();
            if here {
                module
                    .b
                    .matmul_here(&module.a.matmul_here(&gathered, rows.len()), rows.len())
            } else {
                module.b.matmul(&module.a.matmul(&gathered, rows.len()), rows.len())
            }
        };
        const FEW_ROWS: usize = 8;
        let mut deltas: Vec<Vec<f32>> = vec![Vec::new(); segments.len()];
        let small: Vec<usize> = (0..segments.len())
            .filter(|&i| segments[i].rows.len() < FEW_ROWS)
            .collect();
        for (i, d) in small
            .par_iter()
            .map(|&i| (i, delta(&segments[i], true)))
            .collect::<Vec<_>>()
        {
            deltas[i] = d;
        }
        for (i, segment) in segments.iter().enumerate().filter(|(_, s)| s.rows.len() >= FEW_ROWS) {
            deltas[i] = delta(segment, false);
        }
        for (segment, delta) in segments.iter().zip(&deltas) {
            let (module, out) = (segment.module, segment.module.b.outputs());
            for (&r, delta) in segment.rows.iter().zip(delta.chunks_exact(out)) {
                let start = r * width + segment.offset;
                for (y, d) in ys[start..start + out].iter_mut().zip(delta) {
                    *y += module.scale * d;
                }
            }
        }
        Tensor::from_vec(ys, (tokens, width), x.device())
    }
}
