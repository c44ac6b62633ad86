//! The matrix product for a few token rows (decoding at small batch sizes),
//! where a general GEMM leaves most of the memory bandwidth unused: it is a
//! stream of the weight matrix, every weight row read once and dotted with
//! each token row while it sits in L1, the rows split across the cores. AVX2
//! and FMA when the CPU has them (checked at run time), a portable loop
//! otherwise.

use rayon::prelude::*;

/// How far ahead of the current weight (in floats) the fast dot product prefetches.
const PREFETCH_AHEAD: usize = 1024;

/// Weight rows per parallel task.
const ROWS_PER_TASK: usize = 64;

/// `W·xᵀ` for `w` of `(n, k)` and `x` of `(m, k)`, both row-major: the
/// result is `(n, m)` row-major.
pub fn weight_times_rows(w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
    assert_eq!(w.len(), n * k, "weight shape");
    assert_eq!(x.len(), m * k, "input shape");
    let mut out = vec![0f32; n * m];
    if out.is_empty() {
        return out;
    }
    let fast = has_avx2_fma();
    out.par_chunks_mut(ROWS_PER_TASK * m)
        .zip(w.par_chunks(ROWS_PER_TASK * k))
        .for_each(|(out, w)| {
            for (row, o) in w.chunks_exact(k).zip(out.chunks_exact_mut(m)) {
                if fast && m > 1 {
                    // Four token rows per pass: each weight vector is loaded once for all four.
                    for (t, o) in o.chunks_mut(4).enumerate() {
                        dots_fast(row, &x[4 * t * k..], k, o);
                    }
                    continue;
                }
                for (t, o) in o.iter_mut().enumerate() {
                    let xt = &x[t * k..(t + 1) * k];
                    *o = if fast {
                        dot_fast::<true>(row, xt)
                    } else {
                        dot_portable(row, xt)
                    };
                }
            }
        });
    out
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

/// `a · b`, with AVX2/FMA when the CPU has them.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    if has_avx2_fma() {
        dot_fast::<false>(a, b)
    } else {
        dot_portable(a, b)
    }
}

/// `STREAM`: `a` is a row of a weight matrix being streamed; fetch the next row ahead.
fn dot_fast<const STREAM: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: only called after `has_avx2_fma` found both features on this CPU.
        unsafe { dot_avx2::<STREAM>(a, b) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        dot_portable(a, b)
    }
}

/// `out[t] = row · x[t·k..(t+1)·k]` for the `out.len() <= 4` rows of `x`.
fn dots_fast(row: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    assert!(out.len() <= 4 && x.len() >= out.len() * k && row.len() == k);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: only called after `has_avx2_fma` found both features; the
        // assertion above keeps every row of `x` read within bounds.
        unsafe { dots_avx2(row, x, k, out) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    for (t, o) in out.iter_mut().enumerate() {
        *o = dot_portable(row, &x[t * k..(t + 1) * k]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2(row: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let rows = out.len();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 8 <= k {
        // SAFETY: `i + 8 <= k`, and row `t < rows` of `x` spans `t·k..(t+1)·k`.
        let w = _mm256_loadu_ps(row.as_ptr().add(i));
        for (t, acc) in acc.iter_mut().enumerate().take(rows) {
            *acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.as_ptr().add(t * k + i)), *acc);
        }
        i += 8;
    }
    for (t, o) in out.iter_mut().enumerate() {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc[t]);
        let tail: f32 = (i..k).map(|j| row[j] * x[t * k + j]).sum();
        *o = lanes.iter().sum::<f32>() + tail;
    }
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let whole = a.len() / 8 * 8;
    for (x, y) in a[..whole].chunks_exact(8).zip(b[..whole].chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a[whole..].iter().zip(&b[whole..]).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2<const STREAM: bool>(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (every load below): `i + 8 * j + 8 <= n`, within both slices.
    while i + 32 <= n {
        // The next weight row starts one row on: fetch it ahead, across the page
        // boundary that the hardware prefetchers stop at. A prefetch never faults.
        // Elsewhere (attention) what lies ahead is not read next: no prefetch.
        if STREAM {
            _mm_prefetch(pa.wrapping_add(i + PREFETCH_AHEAD) as *const i8, _MM_HINT_T0);
            _mm_prefetch(pa.wrapping_add(i + PREFETCH_AHEAD + 16) as *const i8, _MM_HINT_T0);
        }
        for (j, acc) in acc.iter_mut().enumerate() {
            let va = _mm256_loadu_ps(pa.add(i + 8 * j));
            let vb = _mm256_loadu_ps(pb.add(i + 8 * j));
            *acc = _mm256_fmadd_ps(va, vb, *acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
        i += 8;
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    let mut total: f32 = lanes.iter().sum();
    while i < n {
        total += a[i] * b[i];
        i += 1;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix;

    #[test]
    fn the_product_matches_a_plain_loop_on_odd_shapes() {
        let mut rng = SplitMix::new(1);
        for &(n, k, m) in &[(1, 1, 1), (3, 7, 2), (130, 33, 5), (64, 1024, 8), (200, 1000, 1)] {
            let w: Vec<f32> = (0..n * k).map(|_| rng.uniform() as f32 - 0.5).collect();
            let x: Vec<f32> = (0..m * k).map(|_| rng.uniform() as f32 - 0.5).collect();
            let got = weight_times_rows(&w, n, k, &x, m);
            for j in 0..n {
                for t in 0..m {
                    let want: f64 = (0..k).map(|i| w[j * k + i] as f64 * x[t * k + i] as f64).sum();
                    let g = got[j * m + t] as f64;
                    assert!(
                        (g - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "({n},{k},{m}) [{j},{t}]: {g} vs {want}"
                    );
                    let portable = dot_portable(&w[j * k..(j + 1) * k], &x[t * k..(t + 1) * k]) as f64;
                    assert!((portable - want).abs() <= 1e-5 * (1.0 + want.abs()));
                }
            }
        }
    }
}
