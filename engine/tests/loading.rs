//! Loading checkpoints: config variants, and bad files as typed errors naming
//! what is wrong, never panics.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::models::llama::{Llama, LlamaConfigFile, RopeScaling};
use lorry_engine::models::ModelError;

fn fixture(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lorry-loading-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    fixtures::write(Fixture::parse(name).unwrap(), &dir).unwrap();
    dir
}

#[test]
fn llama3_rope_reads_the_same_from_rope_scaling_and_rope_parameters() {
    let old: LlamaConfigFile = serde_json::from_value(serde_json::json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "rms_norm_eps": 1e-5, "vocab_size": 10, "max_position_embeddings": 128, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    }))
    .unwrap();
    let new: LlamaConfigFile = serde_json::from_value(serde_json::json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "rms_norm_eps": 1e-5, "vocab_size": 10, "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    }))
    .unwrap();
    let (old, new) = (old.into_config().unwrap(), new.into_config().unwrap());
    assert_eq!(old, new);
    assert_eq!(new.rope_theta, 500000.0);
    assert!(matches!(new.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
    assert_eq!((new.num_kv_heads, new.head_dim), (4, 16));
}

#[test]
fn linear_rope_scaling_divides_every_frequency_as_transformers_does() {
    use lorry_engine::models::llama::inverse_frequencies;
    let config = |scaling: serde_json::Value| {
        let file: LlamaConfigFile = serde_json::from_value(serde_json::json!({
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "rms_norm_eps": 1e-5, "vocab_size": 10, "max_position_embeddings": 128, "rope_scaling": scaling
        }))
        .unwrap();
        file.into_config()
    };
    let plain = config(serde_json::Value::Null).unwrap();
    let linear = config(serde_json::json!({"type": "linear", "factor": 4.0})).unwrap();
    assert!(matches!(linear.rope_scaling, RopeScaling::Linear { factor } if factor == 4.0));
    // transformers: `inv_freq /= factor`.
    let want: Vec<f32> = inverse_frequencies(&plain)
        .iter()
        .map(|f| (*f as f64 / 4.0) as f32)
        .collect();
    let got = inverse_frequencies(&linear);
    assert!(
        got.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 1e-7 * w.abs()),
        "{got:?} vs {want:?}"
    );
    assert!(config(serde_json::json!({"type": "linear"})).is_err());
    assert!(config(serde_json::json!({"type": "yarn", "factor": 4.0}))
        .unwrap_err()
        .to_string()
        .contains("yarn"));
}

#[test]
fn a_missing_tensor_is_an_error_that_names_it() {
    let dir = fixture("tiny-llama", "missing");
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    tensors.remove("model.layers.1.mlp.up_proj.weight");
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let err = Llama::from_dir(&dir, &Device::Cpu).unwrap_err();
    assert!(matches!(err, ModelError::Weights(_)));
    assert!(err.to_string().contains("model.layers.1.mlp.up_proj.weight"), "{err}");
}

#[test]
fn a_tensor_of_the_wrong_shape_is_an_error_that_names_it() {
    let dir = fixture("tiny-llama", "shape");
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let wrong = candle_core::Tensor::zeros((3, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
    tensors.insert("model.layers.0.self_attn.k_proj.weight".into(), wrong);
    candle_core::safetensors::save(&tensors, &path).unwrap();
    let err = Llama::from_dir(&dir, &Device::Cpu).unwrap_err();
    assert!(
        err.to_string().contains("model.layers.0.self_attn.k_proj.weight"),
        "{err}"
    );
}

#[test]
fn a_truncated_file_is_an_error_not_a_panic() {
    let dir = fixture("tiny-qwen2", "truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        Llama::from_dir(&dir, &Device::Cpu),
        Err(ModelError::Weights(_))
    ));
    std::fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").unwrap();
    assert!(Llama::from_dir(&dir, &Device::Cpu).is_err());
}

#[test]
fn an_unsupported_model_type_is_refused() {
    let dir = fixture("tiny-llama", "type");
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap().replace("\"llama\"", "\"gpt2\"");
    std::fs::write(&path, text).unwrap();
    let err = Llama::from_dir(&dir, &Device::Cpu).unwrap_err();
    assert!(matches!(err, ModelError::Config(_)), "{err}");
}

#[test]
fn a_half_precision_checkpoint_gives_the_logits_its_widened_weights_give() {
    for (dtype, tag) in [(DType::F16, "f16"), (DType::BF16, "bf16")] {
        let half = std::env::temp_dir().join(format!("lorry-loading-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&half);
        fixtures::write_as(Fixture::TinyLlama, &half, dtype).unwrap();
        // The same checkpoint widened to f32 on disk.
        let wide = half.with_extension("f32");
        let _ = std::fs::remove_dir_all(&wide);
        std::fs::create_dir_all(&wide).unwrap();
        for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(half.join(file), wide.join(file)).unwrap();
        }
        let tensors = candle_core::safetensors::load(half.join("model.safetensors"), &Device::Cpu).unwrap();
        assert!(tensors.values().all(|t| t.dtype() == dtype));
        let widened: HashMap<String, Tensor> = tensors
            .into_iter()
            .map(|(name, t)| (name, t.to_dtype(DType::F32).unwrap()))
            .collect();
        candle_core::safetensors::save(&widened, wide.join("model.safetensors")).unwrap();
        use lorry_engine::models::llama::Products;
        // The exact products widen the halves inside the product.
        let (half_model, wide_model) = (
            Llama::from_dir_with(&half, &Device::Cpu, Products::Exact).unwrap(),
            Llama::from_dir(&wide, &Device::Cpu).unwrap(),
        );
        assert_eq!(half_model.weight_bytes_per_param(), 2.0);
        assert_eq!(wide_model.weight_bytes_per_param(), 4.0);
        let prompt = [5u32, 17, 42, 99, 3];
        let logits = |model: &Llama| {
            let mut cache = model.new_cache();
            model.forward(&prompt, &mut cache).unwrap().to_vec1::<f32>().unwrap()
        };
        // The same widened values through the same kernel: the same numbers.
        let want = logits(&wide_model);
        assert_eq!(logits(&half_model), want, "{tag}");
        assert_eq!(
            half_model.greedy(&prompt, 8).unwrap(),
            wide_model.greedy(&prompt, 8).unwrap(),
            "{tag}"
        );
        // The native products: bf16 dot products where the CPU has them
        // (weights and token rows rounded to bf16), the same two bytes a
        // weight; logits within 2% of the largest (measured 0.9–1.1%: the tiny
        // fixture's logits are small).
        let native = Llama::from_dir(&half, &Device::Cpu).unwrap();
        assert_eq!(native.weight_bytes_per_param(), 2.0);
        let got = logits(&native);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!(
            "{tag} native (bf16 dot products: {}): largest logit difference {} of the largest",
            lorry_engine::ops::gemm::bf16_dot_available(),
            worst / scale
        );
        assert!(worst <= 0.02 * scale, "{tag}: {worst} of {scale}");
        if !lorry_engine::ops::gemm::bf16_dot_available() {
            assert_eq!(got, want, "{tag}: without bf16 dot products, native widens");
        }
        let _ = std::fs::remove_dir_all(&half);
        let _ = std::fs::remove_dir_all(&wide);
    }
}

/// `--quantize`: a checkpoint's f32 and half-precision projections
/// quantized at load to GGUF's blocks (weight only) read a block format's
/// bytes and give logits near the full-precision ones.
#[test]
fn projections_quantized_at_load_follow_the_full_precision_weights() {
    use lorry_engine::models::llama::Products;
    use lorry_engine::ops::quant::QuantType;
    for (dtype, tag) in [(DType::F32, "f32"), (DType::BF16, "bf16")] {
        let dir = std::env::temp_dir().join(format!("lorry-loading-quantize-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        fixtures::write_as(Fixture::TinyLlama, &dir, dtype).unwrap();
        let full = Llama::from_dir(&dir, &Device::Cpu).unwrap();
        let prompt = [5u32, 17, 42, 99, 3, 64, 8];
        let logits = |model: &Llama| {
            let mut cache = model.new_cache();
            model.forward(&prompt, &mut cache).unwrap().to_vec1::<f32>().unwrap()
        };
        let want = logits(&full);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Bytes a weight, and the largest difference allowed as a share of the
        // largest logit (measured: Q8_0 2.8–2.9%, Q4_1 38–41%: four bits hold
        // this fixture's Gaussian weights coarsely, and its logits are small).
        for (ty, bytes, bound) in [
            (QuantType::Q8_0, 34.0 / 32.0, 0.06),
            (QuantType::Q4_1, 20.0 / 32.0, 0.6),
        ] {
            let quantized = Llama::from_dir_with(&dir, &Device::Cpu, Products::Quantize(ty)).unwrap();
            assert_eq!(quantized.weight_bytes_per_param(), bytes, "{tag} {}", ty.name());
            let got = logits(&quantized);
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            eprintln!(
                "{tag} {}: largest logit difference {} of the largest logit",
                ty.name(),
                worst / scale
            );
            assert!(
                worst > 0.0 && worst <= bound * scale,
                "{tag} {}: {worst} of {scale}",
                ty.name()
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
