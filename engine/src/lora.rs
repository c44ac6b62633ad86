//! LoRA adapters laid out for the forward pass.
//!
//! The format (PEFT's files, checked against the base model) is
//! [`lorry_protocol::lora`]'s, re-exported here; this module packs a checked
//! [`Adapter`] like the base weights. The segmented product that applies
//! many adapters in one batch is [`crate::ops::sgmv`]; which adapters are
//! resident is [`crate::adapters`]'s.

use crate::ops::gemm::PackedMatrix;
pub use lorry_protocol::lora::{
    check_config, check_weights, Adapter, AdapterError, AdapterLimits, LoraWeights, Precision, Target,
};

/// One adapted projection laid out for the forward pass: `lora_A` and
/// `lora_B` packed for [`PackedMatrix::matmul`], so the shrink
/// (`x·Aᵀ`, rank outputs) and the expand (`·Bᵀ`) run on the same kernels as
/// the base model's products.
#[derive(Debug, Clone)]
pub struct PackedLora {
    /// `(rank, in)`.
    pub a: PackedMatrix,
    /// `(out, rank)`.
    pub b: PackedMatrix,
    /// `alpha / r` (or `/ √r`).
    pub scale: f32,
}

/// An adapter ready to serve: every module packed.
#[derive(Debug, Clone)]
pub struct PackedAdapter {
    /// Layer by layer, [`Target::ALL`]'s order within a layer: what a pass
    /// looks up for each adapter, layer and projection, one index each.
    modules: Vec<Option<PackedLora>>,
    key: [u8; 32],
}

impl PackedAdapter {
    /// A SHA-256 of everything the adapter computes with (every module's
    /// place, rank, scale, precision and weights): equal keys, equal outputs.
    /// The prefix cache keeps blocks computed under different keys apart.
    pub fn key(&self) -> &[u8; 32] {
        &self.key
    }

    /// Memory the packed weights take.
    pub fn bytes(&self) -> usize {
        self.modules.iter().flatten().map(|m| m.a.bytes() + m.b.bytes()).sum()
    }

    /// The module adapting `target` in `layer`, if the adapter has one.
    pub fn module(&self, layer: usize, target: Target) -> Option<&PackedLora> {
        self.modules.get(slot(layer, target))?.as_ref()
    }
}

/// Where [`PackedAdapter::module`] keeps `target` of `layer`.
fn slot(layer: usize, target: Target) -> usize {
    layer * Target::ALL.len() + target as usize
}

/// The content key of [`PackedAdapter::key`].
fn content_key(adapter: &Adapter) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for (&(layer, target), m) in &adapter.modules {
        h.update(format!("{layer}.{target:?}.{}.{:?}:", m.rank, m.precision));
        h.update(m.scale.to_le_bytes());
        let weights: Vec<u8> = m.a.iter().chain(&m.b).flat_map(|v| v.to_le_bytes()).collect();
        h.update(&weights);
    }
    h.finalize().into()
}

impl PackedAdapter {
    /// Pack every module of a checked adapter for the forward pass.
    pub fn new(adapter: &Adapter) -> PackedAdapter {
        let slots = adapter
            .modules
            .keys()
            .map(|&(layer, target)| slot(layer, target) + 1)
            .max();
        let mut modules: Vec<Option<PackedLora>> = vec![None; slots.unwrap_or(0)];
        for (&(layer, target), m) in &adapter.modules {
            let inputs = m.a.len() / m.rank;
            let outputs = m.b.len() / m.rank;
            let pack = |values: &[f32], n: usize, k: usize| PackedMatrix::from_f32_in(m.precision, values, n, k);
            modules[slot(layer, target)] = Some(PackedLora {
                a: pack(&m.a, m.rank, inputs),
                b: pack(&m.b, outputs, m.rank),
                scale: m.scale,
            });
        }
        PackedAdapter {
            key: content_key(adapter),
            modules,
        }
    }
}
