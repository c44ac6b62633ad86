//! Llama-family decoders: Llama 2/3/3.1/3.2 (with `llama3` rope scaling),
//! Mistral, Qwen2 (q/k/v biases) and Gemma.
//!
//! Follows "LLaMA: Open and Efficient Foundation Language Models" (Touvron et
//! al., 2023), "Llama 2" (Touvron et al., 2023) and "Gemma: Open Models Based
//! on Gemini Research and Technology" (Gemma Team, 2024), as implemented by
//! Hugging Face transformers' `modeling_llama.py`, `modeling_qwen2.py` and
//! `modeling_gemma.py`: RMSNorm pre-normalisation, rotary position embeddings
//! in the "rotate half" layout, grouped-query attention, and a gated MLP (SiLU;
//! tanh-approximate GELU for Gemma, which also scales its embeddings by
//! √hidden and stores RMSNorm weights as offsets from 1).
//!
//! [`Llama::forward_batch`] takes the new tokens of many sequences packed
//! into one `(tokens, hidden)` matrix, so every projection is one product
//! for the whole step ([`crate::ops::gemm`]); rotary embeddings are applied
//! per row at each row's own position; keys and values are written to the
//! paged cache through each sequence's blocks and attention reads them back
//! the same way ([`crate::runtime::kv`]). Each chunk may name its LoRA
//! adapter, applied by one segmented product per projection
//! ([`crate::ops::sgmv`]). `llama3` and `linear` rope scaling are read from
//! `rope_scaling` or `rope_parameters`. Checkpoints are read through memory
//! maps; `model.safetensors.index.json`, where present, names the shards. A
//! bad checkpoint (missing or misshapen tensor, truncated file, unsupported
//! `model_type`) is a [`ModelError`](crate::models::ModelError) naming what
//! is wrong.

use std::path::Path;

use candle_core::{CpuStorage, DType, Device, Module, Storage, Tensor};
use candle_nn::{embedding, rms_norm, Embedding, RmsNorm, VarBuilder};
use rayon::prelude::*;
use serde::Deserialize;

use super::{load_tensors, read_config, ModelError};
use crate::lora::{PackedAdapter, Target};
use crate::ops::attention::exp_in_place;
use crate::ops::gemm::PackedMatrix;
use crate::ops::quant::{QuantMatrix, QuantType};
use crate::ops::sgmv::{CpuSgmv, Segment, Sgmv};
use crate::runtime::kv::{AttentionSeq, BlockId, BlockPool, BlockTable, KvCache, KvLayout};
use crate::runtime::sampling::{Sampler, SamplingParams};
use crate::AdapterShape;

type Result<T> = std::result::Result<T, ModelError>;

/// Block size of a sequence run alone.
const SOLO_BLOCK: usize = 16;

/// `rope_scaling` (or the newer `rope_parameters`) as written in `config.json`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct RopeScalingFile {
    /// `llama3`, `default`, … (older files say `type`).
    #[serde(alias = "type")]
    pub rope_type: Option<String>,
    /// Scale factor.
    pub factor: Option<f64>,
    /// `llama3`: low-frequency factor.
    pub low_freq_factor: Option<f64>,
    /// `llama3`: high-frequency factor.
    pub high_freq_factor: Option<f64>,
    /// `llama3`: the context length the model was trained with.
    pub original_max_position_embeddings: Option<usize>,
    /// The newer layout keeps `rope_theta` here.
    pub rope_theta: Option<f64>,
}

/// `config.json` of a Llama-family checkpoint.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfigFile {
    /// `llama`, `mistral`, `qwen2`.
    pub model_type: Option<String>,
    #[allow(missing_docs)]
    pub hidden_size: usize,
    #[allow(missing_docs)]
    pub intermediate_size: usize,
    #[allow(missing_docs)]
    pub num_hidden_layers: usize,
    #[allow(missing_docs)]
    pub num_attention_heads: usize,
    /// Defaults to `num_attention_heads` (no grouping).
    pub num_key_value_heads: Option<usize>,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    #[allow(missing_docs)]
    pub rms_norm_eps: f64,
    /// Defaults to 10,000.
    pub rope_theta: Option<f64>,
    #[allow(missing_docs)]
    pub vocab_size: usize,
    /// Share the embedding matrix with the output head (Gemma's default: yes).
    pub tie_word_embeddings: Option<bool>,
    /// The MLP activation (`silu`, `gelu_pytorch_tanh`).
    pub hidden_act: Option<String>,
    /// Gemma's name for `hidden_act`, which wins where both are given.
    pub hidden_activation: Option<String>,
    /// Older placement of the rope parameters.
    pub rope_scaling: Option<RopeScalingFile>,
    /// Newer placement of the rope parameters.
    pub rope_parameters: Option<RopeScalingFile>,
    /// Biases on all four attention projections (Llama's `attention_bias`).
    #[serde(default)]
    pub attention_bias: bool,
    #[allow(missing_docs)]
    pub max_position_embeddings: usize,
}

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (every frequency divided by it).
    Linear {
        /// Scale factor.
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Scale factor.
        factor: f64,
        /// Wavelengths longer than `original / low` are scaled fully.
        low_freq_factor: f64,
        /// Wavelengths shorter than `original / high` are kept.
        high_freq_factor: f64,
        /// Training context length.
        original_max_position_embeddings: usize,
    },
}

/// The gated MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (Llama, Mistral, Qwen2).
    Silu,
    /// Tanh-approximate GELU (Gemma).
    GeluTanh,
}

/// The internal configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The MLP activation.
    pub activation: Activation,
    /// RMSNorm weights are stored as offsets from 1 (Gemma).
    pub norm_weight_offset: bool,
    /// Embeddings are scaled by √hidden (Gemma).
    pub scale_embeddings: bool,
    #[allow(missing_docs)]
    pub hidden_size: usize,
    #[allow(missing_docs)]
    pub intermediate_size: usize,
    #[allow(missing_docs)]
    pub num_layers: usize,
    #[allow(missing_docs)]
    pub num_heads: usize,
    #[allow(missing_docs)]
    pub num_kv_heads: usize,
    #[allow(missing_docs)]
    pub head_dim: usize,
    #[allow(missing_docs)]
    pub rms_norm_eps: f64,
    #[allow(missing_docs)]
    pub rope_theta: f64,
    #[allow(missing_docs)]
    pub rope_scaling: RopeScaling,
    /// Llama 3.1's rope scaling as llama.cpp writes it: one divisor per
    /// rotary frequency (a GGUF file's `rope_freqs.weight`).
    pub rope_factors: Option<Vec<f32>>,
    #[allow(missing_docs)]
    pub vocab_size: usize,
    #[allow(missing_docs)]
    pub tie_word_embeddings: bool,
    /// Biases on q, k and v.
    pub qkv_bias: bool,
    /// Bias on o.
    pub o_bias: bool,
    #[allow(missing_docs)]
    pub max_position_embeddings: usize,
}

impl Config {
    /// The projection sizes a LoRA adapter for this model must fit.
    pub fn adapter_shape(&self) -> AdapterShape {
        AdapterShape {
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Weights that take part in a matrix product per token: every projection and the output head.
    pub fn matmul_params(&self) -> usize {
        self.matmul_shapes().iter().map(|(n, k, count)| n * k * count).sum()
    }

    /// The products of one step as `(outputs, inputs, how many)`: stacked
    /// q/k/v, o, stacked gate/up and down once per layer, then the head.
    pub fn matmul_shapes(&self) -> Vec<(usize, usize, usize)> {
        let (h, d, layers) = (self.hidden_size, self.head_dim, self.num_layers);
        vec![
            ((self.num_heads + 2 * self.num_kv_heads) * d, h, layers),
            (h, self.num_heads * d, layers),
            (2 * self.intermediate_size, h, layers),
            (h, self.intermediate_size, layers),
            (self.vocab_size, h, 1),
        ]
    }
}

impl LlamaConfigFile {
    /// Check and convert into the internal configuration.
    pub fn into_config(self) -> Result<Config> {
        let model_type = self.model_type.as_deref().unwrap_or("llama");
        if !matches!(model_type, "llama" | "mistral" | "qwen2" | "gemma") {
            return Err(ModelError::Config(format!(
                "model_type {model_type:?} is not a Llama-family model"
            )));
        }
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads) && self.head_dim.is_none()
        {
            return Err(ModelError::Config(
                "hidden_size must divide into num_attention_heads".into(),
            ));
        }
        let num_kv_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if num_kv_heads == 0 || !self.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(ModelError::Config(
                "num_attention_heads must be a multiple of num_key_value_heads".into(),
            ));
        }
        let rope = self.rope_parameters.or(self.rope_scaling);
        let rope_theta = rope
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10_000.0);
        let rope_scaling = match rope {
            Some(r) if r.rope_type.as_deref() == Some("llama3") => RopeScaling::Llama3 {
                factor: r.factor.unwrap_or(8.0),
                low_freq_factor: r.low_freq_factor.unwrap_or(1.0),
                high_freq_factor: r.high_freq_factor.unwrap_or(4.0),
                original_max_position_embeddings: r.original_max_position_embeddings.unwrap_or(8192),
            },
            Some(r) if r.rope_type.as_deref() == Some("linear") => match r.factor {
                Some(factor) if factor > 0.0 => RopeScaling::Linear { factor },
                _ => return Err(ModelError::Config("linear rope scaling needs a positive factor".into())),
            },
            Some(r) if matches!(r.rope_type.as_deref(), None | Some("default")) => RopeScaling::None,
            Some(r) => {
                return Err(ModelError::Config(format!(
                    "rope type {:?} is not supported",
                    r.rope_type
                )));
            }
            None => RopeScaling::None,
        };
        let qwen2 = model_type == "qwen2";
        let gemma = model_type == "gemma";
        let activation = match self.hidden_activation.or(self.hidden_act).as_deref() {
            None if gemma => Activation::GeluTanh,
            None | Some("silu") => Activation::Silu,
            Some("gelu_pytorch_tanh" | "gelu_tanh" | "gelu") if gemma => Activation::GeluTanh,
            Some(other) => return Err(ModelError::Config(format!("activation {other:?} is not supported"))),
        };
        Ok(Config {
            activation,
            norm_weight_offset: gemma,
            scale_embeddings: gemma,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads,
            head_dim: self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads),
            rms_norm_eps: self.rms_norm_eps,
            rope_theta,
            rope_scaling,
            rope_factors: None,
            vocab_size: self.vocab_size,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(gemma),
            qkv_bias: qwen2 || self.attention_bias,
            o_bias: !qwen2 && self.attention_bias,
            max_position_embeddings: self.max_position_embeddings,
        })
    }
}

/// The inverse frequencies of the rotary embedding, scaled as configured.
pub fn inverse_frequencies(cfg: &Config) -> Vec<f32> {
    let d = cfg.head_dim;
    let base: Vec<f64> = (0..d)
        .step_by(2)
        .map(|i| 1.0 / cfg.rope_theta.powf(i as f64 / d as f64))
        .collect();
    let scaled = match cfg.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let original = original_max_position_embeddings as f64;
            let low_freq_wavelen = original / low_freq_factor;
            let high_freq_wavelen = original / high_freq_factor;
            base.into_iter()
                .map(|freq| {
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen < high_freq_wavelen {
                        freq
                    } else if wavelen > low_freq_wavelen {
                        freq / factor
                    } else {
                        let smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                })
                .collect()
        }
    };
    match &cfg.rope_factors {
        Some(factors) => scaled
            .into_iter()
            .zip(factors)
            .map(|(f, &divisor)| (f / divisor as f64) as f32)
            .collect(),
        None => scaled.into_iter().map(|f| f as f32).collect(),
    }
}

/// The rotary embedding's frequencies, `head_dim / 2` of them. Each pass
/// computes the cos/sin of its own rows' positions ([`Rotary::angles`]):
/// a table for every position a model allows is megabytes that no pass
/// reads whole (8,192 positions of 32 frequencies are 2 MiB, 131,072 are 32
/// MiB).
#[derive(Debug, Clone)]
struct Rotary {
    inv_freq: Vec<f32>,
}

/// The cos/sin of one pass's rows, `(rows, head_dim / 2)` each.
struct Angles {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl Rotary {
    fn new(cfg: &Config) -> Self {
        Rotary {
            inv_freq: inverse_frequencies(cfg),
        }
    }

    /// The cos/sin of each of `positions`, in order.
    fn angles(&self, positions: &[usize]) -> Angles {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &position in positions {
            for &f in &self.inv_freq {
                // The angle in f32, as transformers computes it.
                let angle = position as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Angles { cos, sin, half }
    }
}

impl Angles {
    /// Rotate every head of every row of `x` (`(tokens, heads * head_dim)`) in
    /// the "rotate half" layout, row `i` by the angles of row `i`.
    fn apply(&self, x: &mut [f32], heads: usize) {
        let half = self.half;
        let rows = x
            .chunks_exact_mut(heads * 2 * half)
            .zip(self.cos.chunks_exact(half).zip(self.sin.chunks_exact(half)));
        for (row, (cos, sin)) in rows {
            for head in row.chunks_exact_mut(2 * half) {
                let (x1, x2) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * cos[i] - b * sin[i];
                    x2[i] = b * cos[i] + a * sin[i];
                }
            }
        }
    }
}

/// The new tokens of one sequence in a batched forward pass.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Tokens to run, at positions `start..start + tokens.len()`.
    pub tokens: &'a [u32],
    /// Tokens already in the cache before these.
    pub start: usize,
    /// The sequence's blocks, with room for these tokens already allocated.
    pub blocks: &'a [BlockId],
    /// Return the logits after each of the last `logits` of these tokens
    /// (1: the next token's; more: to verify proposed tokens; 0: none).
    pub logits: usize,
    /// The LoRA adapter these tokens run with, if any.
    pub adapter: Option<&'a PackedAdapter>,
}

/// The KV cache of one sequence run alone: its own pool, table and storage,
/// grown as it goes.
#[derive(Debug, Clone)]
pub struct SequenceCache {
    pool: BlockPool,
    table: BlockTable,
    kv: KvCache,
}

impl SequenceCache {
    /// Tokens cached so far.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }
}

/// A linear layer `y = x·Wᵀ + b` over packed token rows, computed as
/// `(W·xᵀ)ᵀ`: with the weight as the left operand the matrix product streams
/// the large matrix once per step and runs at 100–108 GFLOP/s on the decode
/// shapes here, against 70–79 for `x·Wᵀ` (`lorry bench engine` reports the
/// end-to-end effect).
#[derive(Debug, Clone)]
struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
}

/// A projection's weight as the product reads it.
#[derive(Debug, Clone)]
enum Weight {
    /// As loaded, in the checkpoint's precision, until [`Linear::packed`].
    Tensor(Tensor),
    /// On the CPU: panels for [`gemm`], laid out once.
    Packed(PackedMatrix),
    /// On the CPU: a GGUF file's quantized blocks, multiplied as they are
    /// ([`crate::ops::quant`]).
    Quant(QuantMatrix),
}

/// Where a projection's weights may come as quantized blocks (a GGUF file).
pub(crate) trait QuantSource {
    /// The blocks of the weight under Hugging Face's `name`, where the
    /// checkpoint holds them in a format the products run on.
    fn quantized(&self, name: &str) -> Result<Option<QuantMatrix>>;
}

/// How a checkpoint's projections are multiplied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Products {
    /// Quantized blocks (GGUF's `Q8_0`, `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`,
    /// `Q4_K`, `Q5_K`, `Q6_K`) kept and multiplied as they are, each token
    /// row quantized to 8-bit blocks; f16 and bf16 projections multiplied
    /// with bf16 dot products where the CPU has them (AVX-512 BF16: weights
    /// and token rows rounded to bf16, sums in f32); other weights as
    /// [`Products::Exact`].
    #[default]
    Native,
    /// Every weight dequantized at load (half precision kept and widened in
    /// the product), token rows in f32: the arithmetic of transformers'
    /// GGUF loader.
    Exact,
    /// As [`Products::Native`], and every f32, f16 or bf16 projection
    /// quantized at load to this format (weight-only quantization): a
    /// Hugging Face checkpoint served at a quantized file's speed.
    Quantize(QuantType),
}

impl Products {
    fn projections<'q>(self, dtype: DType, blocks: Option<&'q dyn QuantSource>, device: &Device) -> Projections<'q> {
        let cpu = device.is_cpu();
        Projections {
            dtype,
            blocks: blocks.filter(|_| cpu && self != Products::Exact),
            bf16_dot: cpu && self != Products::Exact,
            quantize: match self {
                Products::Quantize(ty) if cpu => Some(ty),
                _ => None,
            },
        }
    }
}

/// What the projections of a load are read as: `dtype` for tensors, and
/// the quantized blocks of `blocks` where it has them; the other ones
/// quantized at load to `quantize`, where set.
#[derive(Clone, Copy)]
struct Projections<'q> {
    dtype: DType,
    blocks: Option<&'q dyn QuantSource>,
    quantize: Option<QuantType>,
    /// Half-precision projections multiplied with bf16 dot products where
    /// the CPU has them (token rows rounded to bf16).
    bf16_dot: bool,
}

impl Linear {
    /// `(outputs, inputs)` weights in `dtype` (the checkpoint's, so that
    /// half-precision panels stay half), with an f32 bias if asked.
    /// Where `p` has the weight as quantized blocks, those.
    fn load(vb: VarBuilder, inputs: usize, outputs: usize, bias: bool, p: Projections<'_>) -> Result<Self> {
        let bias = if bias { Some(vb.get(outputs, "bias")?) } else { None };
        let name = format!("{}.weight", vb.prefix());
        if let Some(q) = p.blocks.map(|b| b.quantized(&name)).transpose()?.flatten() {
            if (q.outputs(), q.inputs()) != (outputs, inputs) {
                return Err(ModelError::Config(format!(
                    "{name} is {}×{}, the configuration makes it {outputs}×{inputs}",
                    q.outputs(),
                    q.inputs()
                )));
            }
            return Ok(Linear {
                weight: Weight::Quant(q),
                bias,
            });
        }
        Ok(Linear {
            weight: Weight::Tensor(vb.to_dtype(p.dtype).get((outputs, inputs), "weight")?),
            bias,
        })
    }

    /// Several layers over the same input as one, their outputs side by
    /// side: quantized blocks stay blocks where every part is quantized.
    fn stack(parts: &[Linear]) -> Result<Self> {
        let biases: Option<Vec<&Tensor>> = parts.iter().map(|p| p.bias.as_ref()).collect();
        let bias = biases.map(|b| Tensor::cat(&b, 0)).transpose()?;
        let quantized: Option<Vec<QuantMatrix>> = parts
            .iter()
            .map(|p| match &p.weight {
                Weight::Quant(q) => Some(q.clone()),
                _ => None,
            })
            .collect();
        if let Some(stacked) = quantized.and_then(|q| QuantMatrix::stack(&q)) {
            return Ok(Linear {
                weight: Weight::Quant(stacked),
                bias,
            });
        }
        let weights = parts.iter().map(Linear::weight_tensor).collect::<Result<Vec<_>>>()?;
        // Mixed parts: blocks dequantized, every part in the widest precision.
        let dtype = if weights.iter().all(|w| w.dtype() == weights[0].dtype()) {
            weights[0].dtype()
        } else {
            DType::F32
        };
        let weights = weights
            .iter()
            .map(|w| w.to_dtype(dtype))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Linear {
            weight: Weight::Tensor(Tensor::cat(&weights, 0)?),
            bias,
        })
    }

    /// Ready for the forward pass: packed on the CPU (quantized to blocks
    /// where `p` asks and the inputs are whole blocks), f32 elsewhere.
    fn packed(self, p: Projections<'_>) -> Result<Self> {
        // The format a CPU tensor is quantized to, where one is asked and fits.
        let quantize_to = match &self.weight {
            Weight::Tensor(t) if t.device().is_cpu() => p.quantize.and_then(|ty| ty.for_inputs(t.dim(1).ok()?)),
            _ => None,
        };
        let weight = match self.weight {
            Weight::Tensor(t) if quantize_to.is_some() => {
                let (n, k) = t.dims2()?;
                let w = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let ty = quantize_to.expect("checked");
                Weight::Quant(QuantMatrix::quantize(ty, &w, n, k).map_err(|e| ModelError::Config(e.to_string()))?)
            }
            Weight::Tensor(t) if t.device().is_cpu() => Weight::Packed(if p.bf16_dot {
                PackedMatrix::from_tensor_dot(&t)?
            } else {
                PackedMatrix::from_tensor(&t)?
            }),
            Weight::Tensor(t) => Weight::Tensor(t.to_dtype(DType::F32)?),
            packed => packed,
        };
        Ok(Linear { weight, ..self })
    }

    /// `x` is `(tokens, inputs)`; the result is `(tokens, outputs)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_adapted(x, None)
    }

    /// [`Linear::forward`], then this layer's part of the pass's adapters
    /// (`lora`: the pass, the layer, and where each adapted projection's
    /// outputs start), added where the product lies.
    fn forward_adapted(&self, x: &Tensor, lora: Option<Adapted<'_, '_>>) -> Result<Tensor> {
        if let Weight::Tensor(_) = &self.weight {
            let y = x.matmul(&self.weight_tensor()?.t()?)?;
            let y = match &self.bias {
                Some(b) => y.broadcast_add(b)?,
                None => y,
            };
            return match lora {
                Some(a) => a.pass.lora(x, y, a.layer, a.parts),
                None => Ok(y),
            };
        };
        let (tokens, inputs) = x.dims2()?;
        // The rows as they lie in the tensor where they can be, not copied.
        with_values(x, |rows| {
            let segments = lora.as_ref().map(|a| a.pass.segments(a.layer, a.parts));
            let (mut product, outputs) = match &self.weight {
                Weight::Packed(w) => {
                    // Without a bias, the adapters' expand runs inside the product
                    // where that pays.
                    if let Some(segments) = segments.as_ref().filter(|s| self.bias.is_none() && CpuSgmv::fusable(s)) {
                        let product = CpuSgmv.apply_fused(w, rows, tokens, segments)?;
                        return Ok(Tensor::from_vec(product, (tokens, w.outputs()), x.device())?);
                    }
                    (w.matmul(rows, tokens), w.outputs())
                }
                Weight::Quant(q) => {
                    // The same on quantized blocks whose formats' parts start on panels.
                    if let Some(segments) = segments
                        .as_ref()
                        .filter(|s| self.bias.is_none() && q.panels_whole() && CpuSgmv::fusable(s))
                    {
                        let product = CpuSgmv.apply_fused(q, rows, tokens, segments)?;
                        return Ok(Tensor::from_vec(product, (tokens, q.outputs()), x.device())?);
                    }
                    (q.matmul(rows, tokens), q.outputs())
                }
                Weight::Tensor(_) => unreachable!("handled above"),
            };
            if let Some(bias) = &self.bias {
                let bias = bias.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                for row in product.chunks_exact_mut(outputs) {
                    for (y, b) in row.iter_mut().zip(&bias) {
                        *y += b;
                    }
                }
            }
            if let Some(segments) = segments {
                CpuSgmv.apply_rows(rows, inputs, &mut product, outputs, &segments)?;
            }
            Ok(Tensor::from_vec(product, (tokens, outputs), x.device())?)
        })?
    }

    /// The weight as a tensor, where it is not packed (quantized blocks
    /// dequantized to f32).
    fn weight_tensor(&self) -> Result<Tensor> {
        match &self.weight {
            Weight::Tensor(t) => Ok(t.clone()),
            Weight::Quant(q) => Ok(Tensor::from_vec(
                q.dequantize(),
                (q.outputs(), q.inputs()),
                &Device::Cpu,
            )?),
            Weight::Packed(_) => Err(ModelError::Config("packed weights have no tensor".into())),
        }
    }

    /// Name this product as the one the pass runs next
    /// ([`crate::ops::ahead`]): the pool's idle threads ask for its weights
    /// while the serial work before it runs.
    fn ahead(&self) {
        match &self.weight {
            Weight::Packed(w) => crate::ops::ahead::set(&[w.raw()]),
            Weight::Quant(q) => crate::ops::ahead::set(&q.raw()),
            Weight::Tensor(_) => crate::ops::ahead::clear(),
        }
    }

    /// Bytes the weight is read in, and its parameters.
    fn weight_bytes(&self) -> (usize, usize) {
        match &self.weight {
            Weight::Packed(w) => (w.bytes(), w.outputs() * w.inputs()),
            Weight::Quant(q) => (q.bytes(), q.outputs() * q.inputs()),
            Weight::Tensor(t) => (t.elem_count() * t.dtype().size_in_bytes(), t.elem_count()),
        }
    }
}

#[derive(Debug, Clone)]
struct Attention {
    /// `q_proj`, `k_proj` and `v_proj` stacked: one product per step instead of three.
    qkv_proj: Linear,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

/// A 2-D tensor's values, row-major.
fn rows(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// `f` on an f32 tensor's values, row-major: read where they lie when the
/// tensor is contiguous on the CPU, copied otherwise.
fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    if let (Storage::Cpu(CpuStorage::F32(values)), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
        return Ok(f(&values[start..end]));
    }
    drop(storage);
    Ok(f(&rows(t)?))
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &Config, p: Projections<'_>) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        Ok(Attention {
            qkv_proj: Linear::stack(&[
                Linear::load(vb.pp("q_proj"), h, cfg.num_heads * d, cfg.qkv_bias, p)?,
                Linear::load(vb.pp("k_proj"), h, cfg.num_kv_heads * d, cfg.qkv_bias, p)?,
                Linear::load(vb.pp("v_proj"), h, cfg.num_kv_heads * d, cfg.qkv_bias, p)?,
            ])?
            .packed(p)?,
            o_proj: Linear::load(vb.pp("o_proj"), cfg.num_heads * d, h, cfg.o_bias, p)?.packed(p)?,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: d,
        })
    }

    /// `x` is `(tokens, hidden)`: every sequence's new tokens, packed.
    fn forward(&self, x: &Tensor, pass: &Pass<'_>, kv: &mut KvCache, layer: usize) -> Result<Tensor> {
        let (tokens, _) = x.dims2()?;
        let (q_width, kv_width) = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim);
        let parts = [(Target::Q, 0), (Target::K, q_width), (Target::V, q_width + kv_width)];
        let qkv = self.qkv_proj.forward_adapted(x, pass.lora_for(layer, &parts))?;
        self.o_proj.ahead();
        let (mut q, mut k, v) = with_values(&qkv, |all| {
            let (mut q, mut k, mut v) = (
                Vec::with_capacity(tokens * q_width),
                Vec::with_capacity(tokens * kv_width),
                Vec::with_capacity(tokens * kv_width),
            );
            for row in all.chunks_exact(q_width + 2 * kv_width) {
                let (row_q, rest) = row.split_at(q_width);
                let (row_k, row_v) = rest.split_at(kv_width);
                q.extend_from_slice(row_q);
                k.extend_from_slice(row_k);
                v.extend_from_slice(row_v);
            }
            (q, k, v)
        })?;
        pass.angles.apply(&mut q, self.num_heads);
        pass.angles.apply(&mut k, self.num_kv_heads);
        kv.write(layer, &pass.seqs, &k, &v);
        let out = kv.attend(layer, &pass.seqs, self.num_heads, &q);
        let width = out.len() / tokens;
        let out = Tensor::from_vec(out, (tokens, width), x.device())?;
        self.o_proj
            .forward_adapted(&out, pass.lora_for(layer, &[(Target::O, 0)]))
    }
}

/// What every layer needs to know about one batched forward pass.
struct Pass<'a> {
    /// The rotary angles of each row.
    angles: Angles,
    seqs: Vec<AttentionSeq<'a>>,
    /// Each adapter in the batch with the rows that run with it.
    adapters: Vec<(&'a PackedAdapter, Vec<usize>)>,
}

/// What [`Linear::forward_adapted`] needs to add a pass's adapters to a product.
struct Adapted<'p, 'a> {
    pass: &'p Pass<'a>,
    layer: usize,
    /// The adapted projections and the first column of each.
    parts: &'p [(Target, usize)],
}

impl<'a> Pass<'a> {
    /// [`Adapted`] for `parts` of `layer`; `None` when no row of the pass
    /// has an adapter.
    fn lora_for<'p>(&'p self, layer: usize, parts: &'p [(Target, usize)]) -> Option<Adapted<'p, 'a>> {
        (!self.adapters.is_empty()).then_some(Adapted {
            pass: self,
            layer,
            parts,
        })
    }

    /// Every (adapter, projection) pair of `layer` among `parts` as one
    /// segment of one segmented product, whatever mix of adapters shares the
    /// batch.
    fn segments(&self, layer: usize, parts: &[(Target, usize)]) -> Vec<Segment<'_>> {
        self.adapters
            .iter()
            .flat_map(|(adapter, rows)| {
                parts.iter().filter_map(move |&(target, offset)| {
                    Some(Segment {
                        module: adapter.module(layer, target)?,
                        rows: rows.as_slice(),
                        offset,
                    })
                })
            })
            .collect()
    }

    /// `y += scale · (x·Aᵀ)·Bᵀ` for the rows of each adapter, into the columns
    /// of `y` where each of `parts` (a projection and its first column) lies.
    fn lora(&self, x: &Tensor, y: Tensor, layer: usize, parts: &[(Target, usize)]) -> Result<Tensor> {
        let segments = self.segments(layer, parts);
        Ok(CpuSgmv.apply(x, y, &segments)?)
    }
}

/// The rows of each distinct adapter among `chunks`, in row order.
fn group_by_adapter<'a>(chunks: &[SeqChunk<'a>]) -> Vec<(&'a PackedAdapter, Vec<usize>)> {
    let mut groups: Vec<(&PackedAdapter, Vec<usize>)> = Vec::new();
    let mut row = 0;
    for chunk in chunks {
        let rows = row..row + chunk.tokens.len();
        row = rows.end;
        let Some(adapter) = chunk.adapter else { continue };
        match groups.iter_mut().find(|(a, _)| std::ptr::eq(*a, adapter)) {
            Some((_, group)) => group.extend(rows),
            None => groups.push((adapter, rows.collect())),
        }
    }
    groups
}

#[derive(Debug, Clone)]
struct Mlp {
    /// `gate_proj` and `up_proj` stacked.
    gate_up_proj: Linear,
    down_proj: Linear,
    activation: Activation,
    intermediate: usize,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &Config, p: Projections<'_>) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Mlp {
            gate_up_proj: Linear::stack(&[
                Linear::load(vb.pp("gate_proj"), h, i, false, p)?,
                Linear::load(vb.pp("up_proj"), h, i, false, p)?,
            ])?
            .packed(p)?,
            down_proj: Linear::load(vb.pp("down_proj"), i, h, false, p)?.packed(p)?,
            activation: cfg.activation,
            intermediate: i,
        })
    }

    fn forward(&self, x: &Tensor, pass: &Pass<'_>, layer: usize) -> Result<Tensor> {
        let parts = [(Target::Gate, 0), (Target::Up, self.intermediate)];
        let gate_up = self.gate_up_proj.forward_adapted(x, pass.lora_for(layer, &parts))?;
        self.down_proj.ahead();
        let i = self.intermediate;
        let hidden = match self.activation {
            // `silu(gate)·up`, a row at a time.
            Activation::Silu if gate_up.device().is_cpu() => {
                let hidden = with_values(&gate_up, |all| {
                    let mut hidden = vec![0f32; all.len() / 2];
                    hidden
                        .par_chunks_mut(i)
                        .zip(all.par_chunks(2 * i))
                        .with_min_len(16)
                        .for_each(|(out, row)| silu_times(row, out));
                    hidden
                })?;
                Tensor::from_vec(hidden, (gate_up.dim(0)?, i), gate_up.device())?
            }
            Activation::Silu => (candle_nn::ops::silu(&gate_up.narrow(1, 0, i)?)? * gate_up.narrow(1, i, i)?)?,
            Activation::GeluTanh => (gate_up.narrow(1, 0, i)?.gelu()? * gate_up.narrow(1, i, i)?)?,
        };
        self.down_proj
            .forward_adapted(&hidden, pass.lora_for(layer, &[(Target::Down, 0)]))
    }
}

/// `out = silu(gate)·up` for one row of the stacked gate and up projections
/// (`row` is `gate` then `up`, each `out.len()` long): `g / (1 + e^−g) · u`
/// as candle writes it, the exponentials eight at a time where the CPU has
/// AVX2 ([`exp_in_place`]: within two units in the last place, and a value's
/// the same wherever it lies in the row).
fn silu_times(row: &[f32], out: &mut [f32]) {
    let (gate, up) = row.split_at(out.len());
    for (y, &g) in out.iter_mut().zip(gate) {
        *y = -g;
    }
    exp_in_place(out);
    for ((y, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *y = g / (1.0 + *y) * u;
    }
}

/// RMSNorm; Gemma stores its weight as an offset from 1.
fn norm(vb: VarBuilder, cfg: &Config) -> Result<RmsNorm> {
    if !cfg.norm_weight_offset {
        return Ok(rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb)?);
    }
    let weight = (vb.get(cfg.hidden_size, "weight")? + 1.0)?;
    Ok(RmsNorm::new(weight, cfg.rms_norm_eps))
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn load(vb: VarBuilder, cfg: &Config, p: Projections<'_>) -> Result<Self> {
        Ok(DecoderLayer {
            input_layernorm: norm(vb.pp("input_layernorm"), cfg)?,
            self_attn: Attention::load(vb.pp("self_attn"), cfg, p)?,
            post_attention_layernorm: norm(vb.pp("post_attention_layernorm"), cfg)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg, p)?,
        })
    }

    fn forward(&self, x: &Tensor, pass: &Pass<'_>, kv: &mut KvCache, layer: usize) -> Result<Tensor> {
        let attn = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, pass, kv, layer)?;
        self.mlp.gate_up_proj.ahead();
        let x = (x + attn)?;
        let mlp = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?, pass, layer)?;
        Ok((x + mlp)?)
    }
}

/// The token embedding.
#[derive(Debug, Clone)]
enum Embed {
    /// A table of f32 rows.
    Table(Embedding),
    /// A GGUF file's quantized rows (on the CPU), dequantized as tokens ask
    /// for them: the table costs its blocks' bytes, not four a weight.
    Rows(QuantMatrix),
}

impl Embed {
    fn device(&self) -> &Device {
        match self {
            Embed::Table(t) => t.embeddings().device(),
            Embed::Rows(_) => &Device::Cpu,
        }
    }

    /// The rows of `ids`, `(ids, hidden)`.
    fn forward(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        match self {
            Embed::Table(t) => Ok(t.forward(&Tensor::new(ids, device)?)?),
            Embed::Rows(rows) => {
                let hidden = rows.inputs();
                let mut x = vec![0f32; ids.len() * hidden];
                for (&id, out) in ids.iter().zip(x.chunks_exact_mut(hidden.max(1))) {
                    if id as usize >= rows.outputs() {
                        return Err(ModelError::Config(format!(
                            "token {id} is outside the vocabulary of {}",
                            rows.outputs()
                        )));
                    }
                    rows.dequantize_row(id as usize, out);
                }
                Ok(Tensor::from_vec(x, (ids.len(), hidden), device)?)
            }
        }
    }
}

/// A Llama-family causal language model.
#[derive(Debug, Clone)]
pub struct Llama {
    embed_tokens: Embed,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    config: Config,
}

impl Llama {
    /// Load from a `VarBuilder` rooted at the checkpoint (names `model.…`,
    /// `lm_head`). Projections are kept in `dtype` (the checkpoint's: f16 and
    /// bf16 weights are widened inside the product, not at load); everything
    /// else in the builder's dtype.
    pub fn load(vb: VarBuilder, cfg: &Config, dtype: DType) -> Result<Self> {
        Llama::load_from(
            vb,
            cfg,
            Projections {
                dtype,
                blocks: None,
                quantize: None,
                bf16_dot: false,
            },
        )
    }

    /// [`Llama::load`], projections read as `p` says.
    fn load_from(vb: VarBuilder, cfg: &Config, p: Projections<'_>) -> Result<Self> {
        let model = vb.pp("model");
        let rows = p
            .blocks
            .map(|b| b.quantized("model.embed_tokens.weight"))
            .transpose()?
            .flatten();
        let embed_tokens = match rows {
            Some(rows) if (rows.outputs(), rows.inputs()) == (cfg.vocab_size, cfg.hidden_size) => Embed::Rows(rows),
            _ => Embed::Table(embedding(cfg.vocab_size, cfg.hidden_size, model.pp("embed_tokens"))?),
        };
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::load(model.pp("layers").pp(i), cfg, p))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = match &embed_tokens {
            // A tied head multiplies the embedding's own blocks.
            Embed::Rows(rows) if cfg.tie_word_embeddings => Linear {
                weight: Weight::Quant(rows.clone()),
                bias: None,
            },
            _ => {
                let head = if cfg.tie_word_embeddings {
                    model.pp("embed_tokens")
                } else {
                    vb.pp("lm_head")
                };
                Linear::load(head, cfg.hidden_size, cfg.vocab_size, false, p)?.packed(p)?
            }
        };
        Ok(Llama {
            norm: norm(model.pp("norm"), cfg)?,
            rotary: Rotary::new(cfg),
            embed_tokens,
            layers,
            lm_head,
            config: cfg.clone(),
        })
    }

    /// Bytes a projection weight is read in, on average over every
    /// projection a token passes: 4 for f32, 2 for f16 and bf16, 1.0625 for
    /// `Q8_0`, 0.625 for `Q4_1`, ...
    pub fn weight_bytes_per_param(&self) -> f64 {
        let (bytes, params) = self
            .layers
            .iter()
            .flat_map(|l| {
                [
                    &l.self_attn.qkv_proj,
                    &l.self_attn.o_proj,
                    &l.mlp.gate_up_proj,
                    &l.mlp.down_proj,
                ]
            })
            .chain([&self.lm_head])
            .map(Linear::weight_bytes)
            .fold((0, 0), |(b, p), (lb, lp)| (b + lb, p + lp));
        bytes as f64 / params.max(1) as f64
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The shape of this model's KV cache with `block_size`-token blocks.
    pub fn kv_layout(&self, block_size: usize) -> KvLayout {
        KvLayout {
            layers: self.layers.len(),
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            block_size,
        }
    }

    /// A fresh cache for one sequence run alone.
    pub fn new_cache(&self) -> SequenceCache {
        SequenceCache {
            pool: BlockPool::new(0, SOLO_BLOCK),
            table: BlockTable::default(),
            kv: KvCache::new(self.kv_layout(SOLO_BLOCK), 0),
        }
    }

    /// Run `tokens` after what `cache` holds; returns the logits at the last position (vocab).
    pub fn forward(&self, tokens: &[u32], cache: &mut SequenceCache) -> Result<Tensor> {
        self.forward_adapted(tokens, cache, None)
    }

    /// [`Llama::forward`] with a LoRA adapter.
    pub fn forward_adapted(
        &self,
        tokens: &[u32],
        cache: &mut SequenceCache,
        adapter: Option<&PackedAdapter>,
    ) -> Result<Tensor> {
        Ok(self.forward_positions(tokens, cache, adapter, 1)?.squeeze(0)?)
    }

    /// Mean negative log-likelihood (nats a token) of each of `tokens` after
    /// the ones before it, the text run in pieces of `chunk` tokens.
    pub fn mean_nll(&self, tokens: &[u32], chunk: usize) -> Result<f64> {
        let mut cache = self.new_cache();
        let (mut total, mut count) = (0f64, 0usize);
        let chunk = chunk.max(1);
        for (i, piece) in tokens.chunks(chunk).enumerate() {
            let logits = self.forward_positions(piece, &mut cache, None, piece.len())?;
            let logits = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            for (at, row) in logits.iter().enumerate() {
                let Some(&next) = tokens.get(i * chunk + at + 1) else {
                    break;
                };
                let max = row.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64;
                let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
                total += max + sum.ln() - row[next as usize] as f64;
                count += 1;
            }
        }
        Ok(total / count.max(1) as f64)
    }

    /// Run `tokens` after what `cache` holds; the logits after each of the
    /// last `positions` of them, `(positions, vocab)`.
    fn forward_positions(
        &self,
        tokens: &[u32],
        cache: &mut SequenceCache,
        adapter: Option<&PackedAdapter>,
        positions: usize,
    ) -> Result<Tensor> {
        let start = cache.table.len();
        let short = cache.table.blocks_needed(&cache.pool, tokens.len());
        let short = short.saturating_sub(cache.pool.free_blocks());
        cache.pool.grow(short);
        cache.kv.grow(cache.pool.total_blocks());
        cache
            .table
            .append(&mut cache.pool, tokens.len())
            .expect("the pool was grown to fit");
        let chunk = SeqChunk {
            tokens,
            start,
            blocks: cache.table.blocks(),
            logits: positions,
            adapter,
        };
        self.forward_batch(&[chunk], &mut cache.kv)
    }

    /// One batched step: every chunk's tokens run together, keys and values go
    /// to `kv` through the chunks' blocks, and the logits after the positions
    /// each chunk asks for come back, `(positions asked, vocab)` in chunk order.
    pub fn forward_batch(&self, chunks: &[SeqChunk<'_>], kv: &mut KvCache) -> Result<Tensor> {
        self.head(&self.forward_hidden(chunks, kv)?)
    }

    /// [`Llama::forward_batch`] up to the head: the final norm's rows at the
    /// positions each chunk asks for, `(positions asked, hidden)` in chunk
    /// order, for [`Llama::head`] to take in parts (a step's logits over a
    /// large vocabulary are megabytes a row group).
    pub fn forward_hidden(&self, chunks: &[SeqChunk<'_>], kv: &mut KvCache) -> Result<Tensor> {
        let limit = self.config.max_position_embeddings;
        if let Some(c) = chunks.iter().find(|c| c.start + c.tokens.len() > limit) {
            return Err(ModelError::Config(format!(
                "{} positions exceed max_position_embeddings {limit}",
                c.start + c.tokens.len()
            )));
        }
        let device = self.embed_tokens.device();
        let ids: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.iter().copied()).collect();
        let positions: Vec<usize> = chunks.iter().flat_map(|c| c.start..c.start + c.tokens.len()).collect();
        let pass = Pass {
            angles: self.rotary.angles(&positions),
            seqs: chunks
                .iter()
                .map(|c| AttentionSeq {
                    blocks: c.blocks,
                    start: c.start,
                    len: c.tokens.len(),
                })
                .collect(),
            adapters: group_by_adapter(chunks),
        };
        let mut x = self.embed_tokens.forward(&ids, device)?;
        if self.config.scale_embeddings {
            x = (x * (self.config.hidden_size as f64).sqrt())?;
        }
        // Each product is named to the pool's idle threads before the
        // serial work that comes before it (the layers name their own).
        if let Some(layer) = self.layers.first() {
            layer.self_attn.qkv_proj.ahead();
        }
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &pass, kv, i)?;
            match self.layers.get(i + 1) {
                Some(next) => next.self_attn.qkv_proj.ahead(),
                None => self.lm_head.ahead(),
            }
        }
        let mut last = Vec::new();
        let mut end = 0u32;
        for c in chunks {
            end += c.tokens.len() as u32;
            last.extend(end - c.logits.min(c.tokens.len()) as u32..end);
        }
        let last = x.index_select(&Tensor::new(last.as_slice(), device)?, 0)?;
        Ok(self.norm.forward(&last)?)
    }

    /// The logits of rows of [`Llama::forward_hidden`], `(rows, vocab)`: each
    /// row's are the same whatever rows go with it.
    pub fn head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)
    }

    /// Greedy decoding: `max_new` tokens after `prompt`.
    pub fn greedy(&self, prompt: &[u32], max_new: usize) -> Result<Vec<u32>> {
        self.generate(prompt, max_new, &mut Sampler::new(SamplingParams::greedy()), None)
    }

    /// Up to `max_new` tokens after `prompt`, drawn by `sampler`, ending early after `eos`.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampler: &mut Sampler,
        eos: Option<u32>,
    ) -> Result<Vec<u32>> {
        let mut cache = self.new_cache();
        let mut out = Vec::with_capacity(max_new);
        let mut logits = self.forward(prompt, &mut cache)?;
        while out.len() < max_new {
            let next = sampler.sample(&logits.to_vec1::<f32>()?);
            out.push(next);
            if Some(next) == eos || out.len() == max_new {
                break;
            }
            logits = self.forward(&[next], &mut cache)?;
        }
        Ok(out)
    }
}

impl Llama {
    /// Load a Hugging Face checkpoint directory: f32 activations; projections
    /// packed in the checkpoint's precision (f32, f16 or bf16; half precision
    /// as bf16 pairs where the CPU has bf16 dot products).
    pub fn from_dir(dir: &Path, device: &Device) -> Result<Self> {
        Llama::from_dir_with(dir, device, Products::Native)
    }

    /// [`Llama::from_dir`], projections quantized at load where `products`
    /// says ([`Products::Quantize`]).
    pub fn from_dir_with(dir: &Path, device: &Device, products: Products) -> Result<Self> {
        let cfg = read_config::<LlamaConfigFile>(dir)?.into_config()?;
        let tensors = load_tensors(dir, device)?;
        // Projections stay in the checkpoint's precision.
        let dtype = tensors
            .get("model.layers.0.mlp.down_proj.weight")
            .map_or(DType::F32, |t| t.dtype());
        let vb = VarBuilder::from_tensors(tensors, DType::F32, device);
        Llama::load_from(vb, &cfg, products.projections(dtype, None, device))
    }

    /// Load a GGUF file: on the CPU, projections in `Q8_0`, `Q4_0`, `Q4_1`,
    /// `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K` or `Q6_K` as their blocks (unless `products` is [`Products::Exact`]); other
    /// tensors dequantized one at a time as the layers ask for them (f32, or
    /// the file's own f16/bf16 where every projection is half precision).
    pub fn from_gguf(file: &super::gguf::GgufFile, device: &Device, products: Products) -> Result<Self> {
        let cfg = file.config()?;
        let tensors = file.lazy(&cfg)?;
        let p = products.projections(file.projection_dtype(), Some(&tensors), device);
        Llama::load_from(tensors.clone().var_builder(device), &cfg, p)
    }

    /// The configuration of a checkpoint (a GGUF file or a Hugging Face
    /// directory), without reading its weights.
    pub fn config_of(path: &Path) -> Result<Config> {
        if super::gguf::is_gguf(path) {
            super::gguf::GgufFile::open(path)?.config()
        } else {
            read_config::<LlamaConfigFile>(path)?.into_config()
        }
    }

    /// Load a checkpoint: a GGUF file or a Hugging Face directory.
    pub fn open(path: &Path, device: &Device) -> Result<Self> {
        if super::gguf::is_gguf(path) {
            Llama::from_gguf(&super::gguf::GgufFile::open(path)?, device, Products::Native)
        } else {
            Llama::from_dir(path, device)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::rng::SplitMix;

    /// `silu(g)·u` within a few units in the last place of the f64 value,
    /// from far below zero (under 1e-36 where the exact value is smaller
    /// still) to far above; a value's result the same wherever it lies in
    /// its row (the exponentials go eight at a time).
    #[test]
    fn silu_times_up_is_close_to_the_exact_value_and_the_same_in_any_place() {
        let mut rng = SplitMix::new(3);
        let n = 37;
        let mut gate: Vec<f32> = (0..n).map(|_| (rng.uniform() as f32 - 0.5) * 40.0).collect();
        gate[..6].copy_from_slice(&[0.0, -0.0, -150.0, 150.0, 1e-30, -88.5]);
        let up: Vec<f32> = (0..n).map(|_| rng.uniform() as f32 * 4.0 - 2.0).collect();
        let row = [gate.clone(), up.clone()].concat();
        let mut out = vec![0f32; n];
        silu_times(&row, &mut out);
        for ((&y, &g), &u) in out.iter().zip(&gate).zip(&up) {
            let (g64, u64) = (g as f64, u as f64);
            let want = g64 / (1.0 + (-g64).exp()) * u64;
            let bound = 4.0 * f32::EPSILON as f64 * want.abs() + 1e-36;
            assert!((y as f64 - want).abs() <= bound, "silu({g})·{u}: {y} against {want}");
        }
        // The same values shifted by three places (another alignment, another tail).
        let shift = 3;
        let mut shifted_gate = vec![0.5f32; shift];
        shifted_gate.extend(&gate);
        let mut shifted_up = vec![1.0f32; shift];
        shifted_up.extend(&up);
        let mut shifted = vec![0f32; n + shift];
        silu_times(&[shifted_gate, shifted_up].concat(), &mut shifted);
        assert_eq!(shifted[shift..], out[..]);
    }
}
