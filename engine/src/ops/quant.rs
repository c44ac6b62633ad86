//! Matrix products on GGUF's quantized blocks, kept as the file holds them.
//!
//! A quantized weight row is a run of blocks of [`QK`] weights, each block a
//! half-precision scale (and, for `Q4_1`, a half-precision minimum) and the
//! weights as small integers: `Q8_0` (8-bit, `d·q`), `Q4_0` (4-bit,
//! `d·(q − 8)`) and `Q4_1` (4-bit, `d·q + m`). Dequantizing them at load
//! multiplies the bytes every decode step reads by 4–6; here the blocks stay
//! as they are and the product runs on them, as llama.cpp's does: each token
//! row is quantized to 8-bit blocks of its own (`d = max|x| / 127`, one scale
//! per [`QK`] values), a block of weights times a block of inputs is an
//! integer dot product (AVX2 `vpmaddubsw` + `vpmaddwd`, exact), and the two
//! scales are applied to it in f32.
//!
//! At load the rows are re-laid in groups of [`WR`], block by block (the
//! first block of each of the group's rows, then the second, ...), so that a
//! tile of [`WR`] outputs reads one stream of weights. A tile is [`WR`]
//! weight rows times up to [`XR`] token rows; a task is a run of groups, and
//! the tasks split the weights between the cores, so each weight byte is read
//! once per product whatever the number of token rows.
//!
//! The arithmetic of one output, the same on every kernel and bit for bit
//! ([`dot_reference`] writes it out): eight f32 lanes, lane `l` adding, block
//! by block, `(d_w·d_x) · Σ_{i=4l}^{4l+3} q_w[i]·q_x[i]` with one fused
//! multiply-add; the lanes summed as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`;
//! then, for the types with a minimum, `Σ_b m_b · d_x·Σq_x` (block by block,
//! fused) added. A row's result depends on that row alone, never on what else
//! is in the product.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

/// Weights (and inputs) per block.
pub const QK: usize = 32;

/// Weight rows per group: the outputs of one tile.
pub(crate) const WR: usize = 4;

/// Token rows per tile with the 16 AVX registers: with [`WR`] weight rows, 8
/// accumulators, the rest for the inputs and the unpacked weights.
const XR: usize = 2;

/// Token rows per tile with AVX-512VL's 32: 16 accumulators, so each
/// unpacked weight block serves twice the rows.
const XR_WIDE: usize = 4;

/// Which kernel a quantized product runs on. All give the same bits: the
/// integer dot products are exact whichever instructions compute them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKernel {
    /// The best this CPU has.
    Auto,
    /// AVX-512 VNNI's `vpdpbusd` on 256-bit registers (with AVX-512VL's 32
    /// of them): tiles of [`XR_WIDE`] token rows.
    Avx512Vnni,
    /// AVX-VNNI's `vpdpbusd` (VEX): tiles of [`XR`].
    AvxVnni,
    /// AVX2's `vpmaddubsw` + `vpmaddwd`: tiles of [`XR`].
    Avx2,
    /// Plain Rust, any CPU: the reference.
    Portable,
}

impl QuantKernel {
    /// The kernels this CPU can run, best first (always ending with `Portable`).
    pub fn available() -> Vec<QuantKernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c");
            if avx2 && std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl") {
                kernels.push(QuantKernel::Avx512Vnni);
            }
            if avx2 && std::is_x86_feature_detected!("avxvnni") {
                kernels.push(QuantKernel::AvxVnni);
            }
            if avx2 {
                kernels.push(QuantKernel::Avx2);
            }
        }
        kernels.push(QuantKernel::Portable);
        kernels
    }

    /// The best kernel this CPU runs (found once).
    pub fn best() -> QuantKernel {
        static BEST: std::sync::OnceLock<QuantKernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| QuantKernel::available()[0])
    }

    /// `Auto` made concrete; a kernel this CPU lacks falls back to the best it has.
    fn resolve(self) -> QuantKernel {
        match self {
            QuantKernel::Auto => QuantKernel::best(),
            QuantKernel::Portable => QuantKernel::Portable,
            wanted if QuantKernel::available().contains(&wanted) => wanted,
            _ => QuantKernel::best(),
        }
    }
}

/// Token rows per pass over the weights: a large pre-fill's quantized rows
/// are taken in chunks that stay in the core's L2 while the weights stream by.
const MC: usize = 64;

/// A quantized block format the products run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// `d·q`, `q` 8-bit signed: 34 bytes a block.
    Q8_0,
    /// `d·(q − 8)`, `q` 4-bit: 18 bytes a block.
    Q4_0,
    /// `d·q + m`, `q` 4-bit: 20 bytes a block.
    Q4_1,
}

impl QuantType {
    /// The format of a GGUF tensor type, where the products run on it.
    pub fn from_ggml(t: GgmlDType) -> Option<Self> {
        match t {
            GgmlDType::Q8_0 => Some(QuantType::Q8_0),
            GgmlDType::Q4_0 => Some(QuantType::Q4_0),
            GgmlDType::Q4_1 => Some(QuantType::Q4_1),
            _ => None,
        }
    }

    /// Bytes of one block of [`QK`] weights.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 => 34,
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
        }
    }

    /// The name llama.cpp gives it.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
        }
    }

    /// Where a block's quants start.
    fn quants_at(self) -> usize {
        match self {
            QuantType::Q4_1 => 4,
            _ => 2,
        }
    }
}

/// One block's scale and minimum, as f32.
fn scale_min(ty: QuantType, block: &[u8]) -> (f32, f32) {
    let half = |at: usize| f16::from_bits(u16::from_le_bytes([block[at], block[at + 1]])).to_f32();
    let d = half(0);
    match ty {
        QuantType::Q8_0 => (d, 0.0),
        // Exact: a power of two times a half-precision value.
        QuantType::Q4_0 => (d, -8.0 * d),
        QuantType::Q4_1 => (d, half(2)),
    }
}

/// One block's weights as the integers the dot product multiplies: `Q8_0`
/// signed, the 4-bit types unsigned (their offset is in the minimum).
fn quants(ty: QuantType, block: &[u8]) -> [i32; QK] {
    let qs = &block[ty.quants_at()..];
    match ty {
        QuantType::Q8_0 => std::array::from_fn(|i| qs[i] as i8 as i32),
        QuantType::Q4_0 | QuantType::Q4_1 => std::array::from_fn(|i| {
            if i < QK / 2 {
                (qs[i] & 0x0f) as i32
            } else {
                (qs[i - QK / 2] >> 4) as i32
            }
        }),
    }
}

/// Rows of one format: `rows` rows re-laid in groups of [`WR`] (the last
/// padded with zero blocks, which add nothing).
#[derive(Debug)]
struct Part {
    ty: QuantType,
    /// The part's first row among the matrix's outputs.
    first: usize,
    rows: usize,
    data: Arc<[u8]>,
}

impl Part {
    fn groups(&self) -> usize {
        self.rows.div_ceil(WR)
    }
}

/// A weight matrix of `n` outputs by `k` inputs held in quantized blocks,
/// for [`QuantMatrix::matmul`]. Rows of several formats may lie in one
/// matrix (projections stacked into one product); cloning shares the blocks.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    n: usize,
    k: usize,
    parts: Arc<[Part]>,
}

/// Why blocks could not be taken as a matrix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{inputs} inputs are not a whole number of {QK}-value blocks")]
    Inputs { inputs: usize },
    #[error("{got} bytes of {ty} blocks for {rows} rows of {inputs} inputs (want {want})")]
    Size {
        ty: &'static str,
        rows: usize,
        inputs: usize,
        got: usize,
        want: usize,
    },
    #[error("a row order of {got} rows for {rows} rows, or naming a row twice")]
    Order { rows: usize, got: usize },
}

impl QuantMatrix {
    /// `n × k` weights from blocks as a GGUF file lays them out (row by row),
    /// row `r` taken from the blocks' row `order[r]` where an order is given.
    pub fn from_blocks(
        ty: QuantType,
        data: &[u8],
        n: usize,
        k: usize,
        order: Option<&[usize]>,
    ) -> Result<Self, QuantError> {
        if k % QK != 0 {
            return Err(QuantError::Inputs { inputs: k });
        }
        let (nb, bb) = (k / QK, ty.block_bytes());
        let want = n * nb * bb;
        if data.len() != want {
            return Err(QuantError::Size {
                ty: ty.name(),
                rows: n,
                inputs: k,
                got: data.len(),
                want,
            });
        }
        if let Some(order) = order {
            let mut seen = vec![false; n];
            let valid = order.len() == n && order.iter().all(|&r| r < n && !std::mem::replace(&mut seen[r], true));
            if !valid {
                return Err(QuantError::Order {
                    rows: n,
                    got: order.len(),
                });
            }
        }
        let source = |r: usize| order.map_or(r, |o| o[r]);
        let groups = n.div_ceil(WR);
        let mut laid = vec![0u8; groups * nb * WR * bb];
        if nb > 0 {
            laid.par_chunks_mut(nb * WR * bb).enumerate().for_each(|(g, group)| {
                for j in 0..WR.min(n - g * WR) {
                    let row = &data[source(g * WR + j) * nb * bb..][..nb * bb];
                    for (b, block) in row.chunks_exact(bb).enumerate() {
                        group[(b * WR + j) * bb..][..bb].copy_from_slice(block);
                    }
                }
            });
        }
        Ok(QuantMatrix {
            n,
            k,
            parts: Arc::from(vec![Part {
                ty,
                first: 0,
                rows: n,
                data: Arc::from(laid),
            }]),
        })
    }

    /// Several matrices over the same inputs as one, their outputs side by
    /// side (the blocks are shared, not copied). `None` where the inputs differ.
    pub fn stack(matrices: &[QuantMatrix]) -> Option<Self> {
        let k = matrices.first()?.k;
        let mut parts = Vec::new();
        let mut n = 0;
        for m in matrices {
            if m.k != k {
                return None;
            }
            for p in m.parts.iter() {
                parts.push(Part {
                    ty: p.ty,
                    first: n + p.first,
                    rows: p.rows,
                    data: p.data.clone(),
                });
            }
            n += m.n;
        }
        Some(QuantMatrix {
            n,
            k,
            parts: Arc::from(parts),
        })
    }

    /// Outputs (the checkpoint's rows).
    pub fn outputs(&self) -> usize {
        self.n
    }

    /// Inputs (the checkpoint's columns).
    pub fn inputs(&self) -> usize {
        self.k
    }

    /// Bytes the blocks occupy (what one product reads).
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }

    /// The formats of the rows, in order, without repeats.
    pub fn types(&self) -> Vec<QuantType> {
        let mut types: Vec<QuantType> = Vec::new();
        for p in self.parts.iter() {
            if !types.contains(&p.ty) {
                types.push(p.ty);
            }
        }
        types
    }

    /// The weights as f32, `n × k` row-major: exactly what GGUF's
    /// dequantization gives.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        if self.k > 0 {
            for (r, row) in out.chunks_exact_mut(self.k).enumerate() {
                self.dequantize_row(r, row);
            }
        }
        out
    }

    /// Row `row` as f32 into `out` (`k` values): what [`QuantMatrix::dequantize`]
    /// gives for it. An embedding's lookup.
    ///
    /// # Panics
    /// On a row out of range or an `out` of another length.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.n && out.len() == self.k,
            "row {row} of {}×{}",
            self.n,
            self.k
        );
        let p = self
            .parts
            .iter()
            .find(|p| (p.first..p.first + p.rows).contains(&row))
            .expect("the parts cover every row");
        let (nb, bb, r) = (self.k / QK, p.ty.block_bytes(), row - p.first);
        let (g, j) = (r / WR, r % WR);
        for (b, out) in out.chunks_exact_mut(QK).enumerate() {
            let block = &p.data[((g * nb + b) * WR + j) * bb..][..bb];
            let (d, m) = scale_min(p.ty, block);
            for (w, q) in out.iter_mut().zip(quants(p.ty, block)) {
                *w = d * q as f32 + m;
            }
        }
    }

    /// `x · Wᵀ` for `x` of `m × k` row-major: `m × n` row-major.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * self.n];
        self.matmul_into(x, m, &mut out, QuantKernel::Auto);
        out
    }

    /// [`QuantMatrix::matmul`] into `out` (`m × n`), on the kernel chosen.
    pub fn matmul_into(&self, x: &[f32], m: usize, out: &mut [f32], kernel: QuantKernel) {
        assert_eq!(x.len(), m * self.k, "input shape");
        assert_eq!(out.len(), m * self.n, "output shape");
        if out.is_empty() {
            return;
        }
        let kernel = kernel.resolve();
        let rows = QuantizedRows::new(x, m, self.k);
        let target = OutPtr(out.as_mut_ptr());
        let threads = rayon::current_num_threads();
        for part in self.parts.iter() {
            let groups = part.groups();
            // A few tasks per thread, each a contiguous run of groups, so that
            // the threads stream disjoint stretches of the weights.
            let per_task = groups.div_ceil(4 * threads).max(1);
            (0..groups.div_ceil(per_task)).into_par_iter().for_each(|t| {
                let groups = t * per_task..((t + 1) * per_task).min(groups);
                // SAFETY: this task alone writes the columns of its groups, all
                // inside `out` (`m × n`), and nothing reads `out` until every
                // task is done.
                unsafe { part_product(part, groups, &rows, self.n, target, kernel) };
            });
        }
    }
}

/// Token rows quantized to 8-bit blocks: `q` (`m × k`), and per block the
/// scale `d` and `d·Σq` (`m × k/QK` each).
pub(crate) struct QuantizedRows {
    k: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl QuantizedRows {
    /// Quantize `m` rows of `k` values (`k` a multiple of [`QK`]): per
    /// block `d = max|x| / 127`, `q = round(x / d)` (halves away from zero).
    pub(crate) fn new(x: &[f32], m: usize, k: usize) -> Self {
        assert!(k % QK == 0 && x.len() == m * k, "quantized rows' shape");
        let blocks = m * k / QK;
        let mut rows = QuantizedRows {
            k,
            q: vec![0; m * k],
            d: vec![0.0; blocks],
            s: vec![0.0; blocks],
        };
        for (((x, q), d), s) in x
            .chunks_exact(QK)
            .zip(rows.q.chunks_exact_mut(QK))
            .zip(&mut rows.d)
            .zip(&mut rows.s)
        {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            *d = amax / 127.0;
            let inverse = if *d != 0.0 { 1.0 / *d } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in q.iter_mut().zip(x) {
                *q = (v * inverse).round().clamp(-127.0, 127.0) as i8;
                sum += *q as i32;
            }
            *s = *d * sum as f32;
        }
        rows
    }

    fn blocks(&self) -> usize {
        self.k / QK
    }
}

/// The lanes of one output summed in the one order every kernel uses.
fn hsum(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// One output: weight row `row` of a part's blocks (`nb` a row, laid out in
/// groups) times token row `r` of `x`, in the arithmetic the module comment
/// gives, written out plainly. The portable kernel; the reference the SIMD
/// kernels are held to, bit for bit.
fn dot_reference(ty: QuantType, data: &[u8], nb: usize, row: usize, x: &QuantizedRows, r: usize) -> f32 {
    let bb = ty.block_bytes();
    let (g, j) = (row / WR, row % WR);
    let mut lanes = [0f32; 8];
    let mut min = 0f32;
    for b in 0..nb {
        let block = &data[((g * nb + b) * WR + j) * bb..][..bb];
        let (d, m) = scale_min(ty, block);
        let w = quants(ty, block);
        let xq = &x.q[r * x.k + b * QK..][..QK];
        let scale = d * x.d[r * nb + b];
        for (l, lane) in lanes.iter_mut().enumerate() {
            let sum: i32 = (4 * l..4 * l + 4).map(|i| w[i] * xq[i] as i32).sum();
            *lane = scale.mul_add(sum as f32, *lane);
        }
        if ty != QuantType::Q8_0 {
            min = m.mul_add(x.s[r * nb + b], min);
        }
    }
    hsum(lanes) + min
}

/// The output buffer, shared by tasks that write disjoint columns of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: tasks write disjoint columns only (see `QuantMatrix::matmul_into`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Every token row of `x` times the part's `groups`, into their columns of
/// `out` (`m × n`).
///
/// # Safety
/// Nothing else may touch those columns meanwhile; the CPU must have
/// `kernel` (resolved).
unsafe fn part_product(
    part: &Part,
    groups: std::ops::Range<usize>,
    x: &QuantizedRows,
    n: usize,
    out: OutPtr,
    kernel: QuantKernel,
) {
    let nb = x.blocks();
    let bb = part.ty.block_bytes();
    let m = x.d.len() / nb.max(1);
    if nb == 0 {
        for g in groups {
            for r in 0..m {
                for j in 0..WR.min(part.rows - g * WR) {
                    // SAFETY: the caller's contract; inside `out`.
                    unsafe { *out.0.add(r * n + part.first + g * WR + j) = 0.0 };
                }
            }
        }
        return;
    }
    for chunk in (0..m).step_by(MC) {
        let chunk = chunk..(chunk + MC).min(m);
        for g in groups.clone() {
            let cols = WR.min(part.rows - g * WR);
            let first_col = part.first + g * WR;
            if kernel == QuantKernel::Portable {
                for r in chunk.clone() {
                    for j in 0..cols {
                        let y = dot_reference(part.ty, &part.data, nb, g * WR + j, x, r);
                        // SAFETY: the caller's contract; inside `out`.
                        unsafe { *out.0.add(r * n + first_col + j) = y };
                    }
                }
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            {
                let blocks = part.data[g * nb * WR * bb..][..nb * WR * bb].as_ptr();
                let height = if kernel == QuantKernel::Avx512Vnni { XR_WIDE } else { XR };
                let mut r = chunk.start;
                while r < chunk.end {
                    let rows = height.min(chunk.end - r);
                    // SAFETY: the caller's contract; the group holds `nb × WR`
                    // blocks and each token row `nb` quantized blocks.
                    unsafe {
                        let tile = x86::Tile {
                            blocks,
                            nb,
                            x,
                            row: r,
                            out: out.0.add(r * n + first_col),
                            ldo: n,
                            cols,
                        };
                        match part.ty {
                            QuantType::Q8_0 => x86::tile::<x86::Q8>(kernel, rows, &tile),
                            QuantType::Q4_0 => x86::tile::<x86::Q4<false>>(kernel, rows, &tile),
                            QuantType::Q4_1 => x86::tile::<x86::Q4<true>>(kernel, rows, &tile),
                        }
                    }
                    r += rows;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{QuantKernel, QuantizedRows, QK, WR};

    /// A group's tile: [`WR`] weight rows (of which `cols` are real) times
    /// token rows `row..row + X` of `x`.
    pub(super) struct Tile<'a> {
        pub blocks: *const u8,
        pub nb: usize,
        pub x: &'a QuantizedRows,
        pub row: usize,
        /// The tile's first output; its rows are `ldo` apart.
        pub out: *mut f32,
        pub ldo: usize,
        pub cols: usize,
    }

    /// A block format as the AVX2 kernel reads it.
    pub(super) trait Block {
        const BYTES: usize;
        const MIN: bool;
        /// Scale and minimum (0 where there is none).
        unsafe fn scale_min(p: *const u8) -> (f32, f32);
        /// The block's weights, one byte each in order.
        unsafe fn weights(p: *const u8) -> __m256i;
        /// The weights and inputs as the unsigned and signed operands of a
        /// byte dot product with the same sums.
        unsafe fn operands(w: __m256i, x: __m256i) -> (__m256i, __m256i);
    }

    /// The eight lanes `Σ_{i=4l}^{4l+3} u[i]·s[i]` (`u` unsigned, `s` signed
    /// bytes; pairs' sums within i16, as [`Block::operands`] keeps them).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    /// [`dot_avx2`] in one instruction (AVX-VNNI).
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    fn dot_avx_vnni(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
    }

    /// [`dot_avx2`] in one instruction (AVX-512 VNNI on 256 bits).
    #[inline]
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    fn dot_avx512_vnni(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }

    #[inline(always)]
    unsafe fn half(p: *const u8) -> f32 {
        // SAFETY: the caller's block holds two bytes at `p`; F16C is there.
        unsafe {
            let bits = (p as *const u16).read_unaligned();
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
        }
    }

    pub(super) struct Q8;

    impl Block for Q8 {
        const BYTES: usize = 34;
        const MIN: bool = false;

        #[inline(always)]
        unsafe fn scale_min(p: *const u8) -> (f32, f32) {
            // SAFETY: as `half`.
            (unsafe { half(p) }, 0.0)
        }

        #[inline(always)]
        unsafe fn weights(p: *const u8) -> __m256i {
            // SAFETY: a Q8_0 block holds 32 quants after its scale.
            unsafe { _mm256_loadu_si256(p.add(2) as *const __m256i) }
        }

        #[inline(always)]
        unsafe fn operands(w: __m256i, x: __m256i) -> (__m256i, __m256i) {
            // |w| times x with w's sign: one operand unsigned, as the byte
            // dot products want; |w| ≤ 128 and |x| ≤ 127 keep each pair's sum
            // in i16.
            // SAFETY: AVX2 is there.
            unsafe { (_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)) }
        }
    }

    /// The 4-bit formats: `Q4_1` (`MIN`, scale and minimum) or `Q4_0`.
    pub(super) struct Q4<const MIN: bool>;

    impl<const M: bool> Block for Q4<M> {
        const BYTES: usize = if M { 20 } else { 18 };
        const MIN: bool = true;

        #[inline(always)]
        unsafe fn scale_min(p: *const u8) -> (f32, f32) {
            // SAFETY: as `half`.
            unsafe {
                let d = half(p);
                (d, if M { half(p.add(2)) } else { -8.0 * d })
            }
        }

        #[inline(always)]
        unsafe fn weights(p: *const u8) -> __m256i {
            // SAFETY: a 4-bit block holds 16 bytes of nibbles after its
            // scale(s): low nibbles are weights 0..16, high ones 16..32.
            unsafe {
                let packed = _mm_loadu_si128(p.add(if M { 4 } else { 2 }) as *const __m128i);
                let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
                _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
            }
        }

        #[inline(always)]
        unsafe fn operands(w: __m256i, x: __m256i) -> (__m256i, __m256i) {
            // w ≤ 15 keeps each pair's sum in i16.
            (w, x)
        }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: AVX is there. ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), as `super::hsum`.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
        }
    }

    /// [`WR`] weight rows times `rows` token rows (at most the kernel's
    /// tile height): `out[r][j]` for `j < cols`.
    ///
    /// # Safety
    /// `tile.blocks` must hold `nb × WR` blocks of `B`, `x` rows
    /// `row..row + rows`, `out` room for `cols` floats at each of `rows` rows
    /// `ldo` apart; the CPU must have `kernel` (AVX2, FMA, F16C and its own).
    pub(super) unsafe fn tile<B: Block>(kernel: QuantKernel, rows: usize, tile: &Tile<'_>) {
        // SAFETY: the caller's contract.
        unsafe {
            match (kernel, rows) {
                (QuantKernel::Avx512Vnni, 1) => tile_avx512_vnni::<B, 1>(tile),
                (QuantKernel::Avx512Vnni, 2) => tile_avx512_vnni::<B, 2>(tile),
                (QuantKernel::Avx512Vnni, 3) => tile_avx512_vnni::<B, 3>(tile),
                (QuantKernel::Avx512Vnni, _) => tile_avx512_vnni::<B, { super::XR_WIDE }>(tile),
                (QuantKernel::AvxVnni, 1) => tile_avx_vnni::<B, 1>(tile),
                (QuantKernel::AvxVnni, _) => tile_avx_vnni::<B, { super::XR }>(tile),
                (_, 1) => tile_avx2::<B, 1>(tile),
                (_, _) => tile_avx2::<B, { super::XR }>(tile),
            }
        }
    }

    /// One tile kernel for each byte dot product: the same body, built for
    /// the instructions its features allow.
    macro_rules! tile_kernel {
        ($name:ident, $features:literal, $dot:ident) => {
            /// [`WR`] weight rows times `X` token rows, as [`tile`].
            ///
            /// # Safety
            /// As [`tile`], with exactly `X` rows.
            #[target_feature(enable = $features)]
            unsafe fn $name<B: Block, const X: usize>(tile: &Tile<'_>) {
                let &Tile {
                    blocks,
                    nb,
                    x,
                    row,
                    out,
                    ldo,
                    cols,
                } = tile;
                let mut acc = [[_mm256_setzero_ps(); X]; WR];
                let mut min = [[0f32; X]; WR];
                let xq: [*const i8; X] = std::array::from_fn(|r| x.q[(row + r) * x.k..].as_ptr());
                let xd: [&[f32]; X] = std::array::from_fn(|r| &x.d[(row + r) * nb..][..nb]);
                let xs: [&[f32]; X] = std::array::from_fn(|r| &x.s[(row + r) * nb..][..nb]);
                for b in 0..nb {
                    // SAFETY: the caller's contract: block `b` of each row lies in range.
                    unsafe {
                        let xv: [__m256i; X] =
                            std::array::from_fn(|r| _mm256_loadu_si256(xq[r].add(b * QK) as *const __m256i));
                        for j in 0..WR {
                            let p = blocks.add((b * WR + j) * B::BYTES);
                            let (d, m) = B::scale_min(p);
                            let w = B::weights(p);
                            for r in 0..X {
                                let (u, s) = B::operands(w, xv[r]);
                                let sums = _mm256_cvtepi32_ps($dot(u, s));
                                acc[j][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r][b]), sums, acc[j][r]);
                                if B::MIN {
                                    min[j][r] = m.mul_add(xs[r][b], min[j][r]);
                                }
                            }
                        }
                    }
                }
                for (j, (acc, min)) in acc.iter().zip(&min).enumerate().take(cols) {
                    for r in 0..X {
                        // SAFETY: the caller's contract.
                        unsafe { *out.add(r * ldo + j) = hsum(acc[r]) + min[r] };
                    }
                }
            }
        };
    }

    tile_kernel!(tile_avx2, "avx2,fma,f16c", dot_avx2);
    tile_kernel!(tile_avx_vnni, "avx2,fma,f16c,avxvnni", dot_avx_vnni);
    tile_kernel!(tile_avx512_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", dot_avx512_vnni);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// Random-looking weights with a spread of magnitudes per block.
    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let unit = (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                unit * (1.0 + (i % 7) as f32)
            })
            .collect()
    }

    const TYPES: [(QuantType, GgmlDType); 3] = [
        (QuantType::Q8_0, GgmlDType::Q8_0),
        (QuantType::Q4_0, GgmlDType::Q4_0),
        (QuantType::Q4_1, GgmlDType::Q4_1),
    ];

    /// `n × k` weights quantized by candle, as a GGUF file holds them, and
    /// candle's dequantization of them.
    fn quantized(ggml: GgmlDType, n: usize, k: usize, seed: u32) -> (Vec<u8>, Vec<f32>) {
        let w = Tensor::from_vec(values(n * k, seed), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, ggml).unwrap();
        let back = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        (q.data().unwrap().into_owned(), back)
    }

    #[test]
    fn blocks_dequantize_as_gguf_does_whatever_the_row_order() {
        for (ty, ggml) in TYPES {
            let (n, k) = (7, 96);
            let (blocks, want) = quantized(ggml, n, k, 3);
            let m = QuantMatrix::from_blocks(ty, &blocks, n, k, None).unwrap();
            assert_eq!(m.dequantize(), want, "{}", ty.name());
            let order: Vec<usize> = (0..n).rev().collect();
            let reversed = QuantMatrix::from_blocks(ty, &blocks, n, k, Some(&order)).unwrap();
            let got = reversed.dequantize();
            for r in 0..n {
                assert_eq!(got[r * k..][..k], want[(n - 1 - r) * k..][..k], "{} row {r}", ty.name());
            }
            assert_eq!(m.bytes(), n.div_ceil(WR) * WR * k / QK * ty.block_bytes());
        }
    }

    #[test]
    fn malformed_blocks_are_refused() {
        let (blocks, _) = quantized(GgmlDType::Q8_0, 2, 64, 1);
        assert_eq!(
            QuantMatrix::from_blocks(QuantType::Q8_0, &blocks, 2, 48, None).unwrap_err(),
            QuantError::Inputs { inputs: 48 }
        );
        assert!(matches!(
            QuantMatrix::from_blocks(QuantType::Q8_0, &blocks[1..], 2, 64, None),
            Err(QuantError::Size { .. })
        ));
        assert!(matches!(
            QuantMatrix::from_blocks(QuantType::Q8_0, &blocks, 2, 64, Some(&[1, 1])),
            Err(QuantError::Order { .. })
        ));
    }

    /// Every kernel this CPU has gives the reference's outputs bit for bit,
    /// on odd shapes, partial groups and 1 to 64 token rows, stacked formats too.
    #[test]
    fn every_kernel_matches_the_reference_bit_for_bit() {
        let kernels = QuantKernel::available();
        for (n, k) in [(1, 32), (3, 64), (4, 96), (5, 576), (17, 160), (64, 64)] {
            let parts: Vec<QuantMatrix> = TYPES
                .iter()
                .enumerate()
                .map(|(i, &(ty, ggml))| {
                    let (blocks, _) = quantized(ggml, n, k, 10 + i as u32);
                    QuantMatrix::from_blocks(ty, &blocks, n, k, None).unwrap()
                })
                .collect();
            let stacked = QuantMatrix::stack(&parts).unwrap();
            for m in [1, 2, 3, 5, 64] {
                let x = values(m * k, 99 + m as u32);
                let rows = QuantizedRows::new(&x, m, k);
                let want: Vec<f32> = (0..m)
                    .flat_map(|r| {
                        let rows = &rows;
                        parts.iter().flat_map(move |p| {
                            let part = &p.parts[0];
                            (0..n).map(move |c| dot_reference(part.ty, &part.data, k / QK, c, rows, r))
                        })
                    })
                    .collect();
                for &kernel in &kernels {
                    let mut got = vec![f32::NAN; m * 3 * n];
                    stacked.matmul_into(&x, m, &mut got, kernel);
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel:?}, {n}×{k}, {m} rows"
                    );
                }
            }
        }
    }

    /// A row's outputs are the same alone as among others.
    #[test]
    fn a_row_gives_the_same_outputs_whatever_shares_its_product() {
        let (n, k) = (37, 192);
        let (blocks, _) = quantized(GgmlDType::Q4_1, n, k, 5);
        let w = QuantMatrix::from_blocks(QuantType::Q4_1, &blocks, n, k, None).unwrap();
        let x = values(9 * k, 8);
        let all = w.matmul(&x, 9);
        for r in 0..9 {
            assert_eq!(w.matmul(&x[r * k..][..k], 1), all[r * n..][..n], "row {r}");
        }
    }

    /// Against f32 products of the dequantized weights: within what rounding
    /// each input to its 8-bit block can move them, `Σ_b (d_x/2)·Σ|w|`, plus
    /// f32 rounding.
    #[test]
    fn products_stay_within_the_input_rounding_bound_of_f32() {
        let (n, k, m) = (24, 256, 3);
        for (ty, ggml) in TYPES {
            let (blocks, weights) = quantized(ggml, n, k, 21);
            let w = QuantMatrix::from_blocks(ty, &blocks, n, k, None).unwrap();
            let x = values(m * k, 22);
            let got = w.matmul(&x, m);
            let rows = QuantizedRows::new(&x, m, k);
            for r in 0..m {
                for c in 0..n {
                    let wr = &weights[c * k..][..k];
                    let exact: f64 = wr
                        .iter()
                        .zip(&x[r * k..][..k])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    let bound: f64 = (0..k / QK)
                        .map(|b| {
                            rows.d[r * (k / QK) + b] as f64 / 2.0
                                * wr[b * QK..][..QK].iter().map(|v| v.abs() as f64).sum::<f64>()
                        })
                        .sum::<f64>()
                        * 1.001
                        + 1e-4;
                    let err = (got[r * n + c] as f64 - exact).abs();
                    assert!(err <= bound, "{}: ({r}, {c}) off by {err}, bound {bound}", ty.name());
                }
            }
        }
    }
}
