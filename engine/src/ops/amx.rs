//! Intel AMX tiles for products on bf16 pairs and on bytes.
//!
//! Where the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process
//! use the tiles' state, a product on bf16 pairs ([`super::gemm`]'s
//! `Panels::Pairs`) runs on the tile unit: `tdpbf16ps` multiplies a tile of
//! 16 token rows by 32 inputs (16 pairs) by a tile of one panel's 16 outputs
//! and adds the 16 × 16 products into an f32 tile, 8,192 multiply-adds an
//! instruction against `vdpbf16ps`'s 32.
//!
//! A panel of pairs is already the layout a tile of weights is read in: row
//! `i` of panel `p` holds input pair `i` of its 16 outputs, 64 bytes, so 16
//! consecutive rows are one tile. Token rows are rounded to bf16 pairs and
//! laid out row by row, each padded with zero pairs to a whole number of
//! tiles along `k`.
//!
//! The tile unit adds a tile's 16 pairs in its own order and roundings, not
//! as `vdpbf16ps` chains them, so a product's sums may differ from the
//! other kernels' in their last bits. Where the tiles are used they serve
//! every product on pairs, whatever its number of rows, so a row's result
//! still never depends on what shares its product: each output row of a
//! tile is its own row's inputs against the weights, summed over `k` in
//! the same order of tiles.
//!
//! Products on quantized blocks ([`super::quant`]) take the byte tiles
//! (AMX-INT8, [`ByteTiles`]): `tdpbssd` sums 16 token rows × 32
//! inputs × 16 outputs of signed bytes into 32-bit integers, exactly, so
//! they give the same sums as every other kernel on the blocks.

use std::arch::asm;

/// Input pairs per tile along `k` (64 bytes of a tile row).
pub(crate) const PAIRS: usize = 16;

/// Token rows per tile.
pub(crate) const ROWS: usize = 16;

/// Whether this CPU multiplies tiles of bf16 pairs (AMX-TILE and AMX-BF16)
/// and this process may use them: on Linux the kernel hands out the tiles'
/// state to a process that asks for it, which is asked here, once.
/// `LORRY_AMX=off` leaves the tiles alone (the products on pairs then run
/// on AVX-512 BF16's registers).
pub(crate) fn available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| usable(22))
}

/// Whether this CPU multiplies tiles of bytes (AMX-TILE and AMX-INT8) and
/// this process may use them, as [`available`] (`LORRY_AMX=off` too).
pub(crate) fn int8_available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| usable(25))
}

/// AMX-TILE and the feature at `bit` of CPUID leaf 7's `EDX`, the tiles'
/// state granted, and `LORRY_AMX` not `off`.
fn usable(bit: u32) -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if std::env::var("LORRY_AMX").is_ok_and(|v| v.eq_ignore_ascii_case("off")) {
        return false;
    }
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    let (feature, tile) = (leaf.edx & (1 << bit) != 0, leaf.edx & (1 << 24) != 0);
    feature && tile && *GRANTED.get_or_init(permitted)
}

/// Ask the kernel for the tiles' state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`): granted once for every thread of the process.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn permitted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a request about this process's own state, no memory passed.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn permitted() -> bool {
    false
}

/// The tiles' shapes (`ldtilecfg`'s 64 bytes, palette 1): `tmm0`–`tmm3` the
/// sums (two row blocks × two panels), `tmm4`–`tmm5` the token rows,
/// `tmm6`–`tmm7` the panels; with one block of rows, `tmm2`–`tmm3` take
/// panels too.
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// The tile unit configured on this thread for token tiles of `rows` rows,
/// released (`tilerelease`) when dropped.
pub(crate) struct Tiles {
    rows: usize,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// A tile's worth of f32 sums, 16 × 16, row by row.
#[repr(C, align(64))]
pub(crate) struct Sums(pub(crate) [f32; ROWS * 16]);

/// 16 rows of a panel, for a tile at the end of `k` that the panel does
/// not fill (the rest zero).
#[repr(C, align(64))]
struct Tail([u32; PAIRS * 16]);

impl Tiles {
    /// Configure this thread's tiles: token and sum tiles of `rows` rows
    /// (1 to [`ROWS`]), weight tiles of [`PAIRS`].
    ///
    /// # Safety
    /// [`available`] must have said yes.
    pub(crate) unsafe fn new(rows: usize) -> Tiles {
        assert!((1..=ROWS).contains(&rows));
        let mut config = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            config.bytes_per_row[t] = 64;
            // `tmm2` and `tmm3` hold a second block's sums (only where
            // blocks are whole, 16 rows) or, beside one block, panels.
            config.rows[t] = if matches!(t, 0 | 1 | 4 | 5) {
                rows as u8
            } else {
                PAIRS as u8
            };
        }
        // SAFETY: the caller found the tiles usable; the configuration is valid.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly, preserves_flags)) };
        Tiles {
            rows,
            _not_send: std::marker::PhantomData,
        }
    }

    /// `sums[b][p]` = rows block `b` of `a` times panel `p`, over `k2`
    /// pairs: for `blocks` (1 or 2) blocks of the configured rows, the
    /// second [`ROWS`] rows after the first, and `panels` (1 or 2) panels.
    ///
    /// # Safety
    /// `a` must hold `blocks` blocks of rows `lda` pairs apart, `lda` at
    /// least `k2` rounded up to [`PAIRS`], zero beyond `k2`; each
    /// `b[p]` (`p < panels`) a panel of `k2` rows of 16 pairs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn multiply(
        &self,
        a: *const u32,
        lda: usize,
        blocks: usize,
        b: [*const u32; 2],
        panels: usize,
        k2: usize,
        sums: &mut [[Sums; 2]; 2],
    ) {
        // The second block's sums live in tiles configured for 16 rows.
        assert!(blocks == 1 || (blocks == 2 && self.rows == ROWS));
        assert!((1..=2).contains(&panels));
        // SAFETY (whole body): the caller's contract bounds every tile read.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem, preserves_flags)
            );
            let whole = k2 / PAIRS;
            for t in 0..whole {
                let at = t * PAIRS * 16;
                let (a, b) = (a.add(t * PAIRS), [b[0].add(at), b[1].wrapping_add(at)]);
                if blocks == 1 && t % 2 == 1 {
                    // One block of rows leaves the second block's tiles free:
                    // every other step loads into them, so that its loads need
                    // not wait for the step before to have read its tiles.
                    step_spare(a, lda, b, panels);
                } else {
                    step(a, lda, blocks, b, panels);
                }
            }
            if whole * PAIRS < k2 {
                // The last, partial tile of pairs from a zeroed copy.
                let (at, rows) = (whole * PAIRS * 16, k2 - whole * PAIRS);
                let mut tail = [Tail([0; PAIRS * 16]), Tail([0; PAIRS * 16])];
                for (p, tail) in tail.iter_mut().enumerate().take(panels) {
                    std::ptr::copy_nonoverlapping(b[p].add(at), tail.0.as_mut_ptr(), rows * 16);
                }
                step(
                    a.add(whole * PAIRS),
                    lda,
                    blocks,
                    [tail[0].0.as_ptr(), tail[1].0.as_ptr()],
                    panels,
                );
            }
            // Each sum tile there is into its place in `sums`.
            macro_rules! store {
                ($tile:literal, $block:literal, $panel:literal) => {
                    if $block < blocks && $panel < panels {
                        asm!(
                            concat!("tilestored [{c} + {s}*1], ", $tile),
                            c = in(reg) sums[$block][$panel].0.as_mut_ptr(),
                            s = in(reg) 64usize,
                            options(nostack, preserves_flags)
                        );
                    }
                };
            }
            store!("tmm0", 0, 0);
            store!("tmm1", 0, 1);
            store!("tmm2", 1, 0);
            store!("tmm3", 1, 1);
        }
    }
}

/// One block of rows' step: `tmm0 += a·b₀` and, with two panels, `tmm1 +=
/// a·b₁`, with `a` loaded into the tile `$a` and the panels into `$b0`, `$b1`.
macro_rules! block_step {
    ($a:literal, $b0:literal, $b1:literal, $rows:expr, $lda:expr, $b:expr, $panels:expr) => {{
        asm!(
            concat!("tileloadd ", $b0, ", [{b0} + {s}*1]"),
            concat!("tileloadd ", $a, ", [{a0} + {sa}*1]"),
            concat!("tdpbf16ps tmm0, ", $a, ", ", $b0),
            b0 = in(reg) $b[0],
            a0 = in(reg) $rows,
            s = in(reg) 64usize,
            sa = in(reg) $lda * 4,
            options(nostack, readonly, preserves_flags)
        );
        if $panels == 2 {
            asm!(
                concat!("tileloadd ", $b1, ", [{b1} + {s}*1]"),
                concat!("tdpbf16ps tmm1, ", $a, ", ", $b1),
                b1 = in(reg) $b[1],
                s = in(reg) 64usize,
                options(nostack, readonly, preserves_flags)
            );
        }
    }};
}

/// One tile of pairs along `k`: `tmm0 += a₀·b₀`, `tmm1 += a₀·b₁`, `tmm2 +=
/// a₁·b₀`, `tmm3 += a₁·b₁` for the blocks and panels there are.
///
/// # Safety
/// As [`Tiles::multiply`], at this tile's place along `k`.
#[inline(always)]
unsafe fn step(a: *const u32, lda: usize, blocks: usize, b: [*const u32; 2], panels: usize) {
    // SAFETY: the caller's contract bounds every tile read.
    unsafe {
        block_step!("tmm4", "tmm6", "tmm7", a, lda, b, panels);
        if blocks == 2 {
            asm!(
                "tileloadd tmm5, [{a1} + {sa}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                a1 = in(reg) a.add(ROWS * lda),
                sa = in(reg) lda * 4,
                options(nostack, readonly, preserves_flags)
            );
            if panels == 2 {
                asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem, preserves_flags));
            }
        }
    }
}

/// [`step`] for one block of rows, loading into the second block's tiles:
/// `tmm0 += a·b₀`, `tmm1 += a·b₁` with `a` in `tmm5` and the panels in
/// `tmm2` and `tmm3`.
///
/// # Safety
/// As [`step`].
#[inline(always)]
unsafe fn step_spare(a: *const u32, lda: usize, b: [*const u32; 2], panels: usize) {
    // SAFETY: the caller's contract bounds every tile read.
    unsafe { block_step!("tmm5", "tmm2", "tmm3", a, lda, b, panels) };
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `new` on this thread.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// The tiles configured for products on bytes, in one of two shapes.
/// Narrow ([`ByteTiles::dots`]): `tmm0` and `tmm1` 16 token rows of 32
/// inputs, `tmm2` and `tmm3` the weights for 32 inputs (8 rows of 4 inputs
/// × 16 outputs). Wide ([`ByteTiles::digit_dots`]): the same for 64
/// inputs. Both: `tmm4`–`tmm7` 16 × 16 sums.
pub(crate) struct ByteTiles {
    wide: bool,
    _not_send: std::marker::PhantomData<*const ()>,
}

/// A tile's worth of integer sums, 16 × 16, row by row.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct Ints(pub(crate) [i32; ROWS * 16]);

impl ByteTiles {
    /// Configure this thread's tiles, wide or narrow.
    ///
    /// # Safety
    /// [`int8_available`] must have said yes.
    pub(crate) unsafe fn new(wide: bool) -> ByteTiles {
        let mut config = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        let inputs = if wide { 64 } else { 32 };
        for t in 0..8 {
            (config.bytes_per_row[t], config.rows[t]) = match t {
                0 | 1 => (inputs as u16, ROWS as u8),
                2 | 3 => (64, inputs as u8 / 4),
                _ => (64, ROWS as u8),
            };
        }
        // SAFETY: the caller found the tiles usable; the configuration is valid.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly, preserves_flags)) };
        ByteTiles {
            wide,
            _not_send: std::marker::PhantomData,
        }
    }

    /// For one or two (`tiles`) tiles of 16 token rows (`a[u]`: four runs
    /// of 64 inputs, each 16 rows of 64 bytes, 1 KiB after another) and 256 inputs' weights for 16
    /// outputs in two digits (`b`: four tiles of 64 inputs, each 1 KiB of
    /// low digits then 1 KiB of high ones, as [`ByteTiles::dots`] lays
    /// them), `c[2u]` the sums on the low digits and `c[2u + 1]` on the
    /// high ones, all in signed bytes summed exactly.
    ///
    /// # Safety
    /// The tiles wide; each `a[u]` (`u < tiles`) 4 KiB, `b` 8 KiB.
    #[inline]
    pub(crate) unsafe fn digit_dots(&self, a: [*const i8; 2], tiles: usize, b: *const i8, c: &mut [Ints; 4]) {
        assert!(self.wide && (1..=2).contains(&tiles));
        // One step along the inputs: `$k` tiles of 64 in.
        macro_rules! two {
            ($($k:literal),*) => {
                asm!(
                    "tilezero tmm4",
                    "tilezero tmm5",
                    "tilezero tmm6",
                    "tilezero tmm7",
                    $(
                        concat!("tileloadd tmm0, [{a0} + {s}*1 + 1024*", $k, "]"),
                        concat!("tileloadd tmm1, [{a1} + {s}*1 + 1024*", $k, "]"),
                        concat!("tileloadd tmm2, [{b} + {s}*1 + 2048*", $k, "]"),
                        "tdpbssd tmm4, tmm0, tmm2",
                        "tdpbssd tmm6, tmm1, tmm2",
                        concat!("tileloadd tmm3, [{b} + {s}*1 + 2048*", $k, " + 1024]"),
                        "tdpbssd tmm5, tmm0, tmm3",
                        "tdpbssd tmm7, tmm1, tmm3",
                    )*
                    "tilestored [{c} + {s}*1], tmm4",
                    "tilestored [{c} + {s}*1 + 1024], tmm5",
                    "tilestored [{c} + {s}*1 + 2048], tmm6",
                    "tilestored [{c} + {s}*1 + 3072], tmm7",
                    a0 = in(reg) a[0],
                    a1 = in(reg) a[1],
                    b = in(reg) b,
                    c = in(reg) c.as_mut_ptr(),
                    s = in(reg) 64usize,
                    options(nostack, preserves_flags)
                )
            };
        }
        macro_rules! one {
            ($($k:literal),*) => {
                asm!(
                    "tilezero tmm4",
                    "tilezero tmm5",
                    $(
                        concat!("tileloadd tmm0, [{a0} + {s}*1 + 1024*", $k, "]"),
                        concat!("tileloadd tmm2, [{b} + {s}*1 + 2048*", $k, "]"),
                        "tdpbssd tmm4, tmm0, tmm2",
                        concat!("tileloadd tmm3, [{b} + {s}*1 + 2048*", $k, " + 1024]"),
                        "tdpbssd tmm5, tmm0, tmm3",
                    )*
                    "tilestored [{c} + {s}*1], tmm4",
                    "tilestored [{c} + {s}*1 + 1024], tmm5",
                    a0 = in(reg) a[0],
                    b = in(reg) b,
                    c = in(reg) c.as_mut_ptr(),
                    s = in(reg) 64usize,
                    options(nostack, preserves_flags)
                )
            };
        }
        // SAFETY: the caller's contract bounds the reads; `c` are tiles.
        unsafe {
            if tiles == 2 {
                two!("0", "1", "2", "3");
            } else {
                one!("0", "1", "2", "3");
            }
        }
    }

    /// `c[i][r][n] = Σ_{j<32} a_i[r][j]·b_i[j/4][4n + j%4]` for each dot
    /// `i`, every token row `r` and output `n`, in signed bytes summed
    /// exactly: `a_i` 16 token rows of 32 inputs (`a[i]`, the rows 64
    /// bytes apart), `b_i` the 32 inputs' weights for 16 outputs (512 bytes
    /// from `b + 512·i`: 8 rows of 64 bytes, each four inputs of every
    /// output). Four at a time on the four sum tiles, so that each
    /// `tdpbssd` need not wait for the one before.
    ///
    /// # Safety
    /// The tiles narrow; each `a[i]` must hold 16 rows of 32 bytes 64
    /// apart, `b` 512 bytes a dot; `c` one tile of sums per dot.
    #[inline]
    pub(crate) unsafe fn dots(&self, a: &[*const i8], b: *const i8, c: &mut [Ints]) {
        assert!(!self.wide && a.len() == c.len());
        let whole = a.len() / 4 * 4;
        for (i, a) in a[..whole].chunks_exact(4).enumerate() {
            // SAFETY: the caller's contract bounds the reads; `c` are tiles.
            unsafe {
                asm!(
                    "tilezero tmm4",
                    "tilezero tmm5",
                    "tilezero tmm6",
                    "tilezero tmm7",
                    "tileloadd tmm2, [{b} + {s}*1]",
                    "tileloadd tmm0, [{a0} + {s}*1]",
                    "tdpbssd tmm4, tmm0, tmm2",
                    "tileloadd tmm3, [{b} + {s}*1 + 512]",
                    "tileloadd tmm1, [{a1} + {s}*1]",
                    "tdpbssd tmm5, tmm1, tmm3",
                    "tileloadd tmm2, [{b} + {s}*1 + 1024]",
                    "tileloadd tmm0, [{a2} + {s}*1]",
                    "tdpbssd tmm6, tmm0, tmm2",
                    "tileloadd tmm3, [{b} + {s}*1 + 1536]",
                    "tileloadd tmm1, [{a3} + {s}*1]",
                    "tdpbssd tmm7, tmm1, tmm3",
                    "tilestored [{c} + {s}*1], tmm4",
                    "tilestored [{c} + {s}*1 + 1024], tmm5",
                    "tilestored [{c} + {s}*1 + 2048], tmm6",
                    "tilestored [{c} + {s}*1 + 3072], tmm7",
                    a0 = in(reg) a[0],
                    a1 = in(reg) a[1],
                    a2 = in(reg) a[2],
                    a3 = in(reg) a[3],
                    b = in(reg) b.add(512 * 4 * i),
                    c = in(reg) c[4 * i..][..4].as_mut_ptr(),
                    s = in(reg) 64usize,
                    options(nostack, preserves_flags)
                );
            }
        }
        for (i, &a) in a.iter().enumerate().skip(whole) {
            // SAFETY: as above.
            unsafe {
                asm!(
                    "tilezero tmm4",
                    "tileloadd tmm2, [{b} + {s}*1]",
                    "tileloadd tmm0, [{a} + {s}*1]",
                    "tdpbssd tmm4, tmm0, tmm2",
                    "tilestored [{c} + {s}*1], tmm4",
                    a = in(reg) a,
                    b = in(reg) b.add(512 * i),
                    c = in(reg) c[i].0.as_mut_ptr(),
                    s = in(reg) 64usize,
                    options(nostack, preserves_flags)
                );
            }
        }
    }
}

impl Drop for ByteTiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `new` on this thread.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}
