//! The vector kernels attention runs on: the dot products of a group of query
//! heads with one key, softmax's exponentials (which the MLP's SiLU takes
//! too), and the weighted sums of values into them. AVX2 and
//! FMA when the CPU has them (checked at run time; the weighted sums on
//! AVX-512F where it has that too, with the same bits), portable loops
//! otherwise.
//! The matrix products of the projections are in [`crate::ops::gemm`].

/// AVX-512F beside AVX2 and FMA: the weighted sums take a head's values in
/// 512-bit registers, one pass over the positions.
pub(crate) fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_fma() && super::avx512_allowed() && std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Vectors of `d` floats at `data[offset + shift..]` for each of `offsets`:
/// the keys or values of one head at every visible position of a sequence.
#[derive(Clone, Copy)]
pub(crate) struct Gathered<'a> {
    /// The layer's keys or values.
    pub data: &'a [f32],
    /// Where each position's vector starts, less `shift`.
    pub offsets: &'a [usize],
    /// Added to every offset (the head's place in a token's slot).
    pub shift: usize,
    /// Floats per vector.
    pub d: usize,
}

impl Gathered<'_> {
    fn check(&self) {
        let end = self.offsets.iter().max().map_or(0, |o| o + self.shift + self.d);
        assert!(end <= self.data.len(), "a gathered vector runs past the data");
    }

    fn at(&self, i: usize) -> &[f32] {
        let start = self.offsets[i] + self.shift;
        &self.data[start..start + self.d]
    }
}

/// `scores[i·g + j] = queries[j] · vectors[i]` for the `g` queries of `d`
/// floats laid end to end in `queries` (the query heads that share one
/// key-value head): each key is read once for all of them.
pub(crate) fn scores(queries: &[f32], keys: Gathered<'_>, scores: &mut [f32]) {
    let (d, n) = (keys.d, keys.offsets.len());
    let g = queries.len() / d.max(1);
    assert!(queries.len() == g * d && scores.len() == n * g, "score shapes");
    keys.check();
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && d % 8 == 0 {
        // SAFETY: both features were found; shapes and offsets were checked above.
        unsafe { scores_avx2(queries, keys, g, scores) };
        return;
    }
    for (i, score) in scores.chunks_exact_mut(g.max(1)).enumerate() {
        let key = keys.at(i);
        for (s, q) in score.iter_mut().zip(queries.chunks_exact(d.max(1))) {
            *s = dot_portable(q, key);
        }
    }
}

/// `out[j·d..(j+1)·d] += Σᵢ weights[i·g + j] · values[i]` for the `g = out.len() / d`
/// outputs laid end to end in `out`: each value is read once for all of them.
pub(crate) fn weighted_sum(weights: &[f32], values: Gathered<'_>, out: &mut [f32]) {
    let (d, n) = (values.d, values.offsets.len());
    let g = out.len() / d.max(1);
    assert!(out.len() == g * d && weights.len() == n * g, "weighted-sum shapes");
    values.check();
    #[cfg(target_arch = "x86_64")]
    if has_avx512f() && d % 16 == 0 {
        // SAFETY: the features were found; shapes and offsets were checked above.
        unsafe { weighted_sum_avx512(weights, values, g, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && d % 16 == 0 {
        // SAFETY: both features were found; shapes and offsets were checked above.
        unsafe { weighted_sum_avx2(weights, values, g, out) };
        return;
    }
    for (i, w) in weights.chunks_exact(g.max(1)).enumerate() {
        let value = values.at(i);
        for (&w, o) in w.iter().zip(out.chunks_exact_mut(d.max(1))) {
            for (o, v) in o.iter_mut().zip(value) {
                *o += w * v;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2(queries: &[f32], keys: Gathered<'_>, g: usize, scores: &mut [f32]) {
    // Four queries at a time: their four sums come out of one horizontal-add tree.
    for j0 in (0..g).step_by(4) {
        // SAFETY (each): the caller's, and `j0 + W <= g`.
        unsafe {
            match g - j0 {
                1 => scores_avx2_group::<1>(queries, keys, g, j0, scores),
                2 => scores_avx2_group::<2>(queries, keys, g, j0, scores),
                3 => scores_avx2_group::<3>(queries, keys, g, j0, scores),
                _ => scores_avx2_group::<4>(queries, keys, g, j0, scores),
            }
        }
    }
}

/// Positions ahead whose keys the scores ask for.
const KEYS_AHEAD: usize = 8;

/// Keys whose scores one pass takes together: each query's 8 floats are
/// loaded once for all of them (12 sums, 3 keys and a query: the 16
/// registers).
const KEYS_AT_ONCE: usize = 3;

/// [`scores_avx2`] for queries `j0..j0 + W`: keys [`KEYS_AT_ONCE`] at a time,
/// the rest one by one. Every score is the same chain of multiply-adds and
/// the same horizontal-add tree whichever way its key is taken.
///
/// # Safety
/// As [`scores_avx2`], and `j0 + W <= g`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2_group<const W: usize>(
    queries: &[f32],
    keys: Gathered<'_>,
    g: usize,
    j0: usize,
    scores: &mut [f32],
) {
    let n = keys.offsets.len();
    let mut i = 0;
    while i + KEYS_AT_ONCE <= n {
        // SAFETY: the caller's; keys `i..i + KEYS_AT_ONCE` exist.
        unsafe { scores_avx2_keys::<W, KEYS_AT_ONCE>(queries, keys, g, j0, i, scores) };
        i += KEYS_AT_ONCE;
    }
    for i in i..n {
        // SAFETY: as above, key `i`.
        unsafe { scores_avx2_keys::<W, 1>(queries, keys, g, j0, i, scores) };
    }
}

/// The scores of queries `j0..j0 + W` with keys `i..i + K`.
///
/// # Safety
/// As [`scores_avx2_group`], and `i + K` at most the number of keys.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2_keys<const W: usize, const K: usize>(
    queries: &[f32],
    keys: Gathered<'_>,
    g: usize,
    j0: usize,
    i: usize,
    scores: &mut [f32],
) {
    use std::arch::x86_64::*;
    let d = keys.d;
    // SAFETY (every access): `check` kept each key inside `keys.data`, `d % 8 == 0`,
    // query `j0 + j < g` spans `(j0 + j)·d..` of `queries`, and `scores` holds `n·g`;
    // a prefetch reads nothing.
    unsafe {
        let key: [*const f32; K] = std::array::from_fn(|t| keys.data.as_ptr().add(keys.offsets[i + t] + keys.shift));
        // Every line of the keys `KEYS_AHEAD` further on: the cache's blocks
        // lie apart, where the hardware's prefetchers do not follow.
        for t in 0..K {
            if let Some(&ahead) = keys.offsets.get(i + t + KEYS_AHEAD) {
                let line = keys.data.as_ptr().wrapping_add(ahead + keys.shift) as *const i8;
                for c in (0..d).step_by(16) {
                    _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(4 * c));
                }
            }
        }
        let query = queries.as_ptr().add(j0 * d);
        let mut acc = [[_mm256_setzero_ps(); K]; W];
        for c in (0..d).step_by(8) {
            let k: [__m256; K] = std::array::from_fn(|t| _mm256_loadu_ps(key[t].add(c)));
            for (j, acc) in acc.iter_mut().enumerate() {
                let q = _mm256_loadu_ps(query.add(j * d + c));
                for (acc, k) in acc.iter_mut().zip(&k) {
                    *acc = _mm256_fmadd_ps(q, *k, *acc);
                }
            }
        }
        // Each key's sums of the four queries, zero past the group's `W`.
        let by_key: [[__m256; 4]; K] =
            std::array::from_fn(|t| std::array::from_fn(|j| if j < W { acc[j][t] } else { _mm256_setzero_ps() }));
        for (t, sum) in by_key.iter().enumerate() {
            let pairs = _mm256_hadd_ps(_mm256_hadd_ps(sum[0], sum[1]), _mm256_hadd_ps(sum[2], sum[3]));
            let sums = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps::<1>(pairs));
            let out = scores.as_mut_ptr().add((i + t) * g + j0);
            if W == 4 {
                _mm_storeu_ps(out, sums);
            } else {
                let mut four = [0f32; 4];
                _mm_storeu_ps(four.as_mut_ptr(), sums);
                std::ptr::copy_nonoverlapping(four.as_ptr(), out, W);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_sum_avx2(weights: &[f32], values: Gathered<'_>, g: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = values.d;
    let base = values.data.as_ptr().wrapping_add(values.shift);
    // Four outputs × 16 floats of accumulators stay in registers while every
    // position's value streams by: one pass over the positions for each 16
    // floats. The first pass asks for every line of the value `AHEAD`
    // positions on, so that it reads them from memory once and the later
    // passes find them in cache.
    for j0 in (0..g).step_by(4) {
        let width = (g - j0).min(4);
        for c in (0..d).step_by(16) {
            let first = j0 == 0 && c == 0;
            // SAFETY (every access): `check` kept each value inside `values.data`,
            // `d % 16 == 0`, output `j0 + j < g` spans `(j0 + j)·d..` of `out`,
            // and `weights` holds `n·g`; a prefetch reads nothing.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                for i in 0..values.offsets.len() {
                    if first {
                        if let Some(&ahead) = values.offsets.get(i + AHEAD) {
                            let value = base.wrapping_add(ahead) as *const i8;
                            for at in (0..4 * d).step_by(64).chain([4 * d - 1]) {
                                _mm_prefetch::<_MM_HINT_T0>(value.wrapping_add(at));
                            }
                        }
                    }
                    let value = base.add(values.offsets[i] + c);
                    let (v0, v1) = (_mm256_loadu_ps(value), _mm256_loadu_ps(value.add(8)));
                    for (j, acc) in acc.iter_mut().enumerate().take(width) {
                        let w = _mm256_broadcast_ss(&*weights.as_ptr().add(i * g + j0 + j));
                        acc[0] = _mm256_fmadd_ps(w, v0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(w, v1, acc[1]);
                    }
                }
                for (j, acc) in acc.iter().enumerate().take(width) {
                    let o = out.as_mut_ptr().add((j0 + j) * d + c);
                    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[0]));
                    _mm256_storeu_ps(o.add(8), _mm256_add_ps(_mm256_loadu_ps(o.add(8)), acc[1]));
                }
            }
        }
    }
}

/// Positions ahead whose values the weighted sums ask for (each pass of the
/// AVX-512 kernel, the first pass of the AVX2 one).
const AHEAD: usize = 4;

/// [`weighted_sum_avx2`]'s sums, bit for bit (each output float is the same
/// chain of multiply-adds over the positions in order, then added to `out`),
/// with up to 64 floats of a head for up to four outputs held in sixteen
/// 512-bit registers: one pass over the positions reads each value's lines
/// once, in order, where the AVX2 kernel passes over every position once
/// for each 16 floats.
///
/// # Safety
/// The CPU has AVX-512F, AVX2 and FMA; `values.check()` held, `values.d % 16 == 0`,
/// `out.len() == g·d` and `weights.len() == n·g`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn weighted_sum_avx512(weights: &[f32], values: Gathered<'_>, g: usize, out: &mut [f32]) {
    let d = values.d;
    for c in (0..d).step_by(64) {
        for j0 in (0..g).step_by(4) {
            let width = (g - j0).min(4);
            let tile = match ((d - c) / 16).min(4) {
                4 => avx512_tile::<4>(width),
                3 => avx512_tile::<3>(width),
                2 => avx512_tile::<2>(width),
                _ => avx512_tile::<1>(width),
            };
            // SAFETY: the caller's; the tile takes at most the floats left
            // after `c` and the outputs left after `j0`.
            unsafe { tile(weights, values, g, c, j0, out) };
        }
    }
}

/// A tile of [`weighted_sum_avx512`]: weights, values, `g`, first float, first output, outputs.
#[cfg(target_arch = "x86_64")]
type Avx512Tile = unsafe fn(&[f32], Gathered<'_>, usize, usize, usize, &mut [f32]);

/// [`weighted_sum_avx512_tile`] for `R` registers of each of `width` (at
/// most four) outputs.
#[cfg(target_arch = "x86_64")]
fn avx512_tile<const R: usize>(width: usize) -> Avx512Tile {
    match width {
        4 => weighted_sum_avx512_tile::<R, 4>,
        3 => weighted_sum_avx512_tile::<R, 3>,
        2 => weighted_sum_avx512_tile::<R, 2>,
        _ => weighted_sum_avx512_tile::<R, 1>,
    }
}

/// Floats `c..c + 16·R` of outputs `j0..j0 + W` of [`weighted_sum_avx512`].
///
/// # Safety
/// As [`weighted_sum_avx512`], and `c + 16·R <= d`, `j0 + W <= g`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn weighted_sum_avx512_tile<const R: usize, const W: usize>(
    weights: &[f32],
    values: Gathered<'_>,
    g: usize,
    c: usize,
    j0: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (d, n) = (values.d, values.offsets.len());
    let base = values.data.as_ptr().wrapping_add(values.shift + c);
    // SAFETY (every access): `check` kept each value inside `values.data`,
    // `c + 16·R <= d`, output `j0 + j < g` spans `(j0 + j)·d..` of `out`, and
    // `weights` holds `n·g`; a prefetch reads nothing.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); R]; W];
        for i in 0..n {
            if let Some(&ahead) = values.offsets.get(i + AHEAD) {
                let line = base.wrapping_add(ahead) as *const i8;
                for t in 0..R {
                    _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(64 * t));
                }
            }
            let value = base.add(values.offsets[i]);
            let v: [__m512; R] = std::array::from_fn(|t| _mm512_loadu_ps(value.add(16 * t)));
            for (j, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*weights.get_unchecked(i * g + j0 + j));
                for (acc, v) in acc.iter_mut().zip(&v) {
                    *acc = _mm512_fmadd_ps(w, *v, *acc);
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            for (t, acc) in acc.iter().enumerate() {
                let o = out.as_mut_ptr().add((j0 + j) * d + c + 16 * t);
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), *acc));
            }
        }
    }
}

/// `x = eˣ` for every value: softmax's exponentials, and the MLP's SiLU's.
/// With AVX2 and FMA, eight at a time (Cephes' `expf`: `2ⁿ·p(r)` with
/// `n = round(x·log₂e)`, `r = x − n·ln 2` in two parts, a degree-7
/// polynomial; within 2 units in the last place of the correctly rounded
/// value, exactly 1 at 0; below −87.33 the smallest normal power of two,
/// where the true value is smaller still; above 88.37 the value at 88.37,
/// finite where the true value overflows), the last few through a padded
/// vector, so that a value's result never depends on where it lies;
/// `f32::exp` elsewhere.
pub(crate) fn exp_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        let whole = x.len() / 8 * 8;
        let (body, tail) = x.split_at_mut(whole);
        for eight in body.chunks_exact_mut(8) {
            // SAFETY: AVX2 and FMA checked above; eight floats.
            unsafe { exp8_avx2(eight) };
        }
        if !tail.is_empty() {
            let mut padded = [0f32; 8];
            padded[..tail.len()].copy_from_slice(tail);
            // SAFETY: as above.
            unsafe { exp8_avx2(&mut padded) };
            tail.copy_from_slice(&padded[..tail.len()]);
        }
        return;
    }
    for v in x.iter_mut() {
        *v = v.exp();
    }
}

/// [`exp_in_place`] on eight floats.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x` must hold eight floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8_avx2(x: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert_eq!(x.len(), 8);
    // SAFETY: the caller's: eight floats.
    let v = unsafe { _mm256_loadu_ps(x.as_ptr()) };
    let v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.33)), _mm256_set1_ps(88.37));
    let n = _mm256_round_ps(
        _mm256_mul_ps(v, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), v);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    let power = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    ));
    // SAFETY: as above.
    unsafe { _mm256_storeu_ps(x.as_mut_ptr(), _mm256_mul_ps(p, power)) };
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let whole = n / 8 * 8;
    for (x, y) in a[..whole].chunks_exact(8).zip(b[..whole].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a[whole..].iter().zip(&b[whole..]).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::rng::SplitMix;

    /// Within two units in the last place of `f64`'s exponential (rounded),
    /// over softmax's range and a little past it, in any position of a
    /// slice; exactly 1 at 0; tiny and not negative far below.
    #[test]
    fn exponentials_stay_within_two_units_in_the_last_place() {
        let values: Vec<f32> = (0..20_011).map(|i| -87.0 + i as f32 * 0.0045).collect();
        for len in [values.len(), 7, 8, 13] {
            let mut got = values[..len].to_vec();
            exp_in_place(&mut got);
            for (x, y) in values.iter().zip(&got) {
                let want = (*x as f64).exp() as f32;
                let ulp = (want.to_bits() as i64 - y.to_bits() as i64).abs();
                assert!(ulp <= 2, "e^{x}: {y} against {want} ({ulp} units)");
            }
        }
        let mut edges = [0.0f32, -100.0, -1e30, -0.0];
        exp_in_place(&mut edges);
        assert_eq!(edges[0], 1.0);
        assert!(edges[1] >= 0.0 && edges[1] < 1e-37 && edges[2] >= 0.0 && edges[2] < 1e-37);
        assert_eq!(edges[3], 1.0);
    }

    /// A key's scores are the same bits whether its pass takes it with
    /// other keys or alone (a row's attention never depends on how many
    /// positions it sees beside each one).
    #[test]
    fn a_keys_scores_do_not_depend_on_the_keys_beside_it() {
        let mut rng = SplitMix::new(3);
        for (g, d) in [(1, 8), (2, 64), (3, 64), (4, 64), (7, 64), (9, 16)] {
            for n in [1, 2, 3, 4, 7, 10] {
                let data: Vec<f32> = (0..(n + 1) * 2 * d).map(|_| rng.uniform() as f32 - 0.5).collect();
                let offsets: Vec<usize> = (0..n).rev().map(|i| i * 2 * d).collect();
                let queries: Vec<f32> = (0..g * d).map(|_| rng.uniform() as f32 - 0.5).collect();
                let gathered = |offsets| Gathered {
                    data: &data,
                    offsets,
                    shift: d,
                    d,
                };
                let mut all = vec![0f32; n * g];
                scores(&queries, gathered(&offsets), &mut all);
                for (i, offset) in offsets.iter().enumerate() {
                    let mut alone = vec![0f32; g];
                    scores(&queries, gathered(std::slice::from_ref(offset)), &mut alone);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&all[i * g..(i + 1) * g]), bits(&alone), "{g}×{d}, key {i} of {n}");
                }
            }
        }
    }

    /// The AVX-512 weighted sums give the AVX2 kernel's bits (so a machine's
    /// answers do not depend on which of the two it has), for any number of
    /// outputs and head width, scattered positions, and outputs that start
    /// at zero or not.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn weighted_sums_on_avx512_are_the_avx2_bits() {
        if !has_avx512f() {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let mut rng = SplitMix::new(5);
        for (g, d) in [
            (1, 16),
            (3, 64),
            (4, 64),
            (7, 64),
            (2, 128),
            (5, 128),
            (9, 16),
            (3, 48),
            (2, 80),
        ] {
            for n in [1, 2, 4, 5, 17, 40] {
                let data: Vec<f32> = (0..(n + 3) * 3 * d).map(|_| rng.uniform() as f32 - 0.5).collect();
                let offsets: Vec<usize> = (0..n).map(|i| ((i * 7) % (n + 2)) * 3 * d).collect();
                let values = Gathered {
                    data: &data,
                    offsets: &offsets,
                    shift: 2 * d,
                    d,
                };
                let weights: Vec<f32> = (0..n * g).map(|_| rng.uniform() as f32).collect();
                for start in [0.0f32, 1.0] {
                    let out: Vec<f32> = (0..g * d).map(|_| start * (rng.uniform() as f32 - 0.5)).collect();
                    let (mut wide, mut narrow) = (out.clone(), out);
                    // SAFETY: the CPU has both kernels' features; the shapes hold.
                    unsafe {
                        weighted_sum_avx512(&weights, values, g, &mut wide);
                        weighted_sum_avx2(&weights, values, g, &mut narrow);
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&wide), bits(&narrow), "{g}×{d}, {n} positions");
                }
            }
        }
    }

    #[test]
    fn gathered_scores_and_weighted_sums_match_plain_loops() {
        let mut rng = SplitMix::new(2);
        for (g, d) in [(1, 8), (4, 64), (9, 16), (3, 12), (2, 32)] {
            let n = 7;
            let data: Vec<f32> = (0..(n + 3) * 2 * d).map(|_| rng.uniform() as f32 - 0.5).collect();
            // Scattered, out of order, shifted by one head.
            let offsets: Vec<usize> = (0..n).map(|i| ((i * 5) % (n + 2)) * 2 * d).collect();
            let gathered = Gathered {
                data: &data,
                offsets: &offsets,
                shift: d,
                d,
            };
            let queries: Vec<f32> = (0..g * d).map(|_| rng.uniform() as f32 - 0.5).collect();
            let mut got = vec![0f32; n * g];
            scores(&queries, gathered, &mut got);
            for i in 0..n {
                for j in 0..g {
                    let want = dot_portable(&queries[j * d..(j + 1) * d], gathered.at(i));
                    let value = got[i * g + j];
                    assert!((value - want).abs() <= 1e-5, "{g}×{d} [{i},{j}]: {value} vs {want}");
                }
            }
            let weights: Vec<f32> = (0..n * g).map(|_| rng.uniform() as f32).collect();
            let start: Vec<f32> = (0..g * d).map(|_| rng.uniform() as f32).collect();
            let mut out = start.clone();
            weighted_sum(&weights, gathered, &mut out);
            for (at, value) in out.iter().enumerate() {
                let (j, c) = (at / d, at % d);
                let want = start[at] + (0..n).map(|i| weights[i * g + j] * gathered.at(i)[c]).sum::<f32>();
                assert!((value - want).abs() <= 1e-5, "{g}×{d} [{j},{c}]: {value} vs {want}");
            }
        }
    }
}
