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

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Whether the kernels may use AVX-512 where the CPU has it (the default):
/// `LORRY_AVX512=off` keeps every kernel to AVX2 (AVX-VNNI included, which
/// is not an AVX-512 extension), and so AMX off too, as on a CPU without
/// AVX-512: the same runs compare the two on one machine. Read once.
pub fn avx512_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| !std::env::var("LORRY_AVX512").is_ok_and(|v| v.eq_ignore_ascii_case("off")))
}

/// Ask for `bytes` from `start` into L2, a line at a time. A prefetch
/// reads nothing and never faults.
pub(crate) fn prefetch_l2(start: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for at in (0..bytes).step_by(64) {
        // SAFETY: a prefetch only.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(start.wrapping_add(at) as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, bytes);
}

/// Run `f` (a forward pass) on a thread of rayon's pool, with the pool's
/// other threads kept awake until it returns: each takes the pass's parallel
/// work as soon as it is split off, instead of going to sleep in the pass's
/// serial stretches (norms, rotary, the next product's token rows) and being
/// woken by the kernel for the next parallel loop. A thread with nothing to
/// take yields its core to any other thread waiting for it. While another
/// engine's pass runs on the same pool the helpers do not wait (one of them
/// would take that whole pass inside this one, which would then end only with
/// it): the pool's threads sleep and wake as rayon has them. A panic in `f`
/// reaches the caller, as from `rayon::scope`.
pub fn hot_pass<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    /// Passes in flight in this process.
    static PASSES: AtomicUsize = AtomicUsize::new(0);
    /// Sets the flag however the pass ends, so that no helper outlives it.
    struct Done<'a>(&'a AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
            PASSES.fetch_sub(1, Ordering::AcqRel);
        }
    }
    PASSES.fetch_add(1, Ordering::AcqRel);
    let done = AtomicBool::new(false);
    rayon::scope(|scope| {
        let owner = rayon::current_thread_index();
        let done = &done;
        for _ in 1..rayon::current_num_threads() {
            scope.spawn(move |_| {
                // A helper must never wait above a piece of its own pass on
                // a thread's stack: the pass would wait for that piece. The
                // helpers are spawned before the pass splits anything, so
                // they are the oldest jobs on the pass's own queue, and
                // rayon's thieves take the oldest first: no thread holds a
                // piece of this pass before the helpers are taken. Only the
                // pass's own thread may pop one later (waiting inside a loop
                // of the pass); there it returns at once.
                if rayon::current_thread_index() == owner {
                    return;
                }
                while !done.load(Ordering::Acquire) && PASSES.load(Ordering::Acquire) == 1 {
                    if rayon::yield_now() != Some(rayon::Yield::Executed) && !ahead::step() {
                        // Nothing to take: the core goes to any other
                        // thread waiting for it (the service's own, the
                        // database's) and comes back at once otherwise.
                        std::thread::yield_now();
                    }
                }
            });
        }
        let _done = Done(done);
        let result = f();
        ahead::clear();
        result
    })
}

/// The weights a pass reads next, asked for by the pool's idle helpers
/// ([`hot_pass`]) while the pass's own thread runs a serial stretch (norms,
/// rotary, attention's bookkeeping) or ends its share of a product, so that
/// the memory, idle there, brings them into the caches before the product
/// that reads them starts. Prefetches only: nothing computed changes, and
/// an address no longer valid is harmless (a prefetch never faults).
pub(crate) mod ahead {
    use std::sync::Mutex;

    /// Ranges one product's weights may span (a stacked product's parts).
    const RANGES: usize = 4;
    /// Bytes a helper asks for between looks for work.
    const CHUNK: usize = 4096;

    /// One product's weights and how far the helpers have asked for them.
    pub(super) struct Ahead {
        /// `(start address, length)` of each range, in the product's order.
        ranges: [(usize, usize); RANGES],
        count: usize,
        /// The ranges' bytes together.
        total: usize,
        /// Stretches asked for side by side, one per thread: each thread of
        /// a product starts at the start of its share of the weights.
        stretches: usize,
        /// Bytes of one stretch, whole chunks.
        stretch: usize,
        /// Chunks handed out so far.
        taken: usize,
    }

    impl Ahead {
        pub(super) const NONE: Ahead = Ahead {
            ranges: [(0, 0); RANGES],
            count: 0,
            total: 0,
            stretches: 1,
            stretch: 0,
            taken: 0,
        };

        /// The first [`RANGES`] of `ranges`, asked for in `stretches` side by side.
        pub(super) fn new(ranges: &[&[u8]], stretches: usize) -> Ahead {
            let mut ahead = Ahead {
                stretches: stretches.max(1),
                ..Ahead::NONE
            };
            for (slot, range) in ahead.ranges.iter_mut().zip(ranges) {
                *slot = (range.as_ptr() as usize, range.len());
                ahead.count += 1;
                ahead.total += range.len();
            }
            ahead.stretch = ahead.total.div_ceil(ahead.stretches).next_multiple_of(CHUNK);
            ahead
        }

        /// The next chunk to ask for, as the `(address, bytes)` of each range
        /// it lies in: the stretches' chunks in turn, each stretch from its
        /// start; `None` once all are out.
        pub(super) fn next(&mut self) -> Option<Vec<(usize, usize)>> {
            let ranges = &self.ranges[..self.count];
            loop {
                let (nth, of) = (self.taken / self.stretches, self.taken % self.stretches);
                if nth * CHUNK >= self.stretch {
                    return None;
                }
                self.taken += 1;
                // Bytes `from..to` of the ranges laid end to end (none past
                // their end, in a short last stretch: the next chunk, then).
                let from = of * self.stretch + nth * CHUNK;
                let to = (from + CHUNK).min(self.total);
                let mut pieces = Vec::new();
                let mut before = 0;
                for &(start, len) in ranges {
                    let (lo, hi) = (from.max(before), to.min(before + len));
                    if lo < hi {
                        pieces.push((start + lo - before, hi - lo));
                    }
                    before += len;
                }
                if !pieces.is_empty() {
                    return Some(pieces);
                }
            }
        }
    }

    static AHEAD: Mutex<Ahead> = Mutex::new(Ahead::NONE);

    fn lock() -> std::sync::MutexGuard<'static, Ahead> {
        AHEAD.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The product the pass runs next, as the byte ranges of its weights.
    pub(crate) fn set(ranges: &[&[u8]]) {
        *lock() = Ahead::new(ranges, rayon::current_num_threads());
    }

    /// Nothing more to ask for.
    pub(crate) fn clear() {
        *lock() = Ahead::NONE;
    }

    /// Ask for the next chunk; `false` when nothing is left.
    pub(super) fn step() -> bool {
        let Some(pieces) = lock().next() else {
            return false;
        };
        for (start, len) in pieces {
            super::prefetch_l2(start as *const u8, len);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    use super::hot_pass;

    /// `LORRY_AVX512=off` is read once at a process's start, so the test
    /// runs itself again in a process of its own with it set.
    #[test]
    fn lorry_avx512_off_keeps_every_kernel_to_avx2() {
        use super::gemm::{bf16_dot_available, Kernel, PairKernel};
        use super::quant::QuantKernel;
        const NAME: &str = "ops::tests::lorry_avx512_off_keeps_every_kernel_to_avx2";
        let (gemm, quant) = (Kernel::available(), QuantKernel::available());
        if std::env::var_os("LORRY_AVX512_CHILD").is_some() {
            assert!(!super::avx512_allowed());
            assert!(!gemm.contains(&Kernel::Avx512), "{gemm:?}");
            assert!(
                !quant
                    .iter()
                    .any(|k| matches!(k, QuantKernel::Amx | QuantKernel::Avx512Vnni)),
                "{quant:?}"
            );
            assert!(!bf16_dot_available());
            assert_eq!(PairKernel::available(), [PairKernel::Portable]);
            assert!(!super::attention::has_avx512f());
            return;
        }
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env("LORRY_AVX512", "off")
            .env("LORRY_AVX512_CHILD", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&child.stdout);
        assert!(
            child.status.success() && stdout.contains("1 passed"),
            "{stdout}{}",
            String::from_utf8_lossy(&child.stderr)
        );
        // Without it, a CPU with AVX-512 keeps its kernels.
        #[cfg(target_arch = "x86_64")]
        if std::env::var_os("LORRY_AVX512").is_none()
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512vl")
        {
            assert_eq!(Kernel::best(), Kernel::Avx512);
            assert!(super::attention::has_avx512f());
        }
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
    }

    /// A pass of nested parallel loops, as a forward pass splits its products.
    fn pass(n: u64) -> u64 {
        (0..n)
            .into_par_iter()
            .map(|i| (0..i % 97).into_par_iter().map(|j| j * i).sum::<u64>())
            .sum()
    }

    /// Every chunk [`super::ahead::Ahead`] hands out, as its pieces' byte
    /// offsets into `buffer` and lengths.
    fn chunks(buffer: &[u8], ranges: &[std::ops::Range<usize>], stretches: usize) -> Vec<Vec<(usize, usize)>> {
        let slices: Vec<&[u8]> = ranges.iter().map(|r| &buffer[r.clone()]).collect();
        let mut ahead = super::ahead::Ahead::new(&slices, stretches);
        std::iter::from_fn(|| ahead.next())
            .map(|pieces| {
                pieces
                    .into_iter()
                    .map(|(address, len)| (address - buffer.as_ptr() as usize, len))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_weights_named_ahead_are_asked_for_once_each_every_thread_s_share_from_its_start() {
        let buffer = vec![0u8; 64 << 10];
        // `(start, end)` of each range in the buffer.
        let cases: [&[(usize, usize)]; 6] = [
            &[],
            &[(0, 0)],
            &[(0, 1)],
            &[(100, 4196)],
            &[(0, (5 << 12) + 3)],
            &[(0, 10_000), (20_000, 20_001), (30_000, 41_000)],
        ];
        for case in cases {
            let ranges: Vec<std::ops::Range<usize>> = case.iter().map(|&(start, end)| start..end).collect();
            let ranges = ranges.as_slice();
            for stretches in 1..=3 {
                let taken = chunks(&buffer, ranges, stretches);
                // Each byte of the ranges once, nothing outside them.
                let mut seen = vec![0u8; buffer.len()];
                for pieces in &taken {
                    let bytes: usize = pieces.iter().map(|p| p.1).sum();
                    assert!(bytes > 0 && bytes <= 4096, "{ranges:?}: a chunk of {bytes} bytes");
                    for &(start, len) in pieces {
                        seen[start..start + len].iter_mut().for_each(|b| *b += 1);
                    }
                }
                for (i, &count) in seen.iter().enumerate() {
                    let inside = ranges.iter().any(|r| r.contains(&i));
                    assert_eq!(
                        count,
                        u8::from(inside),
                        "byte {i} of {ranges:?} over {stretches} stretches"
                    );
                }
                // The first chunks are the starts of the stretches, in order.
                let total: usize = ranges.iter().map(|r| r.len()).sum();
                let stretch = total.div_ceil(stretches).next_multiple_of(4096);
                let mut starts = Vec::new();
                let mut at = 0;
                while at < total && starts.len() < stretches {
                    starts.push(at);
                    at += stretch;
                }
                let first: Vec<usize> = taken
                    .iter()
                    .take(starts.len())
                    .map(|pieces| {
                        let start = pieces[0].0;
                        // The chunk's place among the ranges laid end to end.
                        let mut before = 0;
                        for r in ranges {
                            if r.contains(&start) {
                                return before + start - r.start;
                            }
                            before += r.len();
                        }
                        unreachable!("checked above")
                    })
                    .collect();
                assert_eq!(first, starts, "{ranges:?} over {stretches} stretches");
            }
        }
    }

    #[test]
    fn every_pass_returns_what_its_loops_compute_on_any_pool_size() {
        let expected: u64 = (0..2_000u64).map(|i| (0..i % 97).map(|j| j * i).sum::<u64>()).sum();
        for threads in [1, 2, 3] {
            let pool = pool(threads);
            for _ in 0..200 {
                // From outside the pool, as the engine's thread calls it...
                assert_eq!(pool.install(|| hot_pass(|| pass(2_000))), expected);
                // ...and from one of its threads, inside a loop of its own.
                let inside: Vec<u64> =
                    pool.install(|| (0..3).into_par_iter().map(|_| hot_pass(|| pass(2_000))).collect());
                assert_eq!(inside, vec![expected; 3]);
            }
        }
    }

    #[test]
    fn passes_of_two_engines_at_once_on_one_pool_both_end() {
        let pool = pool(2);
        let expected = pass(2_000);
        std::thread::scope(|threads| {
            let engines: Vec<_> = (0..2)
                .map(|_| {
                    threads.spawn(|| {
                        (0..100)
                            .map(|_| pool.install(|| hot_pass(|| pass(2_000))))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for engine in engines {
                assert_eq!(engine.join().unwrap(), vec![expected; 100]);
            }
        });
    }

    #[test]
    fn a_panicking_pass_reaches_the_caller_and_leaves_the_pool_serving() {
        let pool = pool(2);
        for _ in 0..20 {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| {
                    hot_pass(|| {
                        pass(500);
                        panic!("the model failed")
                    })
                })
            }));
            let message = caught.unwrap_err();
            assert_eq!(message.downcast_ref::<&str>(), Some(&"the model failed"));
            assert_eq!(pool.install(|| hot_pass(|| pass(10))), pass(10));
        }
    }
}
