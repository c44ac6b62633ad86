//! The vector kernels attention runs on: the dot products of a group of query
//! heads with one key, softmax's exponentials, and the weighted sums of
//! values into them. AVX2 and
//! FMA when the CPU has them (checked at run time), portable loops otherwise.
//! The matrix products of the projections are in [`crate::ops::gemm`].

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
    // query `j0 + j < g` spans `(j0 + j)·d..` of `queries`, and `scores` holds `n·g`.
    unsafe {
        let key: [*const f32; K] = std::array::from_fn(|t| keys.data.as_ptr().add(keys.offsets[i + t] + keys.shift));
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
    // Four outputs × 16 floats of accumulators stay in registers while every
    // position's value streams by.
    for j0 in (0..g).step_by(4) {
        let width = (g - j0).min(4);
        for c in (0..d).step_by(16) {
            // SAFETY (every access): `check` kept each value inside `values.data`,
            // `d % 16 == 0`, output `j0 + j < g` spans `(j0 + j)·d..` of `out`,
            // and `weights` holds `n·g`.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                for i in 0..values.offsets.len() {
                    let value = values.data.as_ptr().add(values.offsets[i] + values.shift + c);
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

/// `x = eˣ` for every value: softmax's exponentials. With AVX2 and FMA,
/// eight at a time (Cephes' `expf`: `2ⁿ·p(r)` with `n = round(x·log₂e)`,
/// `r = x − n·ln 2` in two parts, a degree-7 polynomial; within 2 units in
/// the last place of the correctly rounded value, exactly 1 at 0; below
/// −87.33 the smallest normal power of two, where the true value is
/// smaller still), the last few through a padded vector, so that a value's
/// result never depends on where it lies; `f32::exp` elsewhere.
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
