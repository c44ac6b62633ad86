//! The numerical kernels the models call: the packed matrix products of
//! every projection (`gemm` on f32/f16/bf16 panels, `quant` on GGUF's
//! quantized blocks), attention's vector kernels over the paged
//! cache (`attention`), and the segmented LoRA product (`sgmv`, Punica's
//! SGMV) behind its device seam. Kernels are chosen at run time from what
//! the CPU has, and every path gives a row the same sums whatever shares its
//! batch.

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub(crate) mod attention;
pub mod gemm;
pub mod quant;
pub mod sgmv;
