//! The dot product attention runs on: AVX2 and FMA when the CPU has them
//! (checked at run time), a portable loop otherwise. The matrix products of
//! the projections are in [`crate::gemm`].

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

/// `a · b` over the shorter of the two, with AVX2/FMA when the CPU has them.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: both features were found on this CPU.
        return unsafe { dot_avx2(a, b) };
    }
    dot_portable(a, b)
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (every load below): `i + 8 * j + 8 <= n`, within both slices.
    unsafe {
        while i + 32 <= n {
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
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
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
    fn the_dot_product_matches_a_plain_loop_on_odd_lengths() {
        let mut rng = SplitMix::new(1);
        for n in [0, 1, 7, 8, 31, 33, 64, 100, 1000] {
            let a: Vec<f32> = (0..n).map(|_| rng.uniform() as f32 - 0.5).collect();
            let b: Vec<f32> = (0..n + 3).map(|_| rng.uniform() as f32 - 0.5).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            for got in [dot(&a, &b), dot_portable(&a, &b)] {
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "n={n}: {got} vs {want}"
                );
            }
        }
    }
}
