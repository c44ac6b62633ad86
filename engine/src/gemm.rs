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
//! memory once per product whatever the number of token rows.
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

use std::sync::Arc;

use candle_core::{DType, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// Output columns per panel: two 8-lane registers of f32.
pub const NR: usize = 16;

/// Token rows per microkernel call with the 16 AVX registers: 6 rows × 2
/// registers of accumulators, plus 2 weight registers and a broadcast.
pub const MR: usize = 6;

/// Token rows per call where AVX-512VL gives 32 of them: 12 rows × 2
/// accumulators + 3. Fewer passes over each panel per step, and fewer loads
/// per multiply-add.
pub const MR_WIDE: usize = 12;

/// Token rows per pass over the weights: large pre-fill chunks are cut into
/// blocks whose rows stay in the core's L2 cache while the panels stream by.
const MC: usize = 96;

/// How far ahead of the current panel row the kernel asks for the weights, in
/// bytes. Panels are read front to back, and the hardware prefetchers stop at
/// page boundaries; the explicit prefetch runs on across them.
const PREFETCH_BYTES: usize = 1024;

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
            if avx2 && std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512vl") {
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

/// The precision panels are stored in.
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
    /// The precision a tensor of `dtype` is packed in: its own where it is one
    /// of the three, f32 otherwise.
    pub fn for_dtype(dtype: DType) -> Self {
        match dtype {
            DType::F16 => Precision::F16,
            DType::BF16 => Precision::Bf16,
            _ => Precision::F32,
        }
    }

    /// Bytes per weight.
    pub fn bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::F16 | Precision::Bf16 => 2,
        }
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

impl PackedMatrix {
    /// Pack an f32 `n × k` row-major matrix.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Self {
        Self::new(n, k, Panels::F32(pack(w, n, k)))
    }

    /// Pack an f16 `n × k` row-major matrix.
    pub fn from_f16(w: &[f16], n: usize, k: usize) -> Self {
        Self::new(n, k, Panels::F16(pack(w, n, k)))
    }

    /// Pack a bf16 `n × k` row-major matrix.
    pub fn from_bf16(w: &[bf16], n: usize, k: usize) -> Self {
        Self::new(n, k, Panels::Bf16(pack(w, n, k)))
    }

    /// Pack a 2-D `(n, k)` tensor in its own precision (f32, f16 or bf16;
    /// any other dtype is converted to f32).
    pub fn from_tensor(w: &Tensor) -> candle_core::Result<Self> {
        let (n, k) = w.dims2()?;
        Ok(match Precision::for_dtype(w.dtype()) {
            Precision::F16 => Self::from_f16(&w.flatten_all()?.to_vec1::<f16>()?, n, k),
            Precision::Bf16 => Self::from_bf16(&w.flatten_all()?.to_vec1::<bf16>()?, n, k),
            Precision::F32 => Self::from_f32(&w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, n, k),
        })
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
            Panels::Bf16(_) => Precision::Bf16,
        }
    }

    /// Bytes the panels occupy (what one product reads).
    pub fn bytes(&self) -> usize {
        self.n.div_ceil(NR) * NR * self.k * self.precision().bytes()
    }

    /// `x · Wᵀ` for `x` of `m × k` row-major: `m × n` row-major.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * self.n];
        self.matmul_into(x, m, &mut out, Kernel::Auto);
        out
    }

    /// [`PackedMatrix::matmul`] on the calling thread alone: for the many
    /// small products (an adapter's few rows) that callers run side by side.
    pub fn matmul_here(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * self.n];
        self.product(x, m, &mut out, Kernel::Auto, false);
        out
    }

    /// `out += scale · x·Wᵀ` for one row `x`, on this thread, panels side by
    /// side: the products of an adapter's single decoding row, which are too
    /// small to be worth tiles. Each output is the same sum as
    /// [`PackedMatrix::matmul`] gives, bit for bit. `false` (and nothing done)
    /// on a CPU without AVX2, FMA and F16C.
    pub fn row_add(&self, x: &[f32], out: &mut [f32], scale: f32) -> bool {
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
                }
            }
            return true;
        }
        let _ = scale;
        false
    }

    /// [`PackedMatrix::matmul`] into `out` (`m × n`), on the kernel chosen.
    pub fn matmul_into(&self, x: &[f32], m: usize, out: &mut [f32], kernel: Kernel) {
        self.product(x, m, out, kernel, true);
    }

    fn product(&self, x: &[f32], m: usize, out: &mut [f32], kernel: Kernel, parallel: bool) {
        assert_eq!(x.len(), m * self.k, "input shape");
        assert_eq!(out.len(), m * self.n, "output shape");
        if out.is_empty() {
            return;
        }
        let kernel = kernel.resolve();
        match &*self.panels {
            Panels::F32(p) => self.run(p.as_slice(), x, m, out, kernel, parallel),
            Panels::F16(p) => self.run(p.as_slice(), x, m, out, kernel, parallel),
            Panels::Bf16(p) => self.run(p.as_slice(), x, m, out, kernel, parallel),
        }
    }

    fn run<T: Element + Tile>(
        &self,
        panels: &[T],
        x: &[f32],
        m: usize,
        out: &mut [f32],
        kernel: Kernel,
        parallel: bool,
    ) {
        let (n, k) = (self.n, self.k);
        let count = n.div_ceil(NR);
        // A few tasks per thread, each a contiguous run of panels, so that the
        // threads stream disjoint stretches of the weights.
        let per_task = count.div_ceil(4 * rayon::current_num_threads()).max(1);
        let tasks = count.div_ceil(per_task);
        let target = OutPtr(out.as_mut_ptr());
        let mut packed_rows = Vec::new();
        for first_row in (0..m).step_by(MC) {
            let block_end = (first_row + MC).min(m);
            // Tiles of equal height (32 rows: 5 or 6 each, never 6 + 2): a short
            // tile leaves the FMA units waiting on too few accumulators.
            let (len, tiles) = (block_end - first_row, (block_end - first_row).div_ceil(kernel.rows()));
            let bounds: Vec<usize> = (0..=tiles).map(|t| first_row + t * len / tiles).collect();
            // Each tile's rows interleaved `[k][rows]`: the kernel then reads
            // one stream of inputs, whatever the tile's height.
            packed_rows.clear();
            packed_rows.resize(len * k, 0f32);
            for tile in bounds.windows(2) {
                let (row, rows) = (tile[0], tile[1] - tile[0]);
                let to = &mut packed_rows[(row - first_row) * k..(row - first_row + rows) * k];
                for r in 0..rows {
                    for (kk, &v) in x[(row + r) * k..(row + r + 1) * k].iter().enumerate() {
                        to[kk * rows + r] = v;
                    }
                }
            }
            let packed_rows = &packed_rows;
            let task = |t: usize| {
                let end = ((t + 1) * per_task).min(count);
                for p in t * per_task..end {
                    let panel = &panels[p * k * NR..(p + 1) * k * NR];
                    let cols = NR.min(n - p * NR);
                    // The task's next panel, fetched a slice per tile while this
                    // one is worked on, so no tile waits for memory.
                    let next = if p + 1 < end {
                        panels[(p + 1) * k * NR..].as_ptr()
                    } else {
                        panel.as_ptr()
                    };
                    let next_lines = if p + 1 < end {
                        (k * NR * std::mem::size_of::<T>()).div_ceil(64)
                    } else {
                        0
                    };
                    for (tile, bound) in bounds.windows(2).enumerate() {
                        let (row, rows) = (bound[0], bound[1] - bound[0]);
                        let x = &packed_rows[(row - first_row) * k..(row - first_row + rows) * k];
                        let first_line = tile * next_lines / tiles;
                        let ahead = Ahead {
                            from: (next as *const u8).wrapping_add(64 * first_line),
                            lines: (tile + 1) * next_lines / tiles - first_line,
                        };
                        // SAFETY: this task alone writes columns `p·NR..p·NR + cols`
                        // (its own panels) of rows `row..row + rows`, all inside `out`
                        // (`m × n`), and nothing reads `out` until every task is done.
                        unsafe {
                            let job = TileJob {
                                rows,
                                x,
                                panel,
                                out: target.get().add(row * n + p * NR),
                                ldo: n,
                                cols,
                                ahead,
                            };
                            if kernel == Kernel::Portable {
                                tile_portable(&job);
                            } else {
                                T::tile_simd(kernel, &job);
                            }
                        }
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
}

/// One tile of a product: `rows` token rows times one panel, into `cols`
/// columns of `rows` output rows.
struct TileJob<'a, T> {
    rows: usize,
    /// The inputs, interleaved `[k][rows]`.
    x: &'a [f32],
    /// The weights, `[k][NR]`.
    panel: &'a [T],
    /// The tile's first output; its rows are `ldo` apart.
    out: *mut f32,
    ldo: usize,
    cols: usize,
    ahead: Ahead,
}

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

/// `out[r][j] = Σₖ x[k][r] · panel[k][j]` for `r < rows ≤ MR_WIDE`, `j < cols ≤ NR`.
///
/// # Safety
/// `job.out` must be valid for writes of `cols` floats at each of `rows` rows `ldo` apart.
unsafe fn tile_portable<T: Element>(job: &TileJob<'_, T>) {
    let &TileJob {
        rows,
        x,
        panel,
        out,
        ldo,
        cols,
        ..
    } = job;
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
    for (r, acc) in acc.iter().enumerate().take(rows) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), out.add(r * ldo), cols) };
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

    use super::{Kernel, Tile, TileJob, MR, MR_WIDE, NR, PREFETCH_BYTES};

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

    /// The `R`-row kernel for one element type, `$load` widening 8 weights to f32.
    macro_rules! kernel {
        ($name:ident, $features:literal, $t:ty, $load:ident) => {
            #[target_feature(enable = $features)]
            unsafe fn $name<const R: usize>(job: &TileJob<'_, $t>) {
                let (k, x, panel) = (job.panel.len() / NR, job.x.as_ptr(), job.panel.as_ptr());
                let (out, ldo, cols, ahead) = (job.out, job.ldo, job.cols, job.ahead);
                // SAFETY (whole body): the caller checked that `x` holds `k × R`
                // inputs, and guarantees the tile of `out`.
                unsafe {
                    let mut lo = [_mm256_setzero_ps(); R];
                    let mut hi = [_mm256_setzero_ps(); R];
                    for kk in 0..k {
                        let b = panel.add(kk * NR);
                        // A prefetch never faults, even past the end of the panels.
                        _mm_prefetch::<_MM_HINT_T0>((b as *const i8).wrapping_add(PREFETCH_BYTES));
                        if kk < ahead.lines {
                            _mm_prefetch::<_MM_HINT_T1>(ahead.from.wrapping_add(64 * kk) as *const i8);
                        }
                        let (b0, b1) = ($load(b), $load(b.add(8)));
                        for r in 0..R {
                            let a = _mm256_broadcast_ss(&*x.add(kk * R + r));
                            lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
                            hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
                        }
                    }
                    if cols == NR {
                        for r in 0..R {
                            _mm256_storeu_ps(out.add(r * ldo), lo[r]);
                            _mm256_storeu_ps(out.add(r * ldo + 8), hi[r]);
                        }
                    } else {
                        let mut row = [0f32; NR];
                        for r in 0..R {
                            _mm256_storeu_ps(row.as_mut_ptr(), lo[r]);
                            _mm256_storeu_ps(row.as_mut_ptr().add(8), hi[r]);
                            std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(r * ldo), cols);
                        }
                    }
                }
            }
        };
    }

    /// Independent chains of multiply-adds in [`fma_chains`]: enough to cover
    /// the latency on two FMA pipes.
    pub const FMA_CHAINS: usize = 12;

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

    row_kernel!(row_f32, f32, load_f32);
    row_kernel!(row_f16, f16, load_f16);
    row_kernel!(row_bf16, bf16, load_bf16);

    /// Dispatch on the kernel and the tile's height, for one element type.
    macro_rules! tile {
        ($t:ty, $narrow:ident, $wide:ident) => {
            impl Tile for $t {
                unsafe fn tile_simd(kernel: Kernel, job: &TileJob<'_, Self>) {
                    let (rows, k) = (job.rows, job.panel.len() / NR);
                    let limit = if kernel == Kernel::Avx512 { MR_WIDE } else { MR };
                    assert!(rows <= limit && job.x.len() >= rows * k && job.cols <= NR);
                    // SAFETY: the assertion bounds every read; the caller vouches
                    // for `out` and for the CPU's features.
                    unsafe {
                        if kernel == Kernel::Avx512 {
                            match rows {
                                1 => $wide::<1>(job),
                                2 => $wide::<2>(job),
                                3 => $wide::<3>(job),
                                4 => $wide::<4>(job),
                                5 => $wide::<5>(job),
                                6 => $wide::<6>(job),
                                7 => $wide::<7>(job),
                                8 => $wide::<8>(job),
                                9 => $wide::<9>(job),
                                10 => $wide::<10>(job),
                                11 => $wide::<11>(job),
                                _ => $wide::<12>(job),
                            }
                        } else {
                            match rows {
                                1 => $narrow::<1>(job),
                                2 => $narrow::<2>(job),
                                3 => $narrow::<3>(job),
                                4 => $narrow::<4>(job),
                                5 => $narrow::<5>(job),
                                _ => $narrow::<6>(job),
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
    use crate::rng::SplitMix;

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

    #[test]
    fn a_single_row_gives_the_tiled_product_bit_for_bit() {
        let mut rng = SplitMix::new(11);
        for (n, k) in [(16, 1024), (8, 64), (2816, 16), (1000, 16), (37, 33), (1, 5)] {
            let w = random(n * k, &mut rng);
            let x = random(k, &mut rng);
            let halves: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let brains: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            for packed in [
                PackedMatrix::from_f32(&w, n, k),
                PackedMatrix::from_f16(&halves, n, k),
                PackedMatrix::from_bf16(&brains, n, k),
            ] {
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
