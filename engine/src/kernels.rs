//! The vector kernels attention runs on: the dot products of a group of query
//! heads with one key, and the weighted sums of values into them. AVX2 and
//! FMA when the CPU has them (checked at run time), portable loops otherwise.
//! The matrix products of the projections are in [`crate::gemm`].

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

/// `out[g] = queries[g] · key` for the `out.len()` queries of `key.len()`
/// floats each, laid end to end in `queries` (the query heads that share one
/// key-value head): the key is read once for all of them.
pub fn dots(queries: &[f32], key: &[f32], out: &mut [f32]) {
    let d = key.len();
    assert_eq!(queries.len(), out.len() * d, "query shape");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && d % 8 == 0 {
        // SAFETY: both features were found; the shapes were checked above.
        unsafe { dots_avx2(queries, key, out) };
        return;
    }
    for (o, q) in out.iter_mut().zip(queries.chunks_exact(d.max(1))) {
        *o = dot_portable(q, key);
    }
}

/// `out[g] += weights[g] · value` for each of the `weights.len()` outputs of
/// `value.len()` floats laid end to end in `out`: the value is read once.
pub fn axpys(weights: &[f32], value: &[f32], out: &mut [f32]) {
    let d = value.len();
    assert_eq!(out.len(), weights.len() * d, "output shape");
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() && d % 8 == 0 {
        // SAFETY: both features were found; the shapes were checked above.
        unsafe { axpys_avx2(weights, value, out) };
        return;
    }
    for (&w, o) in weights.iter().zip(out.chunks_exact_mut(d.max(1))) {
        for (o, v) in o.iter_mut().zip(value) {
            *o += w * v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2(queries: &[f32], key: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = key.len();
    for (group, out) in queries.chunks(8 * d).zip(out.chunks_mut(8)) {
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut i = 0;
        // SAFETY (every load): `i + 8 <= d`, query `g < out.len()` spans `g·d..(g+1)·d` of `group`.
        unsafe {
            while i + 8 <= d {
                let k = _mm256_loadu_ps(key.as_ptr().add(i));
                for (g, acc) in acc.iter_mut().enumerate().take(out.len()) {
                    *acc = _mm256_fmadd_ps(_mm256_loadu_ps(group.as_ptr().add(g * d + i)), k, *acc);
                }
                i += 8;
            }
        }
        for (o, acc) in out.iter_mut().zip(acc) {
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
            *o = lanes.iter().sum();
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpys_avx2(weights: &[f32], value: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = value.len();
    let mut i = 0;
    // SAFETY (every access): `i + 8 <= d`; output `g < weights.len()` spans `g·d..(g+1)·d`.
    unsafe {
        while i + 8 <= d {
            let v = _mm256_loadu_ps(value.as_ptr().add(i));
            for (g, &w) in weights.iter().enumerate() {
                let o = out.as_mut_ptr().add(g * d + i);
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_set1_ps(w), v, _mm256_loadu_ps(o)));
            }
            i += 8;
        }
    }
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
    use crate::rng::SplitMix;

    #[test]
    fn grouped_dots_and_axpys_match_plain_loops() {
        let mut rng = SplitMix::new(2);
        for (groups, d) in [(1, 8), (4, 64), (9, 16), (3, 12)] {
            let queries: Vec<f32> = (0..groups * d).map(|_| rng.uniform() as f32 - 0.5).collect();
            let key: Vec<f32> = (0..d).map(|_| rng.uniform() as f32 - 0.5).collect();
            let mut got = vec![0f32; groups];
            dots(&queries, &key, &mut got);
            for (g, got) in got.iter().enumerate() {
                let want = dot_portable(&queries[g * d..(g + 1) * d], &key);
                assert!((got - want).abs() <= 1e-5, "{groups}×{d} [{g}]: {got} vs {want}");
            }
            let weights: Vec<f32> = (0..groups).map(|_| rng.uniform() as f32).collect();
            let mut out = queries.clone();
            axpys(&weights, &key, &mut out);
            for (i, got) in out.iter().enumerate() {
                let want = queries[i] + weights[i / d] * key[i % d];
                assert!((got - want).abs() <= 1e-6, "{groups}×{d} [{i}]: {got} vs {want}");
            }
        }
    }
}
