//! Heterogeneous batched LoRA, as Punica's SGMV: every (adapter,
//! projection) pair of an adapted product is one [`Segment`] (the module and
//! the rows that use it) of one segmented product — shrink, then expand
//! (`scale · (x·Aᵀ)·Bᵀ`) into the projection's columns — for any mix of
//! adapters and ranks in one continuous batch, base rows untouched. [`Sgmv`]
//! is the device seam; [`CpuSgmv`] runs on the packed product kernels.
//!
//! On the CPU, where some adapter of a product has a decoding step's rows
//! (fewer than 64 rows; one row each where every sequence has its own
//! adapter), the expand runs inside the base product, on float panels or
//! quantized blocks ([`CpuSgmv::apply_fused`], [`PackedMatrix::matmul_expand`],
//! [`QuantMatrix::matmul_expand`]): the shrinks
//! run first, side by side on the cores, and the product's task that has
//! just computed a panel of outputs adds each row's `scale · shrunk·Bᵀ` for
//! those columns, so the adapters' `B` bytes are read while the cores
//! multiply the base's. Where those adapters read a megabyte or more for
//! one product (many distinct adapters), they run beside the product
//! instead ([`CpuSgmv::apply_beside`]): one thread streams their weights
//! while the others multiply. Otherwise [`CpuSgmv::apply_rows`] runs after
//! the product. Every path gives every output the same sums, bit for bit.

use candle_core::Tensor;

use crate::lora::PackedLora;
use crate::ops::gemm::{Expand, Fused, PackedMatrix, RowProduct, EXPAND_WIDE_ROWS, NR};
use crate::ops::quant::QuantMatrix;

/// A base product the adapters' expand can run inside
/// ([`CpuSgmv::apply_fused`]): float panels or quantized blocks.
#[derive(Debug, Clone, Copy)]
pub enum Base<'w> {
    Packed(&'w PackedMatrix),
    Quant(&'w QuantMatrix),
}

impl<'w> From<&'w PackedMatrix> for Base<'w> {
    fn from(w: &'w PackedMatrix) -> Self {
        Base::Packed(w)
    }
}

impl<'w> From<&'w QuantMatrix> for Base<'w> {
    fn from(w: &'w QuantMatrix) -> Self {
        Base::Quant(w)
    }
}

impl Base<'_> {
    fn inputs(self) -> usize {
        match self {
            Base::Packed(w) => w.inputs(),
            Base::Quant(w) => w.inputs(),
        }
    }

    fn outputs(self) -> usize {
        match self {
            Base::Packed(w) => w.outputs(),
            Base::Quant(w) => w.outputs(),
        }
    }

    /// Whether every panel of the product's outputs comes from one piece of
    /// its weights (always for float panels; for quantized blocks, where the
    /// formats' parts start on panels).
    pub fn fusable(self) -> bool {
        match self {
            Base::Packed(_) => true,
            Base::Quant(w) => w.panels_whole(),
        }
    }

    fn matmul_expand(self, x: &[f32], m: usize, expand: &[&[Expand<'_>]]) -> Vec<f32> {
        match self {
            Base::Packed(w) => w.matmul_expand(x, m, expand),
            Base::Quant(w) => w.matmul_expand(x, m, expand),
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
pub(crate) trait Sgmv {
    /// Apply every segment to `y`, the base projection's output for `x`.
    fn apply(&self, x: &Tensor, y: Tensor, segments: &[Segment<'_>]) -> candle_core::Result<Tensor>;
}

/// [`Sgmv`] on the CPU, on the packed product kernels.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuSgmv;

/// Below this many rows an adapter's rows go one by one through
/// [`PackedMatrix::row_add`]; from it on, through tiles.
const FEW_ROWS: usize = 8;

/// Below this many rows an adapter's shrinks in [`CpuSgmv::apply_fused`] go
/// row by row ([`PackedMatrix::row_products`]), and its expand runs inside
/// the product: a decoding step's rows, however many share an adapter (its
/// `A` and `B` then stay in cache from one row to the next). From it on
/// (pre-fill chunks) the shrinks go through tiles.
const FUSED_ROWS: usize = 64;

/// From this many bytes of adapter weights in one product (a core's L2,
/// about), [`CpuSgmv::apply_fused`] runs a decoding step's adapters beside
/// the product ([`CpuSgmv::apply_beside`]) rather than inside it.
const BESIDE_BYTES: usize = 1 << 20;

/// How many panels ahead of the one it multiplies the expand beside the
/// product asks for each row's `B` (a rank-16 bf16 panel is 512 bytes:
/// [`crate::ops::gemm::STREAM_AHEAD_BYTES`] of each row's stream).
const BESIDE_AHEAD_PANELS: usize = 4;

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
    /// the better way to: some adapter has the rows of a decoding step
    /// ([`FUSED_ROWS`]). Where every adapter has many (pre-fill), the tiles
    /// after the product read each `B` once for all its rows.
    pub(crate) fn fusable(segments: &[Segment<'_>]) -> bool {
        PackedMatrix::rows_direct()
            && segments.iter().all(|s| s.offset % NR == 0)
            && segments.iter().any(|s| s.rows.len() < FUSED_ROWS)
    }

    /// The base product `x·Wᵀ` (`w`, float panels or quantized blocks) with
    /// every segment added, the expand fused into the product
    /// ([`PackedMatrix::matmul_expand`], [`QuantMatrix::matmul_expand`]):
    /// first each segment's shrink `x[rows]·Aᵀ`, side by side on the cores,
    /// then one product whose tasks add each row's `scale · shrunk·Bᵀ` to
    /// the panels they have just computed. The same sums as the product
    /// followed by [`CpuSgmv::apply_rows`], bit for bit. A decoding step
    /// whose adapters read a megabyte or more here runs beside the product
    /// instead ([`CpuSgmv::apply_beside`], the same sums). Needs
    /// [`CpuSgmv::fusable`] and [`Base::fusable`].
    pub fn apply_fused<'w>(
        &self,
        w: impl Into<Base<'w>>,
        x: &[f32],
        tokens: usize,
        segments: &[Segment<'_>],
    ) -> candle_core::Result<Vec<f32>> {
        use rayon::prelude::*;
        let w = w.into();
        check_fused(w, tokens, segments)?;
        if Self::beside(segments) {
            return Ok(beside_product(w, x, tokens, segments));
        }
        let inputs = w.inputs();
        // The shrinks. A segment of a decoding step's rows (one row, the
        // usual case, or the rows of a shared adapter) goes row by row, every
        // such row of every segment in one list whose products run several
        // at once; a segment of many rows goes through tiles, cut into one
        // task per thread.
        let threads = rayon::current_num_threads();
        let few: Vec<(usize, usize)> = segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.rows.len() < FUSED_ROWS)
            .flat_map(|(i, s)| s.rows.iter().map(move |&r| (i, r)))
            .collect();
        let mut few_shrunk = vec![0f32; few.iter().map(|&(i, _)| segments[i].module.a.outputs()).sum()];
        let tiled: Vec<(usize, std::ops::Range<usize>)> = segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.rows.len() >= FUSED_ROWS)
            .flat_map(|(i, s)| {
                let per_task = s.rows.len().div_ceil(threads);
                (0..s.rows.len())
                    .step_by(per_task)
                    .map(move |start| (i, start..(start + per_task).min(s.rows.len())))
            })
            .collect();
        let (_, tiled_shrunk) = rayon::join(
            || {
                let mut products = row_shrinks(x, inputs, segments, &few, &mut few_shrunk);
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
        let mut expand = expand_lists(tokens, segments, &few, &few_shrunk, None);
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

impl CpuSgmv {
    /// Whether [`CpuSgmv::apply_fused`] runs `segments` beside the product
    /// ([`CpuSgmv::apply_beside`]): a pool of more than one thread, and a
    /// decoding step's rows only, whose adapters read at least
    /// [`BESIDE_BYTES`] for this product (many distinct adapters, whose
    /// weights come from memory).
    pub(crate) fn beside(segments: &[Segment<'_>]) -> bool {
        rayon::current_num_threads() > 1
            && segments.iter().all(|s| s.rows.len() < FUSED_ROWS)
            && segments
                .iter()
                .map(|s| s.module.a.bytes() + s.module.b.bytes())
                .sum::<usize>()
                >= BESIDE_BYTES
    }

    /// What [`CpuSgmv::apply_fused`] gives, bit for bit, with the adapters
    /// beside the product rather than inside it: one thread runs every
    /// row's shrink and then its expand into a buffer of its own (`shrunk·Bᵀ`,
    /// each adapter's weights read front to back), while the pool's other
    /// threads start the base product, which this thread joins when it is
    /// done; each row then gets `out + scale · sum`. Where every row has
    /// its own adapter, their bytes stream from memory on one core while
    /// the others multiply, instead of every core waiting on them in turn.
    /// Needs what [`CpuSgmv::apply_fused`] needs, and a decoding step's
    /// rows (fewer than 64 for each adapter).
    pub fn apply_beside<'w>(
        &self,
        w: impl Into<Base<'w>>,
        x: &[f32],
        tokens: usize,
        segments: &[Segment<'_>],
    ) -> candle_core::Result<Vec<f32>> {
        let w = w.into();
        check_fused(w, tokens, segments)?;
        if !PackedMatrix::rows_direct() {
            candle_core::bail!("sgmv: the adapters beside the product need AVX2, FMA and F16C");
        }
        if let Some(s) = segments.iter().find(|s| s.rows.len() >= FUSED_ROWS) {
            candle_core::bail!(
                "sgmv: {} rows of one adapter are a pre-fill's, not a decoding step's",
                s.rows.len()
            );
        }
        Ok(beside_product(w, x, tokens, segments))
    }
}

/// [`CpuSgmv::apply_beside`] on segments it has checked.
fn beside_product(w: Base<'_>, x: &[f32], tokens: usize, segments: &[Segment<'_>]) -> Vec<f32> {
    let (inputs, outputs) = (w.inputs(), w.outputs());
    let rows: Vec<(usize, usize)> = segments
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.rows.iter().map(move |&r| (i, r)))
        .collect();
    let (sums, mut y) = rayon::join(
        || {
            // `-0 + 1 · sum` is each sum exactly, a zero's sign included.
            let mut sums = vec![-0f32; tokens * outputs];
            let mut shrunk = vec![0f32; rows.iter().map(|&(i, _)| segments[i].module.a.outputs()).sum()];
            PackedMatrix::row_products(&mut row_shrinks(x, inputs, segments, &rows, &mut shrunk));
            let lists = expand_lists(tokens, segments, &rows, &shrunk, Some(1.0));
            let lists: Vec<&[Expand<'_>]> = lists.iter().map(Vec::as_slice).collect();
            let expand = Fused::checked(&lists, tokens, outputs);
            // Eight rows at a time, panel after panel: each row's `B`
            // read front to back.
            for first in (0..tokens).step_by(EXPAND_WIDE_ROWS) {
                let batch = first..(first + EXPAND_WIDE_ROWS).min(tokens);
                for p in 0..outputs.div_ceil(NR) {
                    // The lines of the panels ahead asked for while this
                    // one's are multiplied: at the first, each of them.
                    let ahead = if p == 0 { 1 } else { BESIDE_AHEAD_PANELS };
                    for q in p + ahead..=p + BESIDE_AHEAD_PANELS {
                        expand.prefetch(batch.clone(), q);
                    }
                    // SAFETY: this thread alone writes `sums`, `tokens × outputs`.
                    unsafe { expand.add(batch.clone(), p, sums.as_mut_ptr(), outputs) };
                }
            }
            sums
        },
        || w.matmul_expand(x, tokens, &[]),
    );
    for segment in segments {
        let (columns, scale) = (segment.module.b.outputs(), segment.module.scale);
        for &r in segment.rows {
            let at = r * outputs + segment.offset;
            // `out + scale · sum`, a multiply then an add, as inside the product.
            for (y, sum) in y[at..at + columns].iter_mut().zip(&sums[at..at + columns]) {
                *y += scale * sum;
            }
        }
    }
    y
}

/// [`CpuSgmv::apply_fused`]'s checks: the base's parts start on panels, and
/// each segment's projection fits the product, starts on a panel, and has
/// rows in range that no other adapter claims.
fn check_fused(w: Base<'_>, tokens: usize, segments: &[Segment<'_>]) -> candle_core::Result<()> {
    if !w.fusable() {
        candle_core::bail!("sgmv: the base's quantized parts do not start on panels");
    }
    let inputs = w.inputs();
    let mut rows_seen = vec![None; tokens];
    for (i, segment) in segments.iter().enumerate() {
        let module = segment.module;
        if module.a.inputs() != inputs
            || segment.offset + module.b.outputs() > w.outputs()
            || module.b.inputs() != module.a.outputs()
            || segment.offset % NR != 0
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
    Ok(())
}

/// One row product per `(segment, row)` of `rows`: the row of `x` times the
/// segment's `A`, into `rank` values of `shrunk` each, in order.
fn row_shrinks<'a>(
    x: &'a [f32],
    inputs: usize,
    segments: &[Segment<'a>],
    rows: &[(usize, usize)],
    shrunk: &'a mut [f32],
) -> Vec<RowProduct<'a>> {
    let mut products = Vec::with_capacity(rows.len());
    let mut rest = shrunk;
    for &(i, r) in rows {
        let a = &segments[i].module.a;
        let (out, tail) = std::mem::take(&mut rest).split_at_mut(a.outputs());
        rest = tail;
        products.push(RowProduct {
            w: a,
            x: &x[r * inputs..(r + 1) * inputs],
            out,
        });
    }
    products
}

/// Each row's expand list (`tokens` of them) for the `(segment, row)` pairs
/// of `rows`, whose shrunk inputs lie in `shrunk` in that order; each part
/// at its segment's scale, or at `scale`.
fn expand_lists<'a>(
    tokens: usize,
    segments: &[Segment<'a>],
    rows: &[(usize, usize)],
    shrunk: &'a [f32],
    scale: Option<f32>,
) -> Vec<Vec<Expand<'a>>> {
    let mut expand: Vec<Vec<Expand<'a>>> = vec![Vec::new(); tokens];
    let mut rest = shrunk;
    for &(i, r) in rows {
        let segment = &segments[i];
        let (shrunk, tail) = rest.split_at(segment.module.a.outputs());
        rest = tail;
        expand[r].push(Expand {
            b: &segment.module.b,
            shrunk,
            first_column: segment.offset,
            scale: scale.unwrap_or(segment.module.scale),
        });
    }
    expand
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
