//! PEFT adapters checked against their base model: what loads, with which
//! scales, and every way an adapter is refused, each with its code; then
//! adapters in the forward pass against transformers + peft, alone and mixed
//! in one batch.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::lora::{check_weights, Adapter, AdapterLimits, PackedAdapter, Target};
use lorry_engine::models::llama::{Config, Llama, LlamaConfigFile, SeqChunk};
use lorry_engine::models::read_config;
use lorry_engine::runtime::kv::{BlockPool, BlockTable, KvCache};
use serde_json::{json, Value};

/// tiny-llama: hidden 64, MLP 160, 2 layers, 4 heads of 16, 2 KV heads.
fn base() -> Config {
    let dir = std::env::temp_dir().join(format!("lorry-adapters-{}", std::process::id()));
    if !dir.join("config.json").exists() {
        fixtures::write(Fixture::TinyLlama, &dir).unwrap();
    }
    read_config::<LlamaConfigFile>(&dir).unwrap().into_config().unwrap()
}

fn key(layer: usize, target: Target, matrix: &str) -> String {
    let block = match target {
        Target::Q | Target::K | Target::V | Target::O => "self_attn",
        _ => "mlp",
    };
    format!(
        "base_model.model.model.layers.{layer}.{block}.{}.{matrix}.weight",
        target.name()
    )
}

/// Weights for `targets` in every layer at `rank` (per module from `ranks`), `dtype`.
fn weights(
    base: &Config,
    targets: &[Target],
    rank: usize,
    ranks: &HashMap<String, usize>,
    dtype: DType,
) -> HashMap<String, Tensor> {
    let mut tensors = HashMap::new();
    for layer in 0..base.num_layers {
        for &t in targets {
            let (out, inputs) = t.shape(&base.adapter_shape());
            let r = ranks.get(t.name()).copied().unwrap_or(rank);
            let a = Tensor::randn(0f32, 0.1, (r, inputs), &Device::Cpu).unwrap();
            let b = Tensor::randn(0f32, 0.1, (out, r), &Device::Cpu).unwrap();
            tensors.insert(key(layer, t, "lora_A"), a.to_dtype(dtype).unwrap());
            tensors.insert(key(layer, t, "lora_B"), b.to_dtype(dtype).unwrap());
        }
    }
    tensors
}

fn bytes(tensors: &HashMap<String, Tensor>) -> Vec<u8> {
    let path = std::env::temp_dir().join(format!(
        "lorry-adapter-{}-{}.safetensors",
        std::process::id(),
        uuid_like()
    ));
    candle_core::safetensors::save(tensors, &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    bytes
}

fn uuid_like() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn config(extra: Value) -> Vec<u8> {
    let mut config = json!({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "bias": "none", "use_rslora": false, "use_dora": false, "fan_in_fan_out": false,
        "modules_to_save": null, "rank_pattern": {}, "alpha_pattern": {}, "task_type": "CAUSAL_LM",
    });
    config
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    serde_json::to_vec(&config).unwrap()
}

fn parse(config: &[u8], weights: &[u8]) -> Result<Adapter, (&'static str, String)> {
    Adapter::parse(config, weights, &base().adapter_shape(), AdapterLimits::default())
        .map_err(|e| (e.code.as_str(), e.message))
}

const QV: [Target; 2] = [Target::Q, Target::V];

#[test]
fn a_peft_adapter_loads_with_its_scales_in_any_precision() {
    let base = base();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tensors = weights(&base, &Target::ALL, 8, &HashMap::new(), dtype);
        let adapter = parse(&config(json!({"target_modules": "all-linear"})), &bytes(&tensors)).unwrap();
        assert_eq!(adapter.modules.len(), 2 * 7, "{dtype:?}");
        assert_eq!(adapter.targets(), Target::ALL.to_vec());
        let down = &adapter.modules[&(1, Target::Down)];
        assert_eq!((down.rank, down.scale), (8, 2.0));
        assert_eq!((down.a.len(), down.b.len()), (8 * 160, 64 * 8));
        let want = tensors[&key(1, Target::Down, "lora_B")]
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(down.b, want);
    }
    // rsLoRA: alpha / √r.
    let tensors = weights(&base, &QV, 16, &HashMap::new(), DType::F32);
    let adapter = parse(&config(json!({"r": 16, "use_rslora": true})), &bytes(&tensors)).unwrap();
    assert_eq!(adapter.modules[&(0, Target::Q)].scale, 4.0);
}

#[test]
fn rank_and_alpha_patterns_apply_per_module() {
    let base = base();
    let ranks = HashMap::from([("v_proj".to_string(), 4)]);
    let tensors = weights(&base, &QV, 8, &ranks, DType::F32);
    let adapter = parse(
        &config(json!({"rank_pattern": {"v_proj": 4}, "alpha_pattern": {"model.layers.1.self_attn.q_proj": 64}})),
        &bytes(&tensors),
    )
    .unwrap();
    let module = |layer, t| {
        let m = &adapter.modules[&(layer, t)];
        (m.rank, m.scale)
    };
    assert_eq!(module(0, Target::V), (4, 4.0));
    assert_eq!(module(0, Target::Q), (8, 2.0));
    assert_eq!(module(1, Target::Q), (8, 8.0));
    assert_eq!(adapter.max_rank(), 8);
    // A regular expression as a key is refused, not guessed at.
    let err = parse(&config(json!({"rank_pattern": {"^v_.*": 4}})), &bytes(&tensors)).unwrap_err();
    assert_eq!(err.0, "adapter_unsupported", "{err:?}");
}

#[test]
fn every_kind_of_bad_adapter_is_refused_with_its_code() {
    let base = base();
    let good = bytes(&weights(&base, &QV, 8, &HashMap::new(), DType::F32));
    let cases: Vec<(&str, Vec<u8>, Vec<u8>, &str)> = vec![
        ("config not JSON", b"{".to_vec(), good.clone(), "adapter_config_invalid"),
        (
            "no rank",
            config(json!({"r": null})),
            good.clone(),
            "adapter_config_invalid",
        ),
        (
            "rank over 32",
            config(json!({"r": 64})),
            good.clone(),
            "adapter_rank_too_large",
        ),
        (
            "unknown target",
            config(json!({"target_modules": ["q_proj", "lm_head"]})),
            good.clone(),
            "adapter_unknown_target",
        ),
        (
            "DoRA",
            config(json!({"use_dora": true})),
            good.clone(),
            "adapter_unsupported",
        ),
        (
            "trained bias",
            config(json!({"bias": "all"})),
            good.clone(),
            "adapter_unsupported",
        ),
        (
            "modules to save",
            config(json!({"modules_to_save": ["lm_head"]})),
            good.clone(),
            "adapter_unsupported",
        ),
        (
            "prefix tuning",
            config(json!({"peft_type": "PREFIX_TUNING"})),
            good.clone(),
            "adapter_unsupported",
        ),
        (
            "weights for a module not targeted",
            config(json!({"target_modules": ["q_proj"]})),
            good.clone(),
            "adapter_unknown_target",
        ),
        (
            "truncated weights",
            config(json!({})),
            good[..good.len() / 2].to_vec(),
            "adapter_weights_invalid",
        ),
        (
            "weights not safetensors",
            config(json!({})),
            b"not a tensor file".to_vec(),
            "adapter_weights_invalid",
        ),
        (
            "rank 0 through rank_pattern",
            config(json!({"rank_pattern": {"q_proj": 0}})),
            good.clone(),
            "adapter_rank_too_large",
        ),
        (
            "an alpha that makes the scale infinite",
            config(json!({"lora_alpha": 1e39})),
            good.clone(),
            "adapter_value_out_of_range",
        ),
        (
            "an alpha_pattern value out of range",
            config(json!({"alpha_pattern": {"v_proj": -1e7}})),
            good.clone(),
            "adapter_value_out_of_range",
        ),
        (
            "weights for a layer not in layers_to_transform",
            config(json!({"layers_to_transform": [0]})),
            good.clone(),
            "adapter_unknown_target",
        ),
        (
            "layers_to_transform not indices",
            config(json!({"layers_to_transform": "all"})),
            good.clone(),
            "adapter_config_invalid",
        ),
        (
            "layers under another name",
            config(json!({"layers_pattern": "h"})),
            good.clone(),
            "adapter_unsupported",
        ),
        (
            "replicated layers",
            config(json!({"layer_replication": [[0, 2]]})),
            good.clone(),
            "adapter_unsupported",
        ),
    ];
    for (what, config, weights, code) in cases {
        let err = parse(&config, &weights).unwrap_err();
        assert_eq!(err.0, code, "{what}: {err:?}");
    }
}

#[test]
fn bad_tensors_are_named() {
    let base = base();
    let mut wrong_shape = weights(&base, &QV, 8, &HashMap::new(), DType::F32);
    wrong_shape.insert(
        key(1, Target::V, "lora_B"),
        Tensor::zeros((64, 8), DType::F32, &Device::Cpu).unwrap(),
    );
    let mut missing = weights(&base, &QV, 8, &HashMap::new(), DType::F32);
    missing.remove(&key(0, Target::Q, "lora_A"));
    let mut not_finite = weights(&base, &QV, 8, &HashMap::new(), DType::F32);
    let mut values = vec![0.5f32; 8 * 64];
    values[77] = f32::NAN;
    not_finite.insert(
        key(0, Target::Q, "lora_A"),
        Tensor::from_vec(values, (8, 64), &Device::Cpu).unwrap(),
    );
    let mut extra_layer = weights(&base, &QV, 8, &HashMap::new(), DType::F32);
    extra_layer.insert(
        key(2, Target::Q, "lora_A"),
        Tensor::zeros((8, 64), DType::F32, &Device::Cpu).unwrap(),
    );
    let mut stray = weights(&base, &QV, 8, &HashMap::new(), DType::F32);
    stray.insert(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector".into(),
        Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap(),
    );
    let mut huge = weights(&base, &QV, 8, &HashMap::new(), DType::F32);
    let mut values = vec![0.5f32; 8 * 64];
    values[3] = 3e38;
    huge.insert(
        key(0, Target::Q, "lora_A"),
        Tensor::from_vec(values, (8, 64), &Device::Cpu).unwrap(),
    );
    // `layers.01.` is layer 1 spelled twice: it must not overwrite `layers.1.`.
    let mut respelled = weights(&base, &QV, 8, &HashMap::new(), DType::F32);
    let original = respelled[&key(1, Target::Q, "lora_A")].clone();
    respelled.insert(
        key(1, Target::Q, "lora_A").replace("layers.1.", "layers.01."),
        original.ones_like().unwrap(),
    );
    let cases = [
        (huge, "adapter_value_out_of_range", "layers.0.self_attn.q_proj.lora_A"),
        (respelled, "adapter_unsupported", "layers.01.self_attn.q_proj"),
        (
            wrong_shape,
            "adapter_shape_mismatch",
            "layers.1.self_attn.v_proj.lora_B",
        ),
        (missing, "adapter_missing_tensor", "layers.0.self_attn.q_proj.lora_A"),
        (not_finite, "adapter_nonfinite", "layers.0.self_attn.q_proj.lora_A"),
        (extra_layer, "adapter_shape_mismatch", "layers.2.self_attn.q_proj"),
        (stray, "adapter_unsupported", "lora_magnitude_vector"),
    ];
    let shape = base.adapter_shape();
    for (tensors, code, named) in cases {
        let err = parse(&config(json!({})), &bytes(&tensors)).unwrap_err();
        assert_eq!(err.0, code, "{err:?}");
        assert!(err.1.contains(named), "{err:?} should name {named}");
        // The weights alone (an upload before its configuration) are refused the same way.
        let alone = check_weights(&bytes(&tensors), &shape, AdapterLimits::default()).unwrap_err();
        assert_eq!(alone.code.as_str(), code, "{alone:?}");
    }
    check_weights(
        &bytes(&weights(&base, &QV, 8, &HashMap::new(), DType::F32)),
        &shape,
        AdapterLimits::default(),
    )
    .unwrap();
    // A header too large to parse cheaply is refused before it is parsed.
    let mut huge_header = (5u64 << 20).to_le_bytes().to_vec();
    huge_header.extend(std::iter::repeat_n(b' ', 64));
    let err = parse(&config(json!({})), &huge_header).unwrap_err();
    assert_eq!(err.0, "adapter_weights_invalid", "{err:?}");
    assert!(err.1.contains("header"), "{err:?}");
    // Over the size limit, before the weights are even parsed.
    let limits = AdapterLimits {
        max_bytes: 1024,
        ..AdapterLimits::default()
    };
    let good = bytes(&weights(&base, &QV, 8, &HashMap::new(), DType::F32));
    let err = Adapter::parse(&config(json!({})), &good, &base.adapter_shape(), limits).unwrap_err();
    assert_eq!(err.code.as_str(), "adapter_too_large");
    // A directory without the two files.
    let err = Adapter::from_dir(
        &std::env::temp_dir().join("lorry-no-adapter-here"),
        &base.adapter_shape(),
        limits,
    )
    .unwrap_err();
    assert_eq!(err.code.as_str(), "adapter_missing_file");
    assert!(err.message.contains("adapter_config.json"), "{err:?}");
}

/// `engine/tests/data/lora`: two PEFT adapters for tiny-llama and what
/// transformers + peft compute with each (`tests/reference/make_lora_reference.py`).
fn reference_adapter(name: &str, base: &Config) -> lorry_engine::lora::PackedAdapter {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/lora")
        .join(name);
    PackedAdapter::new(&Adapter::from_dir(&dir, &base.adapter_shape(), AdapterLimits::default()).unwrap())
}

fn greedy_adapted(model: &Llama, prompt: &[u32], adapter: Option<&PackedAdapter>, n: usize) -> (Vec<f32>, Vec<u32>) {
    let mut cache = model.new_cache();
    let first = model
        .forward_adapted(prompt, &mut cache, adapter)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let (mut logits, mut tokens) = (first.clone(), Vec::new());
    while tokens.len() < n {
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as u32)
            .unwrap();
        tokens.push(next);
        logits = model
            .forward_adapted(&[next], &mut cache, adapter)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
    }
    (first, tokens)
}

#[test]
fn adapters_match_peft_alone_and_mixed_in_one_batch() {
    let dir = std::env::temp_dir().join(format!("lorry-lora-model-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    fixtures::write(Fixture::TinyLlama, &dir).unwrap();
    let model = Llama::from_dir(&dir, &Device::Cpu).unwrap();
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/lora/reference.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let prompt: Vec<u32> = reference["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let adapters = [
        ("base", None),
        ("adapter-a", Some(reference_adapter("adapter-a", model.config()))),
        ("adapter-b", Some(reference_adapter("adapter-b", model.config()))),
    ];
    let mut alone = Vec::new();
    for (name, adapter) in &adapters {
        let want = &reference[*name];
        let want_logits: Vec<f32> = want["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let want_ids: Vec<u32> = want["greedy_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let (logits, ids) = greedy_adapted(&model, &prompt, adapter.as_ref(), want_ids.len());
        let scale = want_logits.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = logits
            .iter()
            .zip(&want_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst / scale <= 1e-4,
            "{name}: logits differ by {worst} against {scale}"
        );
        assert_eq!(ids, want_ids, "{name}: greedy tokens");
        alone.push(logits);
    }
    // The three in one batch: each row's logits are exactly what it gives alone.
    let block = 16;
    let mut pool = BlockPool::new(64, block);
    let mut kv = KvCache::new(model.kv_layout(block), 64);
    let tables: Vec<BlockTable> = (0..3)
        .map(|_| {
            let mut table = BlockTable::default();
            table.append(&mut pool, prompt.len()).unwrap();
            table
        })
        .collect();
    // Adapter rows not adjacent: b, base, a.
    let order = [2, 0, 1];
    let chunks: Vec<SeqChunk<'_>> = order
        .iter()
        .zip(&tables)
        .map(|(&i, table)| SeqChunk {
            tokens: &prompt,
            start: 0,
            blocks: table.blocks(),
            logits: 1,
            adapter: adapters[i].1.as_ref(),
        })
        .collect();
    let batch = model.forward_batch(&chunks, &mut kv).unwrap().to_vec2::<f32>().unwrap();
    for (row, &i) in order.iter().enumerate() {
        assert_eq!(batch[row], alone[i], "{} in a mixed batch", adapters[i].0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_half_precision_adapter_is_served_in_its_own_precision_with_the_same_results() {
    let dir = std::env::temp_dir().join(format!("lorry-lora-half-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    fixtures::write(Fixture::TinyLlama, &dir).unwrap();
    let model = Llama::from_dir(&dir, &Device::Cpu).unwrap();
    let base = model.config().clone();
    let prompt = [5u32, 17, 42, 99, 3, 250, 8];
    let mut results = Vec::new();
    for dtype in [DType::F16, DType::BF16] {
        let half = weights(&base, &Target::ALL, 8, &HashMap::new(), dtype);
        let widened: HashMap<String, Tensor> = half
            .iter()
            .map(|(k, t)| (k.clone(), t.to_dtype(DType::F32).unwrap()))
            .collect();
        let config = config(json!({"target_modules": "all-linear"}));
        let (half, wide) = (
            Adapter::parse(&config, &bytes(&half), &base.adapter_shape(), AdapterLimits::default()).unwrap(),
            Adapter::parse(
                &config,
                &bytes(&widened),
                &base.adapter_shape(),
                AdapterLimits::default(),
            )
            .unwrap(),
        );
        let (half, wide) = (PackedAdapter::new(&half), PackedAdapter::new(&wide));
        let want = lorry_engine::ops::gemm::precision_of(dtype);
        assert_eq!(half.module(1, Target::Down).unwrap().a.precision(), want);
        assert_eq!(
            wide.module(1, Target::Down).unwrap().b.precision(),
            lorry_engine::ops::gemm::Precision::F32
        );
        let logits = |adapter: &PackedAdapter| {
            let mut cache = model.new_cache();
            model
                .forward_adapted(&prompt, &mut cache, Some(adapter))
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(logits(&half), logits(&wide), "{dtype:?}");
        results.push(logits(&half));
    }
    let mut cache = model.new_cache();
    let plain = model.forward(&prompt, &mut cache).unwrap().to_vec1::<f32>().unwrap();
    assert!(results.iter().all(|r| *r != plain), "the adapters changed nothing");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Values uniform in [−0.5, 0.5), from `seed`.
fn uniform_values(seed: u64) -> impl FnMut(usize) -> Vec<f32> {
    let mut rng = lorry_engine::runtime::rng::SplitMix::new(seed);
    move |len| (0..len).map(|_| rng.uniform() as f32 - 0.5).collect()
}

/// A rank-`rank` projection of `inputs` to `out` outputs with weights from `random`.
fn random_module(
    inputs: usize,
    rank: usize,
    out: usize,
    scale: f32,
    random: &mut dyn FnMut(usize) -> Vec<f32>,
) -> lorry_engine::lora::PackedLora {
    use lorry_engine::ops::gemm::PackedMatrix;
    lorry_engine::lora::PackedLora {
        a: PackedMatrix::from_f32(&random(rank * inputs), rank, inputs),
        b: PackedMatrix::from_f32(&random(out * rank), out, rank),
        scale,
    }
}

#[test]
fn the_expand_fused_into_the_product_adds_what_the_separate_pass_adds() {
    use lorry_engine::ops::gemm::PackedMatrix;
    use lorry_engine::ops::sgmv::{CpuSgmv, Segment};
    if !PackedMatrix::rows_direct() {
        return; // no AVX2 here: the separate pass is the only one.
    }
    let mut random = uniform_values(7);
    // A q/k/v-like product: 64 + 32 + 32 outputs over 48 inputs.
    let (inputs, outputs, tokens) = (48, 128, 100);
    let w = PackedMatrix::from_f32(&random(outputs * inputs), outputs, inputs);
    let module = |rank: usize, out: usize, scale: f32, random: &mut dyn FnMut(usize) -> Vec<f32>| {
        random_module(inputs, rank, out, scale, random)
    };
    let (q, v) = (module(8, 64, 2.0, &mut random), module(8, 32, 2.0, &mut random));
    let k = module(16, 32, 0.5, &mut random);
    // Rows of one adapter many (shrinks on tiles: pre-fill) or few (one by
    // one: decoding), not adjacent; rows 0, 5 and 99 have none.
    let many: Vec<usize> = (1..tokens - 1).filter(|r| r % 3 != 2 && *r != 5).collect();
    let few = [2usize, 8, 14];
    assert!(many.len() >= 64);
    let segments = [
        Segment {
            module: &q,
            rows: &many,
            offset: 0,
        },
        Segment {
            module: &v,
            rows: &many,
            offset: 96,
        },
        Segment {
            module: &k,
            rows: &few,
            offset: 64,
        },
        Segment {
            module: &q,
            rows: &few,
            offset: 0,
        },
    ];
    let x = random(tokens * inputs);
    let fused = CpuSgmv.apply_fused(&w, &x, tokens, &segments).unwrap();
    let mut separate = w.matmul(&x, tokens);
    CpuSgmv
        .apply_rows(&x, inputs, &mut separate, outputs, &segments)
        .unwrap();
    assert_eq!(fused, separate);
    assert_ne!(fused, w.matmul(&x, tokens), "the adapters changed nothing");
    // A row claimed by two adapters is refused by both, before anything is written.
    let clash = [
        Segment {
            module: &q,
            rows: &many,
            offset: 0,
        },
        Segment {
            module: &k,
            rows: &[1],
            offset: 64,
        },
    ];
    assert!(CpuSgmv.apply_fused(&w, &x, tokens, &clash).is_err());
    let mut y = w.matmul(&x, tokens);
    assert!(CpuSgmv.apply_rows(&x, inputs, &mut y, outputs, &clash).is_err());
    assert_eq!(y, w.matmul(&x, tokens), "a refused pass wrote");
}

#[test]
fn the_expand_fused_into_a_quantized_product_adds_what_the_separate_pass_adds() {
    use lorry_engine::ops::gemm::PackedMatrix;
    use lorry_engine::ops::quant::{QuantMatrix, QuantType};
    use lorry_engine::ops::sgmv::{CpuSgmv, Segment};
    if !PackedMatrix::rows_direct() {
        return; // no AVX2 here: the separate pass is the only one.
    }
    let mut random = uniform_values(11);
    // Stacked q/k/v-like projections in three formats, over 256 inputs:
    // 64 rows of Q4_K, 48 of Q6_K, 24 of Q4_1 (the last panel half full).
    let inputs = 256;
    let parts = [(QuantType::Q4K, 64), (QuantType::Q6K, 48), (QuantType::Q4_1, 24)];
    let matrices: Vec<QuantMatrix> = parts
        .iter()
        .map(|&(ty, rows)| QuantMatrix::quantize(ty, &random(rows * inputs), rows, inputs).unwrap())
        .collect();
    let w = QuantMatrix::stack(&matrices).unwrap();
    let outputs = w.outputs();
    assert!(w.panels_whole());
    let module = |rank: usize, out: usize, scale: f32, random: &mut dyn FnMut(usize) -> Vec<f32>| {
        random_module(inputs, rank, out, scale, random)
    };
    let q = module(8, 64, 2.0, &mut random);
    let k = module(16, 48, 0.5, &mut random);
    let v = module(4, 24, 1.0, &mut random);
    // 1 row, a tile's worth, more than a chunk of rows (64), and a pre-fill's
    // worth: one adapter on many rows (one by one as in a decoding step, or
    // on tiles from 64 rows on), others on a few each, some rows none.
    for tokens in [1usize, 20, 70, 200] {
        let many: Vec<usize> = (0..tokens).filter(|r| r % 3 == 1).collect();
        let few: Vec<usize> = (0..tokens).filter(|r| r % 3 == 0).take(5).collect();
        let other: Vec<usize> = (0..tokens).filter(|r| r % 3 == 2).take(3).collect();
        let mut segments = vec![
            Segment {
                module: &q,
                rows: &few,
                offset: 0,
            },
            Segment {
                module: &v,
                rows: &few,
                offset: 112,
            },
            Segment {
                module: &k,
                rows: &other,
                offset: 64,
            },
        ];
        if many.len() >= 8 {
            segments.push(Segment {
                module: &k,
                rows: &many,
                offset: 64,
            });
        }
        let x = random(tokens * inputs);
        let fused = CpuSgmv.apply_fused(&w, &x, tokens, &segments).unwrap();
        let mut separate = w.matmul(&x, tokens);
        CpuSgmv
            .apply_rows(&x, inputs, &mut separate, outputs, &segments)
            .unwrap();
        assert_eq!(fused, separate, "{tokens} rows");
        assert_ne!(fused, w.matmul(&x, tokens), "the adapters changed nothing");
    }
    // Parts that do not start on panels (40 rows, then 24) are refused.
    let uneven = QuantMatrix::stack(&[
        QuantMatrix::quantize(QuantType::Q8_0, &random(40 * inputs), 40, inputs).unwrap(),
        QuantMatrix::quantize(QuantType::Q4_0, &random(24 * inputs), 24, inputs).unwrap(),
    ])
    .unwrap();
    assert!(!uneven.panels_whole());
    let x = random(inputs);
    let rows = [0usize];
    let one = [Segment {
        module: &q,
        rows: &rows,
        offset: 0,
    }];
    assert!(CpuSgmv.apply_fused(&uneven, &x, 1, &one).is_err());
}

#[test]
fn the_adapters_beside_the_product_add_what_the_separate_pass_adds() {
    use lorry_engine::lora::PackedLora;
    use lorry_engine::ops::gemm::PackedMatrix;
    use lorry_engine::ops::quant::{QuantMatrix, QuantType};
    use lorry_engine::ops::sgmv::{Base, CpuSgmv, Segment};
    if !PackedMatrix::rows_direct() {
        return; // no AVX2 here: the separate pass is the only one.
    }
    let mut random = uniform_values(13);
    let inputs = 256;
    // Two stacked projections, 64 and 40 outputs (q and k, say), the last
    // panel of the second half full.
    let quant = QuantMatrix::stack(&[
        QuantMatrix::quantize(QuantType::Q4_1, &random(64 * inputs), 64, inputs).unwrap(),
        QuantMatrix::quantize(QuantType::Q8_0, &random(40 * inputs), 40, inputs).unwrap(),
    ])
    .unwrap();
    let float = PackedMatrix::from_f32(&random(104 * inputs), 104, inputs);
    // A matrix in a precision, through the tensor an adapter file gives.
    let mut packed = |n: usize, k: usize, dtype: DType| {
        let w = Tensor::from_vec(random(n * k), (n, k), &Device::Cpu).unwrap();
        PackedMatrix::from_tensor(&w.to_dtype(dtype).unwrap()).unwrap()
    };
    // Adapters of ranks 4, 8 and 16 in f32, f16 and bf16, each on both
    // projections: a decoding step's rows, most with an adapter of their
    // own, five sharing one, the last three with none.
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    let adapters: Vec<[PackedLora; 2]> = (0..13)
        .map(|i| {
            let (rank, dtype) = ([4, 8, 16][i % 3], dtypes[(i / 3) % 3]);
            [(64, 0.5), (40, 2.0)].map(|(out, scale)| PackedLora {
                a: packed(rank, inputs, dtype),
                b: packed(out, rank, dtype),
                scale,
            })
        })
        .collect();
    let tokens = 20;
    let rows: Vec<Vec<usize>> = (0..13)
        .map(|i| if i < 12 { vec![i] } else { (12..17).collect() })
        .collect();
    let segments: Vec<Segment<'_>> = adapters
        .iter()
        .zip(&rows)
        .flat_map(|([q, k], rows)| {
            [
                Segment {
                    module: q,
                    rows,
                    offset: 0,
                },
                Segment {
                    module: k,
                    rows,
                    offset: 64,
                },
            ]
        })
        .collect();
    let x = random(tokens * inputs);
    for (name, w) in [("quantized", Base::Quant(&quant)), ("float", Base::Packed(&float))] {
        let plain = match w {
            Base::Quant(w) => w.matmul(&x, tokens),
            Base::Packed(w) => w.matmul(&x, tokens),
        };
        let beside = CpuSgmv.apply_beside(w, &x, tokens, &segments).unwrap();
        let mut separate = plain.clone();
        CpuSgmv
            .apply_rows(&x, inputs, &mut separate, plain.len() / tokens, &segments)
            .unwrap();
        assert_eq!(beside, separate, "{name}: beside the product");
        assert_eq!(
            beside,
            CpuSgmv.apply_fused(w, &x, tokens, &segments).unwrap(),
            "{name}: inside it"
        );
        for r in 0..tokens {
            let row = r * plain.len() / tokens..(r + 1) * plain.len() / tokens;
            assert_eq!(
                beside[row.clone()] == plain[row],
                r >= 17,
                "{name}: row {r} changed or not"
            );
        }
    }
    // A pre-fill's rows (64 for one adapter) are not a decoding step's.
    let many: Vec<usize> = (0..64).collect();
    let prefill = [Segment {
        module: &adapters[0][0],
        rows: &many,
        offset: 0,
    }];
    let x = random(64 * inputs);
    assert!(CpuSgmv.apply_beside(&quant, &x, 64, &prefill).is_err());
}
