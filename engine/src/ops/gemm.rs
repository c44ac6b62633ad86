//! The matrix products of every step, on weights laid out once at load.
//!
//! A decode step multiplies a few token rows (1 to a few dozen) by every
//! weight matrix of the model. A general GEMM re-packs the weight matrix into
//! its own layout on every call, and that copy costs about as much as the
//! product itself on these skinny shapes. Here each weight matrix is packed
//! once, when the model loads, into panels of [`NR`] output columns stored
//! `[k][NR]`: the microkernel streams a panel front to back and multiplies
//! every `NR`-wide slice of it by up to [`MR`] token rows held in registers.
//! Work is split across the cores by panels, so each weight byte is read from
//! memory once per product whatever the number of token rows (once per block
//! of rows for a pre-fill's hundreds). Each task takes its panels through
//! every block of rows in turn, so a product is one pass over the pool
//! however many blocks it has: no core waits at the end of each block for
//! the other's last tile.
//!
//! Panels keep the checkpoint's precision (f32, f16 or bf16): half-precision
//! weights are widened to f32 inside the kernel (F16C for f16, a shift for
//! bf16), which halves the bytes moved and gives exactly the numbers that
//! widening them at load would. Accumulation is in f32. AVX2, FMA and F16C
//! are checked at run time, and where AVX-512VL is there too the same kernel
//! is built with its 32 registers for tiles of [`MR_WIDE`] rows; a portable
//! kernel serves other CPUs, and the tests hold them all to the same results.
//! Each tile's input rows are interleaved `[k][rows]` before the product, so
//! the kernel reads one stream of inputs beside the panel.
//!
//! Where the CPU has AVX-512 BF16, half-precision weights may instead be
//! packed as bf16 pairs ([`PackedMatrix::from_tensor_dot`]): each panel
//! `[k/2][NR]` of two consecutive weights of an output, one 512-bit register
//! a step holding all [`NR`] outputs' pairs. Token rows are rounded to bf16
//! (to nearest, ties to even) and each `vdpbf16ps` adds two products into
//! each of the sixteen f32 sums, four times the multiply-adds of an f32
//! FMA on 256 bits. A tile is up to [`MR_DOT`] rows times up to
//! [`DOT_PANELS`] panels, so that even one row keeps several independent
//! chains; every output is one chain over its pairs in order, whatever the
//! tile, so a row's result never depends on what shares its product.
//! [`dot_pair`] writes that arithmetic out; it is the portable kernel.
//!
//! Where the CPU also has AMX-BF16 and the kernel grants this process the
//! tiles, every product on bf16 pairs runs on them instead ([`super::amx`]:
//! 16 token rows by two panels a tile pair, 8,192 multiply-adds an
//! instruction). The tile unit adds a tile's pairs in its own order, so its
//! sums can differ from the chains' in their last bits; since it then serves
//! every product on pairs, whatever its rows, a row's result still never
//! depends on what shares its product. [`PairKernel`] names the three.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// Output columns per panel: two 8-lane registers of f32.
pub(crate) const NR: usize = 16;

/// Token rows per microkernel call with the 16 AVX registers: 6 rows × 2
/// registers of accumulators, plus 2 weight registers and a broadcast.
pub(crate) const MR: usize = 6;

/// Token rows per call where AVX-512VL gives 32 of them: 12 rows × 2
/// accumulators + 3. Fewer passes over each panel per step, and fewer loads
/// per multiply-add.
pub(crate) const MR_WIDE: usize = 12;

/// Panels side by side in a tile of `rows` token rows: a tile of one or
/// two rows holds too few chains of multiply-adds to cover their latency,
/// so it takes several panels at once (each output still summed over `k` in
/// the same order, whatever the panels beside it).
const fn tile_panels(rows: usize) -> usize {
    match rows {
        1 => 4,
        2 => 2,
        _ => 1,
    }
}

/// Token rows per pass over the weights: large pre-fill chunks are cut into
/// blocks whose rows stay in the core's L2 cache while the panels stream by.
const MC: usize = 96;

/// Bytes of a pre-fill block's token rows on float panels: fewer rows than
/// [`MC`] where the inputs are long (the rows of a 2,816-input projection in
/// 96 rows are 1.1 MB, twice a core's L2 on some machines), so that they
/// stay in L2 while each panel is read again by every tile.
const BLOCK_BYTES: usize = 384 << 10;

/// Token rows per tile of the bf16 pair kernel: with [`DOT_PANELS`] panels,
/// 24 of the 32 AVX-512 registers hold sums.
pub(crate) const MR_DOT: usize = 6;

/// Panels per tile of the bf16 pair kernel.
pub(crate) const DOT_PANELS: usize = 4;

/// How far ahead of the current panel row the kernel asks for the weights, in
/// bytes. Panels are read front to back, and the hardware prefetchers stop at
/// page boundaries; the explicit prefetch runs on across them.
const PREFETCH_BYTES: usize = 1024;

/// How far ahead of the current step the rows kernels ask for each row's
/// weights into L2, beyond the line they ask for into L1 [`PREFETCH_BYTES`]
/// ahead: a thread streaming many rows' adapters from memory (every row its
/// own weights, each a short stream) keeps more lines in flight than L1's
/// misses allow. [`PackedMatrix::row_products`] asks for the first this many
/// bytes of each product's weights a batch of products ahead.
pub(crate) const STREAM_AHEAD_BYTES: usize = 2048;

/// Which kernel a product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// The best this CPU has.
    Auto,
    /// AVX2, FMA and F16C: 16 registers, tiles of [`MR`] rows.
    Avx2,
    /// The same with AVX-512VL's 32 registers: tiles of [`MR_WIDE`] rows.
    Avx512,
    /// Plain Rust, any CPU.
    Portable,
}

impl Kernel {
    /// The kernels this CPU can run, best first (always ending with `Portable`).
    pub fn available() -> Vec<Kernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c");
            if avx2
                && super::avx512_allowed()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512vl")
            {
                kernels.push(Kernel::Avx512);
            }
            if avx2 {
                kernels.push(Kernel::Avx2);
            }
        }
        kernels.push(Kernel::Portable);
        kernels
    }

    /// The best kernel this CPU runs (found once).
    pub fn best() -> Kernel {
        static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Kernel::available()[0])
    }

    /// `Auto` made concrete; a kernel this CPU lacks falls back to the best it has.
    fn resolve(self) -> Kernel {
        match self {
            Kernel::Auto => Kernel::best(),
            Kernel::Portable => Kernel::Portable,
            wanted if Kernel::available().contains(&wanted) => wanted,
            _ => Kernel::best(),
        }
    }

    /// Token rows per tile.
    fn rows(self) -> usize {
        match self {
            Kernel::Avx512 => MR_WIDE,
            _ => MR,
        }
    }
}

/// The precision panels are stored in: the checkpoint's own.
pub use lorry_protocol::lora::Precision;

/// The precision a tensor of `dtype` is packed in: its own where it is one
/// of the three, f32 otherwise.
pub fn precision_of(dtype: DType) -> Precision {
    match dtype {
        DType::F16 => Precision::F16,
        DType::BF16 => Precision::Bf16,
        _ => Precision::F32,
    }
}

/// f32 multiply-adds (counted as 2 operations) per second that the cores do
/// on registers alone, every thread of the pool busy: the compute ceiling
/// that products are measured against. 0 where the SIMD kernel is missing.
pub fn peak_flops() -> f64 {
    #[cfg(target_arch = "x86_64")]
    if Kernel::best() != Kernel::Portable {
        const ITERATIONS: usize = 50_000_000;
        let threads = rayon::current_num_threads();
        let mut best = f64::MAX;
        for _ in 0..3 {
            let start = std::time::Instant::now();
            (0..threads).into_par_iter().for_each(|_| {
                // SAFETY: the features were found on this CPU.
                std::hint::black_box(unsafe { x86::fma_chains(ITERATIONS) });
            });
            best = best.min(start.elapsed().as_secs_f64());
        }
        return (2 * x86::FMA_CHAINS * 8 * ITERATIONS * threads) as f64 / best;
    }
    0.0
}

/// A weight matrix of `n` outputs by `k` inputs (a checkpoint's `(out, in)`
/// projection), packed for [`PackedMatrix::matmul`]. Cloning shares the panels.
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    n: usize,
    k: usize,
    panels: Arc<Panels>,
}

#[derive(Debug)]
enum Panels {
    F32(Aligned<f32>),
    F16(Aligned<f16>),
    Bf16(Aligned<bf16>),
    /// bf16 pairs (the even input's weight in the low half), panels
    /// `[k/2][NR]`: for the bf16 dot-product kernel.
    Pairs(Aligned<u32>),
}

impl Element for u32 {
    fn widen(self) -> f32 {
        unreachable!("bf16 pairs are multiplied as pairs")
    }
}

/// Whether this CPU multiplies bf16 pairs (AVX-512 BF16's `vdpbf16ps`, with
/// AVX-512F/VL, AVX2, FMA and F16C): where it does not,
/// [`PackedMatrix::from_tensor_dot`] packs half precision as it is.
pub fn bf16_dot_available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            Kernel::best() == Kernel::Avx512 && std::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Which kernel a product on bf16 pairs runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairKernel {
    /// AMX tiles (`tdpbf16ps` on 16 × 16 tiles), where the CPU has AMX-BF16
    /// and lets this process use it.
    Amx,
    /// AVX-512 BF16's `vdpbf16ps` on registers.
    Dot,
    /// Plain Rust: [`dot_pair`] chains.
    Portable,
}

impl PairKernel {
    /// The kernels on bf16 pairs this CPU runs, best first (always ending
    /// with `Portable`).
    pub fn available() -> Vec<PairKernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if bf16_dot_available() {
            if super::amx::available() {
                kernels.push(PairKernel::Amx);
            }
            kernels.push(PairKernel::Dot);
        }
        kernels.push(PairKernel::Portable);
        kernels
    }

    /// The best this CPU runs (found once): what every product on pairs
    /// runs on, whatever its number of rows, so that a row's sums never
    /// depend on what shares its product.
    pub fn best() -> PairKernel {
        static BEST: std::sync::OnceLock<PairKernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| PairKernel::available()[0])
    }

    /// The pair kernel a product asked to run on `kernel` takes.
    fn of(kernel: Kernel) -> PairKernel {
        if kernel == Kernel::Portable {
            PairKernel::Portable
        } else {
            PairKernel::best()
        }
    }
}

/// `acc + x·w` for one pair of bf16 inputs and weights (the even one in the
/// low half of each `u32`): the odd products added first, then the even,
/// each sum rounded to f32 (the products of two bf16 values are exact), as
/// Intel describes `vdpbf16ps`.
pub(crate) fn dot_pair(acc: f32, x: u32, w: u32) -> f32 {
    let half = |v: u32| f32::from_bits(v << 16);
    let odd = acc + half(x >> 16) * half(w >> 16);
    odd + half(x & 0xffff) * half(w & 0xffff)
}

/// Two consecutive bf16 values (the second absent past an odd length's end)
/// as one pair: `(second << 16) | first`.
fn pair_of(two: &[bf16]) -> u32 {
    two[0].to_bits() as u32 | (two.get(1).map_or(0, |v| v.to_bits() as u32) << 16)
}

/// `x` rounded to bf16 pairs ([`pair_of`]), an odd length's last pair
/// holding a zero.
fn bf16_pairs(x: &[f32], pairs: &mut [u32]) {
    let whole = x.len() / 2;
    for (pair, two) in pairs.iter_mut().zip(x.chunks_exact(2)) {
        *pair = to_bf16(two[0]) | (to_bf16(two[1]) << 16);
    }
    if let (Some(&last), Some(pair)) = (x.get(2 * whole), pairs.get_mut(whole)) {
        *pair = to_bf16(last);
    }
}

/// `v` rounded to bf16 (to nearest, ties to even; a NaN stays a quiet NaN),
/// the bits of `half::bf16::from_f32`, without branches so that the
/// compiler runs it on whole vectors of a row.
#[inline(always)]
fn to_bf16(v: f32) -> u32 {
    let bits = v.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let nan = (bits >> 16) | 0x40;
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }
}

/// A weight element the kernels read.
trait Element: Copy + Default + Send + Sync {
    fn widen(self) -> f32;
}

impl Element for f32 {
    fn widen(self) -> f32 {
        self
    }
}

impl Element for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Element for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// A zeroed buffer whose first element sits on a cache-line boundary, so
/// that each panel row is read in whole lines.
#[derive(Debug)]
struct Aligned<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Element> Aligned<T> {
    fn zeroed(len: usize) -> Self {
        let slack = 64 / std::mem::size_of::<T>();
        let buf = vec![T::default(); len + slack];
        let start = buf.as_ptr().align_offset(64).min(slack);
        Aligned { buf, start, len }
    }

    fn as_slice(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// Lay `w` (`n × k`, row-major) out as panels of `NR` rows, each stored
/// `[k][NR]`, the last one padded with zeros.
fn pack<T: Element>(w: &[T], n: usize, k: usize) -> Aligned<T> {
    assert_eq!(w.len(), n * k, "weight shape");
    let mut out = Aligned::zeroed(n.div_ceil(NR) * k * NR);
    if k == 0 {
        return out;
    }
    out.as_mut_slice()
        .par_chunks_mut(k * NR)
        .enumerate()
        .for_each(|(p, panel)| {
            for j in 0..NR.min(n - p * NR) {
                let row = &w[(p * NR + j) * k..][..k];
                for (kk, &v) in row.iter().enumerate() {
                    panel[kk * NR + j] = v;
                }
            }
        });
    out
}

/// Lay `w` (`n × k`, row-major) out as panels of `NR` rows of bf16 pairs,
/// each stored `[k/2][NR]` (an odd `k`'s last pair holding a zero).
fn pack_pairs(w: &[bf16], n: usize, k: usize) -> Aligned<u32> {
    assert_eq!(w.len(), n * k, "weight shape");
    let pairs: Vec<u32> = w.chunks(k.max(1)).flat_map(|row| row.chunks(2).map(pair_of)).collect();
    pack(&pairs, n, k.div_ceil(2))
}

impl PackedMatrix {
    /// Pack an f32 `n × k` row-major matrix.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Self {
        Self::new(n, k, Panels::F32(pack(w, n, k)))
    }

    /// Pack an f16 `n × k` row-major matrix.
    pub(crate) fn from_f16(w: &[f16], n: usize, k: usize) -> Self {
        Self::new(n, k, Panels::F16(pack(w, n, k)))
    }

    /// Pack a bf16 `n × k` row-major matrix.
    pub(crate) fn from_bf16(w: &[bf16], n: usize, k: usize) -> Self {
        Self::new(n, k, Panels::Bf16(pack(w, n, k)))
    }

    /// Pack an f32 `n × k` row-major matrix in `precision`: each value
    /// rounded to it (to nearest, ties to even).
    pub(crate) fn from_f32_in(precision: Precision, w: &[f32], n: usize, k: usize) -> Self {
        match precision {
            Precision::F32 => Self::from_f32(w, n, k),
            Precision::F16 => Self::from_f16(&w.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(), n, k),
            Precision::Bf16 => Self::from_bf16(&w.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(), n, k),
        }
    }

    /// Pack a 2-D `(n, k)` tensor in its own precision (f32, f16 or bf16;
    /// any other dtype is converted to f32).
    pub fn from_tensor(w: &Tensor) -> candle_core::Result<Self> {
        let (n, k) = w.dims2()?;
        Ok(match precision_of(w.dtype()) {
            Precision::F16 => Self::from_f16(&w.flatten_all()?.to_vec1::<f16>()?, n, k),
            Precision::Bf16 => Self::from_bf16(&w.flatten_all()?.to_vec1::<bf16>()?, n, k),
            Precision::F32 => Self::from_f32(&w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, n, k),
        })
    }

    /// Pack a 2-D half-precision `(n, k)` tensor for the bf16 dot products
    /// where the CPU has them ([`bf16_dot_available`]): bf16 weights as they
    /// are, f16 ones rounded to bf16 (to nearest, ties to even). Elsewhere, and
    /// for other dtypes, as [`PackedMatrix::from_tensor`].
    pub fn from_tensor_dot(w: &Tensor) -> candle_core::Result<Self> {
        let (n, k) = w.dims2()?;
        if !bf16_dot_available() || !matches!(w.dtype(), DType::F16 | DType::BF16) {
            return Self::from_tensor(w);
        }
        Ok(Self::from_bf16_pairs(
            &w.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>()?,
            n,
            k,
        ))
    }

    /// Pack a bf16 `n × k` row-major matrix as bf16 pairs, for the bf16 dot
    /// products (the portable kernel on a CPU without them).
    pub(crate) fn from_bf16_pairs(w: &[bf16], n: usize, k: usize) -> Self {
        Self::new(n, k, Panels::Pairs(pack_pairs(w, n, k)))
    }

    fn new(n: usize, k: usize, panels: Panels) -> Self {
        PackedMatrix {
            n,
            k,
            panels: Arc::new(panels),
        }
    }

    /// Outputs (the checkpoint's rows).
    pub fn outputs(&self) -> usize {
        self.n
    }

    /// Inputs (the checkpoint's columns).
    pub fn inputs(&self) -> usize {
        self.k
    }

    /// The precision the panels are stored in.
    pub fn precision(&self) -> Precision {
        match &*self.panels {
            Panels::F32(_) => Precision::F32,
            Panels::F16(_) => Precision::F16,
            Panels::Bf16(_) | Panels::Pairs(_) => Precision::Bf16,
        }
    }

    /// Whether the panels are bf16 pairs, multiplied with bf16 dot products.
    pub fn bf16_dot(&self) -> bool {
        matches!(&*self.panels, Panels::Pairs(_))
    }

    /// Bytes the panels occupy (what one product reads).
    pub fn bytes(&self) -> usize {
        let k = if self.bf16_dot() {
            2 * self.k.div_ceil(2)
        } else {
            self.k
        };
        self.n.div_ceil(NR) * NR * k * self.precision().bytes()
    }

    /// `x · Wᵀ` for `x` of `m × k` row-major: `m × n` row-major.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.product_new(x, m, true, Fused::NONE)
    }

    /// [`PackedMatrix::matmul`] on the calling thread alone: for the many
    /// small products (an adapter's few rows) that callers run side by side.
    pub(crate) fn matmul_here(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.product_new(x, m, false, Fused::NONE)
    }

    /// The product into a new vector: on float panels its outputs are not
    /// zeroed first (the tiles write every one), on bf16 pairs they are.
    fn product_new(&self, x: &[f32], m: usize, parallel: bool, expand: Fused<'_, '_>) -> Vec<f32> {
        assert_eq!(x.len(), m * self.k, "input shape");
        let len = m * self.n;
        let kernel = Kernel::Auto.resolve();
        let mut out = Vec::with_capacity(len);
        if len == 0 {
            return out;
        }
        let spare = out.spare_capacity_mut().as_mut_ptr().cast::<f32>();
        // SAFETY (each): the spare capacity has room for the `m × n` outputs,
        // which `run` writes every one of before it returns.
        match &*self.panels {
            Panels::F32(p) => unsafe { self.run(p.as_slice(), x, m, spare, kernel, parallel, expand) },
            Panels::F16(p) => unsafe { self.run(p.as_slice(), x, m, spare, kernel, parallel, expand) },
            Panels::Bf16(p) => unsafe { self.run(p.as_slice(), x, m, spare, kernel, parallel, expand) },
            Panels::Pairs(p) => {
                out.resize(len, 0.0);
                self.run_pairs(p.as_slice(), x, m, &mut out, PairKernel::of(kernel), parallel, expand);
                return out;
            }
        }
        // SAFETY: written above.
        unsafe { out.set_len(len) };
        out
    }

    /// `out += scale · x·Wᵀ` for one row `x`, on this thread, panels side by
    /// side: the products of an adapter's single decoding row, which are too
    /// small to be worth tiles. Each output is the same sum as
    /// [`PackedMatrix::matmul`] gives, bit for bit. `false` (and nothing done)
    /// on a CPU without AVX2, FMA and F16C.
    pub(crate) fn row_add(&self, x: &[f32], out: &mut [f32], scale: f32) -> bool {
        assert_eq!(x.len(), self.k, "input shape");
        assert_eq!(out.len(), self.n, "output shape");
        #[cfg(target_arch = "x86_64")]
        if Kernel::best() != Kernel::Portable {
            // SAFETY: `best` found AVX2, FMA and F16C on this CPU.
            unsafe {
                match &*self.panels {
                    Panels::F32(p) => x86::row_f32(p.as_slice(), self.n, self.k, x, out, scale),
                    Panels::F16(p) => x86::row_f16(p.as_slice(), self.n, self.k, x, out, scale),
                    Panels::Bf16(p) => x86::row_bf16(p.as_slice(), self.n, self.k, x, out, scale),
                    Panels::Pairs(_) => unreachable!("bf16 pairs hold a model's own weights, not an adapter's"),
                }
            }
            return true;
        }
        let _ = scale;
        false
    }

    /// Whether [`PackedMatrix::row_add`] and [`PackedMatrix::matmul_expand`]
    /// run on this CPU (AVX2, FMA and F16C).
    pub fn rows_direct() -> bool {
        Kernel::best() != Kernel::Portable
    }

    /// [`PackedMatrix::matmul`] with a LoRA expand fused into it: for each
    /// row `r` and each of `expand[r]`, `out[r][cols] += scale · shrunk·Bᵀ`
    /// on the columns from `first_column`, added to each panel's outputs by
    /// the task that has just computed them, so the adapters' `B` weights
    /// are read while the cores multiply the base's (the tiles of one panel
    /// ask, a line every few steps along `k`, for the next panel's slices). Each output gets the same sums as the product
    /// followed by [`PackedMatrix::row_add`], bit for bit. `expand` is empty
    /// or holds one list per row; a part must start on a panel boundary
    /// ([`NR`]) and lie inside the outputs.
    ///
    /// # Panics
    /// On a misplaced part, or on a CPU without [`PackedMatrix::rows_direct`].
    pub(crate) fn matmul_expand(&self, x: &[f32], m: usize, expand: &[&[Expand<'_>]]) -> Vec<f32> {
        let expand = Fused::checked(expand, m, self.n);
        self.product_new(x, m, true, expand)
    }

    /// The panels' bytes, as a product reads them.
    pub(crate) fn raw(&self) -> &[u8] {
        fn bytes<T>(values: &[T]) -> &[u8] {
            // SAFETY: plain numbers, read as bytes within their own allocation.
            unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) }
        }
        match &*self.panels {
            Panels::F32(p) => bytes(p.as_slice()),
            Panels::F16(p) => bytes(p.as_slice()),
            Panels::Bf16(p) => bytes(p.as_slice()),
            Panels::Pairs(p) => bytes(p.as_slice()),
        }
    }

    /// The first byte of the panels.
    fn start(&self) -> *const u8 {
        self.raw().as_ptr()
    }

    /// [`PackedMatrix::matmul`] into `out` (`m × n`), on the kernel chosen.
    pub fn matmul_into(&self, x: &[f32], m: usize, out: &mut [f32], kernel: Kernel) {
        self.product(x, m, out, kernel, true);
    }

    /// [`PackedMatrix::matmul_into`] on bf16 pairs, on the pair kernel chosen
    /// (one this CPU lacks falls back to the best it has): for tests and
    /// benchmarks that hold the kernels side by side.
    ///
    /// # Panics
    /// When the panels are not bf16 pairs, or on misshapen `x` or `out`.
    pub fn matmul_pairs_into(&self, x: &[f32], m: usize, out: &mut [f32], kernel: PairKernel) {
        let Panels::Pairs(p) = &*self.panels else {
            panic!("the panels are not bf16 pairs")
        };
        assert_eq!(x.len(), m * self.k, "input shape");
        assert_eq!(out.len(), m * self.n, "output shape");
        let kernel = if PairKernel::available().contains(&kernel) {
            kernel
        } else {
            PairKernel::best()
        };
        if !out.is_empty() {
            self.run_pairs(p.as_slice(), x, m, out, kernel, true, Fused::NONE);
        }
    }

    fn product(&self, x: &[f32], m: usize, out: &mut [f32], kernel: Kernel, parallel: bool) {
        assert_eq!(x.len(), m * self.k, "input shape");
        assert_eq!(out.len(), m * self.n, "output shape");
        if out.is_empty() {
            return;
        }
        let kernel = kernel.resolve();
        match &*self.panels {
            // SAFETY (each): `out` is `m × n` (asserted above), and ours alone.
            Panels::F32(p) => unsafe { self.run(p.as_slice(), x, m, out.as_mut_ptr(), kernel, parallel, Fused::NONE) },
            Panels::F16(p) => unsafe { self.run(p.as_slice(), x, m, out.as_mut_ptr(), kernel, parallel, Fused::NONE) },
            Panels::Bf16(p) => unsafe { self.run(p.as_slice(), x, m, out.as_mut_ptr(), kernel, parallel, Fused::NONE) },
            Panels::Pairs(p) => self.run_pairs(p.as_slice(), x, m, out, PairKernel::of(kernel), parallel, Fused::NONE),
        }
    }

    /// [`PackedMatrix::run`] on bf16 pairs: tiles of up to [`MR_DOT`] rows
    /// times up to [`DOT_PANELS`] panels, the rows rounded to bf16 pairs.
    #[allow(clippy::too_many_arguments)]
    fn run_pairs(
        &self,
        panels: &[u32],
        x: &[f32],
        m: usize,
        out: &mut [f32],
        kernel: PairKernel,
        parallel: bool,
        expand: Fused<'_, '_>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if kernel == PairKernel::Amx {
            return self.run_pairs_amx(panels, x, m, out, parallel, expand);
        }
        let (n, k, k2) = (self.n, self.k, self.k.div_ceil(2));
        let count = n.div_ceil(NR);
        let groups = count.div_ceil(DOT_PANELS);
        let per_task = groups.div_ceil(4 * rayon::current_num_threads()).max(1);
        let tasks = groups.div_ceil(per_task);
        let target = OutPtr(out.as_mut_ptr());
        let simd = kernel == PairKernel::Dot;
        let mut pairs = Vec::new();
        for first_row in (0..m).step_by(MC) {
            let block_end = (first_row + MC).min(m);
            let (len, tiles) = (block_end - first_row, (block_end - first_row).div_ceil(MR_DOT));
            let bounds: Vec<usize> = (0..=tiles).map(|t| first_row + t * len / tiles).collect();
            // Each tile's rows as bf16 pairs, interleaved `[k/2][rows]`.
            pairs.clear();
            pairs.resize(len * k2, 0u32);
            let mut row_pairs = vec![0u32; k2];
            for tile in bounds.windows(2) {
                let (row, rows) = (tile[0], tile[1] - tile[0]);
                let to = &mut pairs[(row - first_row) * k2..(row - first_row + rows) * k2];
                for r in 0..rows {
                    bf16_pairs(&x[(row + r) * k..(row + r + 1) * k], &mut row_pairs);
                    for (i, &pair) in row_pairs.iter().enumerate() {
                        to[i * rows + r] = pair;
                    }
                }
            }
            let pairs = &pairs;
            let task = |t: usize| {
                for g in t * per_task..((t + 1) * per_task).min(groups) {
                    let first_panel = g * DOT_PANELS;
                    let panel_count = DOT_PANELS.min(count - first_panel);
                    for bound in bounds.windows(2) {
                        let (row, rows) = (bound[0], bound[1] - bound[0]);
                        let job = PairJob {
                            rows,
                            panel_count,
                            k2,
                            x: &pairs[(row - first_row) * k2..(row - first_row + rows) * k2],
                            panels: &panels[first_panel * k2 * NR..(first_panel + panel_count) * k2 * NR],
                            // SAFETY: inside `out` (`m × n`): row `row`, column `first_panel·NR`.
                            out: unsafe { target.get().add(row * n + first_panel * NR) },
                            ldo: n,
                            cols: (n - first_panel * NR).min(panel_count * NR),
                        };
                        // SAFETY: this task alone writes these panels' columns of
                        // these rows, and nothing reads `out` until every task is done.
                        unsafe {
                            #[cfg(target_arch = "x86_64")]
                            if simd {
                                x86::pairs_tile(&job);
                                continue;
                            }
                            pairs_tile_portable(&job);
                        }
                    }
                    for p in first_panel..first_panel + panel_count {
                        // SAFETY: as for the tiles: this task's own columns, all written.
                        unsafe { expand.add(first_row..block_end, p, target.get(), n) };
                    }
                }
            };
            if parallel {
                (0..tasks).into_par_iter().for_each(task);
            } else {
                (0..tasks).for_each(task);
            }
        }
    }

    /// [`PackedMatrix::run_pairs`] on AMX tiles: each task takes pairs of
    /// panels and runs every token row past them, two tiles of 16 rows at
    /// a time (fewer rows than 16: one tile of that many).
    #[cfg(target_arch = "x86_64")]
    fn run_pairs_amx(
        &self,
        panels: &[u32],
        x: &[f32],
        m: usize,
        out: &mut [f32],
        parallel: bool,
        expand: Fused<'_, '_>,
    ) {
        use super::amx::{self, Sums, Tiles};
        let (n, k, k2) = (self.n, self.k, self.k.div_ceil(2));
        // Each token row's pairs, padded with zero pairs to whole tiles.
        let lda = k2.next_multiple_of(amx::PAIRS);
        let count = n.div_ceil(NR);
        let groups = count.div_ceil(2);
        let per_task = groups.div_ceil(4 * rayon::current_num_threads()).max(1);
        let tasks = groups.div_ceil(per_task);
        let target = OutPtr(out.as_mut_ptr());
        let height = m.min(amx::ROWS);
        // Rows per pass over the weights: as many pairs of tiles as keep the
        // rows' pairs within about 1 MiB (the core's L2), at least one pair.
        let pass = ((1 << 20) / (lda * 4)).max(2 * amx::ROWS) / (2 * amx::ROWS) * (2 * amx::ROWS);
        let mut pairs: Vec<u32> = Vec::new();
        for first_row in (0..m).step_by(pass) {
            let block_end = (first_row + pass).min(m);
            let len = block_end - first_row;
            let padded = len.next_multiple_of(height);
            pairs.clear();
            pairs.resize(padded * lda, 0);
            let rows_in = &x[first_row * k..block_end * k];
            let round = |(to, from): (&mut [u32], &[f32])| bf16_pairs(from, &mut to[..k2]);
            if parallel && len >= amx::ROWS {
                pairs.par_chunks_mut(lda).zip(rows_in.par_chunks(k)).for_each(round);
            } else {
                pairs.chunks_mut(lda).zip(rows_in.chunks(k)).for_each(round);
            }
            let pairs = &pairs;
            let tiles = padded / height;
            let task = |t: usize| {
                // SAFETY: `PairKernel::Amx` is only available where the tiles are.
                let unit = unsafe { Tiles::new(height) };
                let mut sums = [
                    [Sums([0.0; 256]), Sums([0.0; 256])],
                    [Sums([0.0; 256]), Sums([0.0; 256])],
                ];
                for g in t * per_task..((t + 1) * per_task).min(groups) {
                    let first_panel = 2 * g;
                    let panel_count = 2.min(count - first_panel);
                    let b = [
                        panels[first_panel * k2 * NR..].as_ptr(),
                        panels[(first_panel + panel_count - 1) * k2 * NR..].as_ptr(),
                    ];
                    for tile in (0..tiles).step_by(2) {
                        let blocks = 2.min(tiles - tile);
                        // SAFETY: `pairs` holds `tiles` tiles of `height` rows of
                        // `lda` pairs, zero past `k2`; each panel `k2` rows of `NR`.
                        unsafe {
                            unit.multiply(
                                pairs[tile * height * lda..].as_ptr(),
                                lda,
                                blocks,
                                b,
                                panel_count,
                                k2,
                                &mut sums,
                            )
                        };
                        for (block, sums) in sums.iter().enumerate().take(blocks) {
                            let row = first_row + (tile + block) * height;
                            let rows = height.min(block_end.saturating_sub(row));
                            for (p, sums) in sums.iter().enumerate().take(panel_count) {
                                let column = (first_panel + p) * NR;
                                let cols = NR.min(n - column);
                                for r in 0..rows {
                                    // SAFETY: inside `out` (`m × n`); this task alone
                                    // writes these panels' columns, and nothing reads
                                    // `out` until every task is done.
                                    unsafe {
                                        std::ptr::copy_nonoverlapping(
                                            sums.0[r * NR..].as_ptr(),
                                            target.get().add((row + r) * n + column),
                                            cols,
                                        )
                                    };
                                }
                            }
                        }
                    }
                    for p in first_panel..first_panel + panel_count {
                        // SAFETY: as for the tiles: this task's own columns, all written.
                        unsafe { expand.add(first_row..block_end, p, target.get(), n) };
                    }
                }
                drop(unit);
            };
            if parallel {
                (0..tasks).into_par_iter().for_each(task);
            } else {
                (0..tasks).for_each(task);
            }
        }
    }

    /// Every one of the `m × n` outputs written at `out`, the tiles' rows
    /// multiplied by `panels`.
    ///
    /// # Safety
    /// `out` must have room for `m × n` floats, which nothing else touches
    /// meanwhile; they need not be initialized (the fused expand adds to
    /// each panel's outputs only after its tiles have written them).
    #[allow(clippy::too_many_arguments)]
    unsafe fn run<T: Element + Tile>(
        &self,
        panels: &[T],
        x: &[f32],
        m: usize,
        out: *mut f32,
        kernel: Kernel,
        parallel: bool,
        expand: Fused<'_, '_>,
    ) {
        let (n, k) = (self.n, self.k);
        let count = n.div_ceil(NR);
        // A few tasks per thread, each a contiguous run of panels, so that the
        // threads stream disjoint stretches of the weights.
        let per_task = count.div_ceil(4 * rayon::current_num_threads()).max(1);
        let tasks = count.div_ceil(per_task);
        let target = OutPtr(out);
        // A decoding step's rows in one block (a second block would read the
        // weights again); pre-fill's in blocks of at most `BLOCK_BYTES`,
        // whole tiles of them.
        let height = kernel.rows();
        let mc = if m <= MC {
            MC
        } else {
            (BLOCK_BYTES / (4 * k).max(1)).clamp(height, MC) / height * height
        };
        let blocks: Vec<RowBlock> = (0..m)
            .step_by(mc)
            .map(|first_row| {
                let end = (first_row + mc).min(m);
                // Tiles of equal height (32 rows: 5 or 6 each, never 6 + 2): a short
                // tile leaves the FMA units waiting on too few accumulators.
                let tiles = (end - first_row).div_ceil(height);
                RowBlock {
                    bounds: (0..=tiles).map(|t| first_row + t * (end - first_row) / tiles).collect(),
                }
            })
            .collect();
        // Each tile's rows interleaved `[k][rows]`, all blocks': the kernel
        // then reads one stream of inputs, whatever the tile's height.
        // Every value is written before any tile reads it.
        let mut packed_rows = Vec::with_capacity(m * k);
        {
            let mut rest = &mut packed_rows.spare_capacity_mut()[..m * k];
            let mut parts = Vec::new();
            for tile in blocks.iter().flat_map(|b| b.bounds.windows(2)) {
                let (row, rows) = (tile[0], tile[1] - tile[0]);
                let (part, tail) = rest.split_at_mut(rows * k);
                parts.push((row, rows, part));
                rest = tail;
            }
            let interleave = |(row, rows, to): (usize, usize, &mut [std::mem::MaybeUninit<f32>])| {
                for r in 0..rows {
                    for (kk, &v) in x[(row + r) * k..(row + r + 1) * k].iter().enumerate() {
                        to[kk * rows + r].write(v);
                    }
                }
            };
            // A pre-fill's rows take both cores; a decoding step's are few.
            if parallel && blocks.len() > 1 {
                parts.into_par_iter().for_each(interleave);
            } else {
                parts.into_iter().for_each(interleave);
            }
        }
        // SAFETY: the tiles' parts cover the first `m·k` values (the blocks'
        // tiles are every row once, in order), and each was written above.
        unsafe { packed_rows.set_len(m * k) };
        let packed_rows = &packed_rows;
        // A block of one or two rows is one tile that takes several panels at
        // once; taller tiles take one.
        let wide = match blocks.as_slice() {
            [one] if kernel != Kernel::Portable && one.bounds.len() == 2 => tile_panels(one.rows().len()),
            _ => 1,
        };
        // Each task takes its panels through every block in turn: one pass
        // over the pool for the whole product, however many blocks.
        let task = |t: usize| {
            let end = ((t + 1) * per_task).min(count);
            // The lines of the adapters' `B` the next group's expand reads.
            let mut expand_lines = Vec::new();
            for block in &blocks {
                let (rows, bounds) = (block.rows(), &block.bounds);
                let (first_row, block_end) = (rows.start, rows.end);
                let tiles = bounds.len() - 1;
                let mut p = t * per_task;
                while p < end {
                    let group = wide.min(end - p);
                    let next = (p + group)..(p + group + wide).min(end);
                    expand_lines.clear();
                    for q in next.clone() {
                        expand.lines(first_row..block_end, q, &mut expand_lines);
                    }
                    let panel = &panels[p * k * NR..(p + group) * k * NR];
                    let cols = (group * NR).min(n - p * NR);
                    // The task's next group, fetched a slice per tile while
                    // this one is worked on, so no tile waits for memory.
                    let ahead_from = if next.is_empty() {
                        panel.as_ptr()
                    } else {
                        panels[next.start * k * NR..].as_ptr()
                    };
                    let next_lines = (next.len() * k * NR * std::mem::size_of::<T>()).div_ceil(64);
                    for (tile, bound) in bounds.windows(2).enumerate() {
                        let (row, rows) = (bound[0], bound[1] - bound[0]);
                        let x = &packed_rows[row * k..(row + rows) * k];
                        let first_line = tile * next_lines / tiles;
                        let ahead = Ahead {
                            from: (ahead_from as *const u8).wrapping_add(64 * first_line),
                            lines: (tile + 1) * next_lines / tiles - first_line,
                        };
                        let expand_lines =
                            &expand_lines[tile * expand_lines.len() / tiles..(tile + 1) * expand_lines.len() / tiles];
                        // SAFETY: this task alone writes columns `p·NR..p·NR + cols`
                        // (its own panels) of rows `row..row + rows`, all inside `out`
                        // (`m × n`), and nothing reads `out` until every task is done.
                        unsafe {
                            let job = TileJob {
                                rows,
                                panel_count: group,
                                x,
                                panel,
                                out: target.get().add(row * n + p * NR),
                                ldo: n,
                                cols,
                                ahead,
                                expand_lines,
                            };
                            if kernel == Kernel::Portable {
                                tile_portable(&job);
                            } else {
                                T::tile_simd(kernel, &job);
                            }
                        }
                    }
                    for q in p..p + group {
                        // SAFETY: as for the tiles: this task's own columns, all written.
                        unsafe { expand.add(first_row..block_end, q, target.get(), n) };
                    }
                    p += group;
                }
            }
        };
        if parallel {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
    }
}

/// Rows of a product multiplied by each panel while they stay in the
/// core's cache, in tiles from each bound to the next.
struct RowBlock {
    bounds: Vec<usize>,
}

impl RowBlock {
    /// The block's rows: from its first bound to its last.
    fn rows(&self) -> std::ops::Range<usize> {
        self.bounds[0]..self.bounds[self.bounds.len() - 1]
    }
}

/// One row's part of a LoRA expand fused into a product
/// ([`PackedMatrix::matmul_expand`]): `out[first_column..][..b.outputs()] +=
/// scale · shrunk·Bᵀ`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expand<'a> {
    /// The adapter's `lora_B`, `(outputs, rank)`.
    pub b: &'a PackedMatrix,
    /// The row's shrunk input, `rank` values.
    pub shrunk: &'a [f32],
    /// The first output column the part adds to: a multiple of [`NR`].
    pub first_column: usize,
    /// `alpha / r` (or `/ √r`).
    pub scale: f32,
}

/// The expand lists of a product's rows (none at all for a plain product):
/// what [`PackedMatrix::matmul_expand`] and
/// [`crate::ops::quant::QuantMatrix::matmul_expand`] add panel by panel.
#[derive(Clone, Copy)]
pub(crate) struct Fused<'e, 'a> {
    expand: &'e [&'e [Expand<'a>]],
}

impl<'e, 'a> Fused<'e, 'a> {
    pub(crate) const NONE: Fused<'static, 'static> = Fused { expand: &[] };

    /// `expand` (empty, or one list per row of a product with `outputs`
    /// columns) checked: each part starts on a panel boundary ([`NR`]) and
    /// lies inside the outputs, and the CPU has
    /// [`PackedMatrix::rows_direct`].
    ///
    /// # Panics
    /// Where it does not.
    pub(crate) fn checked(expand: &'e [&'e [Expand<'a>]], rows: usize, outputs: usize) -> Self {
        assert!(expand.is_empty() || expand.len() == rows, "one expand list per row");
        assert!(
            expand.is_empty() || PackedMatrix::rows_direct(),
            "the fused expand needs AVX2, FMA and F16C"
        );
        for part in expand.iter().flat_map(|parts| parts.iter()) {
            assert!(
                part.first_column % NR == 0 && part.first_column + part.b.n <= outputs && part.shrunk.len() == part.b.k,
                "expand part out of place"
            );
        }
        Fused { expand }
    }

    /// Whether there is nothing to add.
    pub(crate) fn is_none(self) -> bool {
        self.expand.is_empty()
    }

    /// The part of `parts` whose columns panel `p` of the product holds, and
    /// the panel of its `B` that holds them.
    fn part<'p>(parts: &'p [Expand<'_>], p: usize) -> Option<(&'p Expand<'p>, usize)> {
        parts.iter().find_map(|part| {
            let first = part.first_column / NR;
            (first..first + part.b.n.div_ceil(NR))
                .contains(&p)
                .then(|| (part, p - first))
        })
    }

    /// The first byte and the length of each `B` panel that panel `p`'s
    /// expand reads for `rows`, in row order; a panel that rows sharing an
    /// adapter read one after another is listed once.
    fn panels(self, rows: std::ops::Range<usize>, p: usize) -> impl Iterator<Item = (*const u8, usize)> + 'e {
        let mut last = std::ptr::null();
        self.expand
            .get(rows)
            .unwrap_or_default()
            .iter()
            .filter_map(move |parts| {
                let (part, q) = Self::part(parts, p)?;
                let bytes = part.b.k * NR * part.b.precision().bytes();
                let start = part.b.start().wrapping_add(q * bytes);
                (start != last).then(|| {
                    last = start;
                    (start, bytes)
                })
            })
    }

    /// The cache lines of every `B` panel that panel `p`'s expand reads for
    /// `rows`, onto `lines`: each panel's once, however many rows share it.
    pub(crate) fn lines(self, rows: std::ops::Range<usize>, p: usize, lines: &mut Vec<*const u8>) {
        for (start, bytes) in self.panels(rows, p) {
            lines.extend((0..bytes).step_by(64).map(|at| start.wrapping_add(at)));
        }
    }

    /// Ask for every line of the `B` panels that panel `p`'s expand reads
    /// for `rows`, into L2 (each panel's once): what a product's tiles do for
    /// the panel they compute next, so that its expand finds them there.
    pub(crate) fn prefetch(self, rows: std::ops::Range<usize>, p: usize) {
        for (start, bytes) in self.panels(rows, p) {
            super::prefetch_l2(start, bytes);
        }
    }

    /// Add the parts on panel `p` to rows `rows` of `out` (`· × ldo`):
    /// up to [`EXPAND_WIDE_ROWS`] rows at a time (four on AVX2) whose `B`
    /// share a precision and a rank, whole panels apart from a part's last,
    /// partial one, so that their chains of multiply-adds run side by side;
    /// on AVX-512, rows of one adapter load each step of their shared panel
    /// once.
    ///
    /// # Safety
    /// The caller alone writes panel `p`'s columns of those rows of `out`.
    pub(crate) unsafe fn add(self, rows: std::ops::Range<usize>, p: usize, out: *mut f32, ldo: usize) {
        let mut partial = PanelBatch::default();
        let mut whole = WholeBatch::default();
        for (r, parts) in rows.clone().zip(self.expand.get(rows).unwrap_or_default()) {
            if let Some((part, q)) = Self::part(parts, p) {
                // SAFETY: the caller's contract; `matmul_expand` checked that the
                // part lies inside the outputs.
                let out = unsafe { out.add(r * ldo + p * NR) };
                // SAFETY: as above; the shrunk input holds `rank` values.
                unsafe {
                    if part.b.n - q * NR >= NR {
                        whole.push(part.b, q, part.shrunk.as_ptr(), out, part.scale);
                    } else {
                        partial.push(part.b, q, part.shrunk.as_ptr(), out, part.scale);
                    }
                }
            }
        }
        // SAFETY: as above.
        unsafe {
            whole.run();
            partial.run();
        }
    }
}

/// Rows of a fused expand run side by side on AVX-512, one register of
/// [`NR`] outputs each.
pub(crate) const EXPAND_WIDE_ROWS: usize = 8;

/// Rows whose products run side by side, each on one panel of its own.
pub(crate) const EXPAND_ROWS: usize = 4;

/// A matrix, one of its panels, the input row and where the outputs go, and
/// the scale: one entry of a [`RowBatch`].
type PendingRow<'w> = (&'w PackedMatrix, usize, *const f32, *mut f32, f32);

/// Up to `N` single-row products on one panel each, of one precision and
/// one `k`, run together when full (or when the next differs): through the
/// rows kernel (any panel, each weight line asked for ahead), or, `WHOLE`,
/// through the expand kernel (whole panels of [`NR`] outputs, a rank's
/// worth of `k`, nothing asked for).
struct RowBatch<'w, const N: usize, const WHOLE: bool> {
    rows: [Option<PendingRow<'w>>; N],
    len: usize,
}

/// [`RowBatch`] on the rows kernel: shrinks and a part's partial last panel.
type PanelBatch<'w> = RowBatch<'w, EXPAND_WIDE_ROWS, false>;

/// [`RowBatch`] on the expand kernel: [`Fused::add`]'s whole panels.
type WholeBatch<'w> = RowBatch<'w, EXPAND_WIDE_ROWS, true>;

impl<const N: usize, const WHOLE: bool> Default for RowBatch<'_, N, WHOLE> {
    fn default() -> Self {
        RowBatch {
            rows: [None; N],
            len: 0,
        }
    }
}

impl<'w, const N: usize, const WHOLE: bool> RowBatch<'w, N, WHOLE> {
    /// `out[j] += scale · Σₖ x[k] · W[q·NR + j][k]` for the (up to `NR`;
    /// `WHOLE`: exactly `NR`) outputs of panel `q` of `w`.
    ///
    /// # Safety
    /// `x` must hold `w.k` values and `out` the panel's outputs, written by
    /// nothing else until [`RowBatch::run`]; the CPU must have
    /// [`PackedMatrix::rows_direct`].
    unsafe fn push(&mut self, w: &'w PackedMatrix, q: usize, x: *const f32, out: *mut f32, scale: f32) {
        let fits = match self.rows[0] {
            Some((first, ..)) => first.precision() == w.precision() && first.k == w.k,
            None => true,
        };
        if self.len == N || !fits {
            // SAFETY: the caller's contract.
            unsafe { self.run() };
        }
        self.rows[self.len] = Some((w, q, x, out, scale));
        self.len += 1;
    }

    /// Run what is pending.
    ///
    /// # Safety
    /// As [`RowBatch::push`].
    unsafe fn run(&mut self) {
        let batch = &self.rows[..self.len];
        self.len = 0;
        let Some(&Some((first, first_q, ..))) = batch.first() else {
            return;
        };
        let (k, wide) = (first.k, Kernel::best() == Kernel::Avx512);
        // Rows of one adapter go through one panel: its steps loaded once.
        let shared = batch
            .iter()
            .flatten()
            .all(|&(w, q, ..)| std::ptr::eq(w, first) && q == first_q);
        macro_rules! run {
            ($variant:ident, $rows:ident, $rows_wide:ident, $expand:ident) => {{
                let mut rows = [PanelRow::NONE; N];
                for (slot, &(w, q, x, out, scale)) in rows.iter_mut().zip(batch.iter().flatten()) {
                    let Panels::$variant(panels) = &*w.panels else {
                        unreachable!("one precision a batch")
                    };
                    *slot = PanelRow {
                        panel: panels.as_slice()[q * k * NR..(q + 1) * k * NR].as_ptr(),
                        x,
                        out,
                        cols: NR.min(w.n - q * NR),
                        scale,
                    };
                }
                let rows = &rows[..batch.len()];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the caller's contract; each panel holds `k × NR`
                // weights (and `NR` outputs where `WHOLE`).
                unsafe {
                    if WHOLE {
                        x86::$expand(rows, k, wide, shared)
                    } else if wide {
                        x86::$rows_wide(rows, k, shared, true)
                    } else {
                        rows.chunks(EXPAND_ROWS).for_each(|rows| x86::$rows(rows, k))
                    }
                };
            }};
        }
        match &*first.panels {
            Panels::F32(_) => run!(F32, rows_f32, rows_wide_f32, expand_f32),
            Panels::F16(_) => run!(F16, rows_f16, rows_wide_f16, expand_f16),
            Panels::Bf16(_) => run!(Bf16, rows_bf16, rows_wide_bf16, expand_bf16),
            Panels::Pairs(_) => unreachable!("bf16 pairs hold a model's own weights, not an adapter's"),
        }
    }
}

/// One row times one matrix, for [`PackedMatrix::row_products`].
pub(crate) struct RowProduct<'a> {
    /// The matrix, `(n, k)`.
    pub w: &'a PackedMatrix,
    /// The row, `k` values.
    pub x: &'a [f32],
    /// Where `x·Wᵀ` goes, `n` values.
    pub out: &'a mut [f32],
}

impl PackedMatrix {
    /// `out = x·Wᵀ` for each of `products`, on this thread, the panels of
    /// several products side by side (independent chains of multiply-adds,
    /// independent streams of weights): the adapters' shrinks, one row and
    /// a rank's worth of outputs each. Each output is the sum
    /// [`PackedMatrix::row_add`] gives, bit for bit. `false` (and nothing
    /// done) on a CPU without [`PackedMatrix::rows_direct`].
    pub(crate) fn row_products(products: &mut [RowProduct<'_>]) -> bool {
        if !Self::rows_direct() {
            return false;
        }
        let mut batch = PanelBatch::default();
        for j in 0..products.len() {
            // The head of the weights a batch of products on (the rows
            // kernel asks for the rest on the way).
            if let Some(ahead) = products.get(j + EXPAND_WIDE_ROWS) {
                super::prefetch_l2(ahead.w.start(), ahead.w.raw().len().min(STREAM_AHEAD_BYTES));
            }
            let product = &mut products[j];
            let w = product.w;
            assert!(product.x.len() == w.k && product.out.len() == w.n, "row product shape");
            product.out.fill(0.0);
            for q in 0..w.n.div_ceil(NR) {
                // SAFETY: the shapes were checked; each panel's outputs are
                // its own columns of `out`, borrowed until the batch has run.
                unsafe { batch.push(w, q, product.x.as_ptr(), product.out.as_mut_ptr().add(q * NR), 1.0) };
            }
        }
        // SAFETY: as above.
        unsafe { batch.run() };
        true
    }
}

/// One tile of a product on bf16 pairs: `rows` token rows times
/// `panel_count` consecutive panels, into `cols` columns of `rows` output rows.
struct PairJob<'a> {
    rows: usize,
    panel_count: usize,
    /// Pairs along `k`.
    k2: usize,
    /// The inputs as bf16 pairs, interleaved `[k2][rows]`.
    x: &'a [u32],
    /// The panels, each `[k2][NR]`.
    panels: &'a [u32],
    out: *mut f32,
    ldo: usize,
    cols: usize,
}

/// `out[r][j] = Σ_i dot_pair(x[i][r], panel[i][j])` in order of `i`, for
/// every row and column of the tile: the reference the SIMD kernel follows.
///
/// # Safety
/// `job.out` must be valid for writes of `cols` floats at each of `rows` rows `ldo` apart.
unsafe fn pairs_tile_portable(job: &PairJob<'_>) {
    for r in 0..job.rows {
        for c in 0..job.cols {
            let (p, j) = (c / NR, c % NR);
            let panel = &job.panels[p * job.k2 * NR..][..job.k2 * NR];
            let mut acc = 0f32;
            for i in 0..job.k2 {
                acc = dot_pair(acc, job.x[i * job.rows + r], panel[i * NR + j]);
            }
            // SAFETY: the caller's contract.
            unsafe { *job.out.add(r * job.ldo + c) = acc };
        }
    }
}

/// One row's expand on one panel, for the x86 kernels: `out[j] += scale ·
/// Σₖ x[k] · panel[k][j]` for `j < cols`.
#[derive(Clone, Copy)]
struct PanelRow<T> {
    panel: *const T,
    x: *const f32,
    out: *mut f32,
    cols: usize,
    scale: f32,
}

impl<T> PanelRow<T> {
    /// No row: what fills a kernel's slots beyond the rows it was given.
    const NONE: Self = PanelRow {
        panel: std::ptr::null(),
        x: std::ptr::null(),
        out: std::ptr::null_mut(),
        cols: 0,
        scale: 0.0,
    };
}

/// One tile of a product: `rows` token rows times one panel, into `cols`
/// columns of `rows` output rows.
struct TileJob<'a, T> {
    rows: usize,
    /// Panels side by side ([`tile_panels`]; 1 on the portable kernel).
    panel_count: usize,
    /// The inputs, interleaved `[k][rows]`.
    x: &'a [f32],
    /// The weights: `panel_count` panels, each `[k][NR]`.
    panel: &'a [T],
    /// The tile's first output; its rows are `ldo` apart.
    out: *mut f32,
    ldo: usize,
    cols: usize,
    ahead: Ahead,
    /// Lines of adapter weights to ask for into L2, one every
    /// [`EXPAND_LINE_STEPS`] steps along `k` (as many as fit).
    expand_lines: &'a [*const u8],
}

/// Steps along `k` between two of a tile's [`TileJob::expand_lines`].
const EXPAND_LINE_STEPS: usize = 2;

/// Cache lines a tile asks for while it runs (one per step along `k`, at
/// most `k`): a slice of the panel that comes next. Only prefetched, never read.
#[derive(Clone, Copy)]
struct Ahead {
    from: *const u8,
    lines: usize,
}

/// The output buffer, shared by tasks that write disjoint tiles of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: tasks write disjoint tiles only (see `PackedMatrix::run`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[r][q·NR + j] = Σₖ x[k][r] · panel_q[k][j]` for `r < rows ≤ MR_WIDE`
/// and the first `cols ≤ panel_count·NR` columns of the tile's panels.
///
/// # Safety
/// `job.out` must be valid for writes of `cols` floats at each of `rows` rows `ldo` apart.
unsafe fn tile_portable<T: Element>(job: &TileJob<'_, T>) {
    let &TileJob {
        rows,
        panel_count,
        x,
        panel,
        out,
        ldo,
        cols,
        ..
    } = job;
    let k = panel.len() / (NR * panel_count);
    for q in 0..panel_count {
        let panel = &panel[q * k * NR..(q + 1) * k * NR];
        let mut acc = [[0f32; NR]; MR_WIDE];
        for (kk, b) in panel.chunks_exact(NR).enumerate() {
            let b: [f32; NR] = std::array::from_fn(|j| b[j].widen());
            for (r, acc) in acc.iter_mut().enumerate().take(rows) {
                let a = x[kk * rows + r];
                for (acc, b) in acc.iter_mut().zip(&b) {
                    *acc += a * b;
                }
            }
        }
        let width = cols.saturating_sub(q * NR).min(NR);
        for (r, acc) in acc.iter().enumerate().take(rows) {
            // SAFETY: the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), out.add(r * ldo + q * NR), width) };
        }
    }
}

/// The SIMD microkernel for one element type.
trait Tile: Element {
    /// As [`tile_portable`], on `kernel` (`Avx2` or `Avx512`).
    ///
    /// # Safety
    /// As [`tile_portable`], and the CPU must have `kernel`'s features.
    unsafe fn tile_simd(kernel: Kernel, job: &TileJob<'_, Self>);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use super::{
        Kernel, PairJob, PanelRow, Tile, TileJob, DOT_PANELS, EXPAND_LINE_STEPS, MR, MR_DOT, MR_WIDE, NR,
        PREFETCH_BYTES, STREAM_AHEAD_BYTES,
    };

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f32(p: *const f32) -> __m256 {
        // SAFETY: the caller reads within its panel.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const f16) -> __m256 {
        // SAFETY: as above; 8 halves are 16 bytes.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_bf16(p: *const bf16) -> __m256 {
        // SAFETY: as above. A bfloat16 is the top half of an f32.
        unsafe {
            let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
        }
    }

    /// The kernel of `R` rows times `P` panels for one element type, `$load`
    /// widening 8 weights to f32. Each output's sum runs along `k` in the
    /// same order whatever `R` and `P` are.
    macro_rules! kernel {
        ($name:ident, $features:literal, $t:ty, $load:ident) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize, const P: usize>(job: &TileJob<'_, $t>) {
                let (k, x, panel) = (job.panel.len() / (NR * P), job.x.as_ptr(), job.panel.as_ptr());
                let (out, ldo, cols, ahead) = (job.out, job.ldo, job.cols, job.ahead);
                let expand_steps = (job.expand_lines.len() * EXPAND_LINE_STEPS).min(k);
                // Steps along `k` in a cache line of a panel, and in a block.
                const LINE: usize = 64 / (NR * std::mem::size_of::<$t>());
                const STEPS: usize = 8;
                // SAFETY (whole body): the caller checked that `x` holds `k × R`
                // inputs and the panels `P × k × NR` weights, and guarantees
                // the tile of `out`.
                unsafe {
                    let mut lo = [[_mm256_setzero_ps(); R]; P];
                    let mut hi = [[_mm256_setzero_ps(); R]; P];
                    // One step along `k`: every row times every panel.
                    macro_rules! step {
                        ($kk:expr) => {
                            for p in 0..P {
                                let b = panel.add((p * k + $kk) * NR);
                                let (b0, b1) = ($load(b), $load(b.add(8)));
                                for r in 0..R {
                                    let a = _mm256_broadcast_ss(&*x.add($kk * R + r));
                                    lo[p][r] = _mm256_fmadd_ps(a, b0, lo[p][r]);
                                    hi[p][r] = _mm256_fmadd_ps(a, b1, hi[p][r]);
                                }
                            }
                        };
                    }
                    // Blocks of `STEPS` steps: the block's prefetches first, then
                    // its steps, unrolled, with no bookkeeping between them.
                    let mut kk = 0;
                    while kk < k {
                        let steps = STEPS.min(k - kk);
                        for s in (kk..kk + steps).step_by(LINE) {
                            for p in 0..P {
                                let b = panel.add((p * k + s) * NR) as *const i8;
                                // A prefetch never faults, even past the end of the panels.
                                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH_BYTES));
                            }
                        }
                        // The next group's lines, `P` a step.
                        for line in kk * P..((kk + steps) * P).min(ahead.lines) {
                            _mm_prefetch::<_MM_HINT_T1>(ahead.from.wrapping_add(64 * line) as *const i8);
                        }
                        for s in (kk..(kk + steps).min(expand_steps)).step_by(EXPAND_LINE_STEPS) {
                            _mm_prefetch::<_MM_HINT_T1>(
                                *job.expand_lines.get_unchecked(s / EXPAND_LINE_STEPS) as *const i8
                            );
                        }
                        // Unrolled where the sums leave registers to spare:
                        // with twelve, the widened weights of the steps the
                        // compiler moves ahead spill (f16 at six rows ran at
                        // three quarters of its rolled rate).
                        if steps == STEPS && 2 * R * P <= 8 {
                            for s in 0..STEPS {
                                step!(kk + s);
                            }
                        } else {
                            for s in kk..kk + steps {
                                step!(s);
                            }
                        }
                        kk += steps;
                    }
                    for p in 0..P {
                        let width = cols.saturating_sub(p * NR).min(NR);
                        let out = out.add(p * NR);
                        if width == NR {
                            for r in 0..R {
                                _mm256_storeu_ps(out.add(r * ldo), lo[p][r]);
                                _mm256_storeu_ps(out.add(r * ldo + 8), hi[p][r]);
                            }
                        } else {
                            let mut row = [0f32; NR];
                            for r in 0..R {
                                _mm256_storeu_ps(row.as_mut_ptr(), lo[p][r]);
                                _mm256_storeu_ps(row.as_mut_ptr().add(8), hi[p][r]);
                                std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(r * ldo), width);
                            }
                        }
                    }
                }
            }
        };
    }

    /// Independent chains of multiply-adds in [`fma_chains`]: enough to cover
    /// the latency on two FMA pipes.
    pub(crate) const FMA_CHAINS: usize = 12;

    /// `iterations` rounds of `FMA_CHAINS` 8-lane multiply-adds, registers only.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn fma_chains(iterations: usize) -> f32 {
        let mut acc = [_mm256_set1_ps(1.0); FMA_CHAINS];
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..iterations {
            for acc in acc.iter_mut() {
                *acc = _mm256_fmadd_ps(*acc, a, b);
            }
        }
        let mut lanes = [0f32; 8];
        let sum = acc.iter().fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a));
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
        lanes.iter().sum()
    }

    kernel!(kernel_f32, "avx2,fma,f16c", f32, load_f32);
    kernel!(kernel_f16, "avx2,fma,f16c", f16, load_f16);
    kernel!(kernel_bf16, "avx2,fma,f16c", bf16, load_bf16);
    kernel!(kernel_f32_wide, "avx2,fma,f16c,avx512f,avx512vl", f32, load_f32);
    kernel!(kernel_f16_wide, "avx2,fma,f16c,avx512f,avx512vl", f16, load_f16);
    kernel!(kernel_bf16_wide, "avx2,fma,f16c,avx512f,avx512vl", bf16, load_bf16);

    /// One input row through up to `PANELS_AT_ONCE` panels at a time:
    /// independent chains of multiply-adds, each output summed over `k` in
    /// the microkernel's order with the same fused operations.
    macro_rules! row_kernel {
        ($name:ident, $t:ty, $load:ident) => {
            /// `out[j] += scale · Σₖ x[k] · W[j][k]`.
            ///
            /// # Safety
            /// The CPU must have AVX2, FMA and F16C.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name(panels: &[$t], n: usize, k: usize, x: &[f32], out: &mut [f32], scale: f32) {
                assert!(x.len() == k && out.len() == n && panels.len() >= n.div_ceil(NR) * k * NR);
                const PANELS_AT_ONCE: usize = 4;
                let count = n.div_ceil(NR);
                let mut p = 0;
                while p < count {
                    let group = (count - p).min(PANELS_AT_ONCE);
                    // SAFETY (block): the assertion bounds every panel read.
                    unsafe {
                        let mut lo = [_mm256_setzero_ps(); PANELS_AT_ONCE];
                        let mut hi = [_mm256_setzero_ps(); PANELS_AT_ONCE];
                        let base = panels.as_ptr().add(p * k * NR);
                        for kk in 0..k {
                            let a = _mm256_broadcast_ss(&x[kk]);
                            for g in 0..group {
                                let b = base.add(g * k * NR + kk * NR);
                                lo[g] = _mm256_fmadd_ps(a, $load(b), lo[g]);
                                hi[g] = _mm256_fmadd_ps(a, $load(b.add(8)), hi[g]);
                            }
                        }
                        for g in 0..group {
                            let col = (p + g) * NR;
                            let mut row = [0f32; NR];
                            _mm256_storeu_ps(row.as_mut_ptr(), lo[g]);
                            _mm256_storeu_ps(row.as_mut_ptr().add(8), hi[g]);
                            for (o, v) in out[col..(col + NR).min(n)].iter_mut().zip(row) {
                                *o += scale * v;
                            }
                        }
                    }
                    p += group;
                }
            }
        };
    }

    /// Up to [`EXPAND_ROWS`](super::EXPAND_ROWS) rows, each through one
    /// panel of its own, chains side by side: each output summed over `k`
    /// as [`row_kernel`] sums it.
    macro_rules! rows_kernel {
        ($name:ident, $t:ty, $load:ident) => {
            /// # Safety
            /// The CPU must have AVX2, FMA and F16C; every row's panel must hold
            /// `k × NR` weights, its input `k` values, its output `cols ≤ NR`.
            #[target_feature(enable = "avx2,fma,f16c")]
            #[allow(clippy::modulo_one)] // a line holds one step of an f32 panel
            pub(super) unsafe fn $name(rows: &[PanelRow<$t>], k: usize) {
                let mut lo = [_mm256_setzero_ps(); super::EXPAND_ROWS];
                let mut hi = [_mm256_setzero_ps(); super::EXPAND_ROWS];
                let live = rows.len().min(super::EXPAND_ROWS);
                let rows: [PanelRow<$t>; super::EXPAND_ROWS] =
                    std::array::from_fn(|g| rows.get(g).copied().unwrap_or(PanelRow::NONE));
                // SAFETY (whole body): the caller's contract, for the `live` rows.
                unsafe {
                    // Each row's weights, a line ahead at a time.
                    const LINE: usize = 64 / (NR * std::mem::size_of::<$t>());
                    macro_rules! chains {
                        ($g:expr) => {
                            for kk in 0..k {
                                if kk % LINE == 0 {
                                    for g in 0..$g {
                                        let at = rows[g].panel.add(kk * NR) as *const i8;
                                        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES));
                                        _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(STREAM_AHEAD_BYTES));
                                    }
                                }
                                for g in 0..$g {
                                    let a = _mm256_broadcast_ss(&*rows[g].x.add(kk));
                                    let b = rows[g].panel.add(kk * NR);
                                    lo[g] = _mm256_fmadd_ps(a, $load(b), lo[g]);
                                    hi[g] = _mm256_fmadd_ps(a, $load(b.add(8)), hi[g]);
                                }
                            }
                        };
                    }
                    match live {
                        0 => return,
                        1 => chains!(1),
                        2 => chains!(2),
                        3 => chains!(3),
                        _ => chains!(4),
                    }
                    for g in 0..live {
                        let (out, scale) = (rows[g].out, _mm256_set1_ps(rows[g].scale));
                        if rows[g].cols == NR {
                            // `out + scale · sum`, a multiply then an add, lane by lane.
                            let lo = _mm256_add_ps(_mm256_loadu_ps(out), _mm256_mul_ps(scale, lo[g]));
                            let hi = _mm256_add_ps(_mm256_loadu_ps(out.add(8)), _mm256_mul_ps(scale, hi[g]));
                            _mm256_storeu_ps(out, lo);
                            _mm256_storeu_ps(out.add(8), hi);
                            continue;
                        }
                        let mut sums = [0f32; NR];
                        _mm256_storeu_ps(sums.as_mut_ptr(), lo[g]);
                        _mm256_storeu_ps(sums.as_mut_ptr().add(8), hi[g]);
                        let out = std::slice::from_raw_parts_mut(out, rows[g].cols);
                        for (o, v) in out.iter_mut().zip(sums) {
                            *o += rows[g].scale * v;
                        }
                    }
                }
            }
        };
    }

    rows_kernel!(rows_f32, f32, load_f32);
    rows_kernel!(rows_f16, f16, load_f16);
    rows_kernel!(rows_bf16, bf16, load_bf16);

    /// [`rows_kernel`] on AVX-512, up to [`EXPAND_WIDE_ROWS`](super::EXPAND_WIDE_ROWS)
    /// rows, one register of [`NR`] outputs each; where every row goes
    /// through one panel (`shared`: rows of one adapter), each step of the
    /// panel is loaded once for all of them. Each output summed over `k` as
    /// [`row_kernel`] sums it: one fused multiply-add a step in order, then
    /// `out + scale · sum`.
    macro_rules! rows_wide_kernel {
        ($name:ident, $t:ty, $load_wide:ident) => {
            /// # Safety
            /// The CPU must have AVX2, FMA, F16C and AVX-512F/VL; every row's
            /// panel must hold `k × NR` weights (`shared`: all the same), its
            /// input `k` values, its output `cols ≤ NR`.
            #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
            pub(super) unsafe fn $name(rows: &[PanelRow<$t>], k: usize, shared: bool, ahead: bool) {
                #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
                #[allow(clippy::modulo_one)] // a line holds one step of an f32 panel
                unsafe fn run<const N: usize, const SHARED: bool, const AHEAD: bool>(rows: &[PanelRow<$t>], k: usize) {
                    // SAFETY (body): the caller's contract, for these `N` rows.
                    unsafe {
                        const LINE: usize = 64 / (NR * std::mem::size_of::<$t>());
                        let streams = if SHARED { 1 } else { N };
                        let mut acc = [_mm512_setzero_ps(); N];
                        for kk in 0..k {
                            if AHEAD && kk % LINE == 0 {
                                for row in &rows[..streams] {
                                    let at = row.panel.add(kk * NR) as *const i8;
                                    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PREFETCH_BYTES));
                                    _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(STREAM_AHEAD_BYTES));
                                }
                            }
                            if SHARED {
                                let b = $load_wide(rows[0].panel.add(kk * NR));
                                for g in 0..N {
                                    acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(*rows[g].x.add(kk)), b, acc[g]);
                                }
                            } else {
                                for g in 0..N {
                                    let b = $load_wide(rows[g].panel.add(kk * NR));
                                    acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(*rows[g].x.add(kk)), b, acc[g]);
                                }
                            }
                        }
                        for g in 0..N {
                            let (out, scale) = (rows[g].out, _mm512_set1_ps(rows[g].scale));
                            let mask: __mmask16 = if rows[g].cols >= NR {
                                !0
                            } else {
                                (1 << rows[g].cols) - 1
                            };
                            // `out + scale · sum`, a multiply then an add, lane by lane.
                            let sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), _mm512_mul_ps(scale, acc[g]));
                            _mm512_mask_storeu_ps(out, mask, sum);
                        }
                    }
                }
                // SAFETY (block): the caller's contract.
                unsafe {
                    for rows in rows.chunks(super::EXPAND_WIDE_ROWS) {
                        macro_rules! by_count {
                            ($shared:literal, $ahead:literal) => {
                                match rows.len() {
                                    1 => run::<1, $shared, $ahead>(rows, k),
                                    2 => run::<2, $shared, $ahead>(rows, k),
                                    3 => run::<3, $shared, $ahead>(rows, k),
                                    4 => run::<4, $shared, $ahead>(rows, k),
                                    5 => run::<5, $shared, $ahead>(rows, k),
                                    6 => run::<6, $shared, $ahead>(rows, k),
                                    7 => run::<7, $shared, $ahead>(rows, k),
                                    _ => run::<8, $shared, $ahead>(rows, k),
                                }
                            };
                        }
                        match (shared, ahead) {
                            (true, true) => by_count!(true, true),
                            (true, false) => by_count!(true, false),
                            (false, true) => by_count!(false, true),
                            (false, false) => by_count!(false, false),
                        }
                    }
                }
            }
        };
    }

    rows_wide_kernel!(rows_wide_f32, f32, load_f32_wide);
    rows_wide_kernel!(rows_wide_f16, f16, load_f16_wide);
    rows_wide_kernel!(rows_wide_bf16, bf16, load_bf16_wide);

    row_kernel!(row_f32, f32, load_f32);
    row_kernel!(row_f16, f16, load_f16);
    row_kernel!(row_bf16, bf16, load_bf16);

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    unsafe fn load_f32_wide(p: *const f32) -> __m512 {
        // SAFETY: the caller reads within its panel.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    unsafe fn load_f16_wide(p: *const f16) -> __m512 {
        // SAFETY: as above; 16 halves are 32 bytes.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    unsafe fn load_bf16_wide(p: *const bf16) -> __m512 {
        // SAFETY: as above. A bfloat16 is the top half of an f32.
        unsafe {
            let halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(halves))
        }
    }

    /// The fused expand on whole panels: rows through a panel of their own
    /// each (`cols` = [`NR`]), over a rank's worth of `k`, side by side —
    /// the short chains of an expand need many rows in flight, and nothing
    /// is asked for ahead (the product's tiles asked for these lines). Each
    /// output summed over `k` as [`row_kernel`] sums it: one fused
    /// multiply-add a step in order, then `out + scale · sum`.
    macro_rules! expand_kernel {
        ($name:ident, $t:ty, $load:ident, $rows_wide:ident) => {
            /// # Safety
            /// The CPU must have AVX2, FMA and F16C (and AVX-512F/VL for
            /// `on_avx512`); every row's panel must hold `k × NR` weights
            /// (`shared`: all the same), its input `k` values, its output `NR`.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name(rows: &[PanelRow<$t>], k: usize, on_avx512: bool, shared: bool) {
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn narrow<const N: usize>(rows: &[PanelRow<$t>], k: usize) {
                    // SAFETY (body): the caller's contract, for these `N` rows.
                    unsafe {
                        let mut lo = [_mm256_setzero_ps(); N];
                        let mut hi = [_mm256_setzero_ps(); N];
                        for kk in 0..k {
                            for g in 0..N {
                                let a = _mm256_broadcast_ss(&*rows[g].x.add(kk));
                                let b = rows[g].panel.add(kk * NR);
                                lo[g] = _mm256_fmadd_ps(a, $load(b), lo[g]);
                                hi[g] = _mm256_fmadd_ps(a, $load(b.add(8)), hi[g]);
                            }
                        }
                        for g in 0..N {
                            let (out, scale) = (rows[g].out, _mm256_set1_ps(rows[g].scale));
                            let lo = _mm256_add_ps(_mm256_loadu_ps(out), _mm256_mul_ps(scale, lo[g]));
                            let hi = _mm256_add_ps(_mm256_loadu_ps(out.add(8)), _mm256_mul_ps(scale, hi[g]));
                            _mm256_storeu_ps(out, lo);
                            _mm256_storeu_ps(out.add(8), hi);
                        }
                    }
                }
                // SAFETY (block): the caller's contract.
                unsafe {
                    if on_avx512 {
                        $rows_wide(rows, k, shared, false);
                    } else {
                        for rows in rows.chunks(super::EXPAND_ROWS) {
                            match rows.len() {
                                1 => narrow::<1>(rows, k),
                                2 => narrow::<2>(rows, k),
                                3 => narrow::<3>(rows, k),
                                _ => narrow::<4>(rows, k),
                            }
                        }
                    }
                }
            }
        };
    }

    expand_kernel!(expand_f32, f32, load_f32, rows_wide_f32);
    expand_kernel!(expand_f16, f16, load_f16, rows_wide_f16);
    expand_kernel!(expand_bf16, bf16, load_bf16, rows_wide_bf16);

    /// Dispatch on the kernel and the tile's height and width, for one element type.
    macro_rules! tile {
        ($t:ty, $narrow:ident, $wide:ident) => {
            impl Tile for $t {
                unsafe fn tile_simd(kernel: Kernel, job: &TileJob<'_, Self>) {
                    let (rows, panels) = (job.rows, job.panel_count);
                    let limit = if kernel == Kernel::Avx512 { MR_WIDE } else { MR };
                    assert!(
                        rows <= limit
                            && (1..=super::tile_panels(rows)).contains(&panels)
                            && job.panel.len().is_multiple_of(panels * NR)
                            && job.x.len() >= rows * job.panel.len() / (panels * NR)
                            && job.cols <= panels * NR
                    );
                    // Several panels only for a tile of one or two rows
                    // (at most [`super::tile_panels`]: the assertion).
                    macro_rules! by_width {
                        ($kernel:ident, 1) => {
                            match panels {
                                1 => $kernel::<1, 1>(job),
                                2 => $kernel::<1, 2>(job),
                                3 => $kernel::<1, 3>(job),
                                _ => $kernel::<1, 4>(job),
                            }
                        };
                        ($kernel:ident, 2) => {
                            match panels {
                                1 => $kernel::<2, 1>(job),
                                _ => $kernel::<2, 2>(job),
                            }
                        };
                    }
                    // SAFETY: the assertion bounds every read; the caller vouches
                    // for `out` and for the CPU's features.
                    unsafe {
                        if kernel == Kernel::Avx512 {
                            match rows {
                                1 => by_width!($wide, 1),
                                2 => by_width!($wide, 2),
                                3 => $wide::<3, 1>(job),
                                4 => $wide::<4, 1>(job),
                                5 => $wide::<5, 1>(job),
                                6 => $wide::<6, 1>(job),
                                7 => $wide::<7, 1>(job),
                                8 => $wide::<8, 1>(job),
                                9 => $wide::<9, 1>(job),
                                10 => $wide::<10, 1>(job),
                                11 => $wide::<11, 1>(job),
                                _ => $wide::<12, 1>(job),
                            }
                        } else {
                            match rows {
                                1 => by_width!($narrow, 1),
                                2 => by_width!($narrow, 2),
                                3 => $narrow::<3, 1>(job),
                                4 => $narrow::<4, 1>(job),
                                5 => $narrow::<5, 1>(job),
                                _ => $narrow::<6, 1>(job),
                            }
                        }
                    }
                }
            }
        };
    }

    tile!(f32, kernel_f32, kernel_f32_wide);
    tile!(f16, kernel_f16, kernel_f16_wide);
    tile!(bf16, kernel_bf16, kernel_bf16_wide);

    /// `R` rows times `P` panels of bf16 pairs, as [`super::pairs_tile_portable`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bf16")]
    #[allow(clippy::needless_range_loop)] // a register tile, indexed by row and panel
    unsafe fn pairs_kernel<const R: usize, const P: usize>(job: &PairJob<'_>) {
        let (k2, x, panels) = (job.k2, job.x.as_ptr(), job.panels.as_ptr());
        // SAFETY (whole body): the caller checked the shapes; `out` is the caller's.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); R]; P];
            for i in 0..k2 {
                let w: [__m512bh; P] = std::array::from_fn(|p| {
                    let at = panels.add((p * k2 + i) * NR);
                    _mm_prefetch::<_MM_HINT_T0>((at as *const i8).wrapping_add(PREFETCH_BYTES));
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at as *const __m512i))
                });
                for r in 0..R {
                    let a = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*x.add(i * R + r) as i32));
                    for p in 0..P {
                        acc[p][r] = _mm512_dpbf16_ps(acc[p][r], a, w[p]);
                    }
                }
            }
            for (p, acc) in acc.iter().enumerate() {
                let cols = job.cols.saturating_sub(p * NR).min(NR);
                for (r, acc) in acc.iter().enumerate() {
                    let out = job.out.add(r * job.ldo + p * NR);
                    if cols == NR {
                        _mm512_storeu_ps(out, *acc);
                    } else {
                        let mut row = [0f32; NR];
                        _mm512_storeu_ps(row.as_mut_ptr(), *acc);
                        std::ptr::copy_nonoverlapping(row.as_ptr(), out, cols);
                    }
                }
            }
        }
    }

    /// Dispatch a tile of bf16 pairs on its height and width.
    ///
    /// # Safety
    /// As [`super::pairs_tile_portable`], on a CPU with [`super::bf16_dot_available`].
    pub(super) unsafe fn pairs_tile(job: &PairJob<'_>) {
        assert!(
            (1..=MR_DOT).contains(&job.rows)
                && (1..=DOT_PANELS).contains(&job.panel_count)
                && job.x.len() >= job.rows * job.k2
                && job.panels.len() >= job.panel_count * job.k2 * NR
                && job.cols <= job.panel_count * NR
        );
        macro_rules! by_width {
            ($r:literal) => {
                match job.panel_count {
                    1 => pairs_kernel::<$r, 1>(job),
                    2 => pairs_kernel::<$r, 2>(job),
                    3 => pairs_kernel::<$r, 3>(job),
                    _ => pairs_kernel::<$r, 4>(job),
                }
            };
        }
        // SAFETY: the assertion bounds every read; the caller vouches for the rest.
        unsafe {
            match job.rows {
                1 => by_width!(1),
                2 => by_width!(2),
                3 => by_width!(3),
                4 => by_width!(4),
                5 => by_width!(5),
                _ => by_width!(6),
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
macro_rules! portable_only {
    ($($t:ty),*) => {$(
        impl Tile for $t {
            unsafe fn tile_simd(_kernel: Kernel, job: &TileJob<'_, Self>) {
                // SAFETY: the caller's contract is the portable kernel's.
                unsafe { tile_portable(job) }
            }
        }
    )*};
}

#[cfg(not(target_arch = "x86_64"))]
portable_only!(f32, f16, bf16);

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::runtime::rng::SplitMix;

    fn random(len: usize, rng: &mut SplitMix) -> Vec<f32> {
        (0..len).map(|_| rng.uniform() as f32 - 0.5).collect()
    }

    /// The largest difference from candle's product, relative to the largest output.
    fn relative_error(got: &[f32], want: &[f32]) -> f32 {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
        got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale
    }

    fn candle_product(w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
        let w = Tensor::from_slice(w, (n, k), &Device::Cpu).unwrap();
        let x = Tensor::from_slice(x, (m, k), &Device::Cpu).unwrap();
        x.matmul(&w.t().unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// `w` (`n × k`) packed in f32, and rounded to f16 and to bf16.
    fn in_each_precision(w: &[f32], n: usize, k: usize) -> [PackedMatrix; 3] {
        let halves: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let brains: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        [
            PackedMatrix::from_f32(w, n, k),
            PackedMatrix::from_f16(&halves, n, k),
            PackedMatrix::from_bf16(&brains, n, k),
        ]
    }

    /// Tiles of one and two rows take several panels at once, taller ones
    /// one: a row's outputs must not depend on which it got. Every row of
    /// products of 1 to 13 rows (and of a pre-fill block and one or two
    /// rows more) against the same row alone, bit for bit, in
    /// each precision, on every kernel here, in parallel tasks and on one
    /// thread (whose single task ends in a group of fewer panels), with a
    /// partial last panel.
    #[test]
    fn a_row_gives_the_same_bits_whatever_panels_share_its_tile() {
        let mut rng = SplitMix::new(41);
        // 1,100 inputs: pre-fill blocks of 84 rows (`BLOCK_BYTES`).
        for (n, k) in [(637, 33), (150, 64), (80, 1), (37, 70), (16, 9), (40, 1100)] {
            let w = random(n * k, &mut rng);
            for packed in in_each_precision(&w, n, k) {
                let x = random((MC + 2) * k, &mut rng);
                for kernel in Kernel::available() {
                    let alone: Vec<Vec<f32>> = x
                        .chunks_exact(k)
                        .map(|row| {
                            let mut out = vec![f32::NAN; n];
                            packed.product(row, 1, &mut out, kernel, true);
                            out
                        })
                        .collect();
                    // Pre-fill: past one block, then one or two rows more.
                    for m in (1..=13).chain([MC + 1, MC + 2]) {
                        for parallel in [true, false] {
                            let mut got = vec![f32::NAN; m * n];
                            packed.product(&x[..m * k], m, &mut got, kernel, parallel);
                            for (r, row) in got.chunks_exact(n).enumerate() {
                                assert_eq!(
                                    row,
                                    &alone[r][..],
                                    "{n}x{k} {:?} on {kernel:?}: row {r} of {m} (parallel {parallel})",
                                    packed.precision()
                                );
                            }
                        }
                    }
                    if packed.precision() == Precision::F32 {
                        let want = candle_product(&w, n, k, &x[..k], 1);
                        let err = relative_error(&alone[0], &want);
                        assert!(err <= 1e-5, "{n}x{k} on {kernel:?}: relative error {err}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_single_row_gives_the_tiled_product_bit_for_bit() {
        let mut rng = SplitMix::new(11);
        for (n, k) in [(16, 1024), (8, 64), (2816, 16), (1000, 16), (37, 33), (1, 5)] {
            let w = random(n * k, &mut rng);
            let x = random(k, &mut rng);
            for packed in in_each_precision(&w, n, k) {
                let want = packed.matmul(&x, 1);
                let mut got = vec![0f32; n];
                if !packed.row_add(&x, &mut got, 1.0) {
                    return; // no AVX2 here: callers use the tiles.
                }
                assert_eq!(got, want, "{n}x{k} {:?}", packed.precision());
                // Added, scaled, onto what is there, as `y += scale · d`.
                let base = random(n, &mut rng);
                let mut got = base.clone();
                packed.row_add(&x, &mut got, 0.5);
                let want: Vec<f32> = base.iter().zip(&want).map(|(y, d)| y + 0.5 * d).collect();
                assert_eq!(got, want, "{n}x{k} scaled");
            }
        }
    }

    #[test]
    fn a_fused_expand_gives_the_product_then_row_adds_bit_for_bit() {
        if !PackedMatrix::rows_direct() {
            return; // no AVX2 here: callers add the adapters after the product.
        }
        let mut rng = SplitMix::new(29);
        // A base of 80 outputs (5 panels, the last partial; in f32 and as
        // bf16 pairs) and parts of rank 8 and 16 in f32 and bf16, at several
        // panel boundaries.
        let (n, k) = (75, 40);
        let weights = random(n * k, &mut rng);
        let brains: Vec<bf16> = weights.iter().map(|&v| bf16::from_f32(v)).collect();
        // The base in f32 panels and as bf16 pairs.
        let bases = [
            PackedMatrix::from_f32(&weights, n, k),
            PackedMatrix::from_bf16_pairs(&brains, n, k),
        ];
        let part = |outputs: usize, rank: usize, half: bool, rng: &mut SplitMix| {
            let values = random(outputs * rank, rng);
            if half {
                let halves: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
                PackedMatrix::from_bf16(&halves, outputs, rank)
            } else {
                PackedMatrix::from_f32(&values, outputs, rank)
            }
        };
        let (b_wide, b_tail, b_half) = (
            part(32, 16, false, &mut rng),
            part(27, 8, true, &mut rng),
            part(16, 8, true, &mut rng),
        );
        for m in [1, 3, 13, 32] {
            let x = random(m * k, &mut rng);
            let shrunk: Vec<Vec<f32>> = (0..m).map(|_| random(24, &mut rng)).collect();
            let parts: Vec<Vec<Expand<'_>>> = (0..m)
                .map(|r| match r % 3 {
                    0 => vec![],
                    1 => vec![
                        Expand {
                            b: &b_wide,
                            shrunk: &shrunk[r][..16],
                            first_column: 0,
                            scale: 0.5,
                        },
                        Expand {
                            b: &b_tail,
                            shrunk: &shrunk[r][16..24],
                            first_column: 48,
                            scale: 2.0,
                        },
                    ],
                    _ => vec![Expand {
                        b: &b_half,
                        shrunk: &shrunk[r][..8],
                        first_column: 32,
                        scale: 0.25,
                    }],
                })
                .collect();
            let lists: Vec<&[Expand<'_>]> = parts.iter().map(Vec::as_slice).collect();
            for w in &bases {
                let got = w.matmul_expand(&x, m, &lists);
                let mut want = w.matmul(&x, m);
                for (row, parts) in want.chunks_exact_mut(n).zip(&parts) {
                    for part in parts {
                        let out = &mut row[part.first_column..part.first_column + part.b.outputs()];
                        assert!(part.b.row_add(part.shrunk, out, part.scale));
                    }
                }
                assert_eq!(got, want, "{m} rows, bf16 pairs: {}", w.bf16_dot());
                assert_eq!(w.matmul_expand(&x, m, &[]), w.matmul(&x, m), "{m} rows, no parts");
            }
        }
    }

    #[test]
    fn the_lines_asked_for_ahead_of_an_expand_are_every_line_of_its_panels_a_shared_panel_once() {
        let mut rng = SplitMix::new(31);
        let half = |outputs: usize, rank: usize, rng: &mut SplitMix| {
            PackedMatrix::from_f32_in(Precision::Bf16, &random(outputs * rank, rng), outputs, rank)
        };
        // Two adapters' `B` of rank 16 (a panel is 16 × 16 halves: 8 lines)
        // over 48 outputs (3 panels), at column 16 of the product.
        let (one, two) = (half(48, 16, &mut rng), half(48, 16, &mut rng));
        let shrunk = vec![0f32; 16];
        let part = |b| Expand {
            b,
            shrunk: &shrunk,
            first_column: 16,
            scale: 1.0,
        };
        // Rows 0-2 share `one`, row 3 has `two`, row 4 none, row 5 `one` again.
        let parts: Vec<Vec<Expand<'_>>> = [Some(&one), Some(&one), Some(&one), Some(&two), None, Some(&one)]
            .into_iter()
            .map(|b| b.map(part).into_iter().collect())
            .collect();
        let lists: Vec<&[Expand<'_>]> = parts.iter().map(Vec::as_slice).collect();
        let fused = Fused { expand: &lists };
        let panel_lines = |b: &PackedMatrix, q: usize| -> Vec<*const u8> {
            let start = b.raw()[q * 16 * NR * 2..].as_ptr();
            (0..8).map(|l| start.wrapping_add(64 * l)).collect()
        };
        for (p, q) in [(1, 0), (3, 2)] {
            let mut lines = Vec::new();
            fused.lines(0..6, p, &mut lines);
            let want = [panel_lines(&one, q), panel_lines(&two, q), panel_lines(&one, q)].concat();
            assert_eq!(lines, want, "panel {p}");
            lines.clear();
            fused.lines(3..5, p, &mut lines);
            assert_eq!(lines, panel_lines(&two, q), "panel {p}, rows 3 and 4");
        }
        // Panels 0 and 4 lie outside every part.
        for p in [0, 4] {
            let mut lines = Vec::new();
            fused.lines(0..6, p, &mut lines);
            assert!(lines.is_empty(), "panel {p}");
        }
    }

    /// A matrix, an input row, its outputs and the scale, for a row kernel.
    #[cfg(target_arch = "x86_64")]
    type RowJob<'w> = (&'w PackedMatrix, *const f32, *mut f32, f32);

    /// Row products of `rows` rows (each its own matrix of `outputs × k`,
    /// or all the first one's where `shared`), through panel `q`, on one of
    /// this CPU's row kernels (`run`), against [`PackedMatrix::row_add`]: bit
    /// for bit in every precision.
    #[cfg(target_arch = "x86_64")]
    fn row_kernel_matches_row_add(
        outputs: usize,
        k: usize,
        rows: usize,
        rng: &mut SplitMix,
        run: &dyn Fn(Vec<RowJob<'_>>, usize, bool),
    ) {
        let values: Vec<Vec<f32>> = (0..rows).map(|_| random(outputs * k, rng)).collect();
        let inputs: Vec<Vec<f32>> = (0..rows).map(|_| random(k, rng)).collect();
        let scales: Vec<f32> = (0..rows).map(|r| 0.25 * (r + 1) as f32).collect();
        for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
            let ws: Vec<PackedMatrix> = values
                .iter()
                .map(|v| PackedMatrix::from_f32_in(precision, v, outputs, k))
                .collect();
            let start: Vec<Vec<f32>> = (0..rows).map(|_| random(outputs, rng)).collect();
            for shared in [false, true] {
                let w = |r: usize| if shared { &ws[0] } else { &ws[r] };
                let mut want = start.clone();
                for (r, out) in want.iter_mut().enumerate() {
                    assert!(w(r).row_add(&inputs[r], out, scales[r]));
                }
                let mut got = start.clone();
                for q in 0..outputs.div_ceil(NR) {
                    let jobs = (0..rows)
                        .zip(&mut got)
                        .map(|(r, out)| (w(r), inputs[r].as_ptr(), out[q * NR..].as_mut_ptr(), scales[r]))
                        .collect();
                    run(jobs, q, shared);
                }
                assert_eq!(
                    got, want,
                    "{outputs} × {k}, {rows} rows, {precision:?}, shared: {shared}"
                );
            }
        }
    }

    /// `jobs` as [`PanelRow`]s of panel `q`, for a kernel of `T`.
    #[cfg(target_arch = "x86_64")]
    fn panel_rows<T>(jobs: &[RowJob<'_>], q: usize) -> Vec<PanelRow<T>> {
        jobs.iter()
            .map(|&(w, x, out, scale)| {
                assert_eq!(w.precision().bytes(), std::mem::size_of::<T>(), "one precision");
                PanelRow {
                    panel: w.raw()[q * w.k * NR * std::mem::size_of::<T>()..].as_ptr() as *const T,
                    x,
                    out,
                    cols: NR.min(w.n - q * NR),
                    scale,
                }
            })
            .collect()
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_expand_kernels_on_whole_panels_add_what_row_add_adds_on_every_kernel_here() {
        if !PackedMatrix::rows_direct() {
            return; // no AVX2 here: callers add the adapters after the product.
        }
        let mut rng = SplitMix::new(31);
        // Wide registers where this CPU has them, AVX2's pairs everywhere.
        let kernels: Vec<bool> = [false, true]
            .into_iter()
            .filter(|&wide| !wide || Kernel::best() == Kernel::Avx512)
            .collect();
        for rank in [1, 4, 16, 33] {
            for rows in 1..=(EXPAND_WIDE_ROWS + 3) {
                for &wide in &kernels {
                    // Each row its own `B` (two panels of outputs), or one for all.
                    row_kernel_matches_row_add(2 * NR, rank, rows, &mut rng, &|jobs, q, shared| {
                        // SAFETY: AVX2 (and AVX-512 where `wide`) checked above;
                        // each panel holds `rank × NR` weights, each output `NR`.
                        unsafe {
                            match jobs[0].0.precision() {
                                Precision::F32 => x86::expand_f32(&panel_rows(&jobs, q), rank, wide, shared),
                                Precision::F16 => x86::expand_f16(&panel_rows(&jobs, q), rank, wide, shared),
                                Precision::Bf16 => x86::expand_bf16(&panel_rows(&jobs, q), rank, wide, shared),
                            }
                        }
                    });
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_row_kernels_add_what_row_add_adds_shared_panel_or_not_on_every_kernel_here() {
        if !PackedMatrix::rows_direct() {
            return; // no AVX2 here: callers add the adapters after the product.
        }
        let mut rng = SplitMix::new(37);
        // A rank's worth of outputs (one panel, or a partial second) over
        // the inputs of a shrink, and odd `k`.
        for (outputs, k) in [(16, 64), (8, 40), (24, 33)] {
            for rows in 1..=(EXPAND_WIDE_ROWS + 3) {
                // AVX2's kernel, four rows at a time.
                row_kernel_matches_row_add(outputs, k, rows, &mut rng, &|jobs, q, _| {
                    for jobs in jobs.chunks(EXPAND_ROWS) {
                        // SAFETY: AVX2 checked above; the shapes are the panels'.
                        unsafe {
                            match jobs[0].0.precision() {
                                Precision::F32 => x86::rows_f32(&panel_rows(jobs, q), k),
                                Precision::F16 => x86::rows_f16(&panel_rows(jobs, q), k),
                                Precision::Bf16 => x86::rows_bf16(&panel_rows(jobs, q), k),
                            }
                        }
                    }
                });
                if Kernel::best() == Kernel::Avx512 {
                    row_kernel_matches_row_add(outputs, k, rows, &mut rng, &|jobs, q, shared| {
                        // SAFETY: AVX-512 checked; the shapes are the panels'.
                        unsafe {
                            match jobs[0].0.precision() {
                                Precision::F32 => x86::rows_wide_f32(&panel_rows(&jobs, q), k, shared, true),
                                Precision::F16 => x86::rows_wide_f16(&panel_rows(&jobs, q), k, shared, true),
                                Precision::Bf16 => x86::rows_wide_bf16(&panel_rows(&jobs, q), k, shared, true),
                            }
                        }
                    });
                }
                // What the shrinks call: this CPU's best, through `RowBatch`.
                row_kernel_matches_row_add(outputs, k, rows, &mut rng, &|jobs, q, _| {
                    let mut batch = PanelBatch::default();
                    for (w, x, out, scale) in jobs {
                        // SAFETY: as above; each output its own row's.
                        unsafe { batch.push(w, q, x, out, scale) };
                    }
                    // SAFETY: as above.
                    unsafe { batch.run() };
                });
            }
        }
    }

    #[test]
    fn both_kernels_match_candle_on_odd_shapes_and_every_batch_size() {
        let mut rng = SplitMix::new(3);
        // Odd sizes, decode shapes, and a rank-16 adapter's shrink and expand.
        let shapes = [
            (1, 1),
            (15, 7),
            (17, 33),
            (40, 100),
            (130, 257),
            (64, 1024),
            (16, 1024),
            (1024, 16),
        ];
        for &(n, k) in &shapes {
            let w = random(n * k, &mut rng);
            let packed = PackedMatrix::from_f32(&w, n, k);
            for m in (1..=64).filter(|m| *m <= 8 || m % 7 == 0 || *m == 64) {
                let x = random(m * k, &mut rng);
                let want = candle_product(&w, n, k, &x, m);
                for kernel in Kernel::available() {
                    let mut got = vec![f32::NAN; m * n];
                    packed.matmul_into(&x, m, &mut got, kernel);
                    let err = relative_error(&got, &want);
                    assert!(err <= 1e-5, "({m}×{k})·({n}×{k})ᵀ on {kernel:?}: relative error {err}");
                }
            }
        }
    }

    #[test]
    fn a_prefill_sized_block_of_rows_matches_too() {
        let mut rng = SplitMix::new(4);
        let (n, k, m) = (70, 96, 2 * MC + 5);
        let w = random(n * k, &mut rng);
        let x = random(m * k, &mut rng);
        let got = PackedMatrix::from_f32(&w, n, k).matmul(&x, m);
        assert!(relative_error(&got, &candle_product(&w, n, k, &x, m)) <= 1e-5);
    }

    #[test]
    fn a_prefill_of_several_row_blocks_gives_each_row_its_bits_alone_on_every_kernel() {
        let mut rng = SplitMix::new(5);
        // Long inputs cut the rows into blocks of about 30 (`BLOCK_BYTES`):
        // 100 rows are four of them, the last short; 37 outputs, three panels.
        let (n, k, m) = (37, 2816, 100);
        let w = random(n * k, &mut rng);
        let x = random(m * k, &mut rng);
        for packed in in_each_precision(&w, n, k) {
            for kernel in Kernel::available() {
                let mut all = vec![f32::NAN; m * n];
                packed.matmul_into(&x, m, &mut all, kernel);
                for (r, got) in all.chunks_exact(n).enumerate() {
                    let mut alone = vec![f32::NAN; n];
                    packed.matmul_into(&x[r * k..(r + 1) * k], 1, &mut alone, kernel);
                    assert_eq!(got, alone, "row {r}, {:?} on {kernel:?}", packed.precision());
                }
            }
        }
    }

    #[test]
    fn bf16_pair_products_follow_the_reference_on_odd_shapes_and_every_batch_size() {
        let mut rng = SplitMix::new(41);
        let kernels = PairKernel::available();
        let mut bit_exact = vec![true; kernels.len()];
        // The last shape's rows pass over the weights in several blocks on AMX
        // (each row's 2,050 pairs: 96 rows a pass).
        let shapes = [(1, 1), (16, 2), (37, 33), (64, 1024), (100, 200), (200, 7), (24, 4100)];
        for (n, k) in shapes {
            let batches: &[usize] = if k > 2048 { &[200] } else { &[1, 2, 5, 6, 7, 13, 37, 64] };
            let w: Vec<bf16> = random(n * k, &mut rng).iter().map(|&v| bf16::from_f32(v)).collect();
            let packed = PackedMatrix::from_bf16_pairs(&w, n, k);
            assert!(packed.bf16_dot());
            assert_eq!(packed.bytes(), n.div_ceil(NR) * NR * 2 * k.div_ceil(2) * 2);
            for &m in batches {
                let x = random(m * k, &mut rng);
                // The reference: each output one chain of `dot_pair` over its pairs.
                let mut want = vec![0f32; m * n];
                let mut pairs = vec![0u32; k.div_ceil(2)];
                for r in 0..m {
                    bf16_pairs(&x[r * k..(r + 1) * k], &mut pairs);
                    for c in 0..n {
                        let row = &w[c * k..(c + 1) * k];
                        let mut wp = vec![0u32; k.div_ceil(2)];
                        bf16_pairs(&row.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), &mut wp);
                        want[r * n + c] = pairs.iter().zip(&wp).fold(0f32, |acc, (&x, &w)| dot_pair(acc, x, w));
                    }
                }
                for (&kernel, bit_exact) in kernels.iter().zip(&mut bit_exact) {
                    let mut got = vec![f32::NAN; m * n];
                    packed.matmul_pairs_into(&x, m, &mut got, kernel);
                    if kernel == PairKernel::best() {
                        let mut auto = vec![f32::NAN; m * n];
                        packed.matmul_into(&x, m, &mut auto, Kernel::Auto);
                        assert_eq!(auto, got, "{n}x{k}, {m} rows: the product runs on {kernel:?}");
                    }
                    // Within f32 rounding of the sums of |x·w| (the hardware may
                    // round its two additions as one, and the tile unit adds a
                    // tile's pairs in its own order).
                    for r in 0..m {
                        let xb: Vec<f32> = x[r * k..(r + 1) * k]
                            .iter()
                            .map(|&v| bf16::from_f32(v).to_f32())
                            .collect();
                        for c in 0..n {
                            let magnitude: f32 = w[c * k..(c + 1) * k]
                                .iter()
                                .zip(&xb)
                                .map(|(w, x)| (w.to_f32() * x).abs())
                                .sum();
                            let (g, e) = (got[r * n + c], want[r * n + c]);
                            *bit_exact &= g.to_bits() == e.to_bits();
                            assert!(
                                (g - e).abs() <= magnitude * k as f32 * f32::EPSILON,
                                "{n}x{k}, {m} rows, {kernel:?}: ({r}, {c}) {g} against {e}"
                            );
                        }
                    }
                    // A row alone gives what it gives among the others.
                    for r in [0, m / 2, m - 1] {
                        let mut alone = vec![0f32; n];
                        packed.matmul_pairs_into(&x[r * k..(r + 1) * k], 1, &mut alone, kernel);
                        assert_eq!(alone, got[r * n..(r + 1) * n], "{n}x{k}, row {r} of {m}, {kernel:?}");
                    }
                }
            }
        }
        for (kernel, bit_exact) in kernels.iter().zip(&bit_exact) {
            eprintln!("bf16 pairs on {kernel:?}, bit for bit with the reference: {bit_exact}");
        }
        assert!(
            bit_exact.last().is_some_and(|&exact| exact),
            "the portable kernel is the reference"
        );
    }

    #[test]
    fn rows_round_to_bf16_as_the_half_crate_does() {
        let mut rng = SplitMix::new(47);
        let mut values: Vec<f32> = [
            0.0,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xff80_8000),
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x7f7f_ffff),
        ]
        .to_vec();
        values.extend((0..100_000).map(|_| f32::from_bits((rng.next_u64() >> 32) as u32)));
        for &v in &values {
            assert_eq!(
                to_bf16(v),
                bf16::from_f32(v).to_bits() as u32,
                "{v:e} ({:#x})",
                v.to_bits()
            );
        }
        // Pairs of an odd length end in a zero.
        let mut pairs = [u32::MAX; 2];
        bf16_pairs(&[1.0, 2.0, 3.0], &mut pairs);
        assert_eq!(pairs, [0x4000_3f80, 0x4040]);
    }

    #[test]
    fn bf16_pair_products_stay_near_f32_products() {
        // Rounding each input and weight to bf16 (8 significant bits) moves a
        // product by at most about 2⁻⁸ of Σ|x·w|.
        let mut rng = SplitMix::new(43);
        let (n, k, m) = (48, 512, 9);
        let w = random(n * k, &mut rng);
        let x = random(m * k, &mut rng);
        let brains: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let got = PackedMatrix::from_bf16_pairs(&brains, n, k).matmul(&x, m);
        let want = candle_product(&w, n, k, &x, m);
        for r in 0..m {
            for c in 0..n {
                let magnitude: f32 = (0..k).map(|i| (x[r * k + i] * w[c * k + i]).abs()).sum();
                let err = (got[r * n + c] - want[r * n + c]).abs();
                assert!(err <= magnitude / 128.0, "({r}, {c}): off by {err} of {magnitude}");
            }
        }
    }

    #[test]
    fn half_precision_panels_give_what_widening_at_load_gives() {
        let mut rng = SplitMix::new(5);
        let (n, k) = (37, 200);
        let w = random(n * k, &mut rng);
        let halves: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
        let brains: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened_h: Vec<f32> = halves.iter().map(|v| v.to_f32()).collect();
        let widened_b: Vec<f32> = brains.iter().map(|v| v.to_f32()).collect();
        for m in [1, 3, 6, 7, 32] {
            let x = random(m * k, &mut rng);
            for (packed, widened) in [
                (PackedMatrix::from_f16(&halves, n, k), &widened_h),
                (PackedMatrix::from_bf16(&brains, n, k), &widened_b),
            ] {
                let want = PackedMatrix::from_f32(widened, n, k).matmul(&x, m);
                for kernel in Kernel::available() {
                    let mut got = vec![0f32; m * n];
                    packed.matmul_into(&x, m, &mut got, kernel);
                    let err = relative_error(&got, &want);
                    assert!(err <= 1e-6, "{:?} m={m} on {kernel:?}: {err}", packed.precision());
                }
            }
        }
    }

    #[test]
    fn a_tensor_is_packed_in_its_own_precision() {
        let w = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        let x = [1f32, 0.0, 0.0, 1.0];
        for (dtype, precision) in [
            (DType::F32, Precision::F32),
            (DType::F16, Precision::F16),
            (DType::BF16, Precision::Bf16),
        ] {
            let packed = PackedMatrix::from_tensor(&w.to_dtype(dtype).unwrap()).unwrap();
            assert_eq!(packed.precision(), precision);
            assert_eq!((packed.outputs(), packed.inputs()), (3, 4));
            // Row j of W is 4j..4j+3: first plus last is 8j + 3.
            assert_eq!(packed.matmul(&x, 1), vec![3.0, 11.0, 19.0]);
        }
    }
}
