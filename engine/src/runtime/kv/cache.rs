//! The KV cache's storage and the attention that reads it through block tables.
//!
//! Each layer keeps keys and values in one flat buffer laid out as
//! `[block][slot][kv_head][head_dim]`, so a block is one contiguous run of
//! memory and a sequence's keys are found by walking its block table: no
//! per-sequence tensors, no concatenation, and no copy when blocks are shared.

use rayon::prelude::*;

use super::BlockId;
use crate::ops::attention::{exp_in_place, scores, weighted_sum, Gathered};

/// The shape of one token's cached keys (or values) in one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Decoder layers.
    pub layers: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Token slots per block.
    pub block_size: usize,
}

impl KvLayout {
    /// Floats of one token's keys in one layer.
    fn token_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes one block takes across all layers, keys and values.
    pub fn bytes_per_block(&self) -> usize {
        2 * self.layers * self.block_size * self.token_width() * std::mem::size_of::<f32>()
    }
}

#[derive(Debug, Clone, Default)]
struct LayerKv {
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// Keys and values of every block of every layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    layout: KvLayout,
    layers: Vec<LayerKv>,
    blocks: usize,
}

/// One sequence's part of a batched attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionSeq<'a> {
    /// The sequence's blocks, in token order.
    pub blocks: &'a [BlockId],
    /// The position of the first query row.
    pub start: usize,
    /// Query rows (tokens) of this sequence in the batch.
    pub len: usize,
}

impl KvCache {
    /// Storage for `blocks` blocks.
    pub fn new(layout: KvLayout, blocks: usize) -> Self {
        let mut cache = KvCache {
            layout,
            layers: vec![LayerKv::default(); layout.layers],
            blocks: 0,
        };
        cache.grow(blocks);
        cache
    }

    /// The layout.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Blocks held.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Make room for `blocks` blocks in all (existing contents are kept).
    pub(crate) fn grow(&mut self, blocks: usize) {
        if blocks <= self.blocks {
            return;
        }
        let len = blocks * self.layout.block_size * self.layout.token_width();
        for layer in &mut self.layers {
            layer.keys.resize(len, 0.0);
            layer.values.resize(len, 0.0);
        }
        self.blocks = blocks;
    }

    fn offset(&self, blocks: &[BlockId], position: usize) -> usize {
        let bs = self.layout.block_size;
        let block = blocks[position / bs].0 as usize;
        (block * bs + position % bs) * self.layout.token_width()
    }

    /// Store keys and values, `(tokens, kv_heads * head_dim)` row-major, of
    /// every sequence's new tokens in `layer`.
    pub fn write(&mut self, layer: usize, seqs: &[AttentionSeq<'_>], keys: &[f32], values: &[f32]) {
        let width = self.layout.token_width();
        let mut row = 0;
        for seq in seqs {
            for position in seq.start..seq.start + seq.len {
                let at = self.offset(seq.blocks, position);
                let stored = &mut self.layers[layer];
                stored.keys[at..at + width].copy_from_slice(&keys[row * width..(row + 1) * width]);
                stored.values[at..at + width].copy_from_slice(&values[row * width..(row + 1) * width]);
                row += 1;
            }
        }
    }

    /// Causal scaled-dot-product attention of `queries` (`(tokens, heads * head_dim)`
    /// row-major, grouped by sequence as in `seqs`) over each sequence's cached
    /// keys and values, which must already include the new tokens.
    pub(crate) fn attend(&self, layer: usize, seqs: &[AttentionSeq<'_>], heads: usize, queries: &[f32]) -> Vec<f32> {
        let d = self.layout.head_dim;
        // Where each visible position's keys and values start, found once per
        // sequence: a row at position `p` sees the first `p + 1` of them.
        let slots: Vec<Vec<usize>> = seqs
            .iter()
            .map(|seq| self.slot_offsets(seq.blocks, seq.start + seq.len))
            .collect();
        let rows: Vec<&[usize]> = seqs
            .iter()
            .zip(&slots)
            .flat_map(|(seq, slots)| (seq.start..seq.start + seq.len).map(move |p| &slots[..p + 1]))
            .collect();
        let stored = &self.layers[layer];
        let (kv_heads, groups) = (self.layout.kv_heads, heads / self.layout.kv_heads);
        let width = groups * d;
        let units = rows.len() * kv_heads;
        // One task per row, key-value head and stretch of its positions:
        // where the key-value heads do not share the pool's threads evenly
        // (SmolLM2's three on two), a decoding step of one sequence has two
        // tasks per key-value head once it sees more than
        // `ATTENTION_STRETCH` positions, and the cores share them evenly.
        // A stretch's sums are its own, whichever thread computes them,
        // and where a row is cut depends on its positions and the
        // deployment's shape alone, never on the rest of the batch. The
        // first stretch's sums go where the row's output goes, the second's
        // to a buffer of their own.
        let cutting = !kv_heads.is_multiple_of(rayon::current_num_threads());
        let cuts: Vec<Option<usize>> = (0..units)
            .map(|unit| cut(rows[unit / kv_heads].len()).filter(|_| cutting))
            .collect();
        let seconds = cuts.iter().flatten().count();
        let mut out = vec![0f32; queries.len()];
        let mut second_sums = vec![0f32; seconds * width];
        // Each stretch's largest scaled score and sum of exponentials for
        // each query head (`groups` of either).
        let mut first_stats = vec![0f32; units * 2 * groups];
        let mut second_stats = vec![0f32; seconds * 2 * groups];
        let mut tasks = Vec::with_capacity(units + seconds);
        // Where each unit's second stretch goes, if it has one.
        let mut second_of = Vec::with_capacity(units);
        let mut seconds_taken = 0;
        {
            let mut second = second_sums
                .chunks_exact_mut(width)
                .zip(second_stats.chunks_exact_mut(2 * groups));
            for (unit, ((sums, stats), cut)) in out
                .chunks_exact_mut(width)
                .zip(first_stats.chunks_exact_mut(2 * groups))
                .zip(&cuts)
                .enumerate()
            {
                let len = rows[unit / kv_heads].len();
                tasks.push((unit, 0..cut.unwrap_or(len), sums, stats));
                second_of.push(cut.map(|_| seconds_taken));
                if let Some(cut) = *cut {
                    let (sums, stats) = second.next().expect("a buffer for every second stretch");
                    tasks.push((unit, cut..len, sums, stats));
                    seconds_taken += 1;
                }
            }
        }
        tasks
            .into_par_iter()
            .for_each_init(Vec::new, |weights, (unit, positions, sums, stats)| {
                let (row, kv_head) = (unit / kv_heads, unit % kv_heads);
                let query = &queries[unit * width..][..width];
                let (max, total) = stats.split_at_mut(groups);
                self.attend_part(stored, &rows[row][positions], kv_head, query, sums, max, total, weights);
            });
        out.par_chunks_mut(width)
            .zip(first_stats.par_chunks(2 * groups))
            .zip(second_of.par_iter())
            .for_each(|((out, first), second)| {
                let second = second.map(|k| {
                    (
                        &second_sums[k * width..][..width],
                        &second_stats[k * 2 * groups..][..2 * groups],
                    )
                });
                combine(out, first, second, groups);
            });
        out
    }

    /// One query row's attention over the positions at `slots` (a stretch
    /// of them), for the query heads of key-value head `kv_head` (`query`
    /// holds theirs): each head's weighted sum of values before the
    /// division onto `sums`, its largest scaled score into `max` and its
    /// sum of exponentials into `total`; `weights` is the worker's buffer
    /// for the scores, kept across the parts it takes.
    #[allow(clippy::too_many_arguments)]
    fn attend_part(
        &self,
        stored: &LayerKv,
        slots: &[usize],
        kv_head: usize,
        query: &[f32],
        sums: &mut [f32],
        max: &mut [f32],
        total: &mut [f32],
        weights: &mut Vec<f32>,
    ) {
        let d = self.layout.head_dim;
        let groups = query.len() / d;
        let scale = 1.0 / (d as f32).sqrt();
        // Scores `[position][query head of the group]`: each key and value
        // is read once for all the query heads that share it. `scores`
        // writes every one, so the buffer is only sized, not cleared.
        weights.resize(slots.len() * groups, 0.0);
        let gathered = |data| Gathered {
            data,
            offsets: slots,
            shift: kv_head * d,
            d,
        };
        scores(query, gathered(&stored.keys), weights);
        softmax_unnormalised(weights, groups, scale, max, total);
        weighted_sum(weights, gathered(&stored.values), sums);
    }

    /// The offsets of positions `0..len` of a sequence, block by block.
    fn slot_offsets(&self, blocks: &[BlockId], len: usize) -> Vec<usize> {
        let (bs, width) = (self.layout.block_size, self.layout.token_width());
        let mut offsets = Vec::with_capacity(len);
        for block in blocks {
            let first = block.0 as usize * bs;
            let take = bs.min(len - offsets.len());
            offsets.extend((first..first + take).map(|slot| slot * width));
            if offsets.len() == len {
                break;
            }
        }
        offsets
    }
}

/// A row that sees more positions than this is cut into two stretches,
/// one task each, whose sums [`combine`] puts together (where the model's
/// key-value heads are not a multiple of the pool's threads).
const ATTENTION_STRETCH: usize = 64;

/// Where a row that sees `positions` is cut, if it is: after
/// `max(ATTENTION_STRETCH, ⌈positions / 2⌉)` of them. Two stretches are
/// enough for one sequence's key-value heads to share two cores evenly,
/// and each stretch starts its streams of keys and values from memory
/// anew, so a row is cut once at most.
fn cut(positions: usize) -> Option<usize> {
    let first = ATTENTION_STRETCH.max(positions.div_ceil(2));
    (positions > first).then_some(first)
}

/// One row's attention for the query heads of one key-value head, in
/// `out` (`groups` heads of `d`), which holds its first stretch's
/// weighted sums; `first` and `second` hold each stretch's largest scaled
/// score and sum of exponentials (`groups` of either), the second with
/// its own sums. A row of one stretch is divided by its total as it is;
/// two are brought to their common largest score first, `e^(m − M)` each,
/// and added.
fn combine(out: &mut [f32], first: &[f32], second: Option<(&[f32], &[f32])>, groups: usize) {
    let d = out.len() / groups;
    for (j, out) in out.chunks_exact_mut(d).enumerate() {
        let (m1, t1) = (first[j], first[groups + j]);
        match second {
            None => out.iter_mut().for_each(|o| *o /= t1),
            Some((sums, stats)) => {
                let (m2, t2) = (stats[j], stats[groups + j]);
                let largest = m1.max(m2);
                let (f1, f2) = ((m1 - largest).exp(), (m2 - largest).exp());
                let total = f1 * t1 + f2 * t2;
                for (o, s) in out.iter_mut().zip(&sums[j * d..][..d]) {
                    *o = (f1 * *o + f2 * s) / total;
                }
            }
        }
    }
}

/// `weights` (`[position][query head]`, `groups` heads) scaled, made
/// `e^(s − max)` per head, and each head's sum of them in `total`: softmax
/// but for the division. The common numbers of heads a key-value head
/// serves get loops of their own size, which the compiler keeps in vector
/// registers; every head's numbers come out the same either way.
fn softmax_unnormalised(weights: &mut [f32], groups: usize, scale: f32, max: &mut [f32], total: &mut [f32]) {
    fn fixed<const G: usize>(weights: &mut [f32], scale: f32, max: &mut [f32], total: &mut [f32]) {
        let mut m = [f32::NEG_INFINITY; G];
        for score in weights.chunks_exact(G) {
            for j in 0..G {
                m[j] = m[j].max(score[j] * scale);
            }
        }
        for score in weights.chunks_exact_mut(G) {
            for j in 0..G {
                score[j] = score[j] * scale - m[j];
            }
        }
        exp_in_place(weights);
        let mut t = [0f32; G];
        for score in weights.chunks_exact(G) {
            for j in 0..G {
                t[j] += score[j];
            }
        }
        max.copy_from_slice(&m);
        total.copy_from_slice(&t);
    }
    assert!(
        max.len() == groups && total.len() == groups,
        "a maximum and a total per head"
    );
    max.fill(f32::NEG_INFINITY);
    total.fill(0.0);
    match groups {
        1 => return fixed::<1>(weights, scale, max, total),
        2 => return fixed::<2>(weights, scale, max, total),
        3 => return fixed::<3>(weights, scale, max, total),
        4 => return fixed::<4>(weights, scale, max, total),
        5 => return fixed::<5>(weights, scale, max, total),
        6 => return fixed::<6>(weights, scale, max, total),
        7 => return fixed::<7>(weights, scale, max, total),
        8 => return fixed::<8>(weights, scale, max, total),
        _ => {}
    }
    for score in weights.chunks_exact(groups) {
        for (m, s) in max.iter_mut().zip(score) {
            *m = m.max(*s * scale);
        }
    }
    for score in weights.chunks_exact_mut(groups) {
        for (s, m) in score.iter_mut().zip(max.iter()) {
            *s = *s * scale - m;
        }
    }
    exp_in_place(weights);
    for score in weights.chunks_exact(groups) {
        for (s, t) in score.iter().zip(total.iter_mut()) {
            *t += *s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::kv::{BlockPool, BlockTable};
    use crate::runtime::rng::SplitMix;

    fn random(n: usize, rng: &mut SplitMix) -> Vec<f32> {
        (0..n).map(|_| rng.uniform() as f32 * 2.0 - 1.0).collect()
    }

    /// Attention over contiguous keys and values, one query at position `p` seeing `0..=p`.
    fn reference(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>], d: usize) -> Vec<f32> {
        let scores: Vec<f32> = keys
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() / (d as f32).sqrt())
            .collect();
        let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f32 = weights.iter().sum();
        (0..d)
            .map(|i| weights.iter().zip(values).map(|(w, v)| w * v[i]).sum::<f32>() / total)
            .collect()
    }

    #[test]
    fn attention_through_scattered_blocks_matches_contiguous_attention() {
        let layout = KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 8,
            block_size: 4,
        };
        let mut pool = BlockPool::new(16, 4);
        let mut cache = KvCache::new(layout, 16);
        let mut rng = SplitMix::new(5);
        // Interleave two sequences so that their blocks are not contiguous.
        let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
        let mut keys = [Vec::new(), Vec::new()];
        let mut values = [Vec::new(), Vec::new()];
        for step in 0..10 {
            for (s, table) in [&mut a, &mut b].into_iter().enumerate() {
                let start = table.len();
                table.append(&mut pool, 1).unwrap();
                let (k, v) = (random(8, &mut rng), random(8, &mut rng));
                let seq = AttentionSeq {
                    blocks: table.blocks(),
                    start,
                    len: 1,
                };
                cache.write(0, &[seq], &k, &v);
                keys[s].push(k);
                values[s].push(v);
                let q = random(8, &mut rng);
                let got = cache.attend(0, &[seq], 1, &q);
                let want = reference(&q, &keys[s], &values[s], 8);
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-5, "step {step}: {got:?} vs {want:?}");
                }
            }
        }
    }

    /// One decoding row, its heads spread over the threads: each query head
    /// attends over the keys and values of its own key-value head.
    #[test]
    fn each_query_head_of_a_row_attends_over_its_own_key_value_head() {
        let (kv_heads, heads, d) = (3, 6, 8);
        let layout = KvLayout {
            layers: 1,
            kv_heads,
            head_dim: d,
            block_size: 4,
        };
        let mut pool = BlockPool::new(8, 4);
        let mut cache = KvCache::new(layout, 8);
        let mut rng = SplitMix::new(11);
        let mut table = BlockTable::default();
        let len = 10;
        table.append(&mut pool, len).unwrap();
        let (keys, values) = (
            random(len * kv_heads * d, &mut rng),
            random(len * kv_heads * d, &mut rng),
        );
        let all = AttentionSeq {
            blocks: table.blocks(),
            start: 0,
            len,
        };
        cache.write(0, &[all], &keys, &values);
        let last = AttentionSeq {
            blocks: table.blocks(),
            start: len - 1,
            len: 1,
        };
        let q = random(heads * d, &mut rng);
        let got = cache.attend(0, &[last], heads, &q);
        let per_head = |data: &[f32], kv: usize| -> Vec<Vec<f32>> {
            (0..len)
                .map(|p| data[(p * kv_heads + kv) * d..][..d].to_vec())
                .collect()
        };
        for h in 0..heads {
            let kv = h / (heads / kv_heads);
            let want = reference(&q[h * d..(h + 1) * d], &per_head(&keys, kv), &per_head(&values, kv), d);
            for (g, w) in got[h * d..(h + 1) * d].iter().zip(&want) {
                assert!((g - w).abs() < 1e-5, "head {h}: {g} vs {w}");
            }
        }
    }

    /// A pre-fill's rows (several sequences, several rows each, spanning
    /// blocks) attend exactly as each row does alone: the offsets found
    /// once per sequence are each row's own.
    #[test]
    fn a_prefills_rows_attend_bit_for_bit_as_each_row_alone() {
        let layout = KvLayout {
            layers: 1,
            kv_heads: 2,
            head_dim: 16,
            block_size: 4,
        };
        let (heads, width) = (6, 2 * 16);
        let mut pool = BlockPool::new(32, 4);
        let mut cache = KvCache::new(layout, 32);
        let mut rng = SplitMix::new(9);
        let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
        // Interleaved appends, so that neither sequence's blocks are contiguous.
        for _ in 0..4 {
            a.append(&mut pool, 3).unwrap();
            b.append(&mut pool, 4).unwrap();
        }
        let seqs = [
            AttentionSeq {
                blocks: a.blocks(),
                start: 0,
                len: 12,
            },
            AttentionSeq {
                blocks: b.blocks(),
                start: 5,
                len: 11,
            },
        ];
        // `b`'s first five positions were cached before this pass.
        let earlier = AttentionSeq {
            blocks: b.blocks(),
            start: 0,
            len: 5,
        };
        cache.write(
            0,
            &[earlier],
            &random(5 * width, &mut rng),
            &random(5 * width, &mut rng),
        );
        let tokens = 12 + 11;
        cache.write(
            0,
            &seqs,
            &random(tokens * width, &mut rng),
            &random(tokens * width, &mut rng),
        );
        let queries = random(tokens * heads * 16, &mut rng);
        let together = cache.attend(0, &seqs, heads, &queries);
        let mut row = 0;
        for seq in &seqs {
            for position in seq.start..seq.start + seq.len {
                let alone = AttentionSeq {
                    blocks: seq.blocks,
                    start: position,
                    len: 1,
                };
                let q = &queries[row * heads * 16..(row + 1) * heads * 16];
                let got = cache.attend(0, &[alone], heads, q);
                assert_eq!(got, together[row * heads * 16..(row + 1) * heads * 16], "row {row}");
                row += 1;
            }
        }
    }

    /// Rows that see more positions than one task takes, cut into
    /// stretches and put together again: each row attends as the reference
    /// does over all it sees, and as it does alone, bit for bit, when a
    /// pre-fill's rows of every length are computed together.
    #[test]
    fn rows_cut_into_stretches_attend_over_every_position() {
        // Three key-value heads on two threads: rows are cut.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        pool.install(rows_cut_into_stretches);
    }

    fn rows_cut_into_stretches() {
        let (kv_heads, heads, d) = (3, 9, 64);
        let layout = KvLayout {
            layers: 1,
            kv_heads,
            head_dim: d,
            block_size: 16,
        };
        let len = 700;
        let mut pool = BlockPool::new(64, 16);
        let mut cache = KvCache::new(layout, 64);
        let mut rng = SplitMix::new(21);
        let mut table = BlockTable::default();
        table.append(&mut pool, len).unwrap();
        let width = kv_heads * d;
        let (keys, values) = (random(len * width, &mut rng), random(len * width, &mut rng));
        let all = AttentionSeq {
            blocks: table.blocks(),
            start: 0,
            len,
        };
        cache.write(0, &[all], &keys, &values);
        let queries = random(len * heads * d, &mut rng);
        let together = cache.attend(0, &[all], heads, &queries);
        let per_head = |data: &[f32], kv: usize, seen: usize| -> Vec<Vec<f32>> {
            (0..seen).map(|p| data[p * width + kv * d..][..d].to_vec()).collect()
        };
        // One stretch; two, the second of one position; two halves of long rows.
        for position in [0, 62, 63, 64, 127, 128, 300, 511, 512, 513, 699] {
            let row = &queries[position * heads * d..][..heads * d];
            let alone = AttentionSeq {
                blocks: table.blocks(),
                start: position,
                len: 1,
            };
            let got = cache.attend(0, &[alone], heads, row);
            assert_eq!(
                got,
                together[position * heads * d..][..heads * d],
                "position {position}"
            );
            for h in 0..heads {
                let kv = h / (heads / kv_heads);
                let seen = position + 1;
                let want = reference(
                    &row[h * d..][..d],
                    &per_head(&keys, kv, seen),
                    &per_head(&values, kv, seen),
                    d,
                );
                for (g, w) in got[h * d..][..d].iter().zip(&want) {
                    assert!((g - w).abs() < 2e-5, "position {position}, head {h}: {g} vs {w}");
                }
            }
        }
    }
}
