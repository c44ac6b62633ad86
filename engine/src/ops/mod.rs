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
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        // Nothing to take: the core goes to any other
                        // thread waiting for it (the service's own, the
                        // database's) and comes back at once otherwise.
                        std::thread::yield_now();
                    }
                }
            });
        }
        let _done = Done(done);
        f()
    })
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    use super::hot_pass;

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
