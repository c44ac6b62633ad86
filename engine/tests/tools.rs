//! Tool calls: conversations with tools render with each family's own
//! template exactly as transformers renders them (reference data made by
//! `tests/reference/make_tools_reference.py`); outputs written in each
//! family's format parse into calls; `required` and a named function always
//! give calls whose arguments are valid under the function's schema, on a
//! random-weight model sampling at temperature 1, in every family's format;
//! and a streamed answer never streams the calls' text.

use std::path::{Path, PathBuf};

use candle_core::Device;
use lorry_engine::fixtures::{self, Fixture};
use lorry_engine::input::Tools;
use lorry_engine::runtime::chat::TextModel;
use lorry_engine::runtime::text_engine::{EngineConfig, TextEngine};
use lorry_engine::runtime::tools::{ToolFormat, ToolSyntax};
use lorry_engine::{Backend, Event, FinishReason, Lane, Request, Task, ValidRequest};
use serde_json::{json, Value};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

/// A template file of `tests/data/templates` with its BOS and EOS tokens.
type Template<'a> = (&'a str, &'a str, &'a str);

/// The tiny random-weight model with `template` (and its special tokens) as its chat template; its own without.
fn model(tag: &str, template: Option<Template>) -> TextModel {
    let dir = std::env::temp_dir().join(format!("lorry-tools-{tag}-{}", std::process::id()));
    fixtures::write(Fixture::TinyLlama, &dir).unwrap();
    if let Some((name, bos, eos)) = template {
        let path = dir.join("tokenizer_config.json");
        let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        config["chat_template"] = json!(std::fs::read_to_string(data("templates").join(name)).unwrap());
        config["bos_token"] = json!(bos);
        config["eos_token"] = json!(eos);
        std::fs::write(&path, config.to_string()).unwrap();
    }
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    model
}

fn request(body: Value) -> ValidRequest {
    ValidRequest::parse(Task::TextGeneration, &body).unwrap()
}

#[test]
fn conversations_with_tools_render_as_transformers_renders_them() {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(data("tools-reference.json")).unwrap()).unwrap();
    let expected_formats = [
        ToolFormat::Hermes,
        ToolFormat::Hermes,
        ToolFormat::Llama3Json,
        ToolFormat::Mistral,
    ];
    for (family, format) in reference["families"].as_array().unwrap().iter().zip(expected_formats) {
        let name = family["template"].as_str().unwrap();
        let model = model(
            "render",
            Some((
                name,
                family["bos_token"].as_str().unwrap(),
                family["eos_token"].as_str().unwrap(),
            )),
        );
        assert_eq!(model.tool_syntax(), ToolSyntax { format, native: true }, "{name}");
        for case in family["cases"].as_array().unwrap() {
            let valid = request(json!({"messages": case["messages"], "tools": case["tools"]}));
            let rendered = model
                .render_with(&valid.prompt, false, valid.tools.as_deref())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(rendered, case["text"].as_str().unwrap(), "{name}");
        }
    }
}

#[test]
fn a_tool_use_template_renders_requests_that_show_tools_as_transformers_picks_it() {
    // Hermes models list a default template and a `tool_use` one in tokenizer_config.json.
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(data("tools-reference.json")).unwrap()).unwrap();
    let hermes = &reference["families"][1];
    assert_eq!(hermes["template"], "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja");
    let dir = std::env::temp_dir().join(format!("lorry-tools-named-{}", std::process::id()));
    fixtures::write(Fixture::TinyLlama, &dir).unwrap();
    let path = dir.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let tool_use = std::fs::read_to_string(data("templates").join(hermes["template"].as_str().unwrap())).unwrap();
    config["chat_template"] = json!([
        {"name": "default", "template": config["chat_template"]},
        {"name": "tool_use", "template": tool_use},
    ]);
    config["bos_token"] = hermes["bos_token"].clone();
    config["eos_token"] = hermes["eos_token"].clone();
    std::fs::write(&path, config.to_string()).unwrap();
    let model = TextModel::from_dir(&dir, &Device::Cpu).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let templates = model.tool_templates();
    assert!(!templates.chat.native);
    assert_eq!(
        templates.tool_use,
        Some(ToolSyntax {
            format: ToolFormat::Hermes,
            native: true
        })
    );
    for case in hermes["cases"].as_array().unwrap() {
        let valid = request(json!({"messages": case["messages"], "tools": case["tools"]}));
        let rendered = model.render_with(&valid.prompt, false, valid.tools.as_deref()).unwrap();
        assert_eq!(rendered, case["text"].as_str().unwrap());
    }
    // Without tools shown, the default template.
    let plain = request(json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(
        model.render_with(&plain.prompt, false, None).unwrap(),
        "<|user|>\nhi</s>\n<|assistant|>\n"
    );
}

#[test]
fn a_template_without_tools_gets_them_in_a_system_message_and_the_calls_as_hermes_text() {
    let model = model("fallback", None);
    assert_eq!(
        model.tool_syntax(),
        ToolSyntax {
            format: ToolFormat::Hermes,
            native: false
        }
    );
    let call = json!({"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}});
    let valid = request(json!({
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "42"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "Adds"}}],
    }));
    let text = model.render_with(&valid.prompt, false, valid.tools.as_deref()).unwrap();
    assert!(text.starts_with("<|system|>\n# Tools\n"), "{text}");
    assert!(
        text.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": \"Adds\", \"parameters\": {\"type\": \"object\", \"properties\": {}}}}\n</tools>"),
        "{text}"
    );
    assert!(
        text.contains("<|assistant|>\n<tool_call>\n{\"name\":\"f\",\"arguments\":{\"a\":1}}\n</tool_call></s>"),
        "{text}"
    );
    assert!(
        text.contains("<|user|>\n<tool_response>\n42\n</tool_response></s>"),
        "{text}"
    );
    // tool_choice none: the tools are not shown; the conversation's calls still render.
    let mut none = valid.clone();
    none.tools.as_mut().unwrap().choice = lorry_engine::tools::ToolChoice::None;
    let text = model.render_with(&none.prompt, false, none.tools.as_deref()).unwrap();
    assert!(!text.contains("# Tools") && text.contains("<tool_call>"), "{text}");
}

fn offered(parallel: bool) -> Tools {
    let valid = request(json!({
        "prompt": "x",
        "tools": [weather(), {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}],
        "parallel_tool_calls": parallel,
    }));
    *valid.tools.unwrap()
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": false,
    }}})
}

/// A recorded output: its format, its text, its content and its calls as (name, arguments).
type Case<'a> = (ToolSyntax, String, &'a str, Vec<(&'a str, Value)>);

#[test]
fn outputs_in_each_familys_format_parse_into_calls() {
    let syntax = |format| ToolSyntax { format, native: true };
    let hermes = syntax(ToolFormat::Hermes);
    let llama = syntax(ToolFormat::Llama3Json);
    let mistral = syntax(ToolFormat::Mistral);
    let weather_call = r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}"#;
    // (syntax, output, content, calls as (name, arguments))
    let cases: Vec<Case> = vec![
        (
            hermes,
            format!("<tool_call>\n{weather_call}\n</tool_call>"),
            "",
            vec![("get_weather", json!({"city": "Paris", "days": 3}))],
        ),
        (
            hermes,
            format!(
                "Let me look.\n<tool_call>\n{weather_call}\n</tool_call>\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>\n"
            ),
            "Let me look.",
            vec![("get_weather", json!({"city": "Paris", "days": 3})), ("get_time", json!({}))],
        ),
        // Ended by its end token before the closing tag.
        (
            hermes,
            format!("<tool_call>\n{weather_call}\n"),
            "",
            vec![("get_weather", json!({"city": "Paris", "days": 3}))],
        ),
        (
            llama,
            r#"{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}"#.into(),
            "",
            vec![("get_weather", json!({"city": "Oslo", "days": 1}))],
        ),
        (
            llama,
            r#"<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}"#
                .into(),
            "",
            vec![("get_time", json!({})), ("get_weather", json!({"city": "Rome", "days": 2}))],
        ),
        (
            mistral,
            r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima", "days": 5}, "id": "abc123XYZ"}]"#.into(),
            "",
            vec![("get_weather", json!({"city": "Lima", "days": 5}))],
        ),
        // The tag is a special token: decoded away, the array is left.
        (
            mistral,
            r#"[{"name": "get_time", "arguments": {}}]"#.into(),
            "",
            vec![("get_time", json!({}))],
        ),
    ];
    let tools = offered(true);
    for (syntax, text, content, calls) in cases {
        let (end, found) = syntax.split(&text, &tools).unwrap_or_else(|| panic!("{text}"));
        assert_eq!(&text[..end], content, "{text}");
        let found: Vec<(&str, Value)> = found
            .iter()
            .map(|c| (c.name.as_str(), serde_json::from_str(&c.arguments).unwrap()))
            .collect();
        assert_eq!(found, calls, "{text}");
        // Nothing of a call is streamed before the output ends.
        assert!(syntax.streamable(&text) <= end, "{text}");
    }
    // Not calls: the whole text stays content.
    for (syntax, text) in [
        (hermes, "The weather is fine.".to_string()),
        (
            hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>".into(),
        ),
        (
            hermes,
            "<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>".into(),
        ),
        (
            hermes,
            format!("<tool_call>\n{weather_call}\n</tool_call> and then some words"),
        ),
        (llama, "Paris is sunny.".into()),
        (llama, "{\"name\": \"get_weather\", \"parameters\": \"Paris\"}".into()),
        (mistral, "[TOOL_CALLS] not json".into()),
    ] {
        assert!(syntax.split(&text, &tools).is_none(), "{text}");
    }
    // One call only where parallel calls are off.
    let text = format!("<tool_call>\n{weather_call}\n</tool_call>\n<tool_call>\n{weather_call}\n</tool_call>");
    assert_eq!(hermes.split(&text, &offered(false)).unwrap().1.len(), 1);
    // What may stream: text before a call, never a tag's beginning.
    assert_eq!(hermes.streamable("Sure. <tool_"), "Sure.".len());
    assert_eq!(hermes.streamable("Sure. <tool_call>\n{\"na"), "Sure.".len());
    assert_eq!(hermes.streamable("a < b"), "a < b".len());
    assert_eq!(llama.streamable("  {\"name\""), 0);
    assert_eq!(llama.streamable("<|python"), 0);
    assert_eq!(llama.streamable("Hello"), 5);
    assert_eq!(mistral.streamable("Hi [TOOL"), 2);
}

/// Every output of a forced choice is calls of what may be called, with valid arguments.
fn check_calls(generation_calls: &[lorry_engine::tools::ToolCall], allowed: &[&str], tools: &Tools, what: &str) {
    assert!(!generation_calls.is_empty(), "{what}");
    for call in generation_calls {
        assert!(allowed.contains(&call.name.as_str()), "{what}: {call:?}");
        let schema = &tools.functions.iter().find(|f| f.name == call.name).unwrap().parameters;
        let arguments: Value = serde_json::from_str(&call.arguments).unwrap();
        assert!(
            jsonschema::validator_for(schema).unwrap().is_valid(&arguments),
            "{what}: {call:?}"
        );
    }
}

#[test]
fn required_and_named_tools_are_always_called_with_valid_arguments_in_every_format() {
    let families: [(&str, Option<Template>); 4] = [
        ("own", None),
        ("qwen", Some(("Qwen-Qwen2.5-7B-Instruct.jinja", "", "</s>"))),
        ("llama", Some(("meta-llama-Llama-3.1-8B-Instruct.jinja", "<s>", "</s>"))),
        (
            "mistral",
            Some(("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>")),
        ),
    ];
    for (tag, template) in families {
        let model = model(tag, template);
        for seed in 0..6u64 {
            for (choice, allowed) in [
                (json!("required"), vec!["get_weather", "get_time"]),
                (
                    json!({"type": "function", "function": {"name": "get_weather"}}),
                    vec!["get_weather"],
                ),
            ] {
                let body = json!({
                    "messages": [{"role": "user", "content": "Weather in Paris for three days?"}],
                    // Without additionalProperties: false, a random model may write keys until max_tokens.
                    "tools": [weather(), {"type": "function", "function": {"name": "get_time",
                        "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}}],
                    "tool_choice": choice, "temperature": 1.0, "seed": seed, "max_tokens": 200,
                    "parallel_tool_calls": false,
                });
                let valid = request(body.clone());
                let generation = model.generate(&valid).unwrap();
                let what = format!("{tag} seed {seed} {choice}: {generation:?}");
                assert_eq!(generation.finish_reason, FinishReason::ToolCalls, "{what}");
                assert_eq!(generation.text, "", "{what}");
                assert_eq!(generation.tool_calls.len(), 1, "{what}");
                check_calls(&generation.tool_calls, &allowed, valid.tools.as_deref().unwrap(), &what);
                // Parallel calls: the grammar takes one call after another until the model ends
                // them (a random model seldom does) or max_tokens cuts the last, whose text is
                // then the answer, its finish reason `length`.
                let mut parallel = body;
                parallel["parallel_tool_calls"] = json!(true);
                let valid = request(parallel);
                let generation = model.generate(&valid).unwrap();
                let what = format!("{tag} seed {seed} {choice} parallel: {generation:?}");
                match generation.finish_reason {
                    FinishReason::ToolCalls => {
                        check_calls(&generation.tool_calls, &allowed, valid.tools.as_deref().unwrap(), &what)
                    }
                    FinishReason::Length => assert!(generation.tool_calls.is_empty(), "{what}"),
                    FinishReason::Stop => panic!("{what}"),
                }
            }
        }
    }
}

#[tokio::test]
async fn a_streamed_answer_streams_no_call_and_ends_with_the_calls() {
    let model = model("stream", Some(("Qwen-Qwen2.5-7B-Instruct.jinja", "", "</s>")));
    let engine = TextEngine::start("tiny", model.clone(), EngineConfig::default());
    let mut valid = request(json!({
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [weather()], "tool_choice": "required", "temperature": 1.0, "seed": 9, "max_tokens": 200,
        "parallel_tool_calls": false,
    }));
    let alone = model.generate(&valid).unwrap();
    valid.stream = true;
    let mut events = engine.submit(Request::new(valid.clone(), Lane::RealTime)).unwrap();
    let mut streamed = String::new();
    let output = loop {
        match events.recv().await.expect("the stream ends with its result") {
            Event::Token { text, .. } => streamed.push_str(&text),
            Event::Finished(output) => break output,
            Event::Failed(e) => panic!("{e}"),
        }
    };
    assert_eq!(streamed, "");
    assert_eq!(output.content.text(), "");
    assert_eq!(
        output.completion.as_ref().unwrap().finish_reason,
        FinishReason::ToolCalls
    );
    // The same calls as the request alone (ids are each call's own).
    let strip = |calls: &[lorry_engine::tools::ToolCall]| -> Vec<(String, String)> {
        calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect()
    };
    assert_eq!(strip(&output.tool_calls), strip(&alone.tool_calls));
    assert!(output
        .tool_calls
        .iter()
        .all(|c| c.id.starts_with("call_") && c.id.len() == 29));
    let body = output.result_body();
    assert_eq!(body["tool_calls"][0]["name"], "get_weather");
    assert!(body["tool_calls"][0]["arguments"].is_object(), "{body}");
}
