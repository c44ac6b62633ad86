//! Matrix products on GGUF's quantized blocks, kept as the file holds them.
//!
//! A quantized weight row is a run of blocks of [`QK`] weights, each block a
//! half-precision scale (and, for `Q4_1` and `Q5_1`, a half-precision
//! minimum) and the weights as small integers: `Q8_0` (8-bit, `d·q`), `Q4_0`
//! (4-bit, `d·(q − 8)`), `Q4_1` (4-bit, `d·q + m`), `Q5_0` (5-bit,
//! `d·(q − 16)`) and `Q5_1` (5-bit, `d·q + m`; the fifth bits of a block kept
//! apart as one `u32`, re-ordered at load so that each weight's sits in the
//! byte its quants will take, and put in place there with a mask in the
//! kernel before its dot product). Dequantizing them at load
//! multiplies the bytes every decode step reads by 4–6; here the blocks stay
//! blocks and the product runs on them, as llama.cpp's does: each token row
//! is quantized to 8-bit blocks of its own (`d = max|x| / 127`, one scale per
//! [`QK`] values), a block of weights times a block of inputs is an integer
//! dot product (exact), and the two scales are applied to it in f32.
//!
//! At load the rows are re-laid in groups of [`WR`] (as llama.cpp re-packs
//! `Q4_0` for AVX2), block by block: the group's [`WR`] scales, its minimums,
//! then its quants interleaved four bytes a row, so that one 32-byte load
//! holds four consecutive weights of each of the eight rows. A byte dot
//! product (`vpdpbusd`, or `vpmaddubsw` + `vpmaddwd`) against four input
//! bytes broadcast then adds into lane `l` what row `l` contributes: one
//! register of integer sums serves all eight outputs, the scales apply eight
//! at a time, and nothing is summed across lanes. A group takes the bytes
//! the file's blocks take. A tile is a group's rows times up to a few token
//! rows; a task is a run of groups, and the tasks split the weights between
//! the cores, so each weight byte is read once per product whatever the
//! number of token rows.
//!
//! The arithmetic of one output, the same on every kernel and bit for bit
//! ([`dot_reference`] writes it out): block by block, `acc = (d_w·d_x) ·
//! Σ q_w·q_x + acc` with one rounding (a fused multiply-add; the integer sum
//! is exact), and, for the types with a minimum, `min = m_w · (d_x·Σq_x) +
//! min`, fused too; the output is `acc + min`. A row's result depends on
//! that row alone, never on what else is in the product.
//!
//! The K-quants (`Q4_K`, `Q5_K`, `Q6_K`) hold a super-block of [`QKK`]
//! weights: one half-precision scale (and minimum) for all of it, and a
//! small integer scale (and minimum) for each of its sub-blocks, of 32
//! weights (`Q4_K`, `Q5_K`: 6 bits each, packed in 12 bytes) or 16
//! (`Q6_K`: 8-bit signed). Their token rows are quantized in blocks of
//! [`QKK`] (llama.cpp's `q8_K`): one scale a super-block, so that the
//! sub-block scales and minimums apply in the integer sums — per
//! super-block `Σ_j s_j·Σ q_w·q_x` and `Σ_j m_j·Σ q_x`, exact — and f32
//! arithmetic comes once a super-block: `acc = (d·d_x)·Σ + acc`, then `acc
//! = (−dmin·d_x)·Σ_m + acc` (fused multiply-adds). At load a group of
//! [`WR`] rows holds per super-block the rows' scales, their
//! sub-block scales and minimums as bytes, then each sub-block as the
//! 32-weight formats lay theirs (nibbles, and `Q5_K`'s fifth bits apart;
//! `Q6_K`'s two high bits of two sub-blocks four to a byte, laid as the
//! nibbles are, so that a mask and a shift put them in place): 148, 180 and
//! 210 bytes a row where the file takes 144, 176 and 210. `Q6_K`'s two halves of a sub-block keep their
//! own integer sums, each times its own scale; its weights are `q − 32`,
//! taken as `Σ q·x − 32·Σx` over each half with the token rows' half sums.
//!
//! Where the CPU has AMX-INT8 and the kernel grants the tiles
//! ([`QuantKernel::Amx`]), every whole tile of 16 token rows of a pair of
//! groups (16 outputs) runs on the tile unit (`super::amx`): the token rows
//! laid out tile by tile, a block's weights of both groups unpacked to
//! signed bytes as tile rows (four inputs of each of the 16 outputs a
//! row), and `tdpbssd` giving the integer sums of 16 rows × 16 outputs of
//! a 32-weight block at once; the f32 steps after it are the other
//! kernels', on 16 outputs a register. A K-quant's sub-block scales are
//! folded into its weights, `s_j·q` (`Q6_K`: `s·(q − 32)`, each half its
//! own) written in two signed-byte digits (`2^5·high + low`, `2^6` for
//! `Q6_K`), so that a tile of 64 inputs sums two sub-blocks with their
//! scales applied and a super-block takes four tiles a digit:
//! `low + 2^shift·high` is the exact integer the other kernels form. The
//! integer sums being exact, the tiles give every kernel's bits, and the
//! rows left over (fewer than 16) and a group without a pair run on
//! AVX-512 VNNI beside them; so do whole products of fewer than 32 rows
//! (16 for `Q8_0`), where unpacking the weights for one tile of rows
//! costs more than the registers' products.

use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use half::f16;
use rayon::prelude::*;

use crate::ops::gemm::{Expand, Fused, NR};

/// Weights (and inputs) per block.
pub const QK: usize = 32;

/// Weights per K-quant super-block.
pub const QKK: usize = 256;

/// Weight rows per group: the eight f32 lanes of one register of outputs.
pub(crate) const WR: usize = 8;

/// Token rows per tile with the 16 AVX registers: an integer and an f32
/// accumulator each, the rest for the group's scales and unpacked weights.
const XR: usize = 4;

/// Token rows per tile with AVX-512VL's 32 registers.
const XR_WIDE: usize = 8;

/// Token rows per AMX tile.
const ROWS: usize = 16;

/// Token rows per pass over the weights: a large pre-fill's quantized rows
/// are taken in chunks that stay in the core's L2 while the weights stream by.
const MC: usize = 64;

/// Which kernel a quantized product runs on. All give the same bits: the
/// integer dot products are exact whichever instructions compute them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKernel {
    /// The best this CPU has.
    Auto,
    /// AMX-INT8's byte tiles (`tdpbssd`) for every whole 16 token rows of
    /// two groups in products of 32 rows or more (16 for `Q8_0`), AVX-512
    /// VNNI for the rest.
    Amx,
    /// AVX-512 VNNI's `vpdpbusd` on 256-bit registers (with AVX-512VL's 32
    /// of them): tiles of [`XR_WIDE`] token rows.
    Avx512Vnni,
    /// AVX-VNNI's `vpdpbusd` (VEX): tiles of [`XR`].
    AvxVnni,
    /// AVX2's `vpmaddubsw` + `vpmaddwd` (the 4-, 5- and 6-bit formats'
    /// pair sums added in 16 bits, several to one `vpmaddwd`): tiles of
    /// [`XR`].
    Avx2,
    /// Plain Rust, any CPU: the reference.
    Portable,
}

impl QuantKernel {
    /// The kernels this CPU can run, best first (always ending with `Portable`).
    pub fn available() -> Vec<QuantKernel> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && super::avx512_allowed()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl");
            if avx512 && std::is_x86_feature_detected!("avx512vnni") && super::amx::int8_available() {
                kernels.push(QuantKernel::Amx);
            }
            if avx2
                && super::avx512_allowed()
                && std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512vl")
            {
                kernels.push(QuantKernel::Avx512Vnni);
            }
            if avx2 && std::is_x86_feature_detected!("avxvnni") {
                kernels.push(QuantKernel::AvxVnni);
            }
            if avx2 {
                kernels.push(QuantKernel::Avx2);
            }
        }
        kernels.push(QuantKernel::Portable);
        kernels
    }

    /// The best kernel this CPU runs (found once).
    pub fn best() -> QuantKernel {
        static BEST: std::sync::OnceLock<QuantKernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| QuantKernel::available()[0])
    }

    /// `Auto` made concrete; a kernel this CPU lacks falls back to the best it has.
    fn resolve(self) -> QuantKernel {
        match self {
            QuantKernel::Auto => QuantKernel::best(),
            QuantKernel::Portable => QuantKernel::Portable,
            wanted if QuantKernel::available().contains(&wanted) => wanted,
            _ => QuantKernel::best(),
        }
    }
}

/// A quantized block format the products run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// `d·q`, `q` 8-bit signed: 34 bytes a block.
    Q8_0,
    /// `d·(q − 8)`, `q` 4-bit: 18 bytes a block.
    Q4_0,
    /// `d·q + m`, `q` 4-bit: 20 bytes a block.
    Q4_1,
    /// `d·(q − 16)`, `q` 5-bit (4 bits and a fifth apart): 22 bytes a block.
    Q5_0,
    /// `d·q + m`, `q` 5-bit: 24 bytes a block.
    Q5_1,
    /// Super-blocks of [`QKK`]: `d·s_j·q − dmin·m_j`, `q` 4-bit, eight
    /// sub-blocks of 32 with 6-bit `s_j`, `m_j`: 144 bytes a super-block.
    Q4K,
    /// As `Q4K` with 5-bit `q`: 176 bytes a super-block.
    Q5K,
    /// Super-blocks of [`QKK`]: `d·s_j·(q − 32)`, `q` 6-bit, sixteen
    /// sub-blocks of 16 with 8-bit signed `s_j`: 210 bytes a super-block.
    Q6K,
}

impl QuantType {
    /// The format of a GGUF tensor type, where the products run on it.
    pub fn from_ggml(t: GgmlDType) -> Option<Self> {
        match t {
            GgmlDType::Q8_0 => Some(QuantType::Q8_0),
            GgmlDType::Q4_0 => Some(QuantType::Q4_0),
            GgmlDType::Q4_1 => Some(QuantType::Q4_1),
            GgmlDType::Q5_0 => Some(QuantType::Q5_0),
            GgmlDType::Q5_1 => Some(QuantType::Q5_1),
            GgmlDType::Q4K => Some(QuantType::Q4K),
            GgmlDType::Q5K => Some(QuantType::Q5K),
            GgmlDType::Q6K => Some(QuantType::Q6K),
            _ => None,
        }
    }

    /// The GGUF tensor type.
    pub fn ggml(self) -> GgmlDType {
        match self {
            QuantType::Q8_0 => GgmlDType::Q8_0,
            QuantType::Q4_0 => GgmlDType::Q4_0,
            QuantType::Q4_1 => GgmlDType::Q4_1,
            QuantType::Q5_0 => GgmlDType::Q5_0,
            QuantType::Q5_1 => GgmlDType::Q5_1,
            QuantType::Q4K => GgmlDType::Q4K,
            QuantType::Q5K => GgmlDType::Q5K,
            QuantType::Q6K => GgmlDType::Q6K,
        }
    }

    /// Weights per block as the file holds them: [`QK`], or [`QKK`] for
    /// the K-quants.
    pub fn block_weights(self) -> usize {
        if self.is_k() {
            QKK
        } else {
            QK
        }
    }

    /// Bytes of one block of [`QuantType::block_weights`] weights in the file.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q8_0 => 34,
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q5_0 => 22,
            QuantType::Q5_1 => 24,
            QuantType::Q4K => 144,
            QuantType::Q5K => 176,
            QuantType::Q6K => 210,
        }
    }

    /// A format by the lower-case name `--quantize` takes (`q8_0`, `q4_1`,
    /// `q4_0`, `q4_k`, `q5_k`, `q6_k`).
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "q8_0" => Ok(QuantType::Q8_0),
            "q4_1" => Ok(QuantType::Q4_1),
            "q4_0" => Ok(QuantType::Q4_0),
            "q4_k" => Ok(QuantType::Q4K),
            "q5_k" => Ok(QuantType::Q5K),
            "q6_k" => Ok(QuantType::Q6K),
            _ => Err(format!("{name:?}: expected q8_0, q4_1, q4_0, q4_k, q5_k or q6_k")),
        }
    }

    /// The format a projection of `inputs` columns is quantized to when
    /// this one is asked: itself where the columns are whole blocks;
    /// otherwise, for a K-quant, the format llama.cpp falls back to
    /// (`Q4_K` → `Q5_0`, `Q5_K` → `Q5_1`, `Q6_K` → `Q8_0`); `None` where
    /// not even that fits.
    pub fn for_inputs(self, inputs: usize) -> Option<Self> {
        let ty = if inputs.is_multiple_of(self.block_weights()) {
            self
        } else {
            match self {
                QuantType::Q4K => QuantType::Q5_0,
                QuantType::Q5K => QuantType::Q5_1,
                QuantType::Q6K => QuantType::Q8_0,
                other => other,
            }
        };
        inputs.is_multiple_of(ty.block_weights()).then_some(ty)
    }

    /// The name llama.cpp gives it.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q4K => "Q4_K",
            QuantType::Q5K => "Q5_K",
            QuantType::Q6K => "Q6_K",
        }
    }

    /// Whether blocks are K-quant super-blocks.
    fn is_k(self) -> bool {
        matches!(self, QuantType::Q4K | QuantType::Q5K | QuantType::Q6K)
    }

    /// Sub-blocks of [`QK`] weights in a block as the file holds it.
    fn sub_blocks(self) -> usize {
        self.block_weights() / QK
    }

    /// Where a (32-weight) block's quants start.
    fn quants_at(self) -> usize {
        match self {
            QuantType::Q8_0 | QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 4,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 8,
            QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => unreachable!("a super-block"),
        }
    }

    /// Whether a block has a minimum of its own (the others' is a fixed
    /// offset times the scale, or none).
    fn has_minimum(self) -> bool {
        matches!(
            self,
            QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K
        )
    }

    /// Whether a block's product has a term from the token rows' block sums
    /// (a minimum, or `Q4_0`'s and `Q5_0`'s offset); `Q6_K`'s offset is
    /// taken in the integer sums.
    fn has_offset(self) -> bool {
        !matches!(self, QuantType::Q8_0 | QuantType::Q6K)
    }

    /// Whether the quants have a fifth bit, kept apart (32 bits a block).
    fn has_fifth_bits(self) -> bool {
        matches!(self, QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q5K)
    }
}

/// A block format's layout in a group of [`WR`] rows: the bytes of one block
/// of every row, and where the minimums and the quants start.
///
/// A K-quant group (one super-block of each row): the rows' `d` (f16), for
/// `Q4_K`/`Q5_K` their `dmin` (f16), then the sub-block scales as bytes,
/// sub-block by sub-block ([`QuantType::k_scales`]; `Q6_K`: sixteen, signed),
/// for `Q4_K`/`Q5_K` the minimums likewise ([`QuantType::k_minimums`]),
/// then the eight sub-blocks ([`QuantType::sub_block_at`]), each its fifth
/// bits (`Q5_K`) and its quants as a 32-weight group's; `Q6_K`'s sub-blocks
/// go in pairs, the pair's high bits ([`QuantType::high_bits_at`]) before
/// its two sub-blocks' quants.
impl QuantType {
    fn group_bytes(self) -> usize {
        match self {
            QuantType::Q4K | QuantType::Q5K => self.sub_block_at(8),
            QuantType::Q6K => self.high_bits_at(8),
            _ => WR * self.block_bytes(),
        }
    }

    fn group_minimums(self) -> usize {
        2 * WR
    }

    /// Where a K-quant group's sub-block scales start (a byte a row).
    fn k_scales(self) -> usize {
        if self == QuantType::Q6K {
            2 * WR
        } else {
            4 * WR
        }
    }

    /// Where a `Q4_K`/`Q5_K` group's sub-block minimums start.
    fn k_minimums(self) -> usize {
        self.k_scales() + 8 * WR
    }

    /// Where sub-block `j` of a group starts (0 for the 32-weight formats).
    fn sub_block_at(self, j: usize) -> usize {
        let (first, each) = match self {
            QuantType::Q4K => (self.k_minimums() + 8 * WR, 16 * WR),
            QuantType::Q5K => (self.k_minimums() + 8 * WR, 20 * WR),
            // A pair: high bits, then the two sub-blocks' quants.
            QuantType::Q6K => {
                let first = self.k_scales() + 16 * WR;
                return first + (j / 2) * 48 * WR + 16 * WR + (j % 2) * 16 * WR;
            }
            _ => return 0,
        };
        first + j * each
    }

    /// Where `Q6_K`'s high bits of sub-blocks `j` and its pair start: a byte
    /// for weights `t` and `t + 16` of both, laid as the quants are; in it
    /// bits `2·(j % 2)` and up hold weight `t`'s of sub-block `j`, bits
    /// `4 + 2·(j % 2)` and up weight `t + 16`'s.
    fn high_bits_at(self, j: usize) -> usize {
        self.k_scales() + 16 * WR + (j / 2) * 48 * WR
    }

    /// Where a (sub-)block's fifth bits start, from its start (`Q5_0`,
    /// `Q5_1`, `Q5_K`: a `u32` a row).
    fn fifth_at(self) -> usize {
        match self {
            QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => 0,
            _ if self.has_minimum() => 4 * WR,
            _ => 2 * WR,
        }
    }

    /// Where a (sub-)block's quants start, from its start.
    fn quants_in(self) -> usize {
        self.fifth_at() + if self.has_fifth_bits() { 4 * WR } else { 0 }
    }
}

/// A block's fifth bits (bit `i` weight `i`'s, as the file holds them) as a
/// group keeps them: byte `t` holds those of weights `4c + t` (bit `c`) and
/// `16 + 4c + t` (bit `4 + c`), `c` in `0..4`, so that the weights a 32-byte
/// load of the quants holds (four of each row: `4c..4c + 4` and `16 + 4c..`)
/// find theirs in their own bytes, under one mask (the kernels' `fifth_bit`).
fn fifth_plane(bits: u32) -> u32 {
    (0..QK).map(|i| ((bits >> i) & 1) << fifth_place(i)).sum()
}

/// Where weight `i`'s fifth bit lies in [`fifth_plane`].
fn fifth_place(i: usize) -> usize {
    8 * (i % 4) + 4 * (i / (QK / 2)) + (i % (QK / 2)) / 4
}

/// Re-lay one block of each of a group's rows (`blocks[l]`, as the file
/// holds them; fewer than [`WR`] for the last group, the rest zero) into
/// `out` (`group_bytes`).
fn lay_group(ty: QuantType, blocks: &[&[u8]], out: &mut [u8]) {
    if ty.is_k() {
        return lay_k_group(ty, blocks, out);
    }
    for (l, block) in blocks.iter().enumerate() {
        out[2 * l..2 * l + 2].copy_from_slice(&block[..2]);
        if ty.has_minimum() {
            out[ty.group_minimums() + 2 * l..][..2].copy_from_slice(&block[2..4]);
        }
        if ty.has_fifth_bits() {
            let at = ty.quants_at() - 4;
            let bits = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
            out[ty.fifth_at() + 4 * l..][..4].copy_from_slice(&fifth_plane(bits).to_le_bytes());
        }
        let qs = &block[ty.quants_at()..];
        // Chunk `c` holds bytes `4c..4c + 4` of every row's quants, row by row.
        for (c, four) in qs.chunks_exact(4).enumerate() {
            out[ty.quants_in() + c * 4 * WR + 4 * l..][..4].copy_from_slice(four);
        }
    }
}

/// A K-quant super-block taken apart: its scales' half-precision bits, the
/// sub-block scales (`Q6_K`: sixteen, signed) and minimums, and every
/// weight's quant (`Q6_K`'s before its offset of 32).
struct KBlock {
    d: [u8; 2],
    dmin: [u8; 2],
    scales: [i8; 16],
    minimums: [u8; 8],
    q: [u8; QKK],
}

/// A super-block as llama.cpp's `block_q4_K`, `block_q5_K` and
/// `block_q6_K` hold it (`ggml-common.h`), taken apart.
fn decode_k(ty: QuantType, b: &[u8]) -> KBlock {
    let mut k = KBlock {
        d: [0; 2],
        dmin: [0; 2],
        scales: [0; 16],
        minimums: [0; 8],
        q: [0; QKK],
    };
    if ty == QuantType::Q6K {
        // ql[128], qh[64], scales[16], d.
        let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
        k.d = [b[208], b[209]];
        for (s, &byte) in k.scales.iter_mut().zip(scales) {
            *s = byte as i8;
        }
        for half in 0..2 {
            let (ql, qh, q) = (&ql[64 * half..], &qh[32 * half..], &mut k.q[128 * half..]);
            for l in 0..32 {
                q[l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
                q[l + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
                q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        return k;
    }
    // d, dmin, scales[12] (6-bit scales and minimums), Q5_K's qh[32], qs[128].
    k.d = [b[0], b[1]];
    k.dmin = [b[2], b[3]];
    let s = &b[4..16];
    for j in 0..8 {
        let (scale, min) = if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            (
                (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
                (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
            )
        };
        k.scales[j] = scale as i8;
        k.minimums[j] = min;
    }
    let (qh, qs) = if ty == QuantType::Q5K {
        (Some(&b[16..48]), &b[48..176])
    } else {
        (None, &b[16..144])
    };
    // Each 32 bytes: the low nibbles are one sub-block, the high the next.
    for (i, bytes) in qs.chunks_exact(32).enumerate() {
        for (l, &byte) in bytes.iter().enumerate() {
            k.q[64 * i + l] = byte & 0x0f;
            k.q[64 * i + 32 + l] = byte >> 4;
        }
    }
    if let Some(qh) = qh {
        for (i, q) in k.q.iter_mut().enumerate() {
            *q |= ((qh[i % 32] >> (i / 32)) & 1) << 4;
        }
    }
    k
}

/// [`lay_group`] for the K-quants.
fn lay_k_group(ty: QuantType, blocks: &[&[u8]], out: &mut [u8]) {
    for (l, block) in blocks.iter().enumerate() {
        let k = decode_k(ty, block);
        out[2 * l..2 * l + 2].copy_from_slice(&k.d);
        let subs = if ty == QuantType::Q6K { 16 } else { 8 };
        for (j, &scale) in k.scales[..subs].iter().enumerate() {
            out[ty.k_scales() + WR * j + l] = scale as u8;
        }
        if ty != QuantType::Q6K {
            out[ty.group_minimums() + 2 * l..][..2].copy_from_slice(&k.dmin);
            for (j, &min) in k.minimums.iter().enumerate() {
                out[ty.k_minimums() + WR * j + l] = min;
            }
        }
        for (j, q) in k.q.chunks_exact(QK).enumerate() {
            if ty == QuantType::Q6K {
                let high = &mut out[ty.high_bits_at(j)..];
                for t in 0..QK / 2 {
                    let at = (t / 4) * 4 * WR + 4 * l + t % 4;
                    high[at] |= ((q[t] >> 4) << (2 * (j % 2))) | ((q[t + QK / 2] >> 4) << (4 + 2 * (j % 2)));
                }
            }
            let sub = &mut out[ty.sub_block_at(j)..];
            if ty.has_fifth_bits() {
                let bits: u32 = q.iter().enumerate().map(|(i, &q)| ((q as u32 >> 4) & 1) << i).sum();
                sub[4 * l..][..4].copy_from_slice(&fifth_plane(bits).to_le_bytes());
            }
            for t in 0..QK / 2 {
                sub[ty.quants_in() + (t / 4) * 4 * WR + 4 * l + t % 4] = (q[t] & 0x0f) | ((q[t + QK / 2] & 0x0f) << 4);
            }
        }
    }
}

/// `x` (a block) as 8-bit integers `q = round(x / d)` (halves away from
/// zero) with `d = max|x| / 127`, returned: llama.cpp's `Q8_0` quantizer,
/// for weights and token rows alike.
fn quantize_q8(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * inverse).round().clamp(-127.0, 127.0) as i8;
    }
    d
}

/// One block of [`QK`] weights in `ty`'s file layout ([`QuantMatrix::quantize`]).
fn quantize_block(ty: QuantType, w: &[f32], block: &mut [u8]) {
    let half = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    match ty {
        QuantType::Q8_0 => {
            let mut q = [0i8; QK];
            let d = quantize_q8(w, &mut q);
            block[..2].copy_from_slice(&half(d));
            for (byte, q) in block[2..].iter_mut().zip(q) {
                *byte = q as u8;
            }
        }
        QuantType::Q4_0 => {
            let max = w.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            block[..2].copy_from_slice(&half(d));
            let q = |v: f32| ((v * id + 8.5) as i32).min(15) as u8;
            for i in 0..QK / 2 {
                block[2 + i] = q(w[i]) | (q(w[i + QK / 2]) << 4);
            }
        }
        QuantType::Q4_1 => {
            let (min, max) = w
                .iter()
                .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let d = (max - min) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            block[..2].copy_from_slice(&half(d));
            block[2..4].copy_from_slice(&half(min));
            let q = |v: f32| (((v - min) * id + 0.5) as i32).min(15) as u8;
            for i in 0..QK / 2 {
                block[4 + i] = q(w[i]) | (q(w[i + QK / 2]) << 4);
            }
        }
        QuantType::Q5_0 => {
            let max = w.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = max / -16.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            block[..2].copy_from_slice(&half(d));
            let q: Vec<u8> = w.iter().map(|&v| ((v * id + 16.5) as i32).min(31) as u8).collect();
            fifth_bits(&q, &mut block[2..]);
        }
        QuantType::Q5_1 => {
            let (min, max) = w
                .iter()
                .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
            let d = (max - min) / 31.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            block[..2].copy_from_slice(&half(d));
            block[2..4].copy_from_slice(&half(min));
            let q: Vec<u8> = w
                .iter()
                .map(|&v| (((v - min) * id + 0.5) as i32).min(31) as u8)
                .collect();
            fifth_bits(&q, &mut block[4..]);
        }
        QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => unreachable!("K-quants are quantized by candle"),
    }
}

/// 32 five-bit quants as a `Q5` block stores them in `out`: their fifth bits
/// (a little-endian `u32`), then the low four bits two to a byte.
fn fifth_bits(q: &[u8], out: &mut [u8]) {
    let high: u32 = q.iter().enumerate().map(|(i, &q)| ((q as u32 >> 4) & 1) << i).sum();
    out[..4].copy_from_slice(&high.to_le_bytes());
    for i in 0..QK / 2 {
        out[4 + i] = (q[i] & 0x0f) | ((q[i + QK / 2] & 0x0f) << 4);
    }
}

/// One (sub-)block of [`QK`] weights of a row, as the products take it.
struct Block {
    /// The scale of the weights `0..16` and `16..32` (the same but for `Q6_K`).
    d: [f32; 2],
    /// What each token row's block sum is multiplied by.
    m: f32,
    /// The weights as the integers the dot product multiplies.
    w: [i32; QK],
}

/// Row `l`'s sub-block `j` (0 for the 32-weight formats) of a group's block
/// (`group`, `group_bytes`): its scales, its minimum (`-8·d` for `Q4_0`,
/// `-16·d` for `Q5_0`, `−dmin·m_j` for `Q4_K`/`Q5_K`, 0 for `Q8_0` and
/// `Q6_K`) and its weights (`Q8_0` and `Q6_K` signed, the others unsigned,
/// their offset in the minimum).
fn group_row(ty: QuantType, group: &[u8], l: usize, j: usize) -> Block {
    let half = |at: usize| f16::from_bits(u16::from_le_bytes([group[at], group[at + 1]])).to_f32();
    let d = half(2 * l);
    let scale = |s: usize| group[ty.k_scales() + WR * s + l] as i8 as f32;
    // Exact: a half-precision value times a power of two or a small integer.
    let (d, m) = match ty {
        QuantType::Q8_0 => ([d; 2], 0.0),
        QuantType::Q4_0 => ([d; 2], -8.0 * d),
        QuantType::Q5_0 => ([d; 2], -16.0 * d),
        QuantType::Q4_1 | QuantType::Q5_1 => ([d; 2], half(ty.group_minimums() + 2 * l)),
        QuantType::Q4K | QuantType::Q5K => {
            let (scale, min) = (group[ty.k_scales() + WR * j + l], group[ty.k_minimums() + WR * j + l]);
            ([d * scale as f32; 2], -(half(ty.group_minimums() + 2 * l) * min as f32))
        }
        QuantType::Q6K => ([d * scale(2 * j), d * scale(2 * j + 1)], 0.0),
    };
    let sub = &group[ty.sub_block_at(j)..];
    let fifth = if ty.has_fifth_bits() {
        let at = ty.fifth_at() + 4 * l;
        u32::from_le_bytes([sub[at], sub[at + 1], sub[at + 2], sub[at + 3]])
    } else {
        0
    };
    let quants = &sub[ty.quants_in()..];
    let byte = |i: usize| quants[(i / 4) * 4 * WR + 4 * l + i % 4];
    // `Q6_K`'s two high bits of weight `i`, at bits 4 and 5.
    let high = |i: usize| -> i32 {
        if ty != QuantType::Q6K {
            return 0;
        }
        let t = i % (QK / 2);
        let b = group[ty.high_bits_at(j) + (t / 4) * 4 * WR + 4 * l + t % 4];
        (((b >> (2 * (j % 2) + 4 * (i / (QK / 2)))) & 3) as i32) << 4
    };
    let w = match ty {
        QuantType::Q8_0 => std::array::from_fn(|i| byte(i) as i8 as i32),
        _ => std::array::from_fn(|i| {
            let low = if i < QK / 2 {
                byte(i) & 0x0f
            } else {
                byte(i - QK / 2) >> 4
            };
            let q = low as i32 | (((fifth >> fifth_place(i)) & 1) << 4) as i32 | high(i);
            if ty == QuantType::Q6K {
                q - 32
            } else {
                q
            }
        }),
    };
    Block { d, m, w }
}

/// Rows of one format: `rows` rows re-laid in groups of [`WR`] (the last
/// padded with zero blocks, which add nothing).
#[derive(Debug)]
struct Part {
    ty: QuantType,
    /// The part's first row among the matrix's outputs.
    first: usize,
    rows: usize,
    /// Kept as laid out (an `Arc<[u8]>` would copy the blocks once more).
    data: Arc<Vec<u8>>,
}

impl Part {
    fn groups(&self) -> usize {
        self.rows.div_ceil(WR)
    }

    /// Block `b` of group `g` (`group_bytes`), with `nb` blocks a row.
    fn group(&self, g: usize, b: usize, nb: usize) -> &[u8] {
        let gb = self.ty.group_bytes();
        &self.data[(g * nb + b) * gb..][..gb]
    }
}

/// A weight matrix of `n` outputs by `k` inputs held in quantized blocks,
/// for [`QuantMatrix::matmul`]. Rows of several formats may lie in one
/// matrix (projections stacked into one product); cloning shares the blocks.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    n: usize,
    k: usize,
    parts: Arc<[Part]>,
}

/// Why blocks could not be taken as a matrix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("{inputs} inputs are not a whole number of {block}-value blocks")]
    Inputs { inputs: usize, block: usize },
    #[error("{got} bytes of {ty} blocks for {rows} rows of {inputs} inputs (want {want})")]
    Size {
        ty: &'static str,
        rows: usize,
        inputs: usize,
        got: usize,
        want: usize,
    },
    #[error("a row order of {got} rows for {rows} rows, or naming a row twice")]
    Order { rows: usize, got: usize },
}

impl QuantMatrix {
    /// `n × k` weights from blocks as a GGUF file lays them out (row by row),
    /// row `r` taken from the blocks' row `order[r]` where an order is given.
    pub fn from_blocks(
        ty: QuantType,
        data: &[u8],
        n: usize,
        k: usize,
        order: Option<&[usize]>,
    ) -> Result<Self, QuantError> {
        if !k.is_multiple_of(ty.block_weights()) {
            return Err(QuantError::Inputs {
                inputs: k,
                block: ty.block_weights(),
            });
        }
        let (nb, bb) = (k / ty.block_weights(), ty.block_bytes());
        let want = n * nb * bb;
        if data.len() != want {
            return Err(QuantError::Size {
                ty: ty.name(),
                rows: n,
                inputs: k,
                got: data.len(),
                want,
            });
        }
        if let Some(order) = order {
            let mut seen = vec![false; n];
            let valid = order.len() == n && order.iter().all(|&r| r < n && !std::mem::replace(&mut seen[r], true));
            if !valid {
                return Err(QuantError::Order {
                    rows: n,
                    got: order.len(),
                });
            }
        }
        let source = |r: usize| order.map_or(r, |o| o[r]);
        let gb = ty.group_bytes();
        let mut laid = vec![0u8; n.div_ceil(WR) * nb * gb];
        if nb > 0 {
            laid.par_chunks_mut(nb * gb).enumerate().for_each(|(g, group)| {
                let rows: Vec<&[u8]> = (g * WR..n.min((g + 1) * WR))
                    .map(|r| &data[source(r) * nb * bb..][..nb * bb])
                    .collect();
                for (b, out) in group.chunks_exact_mut(gb).enumerate() {
                    let blocks: Vec<&[u8]> = rows.iter().map(|row| &row[b * bb..][..bb]).collect();
                    lay_group(ty, &blocks, out);
                }
            });
        }
        Ok(QuantMatrix {
            n,
            k,
            parts: Arc::from(vec![Part {
                ty,
                first: 0,
                rows: n,
                data: Arc::new(laid),
            }]),
        })
    }

    /// `n × k` f32 weights (row-major) quantized to `ty` as llama.cpp's
    /// reference quantizer does (`Q8_0`: `d = max|w| / 127`, `q =
    /// round(w / d)`; `Q4_0`: `d = w_maxabs / -8`, `q = w/d + 8.5` truncated;
    /// `Q4_1`: `d = (max − min) / 15`, `m = min`, `q = (w − m)/d + 0.5`
    /// truncated; `Q5_0` and `Q5_1` as the 4-bit ones over 32 levels), the
    /// scales stored in half precision; the K-quants by candle's quantizer
    /// (llama.cpp's reference algorithm).
    pub fn quantize(ty: QuantType, w: &[f32], n: usize, k: usize) -> Result<Self, QuantError> {
        if !k.is_multiple_of(ty.block_weights()) {
            return Err(QuantError::Inputs {
                inputs: k,
                block: ty.block_weights(),
            });
        }
        assert_eq!(w.len(), n * k, "weight shape");
        if ty.is_k() {
            let blocks = candle_core::Tensor::from_slice(w, (n, k), &candle_core::Device::Cpu)
                .and_then(|t| candle_core::quantized::QTensor::quantize(&t, ty.ggml()))
                .and_then(|q| q.data().map(|d| d.into_owned()))
                .expect("candle quantizes whole super-blocks of f32 on the CPU");
            return QuantMatrix::from_blocks(ty, &blocks, n, k, None);
        }
        let bb = ty.block_bytes();
        let mut data = vec![0u8; n * k / QK * bb];
        data.par_chunks_mut(bb)
            .zip(w.par_chunks(QK))
            .for_each(|(block, w)| quantize_block(ty, w, block));
        QuantMatrix::from_blocks(ty, &data, n, k, None)
    }

    /// Several matrices over the same inputs as one, their outputs side by
    /// side (the blocks are shared, not copied). `None` where the inputs differ.
    pub fn stack(matrices: &[QuantMatrix]) -> Option<Self> {
        let k = matrices.first()?.k;
        let mut parts = Vec::new();
        let mut n = 0;
        for m in matrices {
            if m.k != k {
                return None;
            }
            for p in m.parts.iter() {
                parts.push(Part {
                    ty: p.ty,
                    first: n + p.first,
                    rows: p.rows,
                    data: p.data.clone(),
                });
            }
            n += m.n;
        }
        Some(QuantMatrix {
            n,
            k,
            parts: Arc::from(parts),
        })
    }

    /// Outputs (the checkpoint's rows).
    pub fn outputs(&self) -> usize {
        self.n
    }

    /// Inputs (the checkpoint's columns).
    pub fn inputs(&self) -> usize {
        self.k
    }

    /// The blocks of each part, as a product reads them.
    pub(crate) fn raw(&self) -> Vec<&[u8]> {
        self.parts.iter().map(|p| p.data.as_slice()).collect()
    }

    /// Bytes the blocks occupy (what one product reads).
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }

    /// The weights as f32, `n × k` row-major: exactly what GGUF's
    /// dequantization gives.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        if self.k > 0 {
            for (r, row) in out.chunks_exact_mut(self.k).enumerate() {
                self.dequantize_row(r, row);
            }
        }
        out
    }

    /// Row `row` as f32 into `out` (`k` values): what [`QuantMatrix::dequantize`]
    /// gives for it. An embedding's lookup.
    ///
    /// # Panics
    /// On a row out of range or an `out` of another length.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.n && out.len() == self.k,
            "row {row} of {}×{}",
            self.n,
            self.k
        );
        let p = self
            .parts
            .iter()
            .find(|p| (p.first..p.first + p.rows).contains(&row))
            .expect("the parts cover every row");
        let (subs, r) = (p.ty.sub_blocks(), row - p.first);
        let nb = self.k / p.ty.block_weights();
        for (b, out) in out.chunks_exact_mut(QK).enumerate() {
            let block = group_row(p.ty, p.group(r / WR, b / subs, nb), r % WR, b % subs);
            for (i, (out, q)) in out.iter_mut().zip(block.w).enumerate() {
                *out = block.d[i / (QK / 2)] * q as f32 + block.m;
            }
        }
    }

    /// `x · Wᵀ` for `x` of `m × k` row-major: `m × n` row-major.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.product(x, m, Fused::NONE)
    }

    /// [`QuantMatrix::matmul`] into `out` (`m × n`), on the kernel chosen.
    pub fn matmul_into(&self, x: &[f32], m: usize, out: &mut [f32], kernel: QuantKernel) {
        assert_eq!(out.len(), m * self.n, "output shape");
        // SAFETY: `out` holds the `m × n` outputs.
        unsafe { self.run(x, m, out.as_mut_ptr(), kernel, Fused::NONE) };
    }

    /// The product into a new vector, its outputs not zeroed first (the
    /// product writes every one).
    fn product(&self, x: &[f32], m: usize, expand: Fused<'_, '_>) -> Vec<f32> {
        let mut out = Vec::with_capacity(m * self.n);
        // SAFETY: the spare capacity holds the `m × n` outputs, and `run`
        // writes each of them before it returns.
        unsafe {
            self.run(x, m, out.as_mut_ptr(), QuantKernel::Auto, expand);
            out.set_len(m * self.n);
        }
        out
    }

    /// Whether [`QuantMatrix::matmul_expand`] can take this matrix: every
    /// part (a format's rows, stacked projections) starts on a panel of
    /// [`NR`] outputs, so that each panel's columns come from one part.
    pub fn panels_whole(&self) -> bool {
        self.parts.iter().all(|p| p.first.is_multiple_of(NR))
    }

    /// [`QuantMatrix::matmul`] with a LoRA expand fused into it, as
    /// [`crate::ops::gemm::PackedMatrix::matmul_expand`] does for float
    /// panels: for each row `r` and each of `expand[r]`, `out[r][cols] +=
    /// scale · shrunk·Bᵀ`, added to each panel of [`NR`] outputs by the task
    /// that has just computed it (two groups), the next panel's `B` lines
    /// asked for while this one's tiles run. The same sums as the product
    /// followed by [`crate::ops::gemm::PackedMatrix::row_add`], bit for
    /// bit.
    ///
    /// # Panics
    /// On a misplaced part, on a matrix not [`QuantMatrix::panels_whole`],
    /// or on a CPU without [`crate::ops::gemm::PackedMatrix::rows_direct`].
    pub(crate) fn matmul_expand(&self, x: &[f32], m: usize, expand: &[&[Expand<'_>]]) -> Vec<f32> {
        let expand = Fused::checked(expand, m, self.n);
        assert!(expand.is_none() || self.panels_whole(), "a panel across two parts");
        self.product(x, m, expand)
    }

    /// Every one of the `m × n` outputs written at `out`.
    ///
    /// # Safety
    /// `out` must have room for `m × n` floats, which nothing else touches
    /// meanwhile; they need not be initialized.
    unsafe fn run(&self, x: &[f32], m: usize, out: *mut f32, kernel: QuantKernel, expand: Fused<'_, '_>) {
        assert_eq!(x.len(), m * self.k, "input shape");
        let len = m * self.n;
        if self.k == 0 {
            // No inputs: every output is an empty sum.
            // SAFETY: the caller's contract: room for `len` floats (zero bits are 0.0).
            unsafe { std::ptr::write_bytes(out, 0, len) };
            if len > 0 && !expand.is_none() {
                // SAFETY: `out` is `m × n`, written by nothing else here.
                unsafe { (0..self.n.div_ceil(NR)).for_each(|p| expand.add(0..m, p, out, self.n)) };
            }
            return;
        }
        if len == 0 {
            return;
        }
        let mut kernel = kernel.resolve();
        if !expand.is_none() && kernel == QuantKernel::Portable {
            // The expand's panels run on AVX2 (checked): so do the tiles.
            kernel = QuantKernel::best();
        }
        // The token rows in blocks of 32 for the 32-weight formats, of 256
        // for the K-quants: each only where a part takes it.
        let quantized = |k_quants: bool| {
            self.parts.iter().any(|p| p.ty.is_k() == k_quants).then(|| {
                let mut rows = QuantizedRows::new(x, m, self.k, if k_quants { QKK } else { QK });
                // Laid out for the tiles only where a part takes them.
                let tiled = |p: &Part| p.ty.is_k() == k_quants && on_tiles(kernel, p.ty, m);
                if self.parts.iter().any(tiled) {
                    rows.tile();
                }
                rows
            })
        };
        let (small, large) = (quantized(false), quantized(true));
        let target = OutPtr(out);
        let threads = rayon::current_num_threads();
        // A few tasks per thread over every part together (stacked
        // projections are one parallel loop, not one each), each a
        // contiguous run of one part's groups (whole panels of `NR`
        // outputs), so that the threads stream disjoint stretches of the
        // weights.
        let all: usize = self.parts.iter().map(Part::groups).sum();
        let per_task = all.div_ceil(4 * threads).max(1).next_multiple_of(NR / WR);
        let tasks: Vec<(&Part, std::ops::Range<usize>)> = self
            .parts
            .iter()
            .flat_map(|part| {
                let groups = part.groups();
                (0..groups.div_ceil(per_task)).map(move |t| (part, t * per_task..((t + 1) * per_task).min(groups)))
            })
            .collect();
        tasks.into_par_iter().for_each(|(part, groups)| {
            let rows = if part.ty.is_k() { &large } else { &small }
                .as_ref()
                .expect("quantized for every format among the parts");
            // SAFETY: this task alone writes the columns of its groups, all
            // inside `out` (`m × n`), and nothing reads `out` until every
            // task is done.
            unsafe { part_product(part, groups, rows, self.n, target, kernel, expand) };
        });
    }
}

/// Token rows quantized to 8-bit blocks: `q` (`m × k`), each block of
/// `block` values ([`QK`] for the 32-weight formats, [`QKK`] for the
/// K-quants) with one scale `d` (`m × k/block`), the integer sums of every
/// 16 values (`h`, `m × k/16`: `Q6_K`'s offset, the K-quants' minimums),
/// and, per [`QK`] block, `d·Σq` (`s`: the 32-weight formats' minimums) or,
/// per two [`QK`] blocks, their sums as a pair of `i16` (`p`: the
/// K-quants' minimums, two sub-blocks in one `vpmaddwd`).
pub(crate) struct QuantizedRows {
    k: usize,
    block: usize,
    q: Vec<i8>,
    /// For AMX ([`QuantizedRows::tile`]): `q`'s whole tiles of [`ROWS`]
    /// rows, each as runs of 64 inputs (1 KiB, a row's 64 bytes after
    /// another's; `k` padded with zeros to a multiple of 64), so that a
    /// tile of token rows is one contiguous stretch.
    tiled: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    h: Vec<i32>,
    p: Vec<i32>,
}

impl QuantizedRows {
    /// Quantize `m` rows of `k` values (`k` a multiple of `block`, which is
    /// [`QK`] or [`QKK`]): per block `d = max|x| / 127`, `q = round(x / d)`
    /// (halves away from zero).
    pub(crate) fn new(x: &[f32], m: usize, k: usize, block: usize) -> Self {
        assert!(
            (block == QK || block == QKK) && k.is_multiple_of(block) && x.len() == m * k,
            "quantized rows' shape"
        );
        let mut rows = QuantizedRows {
            k,
            block,
            q: vec![0; m * k],
            tiled: Vec::new(),
            d: vec![0.0; m * k / block],
            s: vec![0.0; if block == QK { m * k / QK } else { 0 }],
            h: vec![0; m * k / (QK / 2)],
            p: vec![0; if block == QKK { m * k / (2 * QK) } else { 0 }],
        };
        #[cfg(target_arch = "x86_64")]
        let simd = std::is_x86_feature_detected!("avx2");
        let per = block / QK;
        for (((x, q), d), h) in x
            .chunks_exact(block)
            .zip(rows.q.chunks_exact_mut(block))
            .zip(&mut rows.d)
            .zip(rows.h.chunks_exact_mut(2 * per))
        {
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: the CPU has AVX2; `x`, `q` and `h` hold a block's
                // values, quants and half sums.
                *d = unsafe { x86::quantize_block(x, q, h) };
                continue;
            }
            *d = quantize_block_reference(x, q, h);
        }
        if block == QK {
            for ((s, d), h) in rows.s.iter_mut().zip(&rows.d).zip(rows.h.chunks_exact(2)) {
                *s = *d * (h[0] + h[1]) as f32;
            }
        } else {
            for (p, h) in rows.p.iter_mut().zip(rows.h.chunks_exact(4)) {
                *p = ((h[0] + h[1]) & 0xffff) | ((h[2] + h[3]) << 16);
            }
        }
        rows
    }

    /// Lay out the rows' whole tiles of [`ROWS`] for the tile unit
    /// ([`QuantizedRows::tiled`]).
    fn tile(&mut self) {
        let (m, runs) = (self.q.len() / self.k, self.k.div_ceil(64));
        self.tiled = vec![0; m / ROWS * runs * 64 * ROWS];
        for (t, tile) in self.tiled.chunks_exact_mut(runs * 64 * ROWS).enumerate() {
            for r in 0..ROWS {
                let row = &self.q[(ROWS * t + r) * self.k..][..self.k];
                for (run, values) in row.chunks(64).enumerate() {
                    tile[(run * ROWS + r) * 64..][..values.len()].copy_from_slice(values);
                }
            }
        }
    }

    /// Where the tile of rows `row..row + ROWS` (`row` a multiple of
    /// [`ROWS`]) holds input `i` (a multiple of 32): rows 64 bytes apart.
    #[cfg(target_arch = "x86_64")]
    fn tiled_at(&self, row: usize, i: usize) -> *const i8 {
        debug_assert!(row.is_multiple_of(ROWS) && i.is_multiple_of(QK) && i < self.k);
        let runs = self.k.div_ceil(64);
        self.tiled[((row / ROWS * runs + i / 64) * ROWS) * 64 + i % 64..].as_ptr()
    }

    /// [`QK`] blocks a row.
    fn blocks(&self) -> usize {
        self.k / QK
    }

    /// Row `r`'s scale of the block holding [`QK`] block `b`.
    fn scale(&self, r: usize, b: usize) -> f32 {
        self.d[(r * self.k + b * QK) / self.block]
    }
}

/// A token row's block (of [`QK`] or [`QKK`] values) as 8-bit integers
/// ([`quantize_q8`]): its scale returned, the integer sums of every 16
/// quants in `h`.
fn quantize_block_reference(x: &[f32], q: &mut [i8], h: &mut [i32]) -> f32 {
    let d = quantize_q8(x, q);
    for (h, q) in h.iter_mut().zip(q.chunks_exact(QK / 2)) {
        *h = q.iter().map(|&q| q as i32).sum();
    }
    d
}

/// One output: weight row `row` of a part times token row `r` of `x`, in
/// the arithmetic the module comment gives, written out plainly. The
/// portable kernel; the reference the SIMD kernels are held to, bit for bit.
///
/// The K-quants take `x` in blocks of [`QKK`]: per super-block, the
/// integer sums of its sub-blocks times their integer scales, summed
/// exactly, then `acc = (d·d_x)·Σ + acc`; `Q4_K` and `Q5_K` then `acc =
/// (−dmin·d_x)·Σ_j m_j·Σ_{x∈j} q_x + acc`; `Q6_K` takes each half-block's
/// `Σ (q − 32)·q_x` as `Σ q·q_x − 32·Σ q_x`.
fn dot_reference(part: &Part, row: usize, x: &QuantizedRows, r: usize) -> f32 {
    let (mut acc, mut min) = (0f32, 0f32);
    let (nb, subs) = (x.blocks(), part.ty.sub_blocks());
    if part.ty.is_k() {
        for fb in 0..nb / subs {
            let group = part.group(row / WR, fb, nb / subs);
            let (l, xd) = (row % WR, x.scale(r, fb * subs));
            let half = |at: usize| f16::from_bits(u16::from_le_bytes([group[at], group[at + 1]])).to_f32();
            let (mut sum, mut minimum) = (0i32, 0i32);
            for j in 0..subs {
                let b = fb * subs + j;
                let block = group_row(part.ty, group, l, j);
                let xq = &x.q[r * x.k + b * QK..][..QK];
                // Exact integers: `Q6_K`'s `Σ (q − 32)·q_x` is `Σ q·q_x − 32·Σ q_x`.
                let dot = |range: std::ops::Range<usize>| -> i32 { range.map(|i| block.w[i] * xq[i] as i32).sum() };
                let xh = &x.h[r * 2 * nb + 2 * b..][..2];
                if part.ty == QuantType::Q6K {
                    let scale = |h: usize| group[part.ty.k_scales() + WR * (2 * j + h) + l] as i8 as i32;
                    sum += scale(0) * dot(0..QK / 2) + scale(1) * dot(QK / 2..QK);
                } else {
                    let k = part.ty.k_scales();
                    sum += group[k + WR * j + l] as i32 * dot(0..QK);
                    minimum += group[part.ty.k_minimums() + WR * j + l] as i32 * (xh[0] + xh[1]);
                }
            }
            acc = (half(2 * l) * xd).mul_add(sum as f32, acc);
            if part.ty != QuantType::Q6K {
                let minus_dmin = -half(part.ty.group_minimums() + 2 * l);
                acc = (minus_dmin * xd).mul_add(minimum as f32, acc);
            }
        }
        // `+ 0.0` as the kernels' sum of their two accumulators gives it.
        return acc + min;
    }
    for b in 0..nb {
        let block = group_row(part.ty, part.group(row / WR, b, nb), row % WR, 0);
        let xq = &x.q[r * x.k + b * QK..][..QK];
        let sum = |range: std::ops::Range<usize>| -> i32 { range.map(|i| block.w[i] * xq[i] as i32).sum() };
        let xd = x.d[r * nb + b];
        acc = (block.d[0] * xd).mul_add(sum(0..QK) as f32, acc);
        if part.ty.has_offset() {
            min = block.m.mul_add(x.s[r * nb + b], min);
        }
    }
    acc + min
}

/// Whether a product of `m` token rows on `ty`'s blocks takes the AMX
/// tiles: on [`QuantKernel::Amx`], from 32 rows (16 for `Q8_0`). Below
/// that only `Q8_0` gains from them: the others' weights, unpacked for one
/// tile of rows alone, cost more than the registers' products.
fn on_tiles(kernel: QuantKernel, ty: QuantType, m: usize) -> bool {
    kernel == QuantKernel::Amx && m >= if ty == QuantType::Q8_0 { ROWS } else { 2 * ROWS }
}

/// The output buffer, shared by tasks that write disjoint columns of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: tasks write disjoint columns only (see `QuantMatrix::matmul_into`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Every token row of `x` times the part's `groups`, into their columns of
/// `out` (`m × n`), and `expand` added to each panel of [`NR`] columns once
/// its groups are done.
///
/// # Safety
/// Nothing else may touch those columns meanwhile; the CPU must have
/// `kernel` (resolved); `groups` must start on a panel and, where `expand`
/// is not empty, the part too, and the kernel must not be portable.
unsafe fn part_product(
    part: &Part,
    groups: std::ops::Range<usize>,
    x: &QuantizedRows,
    n: usize,
    out: OutPtr,
    kernel: QuantKernel,
    expand: Fused<'_, '_>,
) {
    let nb = x.blocks();
    let (gb, file_blocks) = (part.ty.group_bytes(), nb / part.ty.sub_blocks());
    let m = x.q.len() / x.k;
    let per_panel = NR / WR;
    // AMX: whole tiles of 16 token rows of two groups on the tile unit, the
    // rest of the rows (and a group left without a pair) on AVX-512 VNNI,
    // whose sums are the same.
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's contract: the CPU has the kernel.
    let mut byte_tiles = on_tiles(kernel, part.ty, m).then(|| {
        (
            unsafe { super::amx::ByteTiles::new(part.ty.is_k()) },
            x86::Scratch::new(),
        )
    });
    let kernel = if kernel == QuantKernel::Amx {
        QuantKernel::Avx512Vnni
    } else {
        kernel
    };
    // The lines of the next panel's expand, listed at the panel's first group.
    let mut lines: Vec<*const u8> = Vec::new();
    for chunk in (0..m).step_by(MC) {
        let chunk = chunk..(chunk + MC).min(m);
        for g in groups.clone() {
            let cols = WR.min(part.rows - g * WR);
            let first_col = part.first + g * WR;
            let panel = first_col / NR;
            if kernel == QuantKernel::Portable {
                for r in chunk.clone() {
                    for j in 0..cols {
                        let y = dot_reference(part, g * WR + j, x, r);
                        // SAFETY: the caller's contract; inside `out`.
                        unsafe { *out.0.add(r * n + first_col + j) = y };
                    }
                }
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            {
                let blocks = |g: usize| part.data[g * file_blocks * gb..][..file_blocks * gb].as_ptr();
                // The first row the registers take: past the rows the tiles did.
                let mut from = chunk.start;
                let whole = chunk.len() / ROWS * ROWS;
                let pair = g - (g - groups.start) % 2;
                let in_panel = (g - groups.start) % per_panel;
                // The next panel's expand, if this task computes it: its
                // `B` lines (each panel's once) listed at the panel's first
                // group, a slice of them to each tile of the panel's groups,
                // which asks for a few between its blocks (on the tiles: all
                // of them, before the pair).
                let next_panel = !expand.is_none() && g - in_panel + per_panel < groups.end;
                if let Some((unit, scratch)) = byte_tiles.as_mut().filter(|_| whole > 0 && pair + 1 < groups.end) {
                    if g == pair {
                        if next_panel {
                            expand.prefetch(chunk.start..chunk.start + whole, panel + 1);
                        }
                        // SAFETY: the caller's contract; both groups hold
                        // `nb` blocks, the rows lie in `x` and `out`.
                        unsafe {
                            let both = x86::Pair {
                                blocks: [blocks(g), blocks(g + 1)],
                                nb,
                                x,
                                row: chunk.start,
                                tiles: whole / ROWS,
                                out: out.0.add(chunk.start * n + first_col),
                                ldo: n,
                                cols: [cols, WR.min(part.rows - (g + 1) * WR)],
                            };
                            x86::pair_amx(unit, part.ty, &both, scratch);
                        }
                    }
                    from += whole;
                }
                let rest = from..chunk.end;
                let height = if kernel == QuantKernel::Avx512Vnni { XR_WIDE } else { XR };
                let tile_rows = |r: usize| 1usize << height.min(chunk.end - r).ilog2();
                // Whole tiles, then one for each power of two in the rest.
                let tiles = rest.len() / height + (rest.len() % height).count_ones() as usize;
                let slots = per_panel * tiles;
                if next_panel && in_panel == 0 {
                    lines.clear();
                    expand.lines(rest.clone(), panel + 1, &mut lines);
                }
                let (mut r, mut tile_index) = (rest.start, 0);
                while r < rest.end {
                    // Tiles of a power of two rows: 3 rows are 2 and 1.
                    let rows = tile_rows(r);
                    let expand_lines: &[*const u8] = if next_panel {
                        let slot = in_panel * tiles + tile_index;
                        let share = |s: usize| s * lines.len() / slots;
                        &lines[share(slot)..share(slot + 1)]
                    } else {
                        &[]
                    };
                    // SAFETY: the caller's contract; the group holds `nb × WR`
                    // blocks and each token row `nb` quantized blocks.
                    unsafe {
                        let tile = x86::Tile {
                            blocks: blocks(g),
                            nb,
                            x,
                            row: r,
                            out: out.0.add(r * n + first_col),
                            ldo: n,
                            cols,
                            expand_lines,
                        };
                        x86::tile(kernel, part.ty, rows, &tile);
                    }
                    r += rows;
                    tile_index += 1;
                }
            }
            if !expand.is_none() && (((g + 1) * WR).is_multiple_of(NR) || g + 1 == part.groups()) {
                // SAFETY: the caller's contract: this task's panel, all written.
                unsafe { expand.add(chunk.clone(), panel, out.0, n) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::amx::{ByteTiles, Ints};
    use super::{QuantKernel, QuantType, QuantizedRows, MC, QK, QKK, ROWS, WR};

    /// How far ahead of the block a tile is on the kernel asks for the
    /// group's next blocks, in bytes.
    const PREFETCH_BYTES: usize = 2048;

    /// A group's tile: its [`super::WR`] weight rows (of which `cols` are
    /// real) times token rows `row..row + X` of `x`.
    pub(super) struct Tile<'a> {
        /// The group's first block (each `group_bytes`, `nb` of them).
        pub blocks: *const u8,
        pub nb: usize,
        pub x: &'a QuantizedRows,
        pub row: usize,
        /// The tile's first output; its rows are `ldo` apart.
        pub out: *mut f32,
        pub ldo: usize,
        pub cols: usize,
        /// Lines of adapter weights (the fused expand's next panel) to ask
        /// for into L2, spread over the tile's blocks.
        pub expand_lines: &'a [*const u8],
    }

    /// The formats as const parameters of the kernels.
    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q4_1: u8 = 2;
    const Q5_0: u8 = 3;
    const Q5_1: u8 = 4;
    const Q4K: u8 = 5;
    const Q5K: u8 = 6;
    const Q6K: u8 = 7;

    /// The format of a kernel's const parameter.
    const fn format(ty: u8) -> QuantType {
        match ty {
            Q8_0 => QuantType::Q8_0,
            Q4_0 => QuantType::Q4_0,
            Q4_1 => QuantType::Q4_1,
            Q5_0 => QuantType::Q5_0,
            Q5_1 => QuantType::Q5_1,
            Q4K => QuantType::Q4K,
            Q5K => QuantType::Q5K,
            _ => QuantType::Q6K,
        }
    }

    /// `acc + Σ_{i=4l}^{4l+3} u[i]·s[i]` in each lane `l` (`u` unsigned, `s`
    /// signed bytes, each pair's sum within i16 as the callers keep them).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn dot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
    }

    /// [`dot_avx2`] in one instruction (AVX-VNNI).
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    fn dot_avx_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(acc, u, s)
    }

    /// [`dot_avx2`] in one instruction (AVX-512 VNNI on 256 bits).
    #[inline]
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    fn dot_avx512_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, u, s)
    }

    /// [`super::quantize_block_reference`] on AVX2, bit for bit for finite
    /// values: the same maximum, scale and products, and rounding half away
    /// from zero (the truncation, plus one away from zero where the fraction
    /// left is at least a half; `x − trunc(x)` is exact).
    ///
    /// # Safety
    /// The CPU must have AVX2; `x` and `q` must hold the same multiple of
    /// [`QK`] values, `h` one sum for every 16 of them.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn quantize_block(x: &[f32], q: &mut [i8], h: &mut [i32]) -> f32 {
        debug_assert!(x.len().is_multiple_of(QK) && q.len() == x.len() && h.len() == x.len() / (QK / 2));
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let mut m = _mm256_setzero_ps();
        for eight in x.chunks_exact(8) {
            // SAFETY: eight floats.
            m = _mm256_max_ps(m, _mm256_and_ps(unsafe { _mm256_loadu_ps(eight.as_ptr()) }, abs));
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        let d = _mm_cvtss_f32(m) / 127.0;
        let inverse = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
        let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
        let sign = _mm256_set1_ps(-0.0);
        let (low, high) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        for ((x, q), h) in x
            .chunks_exact(QK)
            .zip(q.chunks_exact_mut(QK))
            .zip(h.chunks_exact_mut(2))
        {
            let ints: [__m256i; 4] = std::array::from_fn(|i| {
                // SAFETY: eight of the block's 32 floats.
                let y = _mm256_mul_ps(unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) }, inverse);
                let t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                let fraction = _mm256_andnot_ps(sign, _mm256_sub_ps(y, t));
                let up = _mm256_and_ps(_mm256_cmp_ps(fraction, half, _CMP_GE_OQ), one);
                let r = _mm256_add_ps(t, _mm256_or_ps(up, _mm256_and_ps(y, sign)));
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, low), high))
            });
            // Four vectors of eight i32 into 32 bytes, in order.
            let words = _mm256_packs_epi32(ints[0], ints[1]);
            let words2 = _mm256_packs_epi32(ints[2], ints[3]);
            let bytes = _mm256_packs_epi16(words, words2);
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // SAFETY: the block's 32 bytes.
            unsafe { _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes) };
            let sum = |a: __m256i, b: __m256i| {
                let s = _mm256_add_epi32(a, b);
                let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
                _mm_cvtsi128_si32(s)
            };
            (h[0], h[1]) = (sum(ints[0], ints[1]), sum(ints[2], ints[3]));
        }
        d
    }

    /// The fifth bits of weights `16·half + 4c..` `+ 4` of each row (`bits`:
    /// a [`super::fifth_plane`] a row), as `0x10` or 0 in the byte of each
    /// weight: its bit `4·half + c` in every byte.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn fifth_bit(bits: __m256i, half: usize, c: usize) -> __m256i {
        let select = _mm256_set1_epi8((1u8 << (4 * half + c)) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(bits, select), select);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }

    /// Weights `4c..4c + 3` and `16 + 4c..16 + 4c + 3` of each of a group's
    /// rows in a (sub-)block of a nibble format, as unsigned bytes (four a
    /// row, in order), their fifth bits (`fifth`, where the format has
    /// them) and `Q6_K`'s high bits (at `high_bits`, of sub-block `j`) in
    /// place.
    ///
    /// # Safety
    /// `q` must hold the (sub-)block's 128 bytes of quants, `high_bits`
    /// (`Q6_K`) its pair's 256 bytes of high bits.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quads<const TY: u8>(
        q: *const u8,
        fifth: __m256i,
        high_bits: *const u8,
        j: usize,
        c: usize,
    ) -> (__m256i, __m256i) {
        let nibble = _mm256_set1_epi8(0x0f);
        // SAFETY: the caller's contract; unaligned reads.
        let w = unsafe { _mm256_loadu_si256(q.add(32 * c) as *const __m256i) };
        let mut low = _mm256_and_si256(w, nibble);
        let mut high = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        if format(TY).has_fifth_bits() {
            low = _mm256_or_si256(low, fifth_bit(fifth, 0, c));
            high = _mm256_or_si256(high, fifth_bit(fifth, 1, c));
        }
        if TY == Q6K {
            // Weight `t`'s two bits at `2·(j % 2)`, weight `t + 16`'s at `4 +
            // 2·(j % 2)`: masked, then shifted to bits 4–5 (16-bit shifts of
            // masked bytes carry nothing across bytes).
            // SAFETY: the caller's contract.
            let h = unsafe { _mm256_loadu_si256(high_bits.add(32 * c) as *const __m256i) };
            let (l6, h6) = if j.is_multiple_of(2) {
                (
                    _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x03)), 4),
                    _mm256_and_si256(h, _mm256_set1_epi8(0x30)),
                )
            } else {
                (
                    _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x0c)), 2),
                    _mm256_srli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0xc0u8 as i8)), 2),
                )
            };
            low = _mm256_or_si256(low, l6);
            high = _mm256_or_si256(high, h6);
        }
        (low, high)
    }

    /// Two groups' rows times whole tiles of 16 token rows, for [`pair_amx`].
    pub(super) struct Pair<'a> {
        /// Each group's first block (each `group_bytes`, `nb` of them).
        pub blocks: [*const u8; 2],
        pub nb: usize,
        pub x: &'a QuantizedRows,
        pub row: usize,
        /// Tiles of [`ROWS`] token rows from `row`, at most `MC / ROWS`.
        pub tiles: usize,
        /// The first group's first output; the second's follow its [`WR`].
        pub out: *mut f32,
        pub ldo: usize,
        /// Each group's real rows.
        pub cols: [usize; 2],
    }

    /// 32 inputs of both groups as tile rows: row `i` holds inputs `4i` to
    /// `4i + 3` of the first group's eight outputs, then of the second's,
    /// as signed bytes.
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Weights([i8; 512]);

    /// 64 inputs of both groups as tile rows, as [`Weights`].
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Wide([i8; 1024]);

    /// 16 × 16 f32 of a tile, row by row.
    #[repr(C, align(64))]
    #[derive(Clone, Copy)]
    struct Floats([f32; ROWS * 16]);

    /// The 32-weight blocks [`pair_amx`] takes a step.
    const STEP: usize = 4;

    /// What [`pair_amx`] works in, made once per task: each tile's sums of
    /// blocks and of minimums, a step's weights as tile rows (the
    /// 32-weight blocks') or a super-block's weights times their sub-block
    /// scales in two digits (the K-quants': four tiles of 64 inputs, each
    /// its low digits then its high ones), and the tile products' sums.
    pub(super) struct Scratch {
        acc: [Floats; MC / ROWS],
        min: [Floats; MC / ROWS],
        weights: [Weights; STEP],
        digits: [Wide; 8],
        sums: [Ints; 4],
    }

    impl Scratch {
        pub(super) fn new() -> Box<Scratch> {
            Box::new(Scratch {
                acc: [Floats([0.0; ROWS * 16]); MC / ROWS],
                min: [Floats([0.0; ROWS * 16]); MC / ROWS],
                weights: [Weights([0; 512]); STEP],
                digits: [Wide([0; 1024]); 8],
                sums: [Ints([0; ROWS * 16]); 4],
            })
        }
    }

    /// [`Pair`]'s outputs on AMX-INT8 ([`ByteTiles`] configured for
    /// `ty.is_k()`), the same bits as [`tile`]'s: the integer sums come
    /// from the tiles, exact, and the f32 arithmetic after them is
    /// [`tile`]'s, on 16 outputs at a time.
    ///
    /// # Safety
    /// As [`tile`] for each group, `tiles` whole tiles of rows; `unit` the
    /// tiles configured on this thread; the CPU must have AVX-512 (F, BW,
    /// VL), FMA and F16C.
    pub(super) unsafe fn pair_amx(unit: &ByteTiles, ty: QuantType, pair: &Pair<'_>, scratch: &mut Scratch) {
        assert!(pair.tiles <= MC / ROWS);
        // SAFETY: the caller's contract.
        unsafe {
            match ty {
                QuantType::Q8_0 => pair_amx_blocks::<Q8_0>(unit, pair, scratch),
                QuantType::Q4_0 => pair_amx_blocks::<Q4_0>(unit, pair, scratch),
                QuantType::Q4_1 => pair_amx_blocks::<Q4_1>(unit, pair, scratch),
                QuantType::Q5_0 => pair_amx_blocks::<Q5_0>(unit, pair, scratch),
                QuantType::Q5_1 => pair_amx_blocks::<Q5_1>(unit, pair, scratch),
                QuantType::Q4K => pair_amx_k::<Q4K>(unit, pair, scratch),
                QuantType::Q5K => pair_amx_k::<Q5K>(unit, pair, scratch),
                QuantType::Q6K => pair_amx_k::<Q6K>(unit, pair, scratch),
            }
            write_out(pair, scratch, ty.has_offset() && !ty.is_k());
        }
    }

    /// Each tile's outputs, `acc + min` (`min` zero where the format has
    /// none, as [`tile`]'s), into their places.
    ///
    /// # Safety
    /// As [`pair_amx`].
    #[target_feature(enable = "avx512f")]
    unsafe fn write_out(pair: &Pair<'_>, scratch: &Scratch, has_min: bool) {
        for t in 0..pair.tiles {
            for r in 0..ROWS {
                // SAFETY: the caller's contract: the tiles' outputs lie in `out`.
                unsafe {
                    let min = if has_min {
                        _mm512_load_ps(scratch.min[t].0[16 * r..].as_ptr())
                    } else {
                        _mm512_setzero_ps()
                    };
                    let y = _mm512_add_ps(_mm512_load_ps(scratch.acc[t].0[16 * r..].as_ptr()), min);
                    let at = pair.out.add((ROWS * t + r) * pair.ldo);
                    if pair.cols == [WR, WR] {
                        _mm512_storeu_ps(at, y);
                        continue;
                    }
                    let mut lanes = [0f32; 16];
                    _mm512_storeu_ps(lanes.as_mut_ptr(), y);
                    std::ptr::copy_nonoverlapping(lanes.as_ptr(), at, pair.cols[0]);
                    std::ptr::copy_nonoverlapping(lanes[WR..].as_ptr(), at.add(WR), pair.cols[1]);
                }
            }
        }
    }

    /// Sixteen halves, eight at `a` then eight at `b`, as f32.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn halves(a: *const u8, b: *const u8) -> __m512 {
        // SAFETY: the caller's contract: 16 bytes at each.
        let (a, b) = unsafe {
            (
                _mm_loadu_si128(a as *const __m128i),
                _mm_loadu_si128(b as *const __m128i),
            )
        };
        _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1))
    }

    /// One 32-weight block of both groups (`p`: their blocks) as tile rows.
    ///
    /// # Safety
    /// As [`pair_amx`]; `p` blocks of format `TY`, not a K-quant.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn unpack<const TY: u8>(p: [*const u8; 2], out: &mut Weights) {
        let ty = format(TY);
        for (g, &p) in p.iter().enumerate() {
            // SAFETY (whole loop): the caller's contract; aligned stores
            // inside `out`, unaligned reads of the blocks.
            unsafe {
                let q = p.add(ty.quants_in());
                let mut put = |i: usize, v: __m256i| {
                    _mm256_store_si256(out.0.as_mut_ptr().add(64 * i + 32 * g) as *mut __m256i, v)
                };
                if TY == Q8_0 {
                    for i in 0..QK / 4 {
                        put(i, _mm256_loadu_si256(q.add(32 * i) as *const __m256i));
                    }
                    continue;
                }
                let fifth = if ty.has_fifth_bits() {
                    _mm256_loadu_si256(p.add(ty.fifth_at()) as *const __m256i)
                } else {
                    _mm256_setzero_si256()
                };
                for c in 0..QK / 8 {
                    let (low, high) = quads::<TY>(q, fifth, p, 0, c);
                    put(c, low);
                    put(QK / 8 + c, high);
                }
            }
        }
    }

    /// The 32-weight formats on the tiles: per block of 32 inputs, the
    /// integer sums of 16 token rows × 16 outputs from one `tdpbssd`, then
    /// [`tile`]'s `acc = (d·d_x)·Σ + acc` and `min = m·s_x + min`. A step
    /// takes [`STEP`] blocks, unpacked once for every tile of rows.
    ///
    /// # Safety
    /// As [`pair_amx`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn pair_amx_blocks<const TY: u8>(unit: &ByteTiles, pair: &Pair<'_>, scratch: &mut Scratch) {
        let &Pair {
            blocks,
            nb,
            x,
            row,
            tiles,
            ..
        } = pair;
        let (ty, gb) = (format(TY), format(TY).group_bytes());
        let Scratch {
            acc,
            min,
            weights,
            sums,
            ..
        } = scratch;
        // SAFETY (whole loop): the caller's contract: both groups' blocks
        // and the tiles' token rows lie in range.
        unsafe {
            for first_block in (0..nb).step_by(STEP) {
                let count = STEP.min(nb - first_block);
                let at = |b: usize| [blocks[0].add(b * gb), blocks[1].add(b * gb)];
                for (i, weights) in weights.iter_mut().enumerate().take(count) {
                    unpack::<TY>(at(first_block + i), weights);
                }
                for t in 0..tiles {
                    let first = row + ROWS * t;
                    let mut a = [std::ptr::null::<i8>(); STEP];
                    for (i, a) in a.iter_mut().enumerate().take(count) {
                        *a = x.tiled_at(first, (first_block + i) * QK);
                    }
                    unit.dots(&a[..count], weights.as_ptr() as *const i8, &mut sums[..count]);
                    for (i, sums) in sums.iter().enumerate().take(count) {
                        let (b, p) = (first_block + i, at(first_block + i));
                        let d_file = halves(p[0], p[1]);
                        let m = match TY {
                            Q4_1 | Q5_1 => halves(p[0].add(ty.group_minimums()), p[1].add(ty.group_minimums())),
                            Q5_0 => _mm512_mul_ps(d_file, _mm512_set1_ps(-16.0)),
                            _ => _mm512_mul_ps(d_file, _mm512_set1_ps(-8.0)),
                        };
                        for r in 0..ROWS {
                            let sum = _mm512_load_si512(sums.0.as_ptr().add(16 * r) as *const __m512i);
                            let scale = _mm512_mul_ps(d_file, _mm512_set1_ps(x.d[(first + r) * nb + b]));
                            let (acc, min) = (acc[t].0[16 * r..].as_mut_ptr(), min[t].0[16 * r..].as_mut_ptr());
                            // The sums start at zero, as [`tile`]'s (not stored first).
                            let old = |at: *mut f32| {
                                if b == 0 {
                                    _mm512_setzero_ps()
                                } else {
                                    _mm512_load_ps(at)
                                }
                            };
                            _mm512_store_ps(acc, _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sum), old(acc)));
                            if TY != Q8_0 {
                                let xs = _mm512_set1_ps(x.s[(first + r) * nb + b]);
                                _mm512_store_ps(min, _mm512_fmadd_ps(m, xs, old(min)));
                            }
                        }
                    }
                }
            }
        }
    }

    /// `v`'s bytes (unsigned, eight rows of four) times `scale` (each row's
    /// signed byte scale as `i32` lanes), less `offset` (each row's, as
    /// 16-bit words), in two digits: `(low, high)` with `v·s − offset =
    /// 2^shift·high + low`, `0 ≤ low < 2^shift`, each a signed byte.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn in_digits(v: __m256i, scale: __m256i, offset: __m256i, shift: i32) -> (__m256i, __m256i) {
        // Each row's scale in its even bytes, then in its odd ones: one
        // product a 16-bit word, exact.
        let s = _mm256_and_si256(scale, _mm256_set1_epi32(0xff));
        let even = _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
        let odd = _mm256_slli_epi32(even, 8);
        let pe = _mm256_sub_epi16(_mm256_maddubs_epi16(v, even), offset);
        let po = _mm256_sub_epi16(_mm256_maddubs_epi16(v, odd), offset);
        let count = _mm_cvtsi32_si128(shift);
        let mask = _mm256_set1_epi16((1 << shift) - 1);
        let low = _mm256_or_si256(
            _mm256_and_si256(pe, mask),
            _mm256_slli_epi16(_mm256_and_si256(po, mask), 8),
        );
        let high = _mm256_or_si256(
            _mm256_and_si256(_mm256_sra_epi16(pe, count), _mm256_set1_epi16(0xff)),
            _mm256_slli_epi16(_mm256_sra_epi16(po, count), 8),
        );
        (low, high)
    }

    /// The K-quants on the tiles. Each weight times its sub-block's integer
    /// scale (`Q6_K`: `(q − 32)·s`, each half its own) is written in two
    /// signed-byte digits, `2^shift·high + low` (`shift` 5, or 6 for
    /// `Q6_K`), so that a tile product sums whole sub-blocks with their
    /// scales applied: per super-block and tile of rows, four tiles of 64
    /// inputs for each digit, and `Σ_j s_j·Σ q·q_x = low + 2^shift·high`,
    /// the same exact integer as [`tile`]'s. Then [`tile`]'s f32 steps.
    ///
    /// # Safety
    /// As [`pair_amx`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn pair_amx_k<const TY: u8>(unit: &ByteTiles, pair: &Pair<'_>, scratch: &mut Scratch) {
        let &Pair {
            blocks,
            nb,
            x,
            row,
            tiles,
            ..
        } = pair;
        let ty = format(TY);
        let (gb, subs) = (ty.group_bytes(), ty.sub_blocks());
        let scales = nb / subs;
        let shift = if TY == Q6K { 6 } else { 5 };
        let Scratch { acc, digits, sums, .. } = scratch;
        // SAFETY (whole loop): the caller's contract: both groups' blocks
        // and the tiles' token rows lie in range.
        unsafe {
            for fb in 0..scales {
                let p = [blocks[0].add(fb * gb), blocks[1].add(fb * gb)];
                for (g, &p) in p.iter().enumerate() {
                    for j in 0..subs {
                        let sub = p.add(ty.sub_block_at(j));
                        let q = sub.add(ty.quants_in());
                        let fifth = if ty.has_fifth_bits() {
                            _mm256_loadu_si256(sub.add(ty.fifth_at()) as *const __m256i)
                        } else {
                            _mm256_setzero_si256()
                        };
                        let high_bits = p.add(ty.high_bits_at(j));
                        // Each half's scale (`Q6_K`'s own, signed) and offset.
                        let half = |h: usize| {
                            if TY == Q6K {
                                let s = _mm_loadl_epi64(p.add(ty.k_scales() + 16 * j + 8 * h) as *const __m128i);
                                let s = _mm256_cvtepi8_epi32(s);
                                let offset = _mm256_slli_epi32(s, 5);
                                let offset = _mm256_or_si256(
                                    _mm256_and_si256(offset, _mm256_set1_epi32(0xffff)),
                                    _mm256_slli_epi32(offset, 16),
                                );
                                (s, offset)
                            } else {
                                let s = _mm_loadl_epi64(p.add(ty.k_scales() + 8 * j) as *const __m128i);
                                (_mm256_cvtepu8_epi32(s), _mm256_setzero_si256())
                            }
                        };
                        let (first, second) = (half(0), half(1));
                        // Tile rows of the super-block's step `j / 2`: its
                        // first sub-block's eight rows, then its second's.
                        let (tile, base) = (j / 2, 8 * (j % 2));
                        let put = |digit: usize, i: usize, v: __m256i| {
                            let at = digits[2 * tile + digit].0.as_ptr().add(64 * (base + i) + 32 * g);
                            _mm256_store_si256(at as *mut __m256i, v);
                        };
                        for c in 0..QK / 8 {
                            let (low, high) = quads::<TY>(q, fifth, high_bits, j, c);
                            for (i, v, (s, offset)) in [(c, low, first), (QK / 8 + c, high, second)] {
                                let (l, h) = in_digits(v, s, offset, shift);
                                put(0, i, l);
                                put(1, i, h);
                            }
                        }
                    }
                }
                let mut minimums = [_mm512_setzero_si512(); 4];
                if TY != Q6K {
                    let at = ty.k_minimums();
                    for (pair, m) in minimums.iter_mut().enumerate() {
                        let [a, b] = p.map(|p| {
                            let even = _mm_loadl_epi64(p.add(at + 16 * pair) as *const __m128i);
                            let odd = _mm_loadl_epi64(p.add(at + 16 * pair + 8) as *const __m128i);
                            _mm_unpacklo_epi8(even, odd)
                        });
                        *m = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
                    }
                }
                let d_file = halves(p[0], p[1]);
                let minus_dmin = if TY == Q6K {
                    _mm512_setzero_ps()
                } else {
                    let at = ty.group_minimums();
                    _mm512_mul_ps(halves(p[0].add(at), p[1].add(at)), _mm512_set1_ps(-1.0))
                };
                for t in (0..tiles).step_by(2) {
                    let two = (tiles - t).min(2);
                    let a = |u: usize| x.tiled_at(row + ROWS * (t + u.min(two - 1)), fb * QKK);
                    unit.digit_dots([a(0), a(1)], two, digits.as_ptr() as *const i8, sums);
                    for u in 0..two {
                        let first = row + ROWS * (t + u);
                        for r in 0..ROWS {
                            let low = _mm512_load_si512(sums[2 * u].0.as_ptr().add(16 * r) as *const __m512i);
                            let high = _mm512_load_si512(sums[2 * u + 1].0.as_ptr().add(16 * r) as *const __m512i);
                            let whole = _mm512_add_epi32(low, _mm512_sll_epi32(high, _mm_cvtsi32_si128(shift)));
                            let xd = _mm512_set1_ps(x.d[(first + r) * scales + fb]);
                            let acc = acc[t + u].0[16 * r..].as_mut_ptr();
                            // The sums start at zero, as [`tile`]'s (not stored first).
                            let old = if fb == 0 {
                                _mm512_setzero_ps()
                            } else {
                                _mm512_load_ps(acc)
                            };
                            let mut y = _mm512_fmadd_ps(_mm512_mul_ps(d_file, xd), _mm512_cvtepi32_ps(whole), old);
                            if TY != Q6K {
                                let pairs = &x.p[(first + r) * nb / 2 + 4 * fb..][..4];
                                let mut sum = _mm512_madd_epi16(minimums[0], _mm512_set1_epi32(pairs[0]));
                                for (m, &x) in minimums[1..].iter().zip(&pairs[1..]) {
                                    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(*m, _mm512_set1_epi32(x)));
                                }
                                y = _mm512_fmadd_ps(_mm512_mul_ps(minus_dmin, xd), _mm512_cvtepi32_ps(sum), y);
                            }
                            _mm512_store_ps(acc, y);
                        }
                    }
                }
            }
        }
    }

    /// A group's rows times `rows` token rows (a power of two, at most the
    /// kernel's tile height): `out[r][j]` for `j < cols`.
    ///
    /// # Safety
    /// `tile.blocks` must hold `nb` groups of `ty`, `x` rows `row..row +
    /// rows`, `out` room for `cols` floats at each of `rows` rows `ldo` apart;
    /// the CPU must have `kernel` (AVX2, FMA, F16C and its own).
    pub(super) unsafe fn tile(kernel: QuantKernel, ty: QuantType, rows: usize, tile: &Tile<'_>) {
        macro_rules! by_type {
            ($kernel:ident, $x:literal) => {
                match ty {
                    QuantType::Q8_0 => $kernel::<Q8_0, $x>(tile),
                    QuantType::Q4_0 => $kernel::<Q4_0, $x>(tile),
                    QuantType::Q4_1 => $kernel::<Q4_1, $x>(tile),
                    QuantType::Q5_0 => $kernel::<Q5_0, $x>(tile),
                    QuantType::Q5_1 => $kernel::<Q5_1, $x>(tile),
                    QuantType::Q4K => $kernel::<Q4K, $x>(tile),
                    QuantType::Q5K => $kernel::<Q5K, $x>(tile),
                    QuantType::Q6K => $kernel::<Q6K, $x>(tile),
                }
            };
        }
        // SAFETY: the caller's contract.
        unsafe {
            match (kernel, rows) {
                (QuantKernel::Avx512Vnni, 1) => by_type!(tile_avx512_vnni, 1),
                (QuantKernel::Avx512Vnni, 2) => by_type!(tile_avx512_vnni, 2),
                (QuantKernel::Avx512Vnni, 4) => by_type!(tile_avx512_vnni, 4),
                (QuantKernel::Avx512Vnni, _) => by_type!(tile_avx512_vnni, 8),
                (QuantKernel::AvxVnni, 1) => by_type!(tile_avx_vnni, 1),
                (QuantKernel::AvxVnni, 2) => by_type!(tile_avx_vnni, 2),
                (QuantKernel::AvxVnni, _) => by_type!(tile_avx_vnni, 4),
                (_, 1) => by_type!(tile_avx2, 1),
                (_, 2) => by_type!(tile_avx2, 2),
                (_, _) => by_type!(tile_avx2, 4),
            }
        }
    }

    /// One tile kernel for each byte dot product: the same body, built for
    /// the instructions its features allow.
    macro_rules! tile_kernel {
        ($name:ident, $features:literal, $dot:ident, $widen_late:literal) => {
            /// A group's rows times `X` token rows, as [`tile`], on blocks of
            /// format `TY`.
            ///
            /// # Safety
            /// As [`tile`], with exactly `X` rows.
            #[target_feature(enable = $features)]
            unsafe fn $name<const TY: u8, const X: usize>(tile: &Tile<'_>) {
                let &Tile {
                    blocks,
                    nb,
                    x,
                    row,
                    out,
                    ldo,
                    cols,
                    expand_lines,
                } = tile;
                let ty = format(TY);
                let (gb, subs) = (ty.group_bytes(), ty.sub_blocks());
                let (mut acc, mut min) = ([_mm256_setzero_ps(); X], [_mm256_setzero_ps(); X]);
                // Independent chains of integer sums per row, so that a tile of
                // few rows does not wait on one chain's latency (integer sums:
                // the split changes nothing). `Q6_K` keeps a block's halves
                // apart: its even chains take the first half, its odd ones the
                // second. Widening late, the 16-bit sums are the chains and
                // each half one 32-bit sum: nothing to merge.
                let chains = match (TY == Q6K, $widen_late) {
                    (true, true) => 2,
                    (false, true) => 1,
                    (true, false) => (4 / X).max(2),
                    (false, false) => (4 / X).max(1),
                };
                // The K-quants' token rows come in blocks of 256: a scale per
                // super-block, and sums of two sub-blocks' quants as `i16` pairs.
                let is_k = TY == Q4K || TY == Q5K || TY == Q6K;
                let scales = nb / subs;
                // Each token row's quants, scales and sums (filled in a plain loop:
                // `array::from_fn`'s closures are not inlined here, and a tile is
                // small enough for their calls to show).
                let mut xq: [*const u8; X] = [std::ptr::null(); X];
                let (mut xd, mut xs): ([&[f32]; X], [&[f32]; X]) = ([&[][..]; X], [&[][..]; X]);
                let (mut xp, mut xh): ([&[i32]; X], [&[i32]; X]) = ([&[][..]; X], [&[][..]; X]);
                for r in 0..X {
                    xq[r] = x.q[(row + r) * x.k..].as_ptr() as *const u8;
                    xd[r] = &x.d[(row + r) * scales..][..scales];
                    if is_k {
                        xp[r] = &x.p[(row + r) * nb / 2..][..nb / 2];
                    } else {
                        xs[r] = &x.s[(row + r) * nb..][..nb];
                    }
                    xh[r] = &x.h[2 * (row + r) * nb..][..2 * nb];
                }
                // The expand's lines, a few a block.
                let per_block = expand_lines.len().div_ceil(nb / subs);
                for fb in 0..nb / subs {
                    // The group's blocks [`PREFETCH_BYTES`] on, every line of
                    // this block's length: the hardware prefetchers stop at
                    // page boundaries, and with few token rows a tile is over
                    // before a missed line would arrive.
                    let ahead = blocks.wrapping_add(fb * gb + PREFETCH_BYTES);
                    for line in (0..gb).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
                    }
                    let lines =
                        (fb * per_block).min(expand_lines.len())..((fb + 1) * per_block).min(expand_lines.len());
                    for &line in &expand_lines[lines] {
                        _mm_prefetch::<_MM_HINT_T1>(line as *const i8);
                    }
                    // SAFETY: the caller's contract: group block `fb` and the
                    // rows' blocks lie in range; unaligned reads.
                    unsafe {
                        let p = blocks.add(fb * gb);
                        let d_file = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                        // A K-quant super-block's exact sum, its sub-block scales applied.
                        let mut whole = [_mm256_setzero_si256(); X];
                        for j in 0..subs {
                            let b = fb * subs + j;
                            let sub = p.add(ty.sub_block_at(j));
                            let q = sub.add(ty.quants_in());
                            // Four of token row `r`'s quants from `at` of block `b`, in every lane
                            // (a macro rather than a closure, so that it is always inlined).
                            macro_rules! four {
                                ($r:expr, $at:expr) => {
                                    _mm256_set1_epi32((xq[$r].add(b * QK + $at) as *const i32).read_unaligned())
                                };
                            }
                            let mut sums = [[_mm256_setzero_si256(); X]; 4];
                            if TY == Q8_0 {
                                for c in 0..QK / 4 {
                                    let w = _mm256_loadu_si256(q.add(32 * c) as *const __m256i);
                                    let u = _mm256_abs_epi8(w);
                                    let sums = &mut sums[c % chains];
                                    for r in 0..X {
                                        sums[r] = $dot(sums[r], u, _mm256_sign_epi8(four!(r, 4 * c), w));
                                    }
                                }
                            } else {
                                let fifth = if ty.has_fifth_bits() {
                                    _mm256_loadu_si256(sub.add(ty.fifth_at()) as *const __m256i)
                                } else {
                                    _mm256_setzero_si256()
                                };
                                let high_bits = p.add(ty.high_bits_at(j));
                                if $widen_late {
                                    // Without a byte dot product instruction: the 16-bit
                                    // pair sums of several `vpmaddubsw` added as they are,
                                    // then widened once (`vpmaddwd`), exact while they fit
                                    // in an `i16`: a pair of 4-bit weights times quants of
                                    // at most 127 is at most 3,810, of 5-bit ones 7,874, of
                                    // `Q6_K`'s 6-bit ones 16,002, so eight, four and two of
                                    // them (`Q6_K`'s halves apart, each for its own scale).
                                    let per = if TY == Q6K || ty.has_fifth_bits() { 2 } else { 4 };
                                    for first in (0..QK / 8).step_by(per) {
                                        let mut pairs = [[_mm256_setzero_si256(); X]; 2];
                                        for c in first..first + per {
                                            let (low, high) = quads::<TY>(q, fifth, high_bits, j, c);
                                            for r in 0..X {
                                                let (l, h) = (four!(r, 4 * c), four!(r, QK / 2 + 4 * c));
                                                pairs[0][r] =
                                                    _mm256_add_epi16(pairs[0][r], _mm256_maddubs_epi16(low, l));
                                                pairs[1][r] =
                                                    _mm256_add_epi16(pairs[1][r], _mm256_maddubs_epi16(high, h));
                                            }
                                        }
                                        let ones = _mm256_set1_epi16(1);
                                        for r in 0..X {
                                            if TY == Q6K {
                                                for (sums, pairs) in sums.iter_mut().zip(&pairs) {
                                                    sums[r] =
                                                        _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs[r], ones));
                                                }
                                                continue;
                                            }
                                            let both = _mm256_add_epi16(pairs[0][r], pairs[1][r]);
                                            sums[0][r] = _mm256_add_epi32(sums[0][r], _mm256_madd_epi16(both, ones));
                                        }
                                    }
                                } else {
                                    for c in 0..QK / 8 {
                                        let (low, high) = quads::<TY>(q, fifth, high_bits, j, c);
                                        let (first, second) = ((2 * c) % chains, (2 * c + 1) % chains);
                                        for r in 0..X {
                                            sums[first][r] = $dot(sums[first][r], low, four!(r, 4 * c));
                                            sums[second][r] = $dot(sums[second][r], high, four!(r, QK / 2 + 4 * c));
                                        }
                                    }
                                }
                            }
                            let merged = if TY == Q6K { 2 } else { 1 };
                            for chain in merged..chains {
                                for r in 0..X {
                                    sums[chain % merged][r] = _mm256_add_epi32(sums[chain % merged][r], sums[chain][r]);
                                }
                            }
                            if TY == Q6K {
                                // Each half-block's `Σ q·q_x − 32·Σ q_x` times its scale.
                                let scales = p.add(ty.k_scales() + 16 * j);
                                let s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(scales as *const __m128i));
                                let s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(scales.add(8) as *const __m128i));
                                for r in 0..X {
                                    let offset0 = _mm256_set1_epi32(32 * xh[r][2 * b]);
                                    let offset1 = _mm256_set1_epi32(32 * xh[r][2 * b + 1]);
                                    let first = _mm256_mullo_epi32(_mm256_sub_epi32(sums[0][r], offset0), s0);
                                    let second = _mm256_mullo_epi32(_mm256_sub_epi32(sums[1][r], offset1), s1);
                                    whole[r] = _mm256_add_epi32(whole[r], _mm256_add_epi32(first, second));
                                }
                                continue;
                            }
                            let sums = sums[0];
                            if is_k {
                                let scale = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                    p.add(ty.k_scales() + 8 * j) as *const __m128i
                                ));
                                for r in 0..X {
                                    whole[r] = _mm256_add_epi32(whole[r], _mm256_mullo_epi32(sums[r], scale));
                                }
                                continue;
                            }
                            let (d, m) = match TY {
                                Q4_1 | Q5_1 => (
                                    d_file,
                                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(ty.group_minimums()) as *const __m128i)),
                                ),
                                Q5_0 => (d_file, _mm256_mul_ps(d_file, _mm256_set1_ps(-16.0))),
                                _ => (d_file, _mm256_mul_ps(d_file, _mm256_set1_ps(-8.0))),
                            };
                            for r in 0..X {
                                let scale = _mm256_mul_ps(d, _mm256_set1_ps(xd[r][b]));
                                acc[r] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums[r]), acc[r]);
                                if TY != Q8_0 {
                                    min[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r][b]), min[r]);
                                }
                            }
                        }
                        if !is_k {
                            continue;
                        }
                        // The super-block's sums into the f32 accumulators; `Q4_K`'s
                        // and `Q5_K`'s minimums as `Σ_j m_j·Σ q_x`, two sub-blocks
                        // a `vpmaddwd` (the rows' `m_j` and `m_{j+1}` as `i16` pairs).
                        let mut minimums = [_mm256_setzero_si256(); 4];
                        if TY != Q6K {
                            let at = p.add(ty.k_minimums());
                            for (pair, m) in minimums.iter_mut().enumerate() {
                                let even = _mm_loadl_epi64(at.add(16 * pair) as *const __m128i);
                                let odd = _mm_loadl_epi64(at.add(16 * pair + 8) as *const __m128i);
                                *m = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(even, odd));
                            }
                        }
                        let minus_dmin = if TY == Q6K {
                            _mm256_setzero_ps()
                        } else {
                            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(p.add(ty.group_minimums()) as *const __m128i));
                            _mm256_mul_ps(dmin, _mm256_set1_ps(-1.0))
                        };
                        for r in 0..X {
                            let xd = _mm256_set1_ps(xd[r][fb]);
                            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d_file, xd), _mm256_cvtepi32_ps(whole[r]), acc[r]);
                            if TY != Q6K {
                                let pairs = &xp[r][4 * fb..][..4];
                                let mut sum = _mm256_madd_epi16(minimums[0], _mm256_set1_epi32(pairs[0]));
                                for (m, &x) in minimums[1..].iter().zip(&pairs[1..]) {
                                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(*m, _mm256_set1_epi32(x)));
                                }
                                acc[r] =
                                    _mm256_fmadd_ps(_mm256_mul_ps(minus_dmin, xd), _mm256_cvtepi32_ps(sum), acc[r]);
                            }
                        }
                    }
                }
                for (r, (acc, min)) in acc.iter().zip(&min).enumerate() {
                    let mut lanes = [0f32; 8];
                    // SAFETY: `lanes` holds 8 floats; the caller's contract for `out`.
                    unsafe {
                        _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(*acc, *min));
                        std::ptr::copy_nonoverlapping(lanes.as_ptr(), out.add(r * ldo), cols);
                    }
                }
            }
        };
    }

    tile_kernel!(tile_avx2, "avx2,fma,f16c", dot_avx2, true);
    tile_kernel!(tile_avx_vnni, "avx2,fma,f16c,avxvnni", dot_avx_vnni, false);
    tile_kernel!(
        tile_avx512_vnni,
        "avx2,fma,f16c,avx512vnni,avx512vl",
        dot_avx512_vnni,
        false
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    /// Random-looking weights with a spread of magnitudes per block.
    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let unit = (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                unit * (1.0 + (i % 7) as f32)
            })
            .collect()
    }

    const TYPES: [(QuantType, GgmlDType); 8] = [
        (QuantType::Q8_0, GgmlDType::Q8_0),
        (QuantType::Q4_0, GgmlDType::Q4_0),
        (QuantType::Q4_1, GgmlDType::Q4_1),
        (QuantType::Q5_0, GgmlDType::Q5_0),
        (QuantType::Q5_1, GgmlDType::Q5_1),
        (QuantType::Q4K, GgmlDType::Q4K),
        (QuantType::Q5K, GgmlDType::Q5K),
        (QuantType::Q6K, GgmlDType::Q6K),
    ];

    /// `n × k` weights quantized by candle, as a GGUF file holds them, and
    /// candle's dequantization of them.
    fn quantized(ggml: GgmlDType, n: usize, k: usize, seed: u32) -> (Vec<u8>, Vec<f32>) {
        let w = Tensor::from_vec(values(n * k, seed), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, ggml).unwrap();
        let back = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        (q.data().unwrap().into_owned(), back)
    }

    #[test]
    fn blocks_dequantize_as_gguf_does_whatever_the_row_order() {
        for (ty, ggml) in TYPES {
            let (n, k) = (7, 3 * ty.block_weights());
            let (blocks, want) = quantized(ggml, n, k, 3);
            let m = QuantMatrix::from_blocks(ty, &blocks, n, k, None).unwrap();
            assert_eq!(m.dequantize(), want, "{}", ty.name());
            let order: Vec<usize> = (0..n).rev().collect();
            let reversed = QuantMatrix::from_blocks(ty, &blocks, n, k, Some(&order)).unwrap();
            let got = reversed.dequantize();
            for r in 0..n {
                assert_eq!(got[r * k..][..k], want[(n - 1 - r) * k..][..k], "{} row {r}", ty.name());
            }
            assert_eq!(m.bytes(), n.div_ceil(WR) * k / ty.block_weights() * ty.group_bytes());
        }
    }

    /// Quantizing at load gives the blocks llama.cpp's reference quantizer
    /// (as candle implements it) writes, byte for byte.
    #[test]
    fn quantizing_gives_the_reference_quantizers_blocks() {
        let (n, k) = (9, 512);
        let mut w = values(n * k, 31);
        w[5 * k..6 * k].fill(0.0);
        for (ty, ggml) in TYPES {
            let want = QTensor::quantize(&Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap(), ggml)
                .unwrap()
                .data()
                .unwrap()
                .into_owned();
            let from_file = QuantMatrix::from_blocks(ty, &want, n, k, None).unwrap();
            let ours = QuantMatrix::quantize(ty, &w, n, k).unwrap();
            assert_eq!(ours.parts[0].data, from_file.parts[0].data, "{}", ty.name());
        }
    }

    #[test]
    fn malformed_blocks_are_refused() {
        let (blocks, _) = quantized(GgmlDType::Q8_0, 2, 64, 1);
        assert_eq!(
            QuantMatrix::from_blocks(QuantType::Q8_0, &blocks, 2, 48, None).unwrap_err(),
            QuantError::Inputs { inputs: 48, block: 32 }
        );
        assert_eq!(
            QuantMatrix::from_blocks(QuantType::Q4K, &blocks, 2, 64, None).unwrap_err(),
            QuantError::Inputs { inputs: 64, block: 256 }
        );
        assert!(matches!(
            QuantMatrix::from_blocks(QuantType::Q8_0, &blocks[1..], 2, 64, None),
            Err(QuantError::Size { .. })
        ));
        assert!(matches!(
            QuantMatrix::from_blocks(QuantType::Q8_0, &blocks, 2, 64, Some(&[1, 1])),
            Err(QuantError::Order { .. })
        ));
    }

    /// Every kernel this CPU has gives the reference's outputs bit for bit,
    /// on odd shapes, partial groups and 1 to 100 token rows, stacked formats
    /// too (the K-quants where the inputs are whole super-blocks).
    #[test]
    fn every_kernel_matches_the_reference_bit_for_bit() {
        let kernels = QuantKernel::available();
        for (n, k) in [
            (1, 32usize),
            (3, 64),
            (4, 96),
            (5, 576),
            (17, 160),
            (64, 64),
            (1, 256),
            (13, 512),
            (64, 768),
        ] {
            let parts: Vec<QuantMatrix> = TYPES
                .iter()
                .filter(|(ty, _)| k.is_multiple_of(ty.block_weights()))
                .enumerate()
                .map(|(i, &(ty, ggml))| {
                    let (blocks, _) = quantized(ggml, n, k, 10 + i as u32);
                    QuantMatrix::from_blocks(ty, &blocks, n, k, None).unwrap()
                })
                .collect();
            let stacked = QuantMatrix::stack(&parts).unwrap();
            // 17 and 100 rows: whole tiles of 16 for AMX, and rows left for the registers.
            for m in [1, 2, 3, 5, 17, 64, 100] {
                let x = values(m * k, 99 + m as u32);
                let small = QuantizedRows::new(&x, m, k, QK);
                let large = k.is_multiple_of(QKK).then(|| QuantizedRows::new(&x, m, k, QKK));
                let want: Vec<f32> = (0..m)
                    .flat_map(|r| {
                        let (small, large) = (&small, &large);
                        parts.iter().flat_map(move |p| {
                            let part = &p.parts[0];
                            let rows = if part.ty.is_k() { large.as_ref().unwrap() } else { small };
                            (0..n).map(move |c| dot_reference(part, c, rows, r))
                        })
                    })
                    .collect();
                for &kernel in &kernels {
                    let mut got = vec![f32::NAN; m * parts.len() * n];
                    stacked.matmul_into(&x, m, &mut got, kernel);
                    assert!(
                        got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{kernel:?}, {n}×{k}, {m} rows"
                    );
                }
            }
        }
    }

    /// Every kernel sums the largest quants a format holds against the
    /// largest token quants (±127) exactly, as the reference does: every
    /// quant byte and bit set (a 4-bit weight 15, a 5-bit one 31, a 6-bit one 63), the
    /// block scales small and finite. The AVX2 kernel adds several
    /// `vpmaddubsw` pair sums in 16 bits before widening them, exact only
    /// within the counts it takes.
    #[test]
    fn the_largest_quants_sum_exactly_on_every_kernel() {
        let (n, k) = (8, 512);
        let small_scale = half::f16::from_f32(1.0 / 1024.0).to_le_bytes();
        for (ty, _) in TYPES {
            let (weights, bytes) = (ty.block_weights(), ty.block_bytes());
            let mut block = vec![0xffu8; bytes];
            // The f16 scales: first (`d`, then `m` or `dmin`), or last for `Q6_K`.
            let scales = match ty {
                QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 => vec![0],
                QuantType::Q6K => vec![bytes - 2],
                _ => vec![0, 2],
            };
            for at in scales {
                block[at..at + 2].copy_from_slice(&small_scale);
            }
            let blocks = block.repeat(n * k / weights);
            let matrix = QuantMatrix::from_blocks(ty, &blocks, n, k, None).unwrap();
            for sign in [1.0f32, -1.0] {
                for m in [1, 2, 3, 4, 8, 17, 32] {
                    let x = vec![sign; m * k];
                    let rows = QuantizedRows::new(&x, m, k, if ty.is_k() { QKK } else { QK });
                    let want: Vec<f32> = (0..m)
                        .flat_map(|r| (0..n).map(move |c| (r, c)))
                        .map(|(r, c)| dot_reference(&matrix.parts[0], c, &rows, r))
                        .collect();
                    assert!(want.iter().all(|y| y.is_finite() && *y != 0.0), "{}", ty.name());
                    for kernel in QuantKernel::available() {
                        let mut got = vec![f32::NAN; m * n];
                        matrix.matmul_into(&x, m, &mut got, kernel);
                        assert!(
                            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{kernel:?}, {}, {m} rows of {sign}",
                            ty.name()
                        );
                    }
                }
            }
        }
    }

    /// The AVX2 row quantizer gives the reference's bytes, scales and sums,
    /// halves included (rounded away from zero), and all-zero blocks, in
    /// blocks of 32 and of 256.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_simd_row_quantizer_matches_the_reference() {
        if !std::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut blocks: Vec<Vec<f32>> = (0..100).map(|i| values(QK, 500 + i)).collect();
        blocks.extend((0..20).map(|i| values(QKK, 700 + i)));
        // Exact halves after scaling: max 127 makes the scale 1.
        blocks.push(
            (0..QK)
                .map(|i| if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 })
                .collect(),
        );
        blocks.push(
            (0..QK)
                .map(|i| if i == 0 { -127.0 } else { -(i as f32) - 0.5 })
                .collect(),
        );
        blocks.push(vec![0.0; QK]);
        blocks.push((0..QKK).map(|i| 1e-30 * i as f32).collect());
        for x in &blocks {
            let (mut want, mut got) = (vec![0i8; x.len()], vec![0i8; x.len()]);
            let (mut want_h, mut got_h) = (vec![0; x.len() / 16], vec![0; x.len() / 16]);
            let d = quantize_block_reference(x, &mut want, &mut want_h);
            // SAFETY: AVX2 checked above; one block each.
            let simd = unsafe { x86::quantize_block(x, &mut got, &mut got_h) };
            assert_eq!((got, got_h), (want, want_h), "{x:?}");
            assert_eq!(simd.to_bits(), d.to_bits());
        }
    }

    /// A row's outputs are the same alone as among others.
    #[test]
    fn a_row_gives_the_same_outputs_whatever_shares_its_product() {
        let (n, k) = (37, 512);
        for (ty, ggml) in [(QuantType::Q4_1, GgmlDType::Q4_1), (QuantType::Q6K, GgmlDType::Q6K)] {
            let (blocks, _) = quantized(ggml, n, k, 5);
            let w = QuantMatrix::from_blocks(ty, &blocks, n, k, None).unwrap();
            let x = values(9 * k, 8);
            let all = w.matmul(&x, 9);
            for r in 0..9 {
                assert_eq!(
                    w.matmul(&x[r * k..][..k], 1),
                    all[r * n..][..n],
                    "{} row {r}",
                    ty.name()
                );
            }
        }
    }

    /// Against f32 products of the dequantized weights: within what rounding
    /// each input to its 8-bit block can move them, `Σ_b (d_x/2)·Σ|w|`, plus
    /// f32 rounding.
    #[test]
    fn products_stay_within_the_input_rounding_bound_of_f32() {
        let (n, k, m) = (24, 256, 3);
        for (ty, ggml) in TYPES {
            let (blocks, weights) = quantized(ggml, n, k, 21);
            let w = QuantMatrix::from_blocks(ty, &blocks, n, k, None).unwrap();
            let x = values(m * k, 22);
            let got = w.matmul(&x, m);
            let rows = QuantizedRows::new(&x, m, k, ty.block_weights());
            for r in 0..m {
                for c in 0..n {
                    let wr = &weights[c * k..][..k];
                    let exact: f64 = wr
                        .iter()
                        .zip(&x[r * k..][..k])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    let bound: f64 = (0..k / QK)
                        .map(|b| {
                            rows.scale(r, b) as f64 / 2.0
                                * wr[b * QK..][..QK].iter().map(|v| v.abs() as f64).sum::<f64>()
                        })
                        .sum::<f64>()
                        * 1.001
                        + 1e-4;
                    let err = (got[r * n + c] as f64 - exact).abs();
                    assert!(err <= bound, "{}: ({r}, {c}) off by {err}, bound {bound}", ty.name());
                }
            }
        }
    }
}
