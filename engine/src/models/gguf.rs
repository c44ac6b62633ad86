//! GGUF files (llama.cpp's format): the configuration from the metadata, the
//! tensors renamed to Hugging Face's names and dequantized, as transformers'
//! GGUF loader (`integrations/ggml.py`, `modeling_gguf_pytorch_utils.py`)
//! reads them. The file is read with candle-core's `quantized::gguf_file`.
//! Projections in a block format the engine multiplies as it is (`Q8_0`,
//! `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`: [`crate::ops::quant`]) are read as their blocks instead
//! ([`QuantSource`]), unless the exact products are asked for.
//!
//! llama.cpp's converter permutes the rows of `attn_q`/`attn_k` of the
//! `llama` architecture for its interleaved rotary embedding; the permutation
//! is undone here, so the engine's (Hugging Face's) rotary embedding applies
//! and PEFT adapters trained on the Hugging Face model fit unchanged.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use super::llama::{Activation, Config, QuantSource, RopeScaling};
use super::ModelError;
use crate::ops::quant::{QuantMatrix, QuantType};

type Result<T> = std::result::Result<T, ModelError>;

/// Whether `path` names a GGUF file (by its extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The architectures served, as `general.architecture` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arch {
    /// Llama, Mistral, SmolLM and everything llama.cpp writes as `llama`.
    Llama,
    /// Qwen2 (q/k/v biases).
    Qwen2,
    /// Gemma.
    Gemma,
}

impl Arch {
    fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma => "gemma",
        }
    }
}

/// llama.cpp's name of a tensor type, for messages.
fn type_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "F32",
        GgmlDType::F16 => "F16",
        GgmlDType::BF16 => "BF16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}

/// llama.cpp's names of the type ids candle does not read.
fn unknown_type_name(id: u32) -> String {
    let name = match id {
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("type id {id}"),
    };
    name.to_string()
}

/// An open GGUF file: its metadata and tensor directory, read once.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    arch: Arch,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("arch", &self.arch)
            .finish()
    }
}

impl GgufFile {
    /// Read the header, metadata and tensor directory of `path`, and check
    /// that the architecture is served and every tensor lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(super::io_error(path))?;
        let len = file.metadata().map_err(super::io_error(path))?.len();
        GgufFile::read(&mut BufReader::new(file), len, path)
    }

    /// [`GgufFile::open`] on `len` bytes of `reader`, named `path` in errors.
    pub fn read<R: Read + Seek>(reader: &mut R, len: u64, path: &Path) -> Result<Self> {
        // Every count and length the header states is checked against the
        // bytes there are before the header is parsed: the parser allocates
        // what they say, and a file claiming an exabyte string would abort
        // the process rather than be refused.
        let start = reader.stream_position().map_err(super::io_error(path))?;
        HeaderWalk::new(reader, len.saturating_sub(start))
            .check()
            .map_err(|what| ModelError::Gguf(format!("{}: {what}", path.display())))?;
        reader.seek(SeekFrom::Start(start)).map_err(super::io_error(path))?;
        let content = Content::read(reader).map_err(|e| {
            // The first line: candle appends a backtrace where one is asked for.
            let message = e.to_string().lines().next().unwrap_or_default().to_string();
            let message = match message.strip_prefix("unknown dtype for tensor ") {
                Some(id) => match id.split_whitespace().next().and_then(|id| id.parse::<u32>().ok()) {
                    Some(id) => format!("tensor type {} is not supported", unknown_type_name(id)),
                    None => message,
                },
                None if message.contains("failed to fill whole buffer") => {
                    "the file ends inside its header (truncated?)".to_string()
                }
                None => message,
            };
            ModelError::Gguf(format!("{}: {message}", path.display()))
        })?;
        let mut file = GgufFile {
            path: path.to_path_buf(),
            content,
            arch: Arch::Llama,
        };
        let arch = file.string("general.architecture")?;
        file.arch = match arch.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gemma" => Arch::Gemma,
            other => {
                return Err(ModelError::Gguf(format!(
                    "unsupported architecture {other:?} in {}",
                    path.display()
                )))
            }
        };
        for (name, info) in &file.content.tensor_infos {
            // Checked: the dimensions and offsets are the file's word.
            let elements = info.shape.dims().iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64));
            let end = elements
                .filter(|n| n % info.ggml_dtype.block_size() as u64 == 0)
                .and_then(|n| (n / info.ggml_dtype.block_size() as u64).checked_mul(info.ggml_dtype.type_size() as u64))
                .and_then(|bytes| bytes.checked_add(info.offset))
                .and_then(|end| end.checked_add(file.content.tensor_data_offset));
            let Some(end) = end else {
                return Err(file.error(format!(
                    "tensor {name}: shape {:?} does not fit {} blocks",
                    info.shape.dims(),
                    type_name(info.ggml_dtype)
                )));
            };
            if end > len {
                return Err(file.error(format!(
                    "tensor {name} ends at byte {end}, past the end of the file ({len} bytes): truncated?"
                )));
            }
            if matches!(info.ggml_dtype, GgmlDType::Q8_1 | GgmlDType::Q8K) {
                return Err(file.error(format!(
                    "tensor {name}: type {} is not supported",
                    type_name(info.ggml_dtype)
                )));
            }
        }
        Ok(file)
    }

    /// An error about this file: its path, then `what`.
    pub(crate) fn error(&self, what: impl std::fmt::Display) -> ModelError {
        ModelError::Gguf(format!("{}: {what}", self.path.display()))
    }

    /// A metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| self.error(format!("metadata {key} is missing")))
    }

    /// A string value.
    pub fn string(&self, key: &str) -> Result<String> {
        match self.require(key)? {
            Value::String(s) => Ok(s.clone()),
            _ => Err(self.error(format!("metadata {key} is not a string"))),
        }
    }

    /// An unsigned integer value of any width.
    pub(crate) fn uint(&self, key: &str) -> Result<Option<u64>> {
        let Some(value) = self.get(key) else { return Ok(None) };
        let n = match value {
            Value::U8(v) => *v as u64,
            Value::U16(v) => *v as u64,
            Value::U32(v) => *v as u64,
            Value::U64(v) => *v,
            Value::I8(v) if *v >= 0 => *v as u64,
            Value::I16(v) if *v >= 0 => *v as u64,
            Value::I32(v) if *v >= 0 => *v as u64,
            Value::I64(v) if *v >= 0 => *v as u64,
            _ => return Err(self.error(format!("metadata {key} is not a non-negative integer"))),
        };
        Ok(Some(n))
    }

    /// A float value.
    pub fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(v)) => Ok(Some(*v as f64)),
            Some(Value::F64(v)) => Ok(Some(*v)),
            Some(_) => Err(self.error(format!("metadata {key} is not a number"))),
        }
    }

    /// A boolean value.
    pub fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(_) => Err(self.error(format!("metadata {key} is not a boolean"))),
        }
    }

    /// An array value.
    pub fn array(&self, key: &str) -> Result<Option<&Vec<Value>>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(v)) => Ok(Some(v)),
            Some(_) => Err(self.error(format!("metadata {key} is not an array"))),
        }
    }

    fn arch_uint(&self, key: &str) -> Result<Option<usize>> {
        Ok(self.uint(&format!("{}.{key}", self.arch.name()))?.map(|n| n as usize))
    }

    fn arch_required(&self, key: &str) -> Result<usize> {
        let full = format!("{}.{key}", self.arch.name());
        self.arch_uint(key)?
            .ok_or_else(|| self.error(format!("metadata {full} is missing")))
    }

    /// The model's configuration, from the metadata (and the embedding's
    /// shape for the vocabulary).
    pub fn config(&self) -> Result<Config> {
        let hidden_size = self.arch_required("embedding_length")?;
        let num_heads = self.arch_required("attention.head_count")?;
        let num_kv_heads = self.arch_uint("attention.head_count_kv")?.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(self.error(format!(
                "{0}.attention.head_count ({num_heads}) must be a multiple of {0}.attention.head_count_kv ({num_kv_heads})",
                self.arch.name()
            )));
        }
        let head_dim = match self.arch_uint("attention.key_length")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => return Err(self.error("embedding_length does not divide into head_count")),
        };
        let vocab_size = match self.content.tensor_infos.get("token_embd.weight") {
            Some(info) if info.shape.rank() == 2 => info.shape.dims()[0],
            Some(info) => {
                return Err(self.error(format!(
                    "tensor token_embd.weight has shape {:?}; (vocabulary, embedding) expected",
                    info.shape.dims()
                )))
            }
            None => return Err(self.error("tensor token_embd.weight is missing")),
        };
        let prefix = self.arch.name();
        let rms_norm_eps = self
            .float(&format!("{prefix}.attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| self.error(format!("metadata {prefix}.attention.layer_norm_rms_epsilon is missing")))?;
        let rope_theta = self.float(&format!("{prefix}.rope.freq_base"))?.unwrap_or(10_000.0);
        let rope_scaling = self.rope_scaling()?;
        let gemma = self.arch == Arch::Gemma;
        Ok(Config {
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            norm_weight_offset: gemma,
            scale_embeddings: gemma,
            hidden_size,
            intermediate_size: self.arch_required("feed_forward_length")?,
            num_layers: self.arch_required("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            rope_factors: self.rope_factors(head_dim)?,
            vocab_size,
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            qkv_bias: self.arch == Arch::Qwen2 || self.content.tensor_infos.contains_key("blk.0.attn_q.bias"),
            o_bias: self.content.tensor_infos.contains_key("blk.0.attn_output.bias"),
            max_position_embeddings: self.arch_uint("context_length")?.unwrap_or(2048),
        })
    }

    fn rope_scaling(&self) -> Result<RopeScaling> {
        let prefix = format!("{}.rope.scaling", self.arch.name());
        let kind = match self.get(&format!("{prefix}.type")) {
            None => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(self.error(format!("metadata {prefix}.type is not a string"))),
        };
        let factor = self.float(&format!("{prefix}.factor"))?;
        match (kind.as_deref(), factor) {
            (None | Some("none"), _) | (Some("linear"), None) => Ok(RopeScaling::None),
            (Some("linear"), Some(1.0)) => Ok(RopeScaling::None),
            (Some("linear"), Some(factor)) if factor > 0.0 => Ok(RopeScaling::Linear { factor }),
            (Some(other), _) => Err(self.error(format!(
                "rope scaling {other:?} ({prefix}.type, factor {factor:?}) is not supported"
            ))),
        }
    }

    /// `rope_freqs.weight`: Llama 3.1's rope scaling as llama.cpp writes it,
    /// one divisor per rotary frequency.
    fn rope_factors(&self, head_dim: usize) -> Result<Option<Vec<f32>>> {
        if !self.content.tensor_infos.contains_key("rope_freqs.weight") {
            return Ok(None);
        }
        let factors = self
            .tensor("rope_freqs.weight")?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if factors.len() != head_dim / 2 || factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
            return Err(self.error(format!(
                "tensor rope_freqs.weight: {} positive factors expected (head_dim / 2), found {}",
                head_dim / 2,
                factors.len()
            )));
        }
        Ok(Some(factors))
    }

    /// The tensors a Llama-family model loads, under Hugging Face's names,
    /// dequantized: f32, or the file's own f16/bf16 where it holds half
    /// precision. `attn_q`/`attn_k` of the `llama` architecture are
    /// un-permuted; Gemma's norms are stored as offsets from 1 again.
    pub fn tensors(&self, config: &Config, device: &Device) -> Result<HashMap<String, Tensor>> {
        let names = self.hf_names()?;
        let mut reader = self.reader()?;
        let mut out = HashMap::new();
        for (hf, name) in names {
            let t = self.read_hf(&mut reader, &name, config)?;
            out.insert(hf, t.to_device(device)?);
        }
        Ok(out)
    }

    /// Hugging Face's name of every tensor a model loads, and the file's name
    /// of each; a tensor of no known place is refused by name.
    fn hf_names(&self) -> Result<HashMap<String, String>> {
        let mut names = HashMap::new();
        for name in self.content.tensor_infos.keys() {
            if name == "rope_freqs.weight" {
                continue; // in the configuration
            }
            let Some(hf) = hf_name(name) else {
                return Err(self.error(format!("tensor {name} is not part of a {} model", self.arch.name())));
            };
            names.insert(hf, name.clone());
        }
        Ok(names)
    }

    /// One tensor, dequantized, with llama.cpp's changes undone.
    fn read_hf(&self, reader: &mut BufReader<File>, name: &str, config: &Config) -> Result<Tensor> {
        let t = self.read_tensor(reader, name)?;
        Ok(if let Some(heads) = self.permuted_heads(name, config) {
            unpermute(&t, heads)?
        } else if self.arch == Arch::Gemma && name.ends_with("norm.weight") {
            (t.to_dtype(DType::F32)? - 1.0)?
        } else {
            t
        })
    }

    /// The heads whose rows llama.cpp permuted in the file's tensor `name`
    /// (`attn_q`/`attn_k` of the `llama` architecture), if it is one of those.
    fn permuted_heads(&self, name: &str, config: &Config) -> Option<usize> {
        if self.arch != Arch::Llama {
            None
        } else if name.ends_with("attn_q.weight") {
            Some(config.num_heads)
        } else if name.ends_with("attn_k.weight") {
            Some(config.num_kv_heads)
        } else {
            None
        }
    }

    /// The model's tensors under Hugging Face's names, each read when the
    /// model asks for it ([`Lazy::var_builder`]; [`QuantSource`] for the
    /// projections held in a block format the products run on).
    pub(crate) fn lazy(&self, config: &Config) -> Result<Lazy<'_>> {
        Ok(Lazy {
            file: self,
            config: config.clone(),
            names: self.hf_names()?,
        })
    }

    fn reader(&self) -> Result<BufReader<File>> {
        Ok(BufReader::new(
            File::open(&self.path).map_err(super::io_error(&self.path))?,
        ))
    }

    /// One tensor as the file holds it, under its llama.cpp name,
    /// dequantized: f32, or f16/bf16 as stored.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        self.read_tensor(&mut self.reader()?, name)
    }

    fn read_tensor(&self, reader: &mut BufReader<File>, name: &str) -> Result<Tensor> {
        let q = self.content.tensor(reader, name, &Device::Cpu).map_err(|e| {
            self.error(format!(
                "tensor {name}: {}",
                e.to_string().lines().next().unwrap_or_default()
            ))
        })?;
        Ok(match q.dtype() {
            GgmlDType::F16 => q.dequantize_f16(&Device::Cpu)?,
            GgmlDType::BF16 => q.dequantize(&Device::Cpu)?.to_dtype(DType::BF16)?,
            _ => q.dequantize(&Device::Cpu)?,
        })
    }

    /// The precision projections are kept in: the file's where every
    /// projection is f16 (or every one bf16), else f32.
    pub(crate) fn projection_dtype(&self) -> DType {
        let mut types = self
            .content
            .tensor_infos
            .iter()
            .filter(|(n, _)| n.starts_with("blk.") && n.ends_with(".weight") && !n.contains("norm"))
            .map(|(_, i)| i.ggml_dtype);
        match types.next() {
            Some(first @ (GgmlDType::F16 | GgmlDType::BF16)) if types.all(|t| t == first) => {
                if first == GgmlDType::F16 {
                    DType::F16
                } else {
                    DType::BF16
                }
            }
            _ => DType::F32,
        }
    }

    /// The tensor types in the file and how many tensors of each, for logs.
    pub fn type_counts(&self) -> String {
        let mut counts: std::collections::BTreeMap<&str, usize> = Default::default();
        for info in self.content.tensor_infos.values() {
            *counts.entry(type_name(info.ggml_dtype)).or_default() += 1;
        }
        counts
            .iter()
            .map(|(t, n)| format!("{t}×{n}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// A GGUF file's tensors read as the model asks for them ([`GgufFile::lazy`]).
#[derive(Clone)]
pub(crate) struct Lazy<'a> {
    file: &'a GgufFile,
    config: Config,
    /// Hugging Face's names to the file's.
    names: HashMap<String, String>,
}

impl<'a> Lazy<'a> {
    /// The tensors as a `VarBuilder`: besides what is already packed, only
    /// the tensor at hand is held dequantized.
    pub(crate) fn var_builder(self, device: &Device) -> VarBuilder<'a> {
        VarBuilder::from_backend(Box::new(self), DType::F32, device.clone())
    }
}

impl SimpleBackend for Lazy<'_> {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, device)?;
        if t.shape() != &shape {
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: shape,
                got: t.shape().clone(),
            }
            .bt());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
        let Some(file_name) = self.names.get(name) else {
            return Err(candle_core::Error::CannotFindTensor { path: name.to_string() }.bt());
        };
        let mut reader = self.file.reader().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let t = self
            .file
            .read_hf(&mut reader, file_name, &self.config)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        t.to_dtype(dtype)?.to_device(device)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }
}

impl QuantSource for Lazy<'_> {
    fn quantized(&self, name: &str) -> Result<Option<QuantMatrix>> {
        let Some(file_name) = self.names.get(name) else {
            return Ok(None);
        };
        let info = &self.file.content.tensor_infos[file_name];
        let Some(ty) = QuantType::from_ggml(info.ggml_dtype) else {
            return Ok(None);
        };
        let Ok((rows, cols)) = info.shape.dims2() else {
            return Ok(None);
        };
        let order = self
            .file
            .permuted_heads(file_name, &self.config)
            .map(|heads| unpermuted_rows(rows, heads))
            .transpose()?;
        // The blocks read straight into one buffer (the offsets and sizes were
        // checked against the file's length when it was opened), so a
        // tensor costs its bytes once more while it is re-laid, not thrice.
        let bytes = rows * cols / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        let mut q = vec![0u8; bytes];
        let mut file = File::open(&self.file.path).map_err(super::io_error(&self.file.path))?;
        file.seek(SeekFrom::Start(self.file.content.tensor_data_offset + info.offset))
            .and_then(|_| file.read_exact(&mut q))
            .map_err(|e| self.file.error(format!("tensor {file_name}: {e}")))?;
        QuantMatrix::from_blocks(ty, &q, rows, cols, order.as_deref())
            .map(Some)
            .map_err(|e| self.file.error(format!("tensor {file_name}: {e}")))
    }
}

/// Hugging Face's name of a llama.cpp tensor name.
fn hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(fixed) = fixed {
        return Some(fixed.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// [`unpermute`] as a row order: row `r` of the result is row `order[r]`
/// of the file's.
fn unpermuted_rows(rows: usize, heads: usize) -> Result<Vec<usize>> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(ModelError::Gguf(format!(
            "a query/key projection of {rows} rows does not split into {heads} heads"
        )));
    }
    let half = rows / heads / 2;
    Ok((0..rows)
        .map(|r| {
            let (head, within) = (r / (2 * half), r % (2 * half));
            head * 2 * half + (within % half) * 2 + within / half
        })
        .collect())
}

/// Undo llama.cpp's `permute`: its rows of each head are the two rotary
/// halves interleaved; Hugging Face keeps them as two halves.
fn unpermute(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    if heads == 0 || rows % (2 * heads) != 0 {
        return Err(ModelError::Gguf(format!(
            "a query/key projection of {rows} rows does not split into {heads} heads"
        )));
    }
    Ok(t.reshape((heads, rows / heads / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// A walk over a GGUF header (magic, version, counts, metadata, tensor
/// directory) that reads nothing it has not first checked fits in the bytes
/// left: what a length or count claims is compared with what remains before
/// anything of that size is read.
struct HeaderWalk<'a, R> {
    reader: &'a mut R,
    left: u64,
    /// Version 1 states lengths and counts in 32 bits; later versions in 64.
    wide: bool,
}

/// The deepest nesting of arrays taken (GGUF files nest none).
const MAX_ARRAY_DEPTH: usize = 4;

/// The most dimensions a tensor may state.
const MAX_DIMS: u64 = 8;

impl<'a, R: Read> HeaderWalk<'a, R> {
    fn new(reader: &'a mut R, left: u64) -> Self {
        HeaderWalk {
            reader,
            left,
            wide: true,
        }
    }

    fn check(mut self) -> std::result::Result<(), String> {
        let magic = self.bytes(4)?;
        // The parser takes the magic in either byte order; it names any other.
        if magic != b"GGUF" && magic != b"FUGG" {
            return Ok(());
        }
        let version = self.u32()?;
        self.wide = version >= 2;
        let tensors = self.count()?;
        let entries = self.count()?;
        // Each entry holds at least a key length and a type; each tensor a
        // name length, a dimension count, a type and an offset.
        let (entry, tensor) = if self.wide { (12, 24) } else { (8, 20) };
        self.fits(entries, entry, "metadata entries")?;
        for _ in 0..entries {
            let key = self.string()?;
            let kind = self.u32()?;
            if key == b"general.alignment" {
                self.alignment(kind)?;
            } else {
                self.value(kind, 0)?;
            }
        }
        self.fits(tensors, tensor, "tensors")?;
        for _ in 0..tensors {
            self.string()?;
            let dims = u64::from(self.u32()?);
            if dims > MAX_DIMS {
                return Err(format!("a tensor states {dims} dimensions"));
            }
            self.skip(dims * if self.wide { 8 } else { 4 }, "tensor dimensions")?;
            self.skip(12, "a tensor's type and offset")?;
        }
        Ok(())
    }

    /// `general.alignment`: a positive integer (the data offset is rounded up to it).
    fn alignment(&mut self, kind: u32) -> std::result::Result<(), String> {
        let value = match kind {
            0 => u64::from(self.bytes(1)?[0]),
            1 => self.bytes(1)?[0] as i8 as u64,
            2 => u64::from(u16::from_le_bytes(self.bytes(2)?.try_into().expect("two bytes"))),
            3 => i16::from_le_bytes(self.bytes(2)?.try_into().expect("two bytes")) as u64,
            4 => u64::from(self.u32()?),
            5 => self.u32()? as i32 as u64,
            _ => return self.value(kind, 0),
        };
        if value == 0 || value > 1 << 30 {
            return Err(format!("general.alignment {} is not a usable alignment", value as i64));
        }
        Ok(())
    }

    fn value(&mut self, kind: u32, depth: usize) -> std::result::Result<(), String> {
        match kind {
            0 | 1 | 7 => self.skip(1, "a value"),
            2 | 3 => self.skip(2, "a value"),
            4..=6 => self.skip(4, "a value"),
            10..=12 => self.skip(8, "a value"),
            8 => self.string().map(drop),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err("arrays nested too deep".into());
                }
                let item = self.u32()?;
                let count = self.count()?;
                let least = match item {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    8 => self.width(),
                    9 => 4 + self.width(),
                    other => return Err(format!("metadata value type {other} is not a GGUF type")),
                };
                self.fits(count, least, "an array")?;
                match item {
                    8 | 9 => (0..count).try_for_each(|_| self.value(item, depth + 1)),
                    _ => self.skip(count * least, "an array"),
                }
            }
            other => Err(format!("metadata value type {other} is not a GGUF type")),
        }
    }

    /// The width of a length or count: 8 bytes, or 4 in version 1.
    fn width(&self) -> u64 {
        if self.wide {
            8
        } else {
            4
        }
    }

    fn count(&mut self) -> std::result::Result<u64, String> {
        if self.wide {
            Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("eight bytes")))
        } else {
            self.u32().map(u64::from)
        }
    }

    fn string(&mut self) -> std::result::Result<Vec<u8>, String> {
        let len = self.count()?;
        self.fits(len, 1, "a string")?;
        self.bytes(len as usize)
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("four bytes")))
    }

    /// Whether `count` items of at least `least` bytes each fit in what is left.
    fn fits(&self, count: u64, least: u64, what: &str) -> std::result::Result<(), String> {
        match count.checked_mul(least) {
            Some(bytes) if bytes <= self.left => Ok(()),
            _ => Err(format!(
                "the header states {count} for {what}, more than its {} bytes left hold",
                self.left
            )),
        }
    }

    fn skip(&mut self, n: u64, what: &str) -> std::result::Result<(), String> {
        self.fits(n, 1, what)?;
        std::io::copy(&mut (&mut *self.reader).take(n), &mut std::io::sink()).map_err(|e| e.to_string())?;
        self.left -= n;
        Ok(())
    }

    fn bytes(&mut self, n: usize) -> std::result::Result<Vec<u8>, String> {
        self.fits(n as u64, 1, "a field")
            .map_err(|_| "the file ends inside its header (truncated?)".to_string())?;
        let mut buffer = vec![0; n];
        self.reader.read_exact(&mut buffer).map_err(|e| e.to_string())?;
        self.left -= n as u64;
        Ok(buffer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_names_map_to_hugging_face_names() {
        assert_eq!(hf_name("token_embd.weight").unwrap(), "model.embed_tokens.weight");
        assert_eq!(
            hf_name("blk.12.attn_q.weight").unwrap(),
            "model.layers.12.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.attn_k.bias").unwrap(),
            "model.layers.0.self_attn.k_proj.bias"
        );
        assert_eq!(
            hf_name("blk.3.ffn_down.weight").unwrap(),
            "model.layers.3.mlp.down_proj.weight"
        );
        assert_eq!(
            hf_name("blk.3.ffn_norm.weight").unwrap(),
            "model.layers.3.post_attention_layernorm.weight"
        );
        assert_eq!(hf_name("rope_freqs.weight"), None);
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn llama_cpp_rope_factors_give_llama3_frequencies() {
        let file: super::super::llama::LlamaConfigFile = serde_json::from_value(serde_json::json!({
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 10, "max_position_embeddings": 64, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        }))
        .unwrap();
        let llama3 = file.into_config().unwrap();
        // What llama.cpp's converter writes as rope_freqs.weight.
        let d = llama3.head_dim;
        let factors: Vec<f32> = (0..d)
            .step_by(2)
            .map(|i| {
                let freq = 1.0 / 500000f64.powf(i as f64 / d as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let (low, high) = (8192.0 / 1.0, 8192.0 / 4.0);
                if wavelen < high {
                    1.0
                } else if wavelen > low {
                    32.0
                } else {
                    let smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
                    (1.0 / ((1.0 - smooth) / 32.0 + smooth)) as f32
                }
            })
            .collect();
        assert!(
            factors.iter().any(|&f| f > 1.0 && f < 32.0),
            "some frequency is smoothed"
        );
        let from_gguf = Config {
            rope_scaling: RopeScaling::None,
            rope_factors: Some(factors),
            ..llama3.clone()
        };
        let (want, got) = (
            super::super::llama::inverse_frequencies(&llama3),
            super::super::llama::inverse_frequencies(&from_gguf),
        );
        for (w, g) in want.iter().zip(&got) {
            assert!((w - g).abs() <= 1e-6 * w.abs(), "{g} vs {w}");
        }
    }

    #[test]
    fn the_unpermuted_row_order_is_the_unpermuted_tensor() {
        let (rows, cols, heads) = (24, 3, 3);
        let t = Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu)
            .unwrap()
            .reshape((rows, cols))
            .unwrap();
        let want = unpermute(&t, heads).unwrap().to_vec2::<f32>().unwrap();
        let source = t.to_vec2::<f32>().unwrap();
        let order = unpermuted_rows(rows, heads).unwrap();
        for (r, &from) in order.iter().enumerate() {
            assert_eq!(want[r], source[from], "row {r}");
        }
        assert!(unpermuted_rows(10, 3).is_err());
    }

    #[test]
    fn unpermuting_inverts_llama_cpp_permutation() {
        // llama.cpp: reshape(heads, 2, d/2, cols).swapaxes(1, 2).
        let (heads, d, cols) = (3, 8, 5);
        let hf = Tensor::arange(0f32, (heads * d * cols) as f32, &Device::Cpu)
            .unwrap()
            .reshape((heads * d, cols))
            .unwrap();
        let permuted = hf
            .reshape((heads, 2, d / 2, cols))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((heads * d, cols))
            .unwrap();
        assert_ne!(permuted.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
        let back = unpermute(&permuted, heads).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    }
}
