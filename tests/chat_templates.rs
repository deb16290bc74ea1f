//! Chat templates rendered by treetrain against transformers' `apply_chat_template` on the same
//! conversations (tests/fixtures/chat_templates.json, made by
//! scripts/fixtures/make_chat_fixtures.py from the templates TRL 1.16.0 ships).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use treetrain::tokenizer::{ChatOptions, ChatTemplate, Tokenizer};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// TRL's templates are fetched (never committed): make sure they are there, fetched once
/// however many tests of this file ask at the same time.
fn templates_dir() -> PathBuf {
    static FETCHED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let dir = root().join(".deps/chat_templates");
    let ok = FETCHED.get_or_init(|| {
        dir.join(".trl-1.16.0").exists()
            || Command::new("bash")
                .arg(root().join("scripts/fetch-chat-templates.sh"))
                .status()
                .is_ok_and(|s| s.success())
    });
    assert!(ok, "scripts/fetch-chat-templates.sh failed");
    dir
}

fn tiny_tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&root().join("datasets/tiny-qwen3")).unwrap()
}

fn options(fixture: &Value, case: &Value) -> ChatOptions {
    let opts = &fixture["options"][case["options"].as_str().unwrap()];
    let mut extra = fixture["extra_kwargs"].as_object().unwrap().clone();
    if let Some(v) = opts.get("enable_thinking") {
        extra.insert("enable_thinking".into(), v.clone());
    }
    ChatOptions {
        add_generation_prompt: opts
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        tools: (case["conversation"] == "tools").then(|| fixture["tools"].clone()),
        extra,
    }
}

#[test]
fn renders_like_transformers_for_real_model_templates() {
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("tests/fixtures/chat_templates.json")).unwrap())
            .unwrap();
    let dir = templates_dir();
    let mut tok = tiny_tokenizer();
    let own = tok.chat_template.take().unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    let mut masks_checked = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let label = format!(
            "{name}/{}/{}",
            case["conversation"].as_str().unwrap(),
            case["options"].as_str().unwrap()
        );
        tok.chat_template = Some(if name == "tiny-qwen3" {
            ChatTemplate::new(&own.source).unwrap()
        } else {
            ChatTemplate::new(&std::fs::read_to_string(dir.join(format!("{name}.jinja"))).unwrap()).unwrap()
        });
        let messages = &fixture["conversations"][case["conversation"].as_str().unwrap()];
        let opts = options(&fixture, case);
        let rendered = match tok.apply_chat_template(messages, &opts) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{label}: {e}"));
                continue;
            }
        };
        checked += 1;
        let want = case["text"].as_str().unwrap();
        if rendered.text != want {
            let at = rendered
                .text
                .chars()
                .zip(want.chars())
                .take_while(|(a, b)| a == b)
                .count();
            let ctx = |s: &str| s.chars().skip(at.saturating_sub(20)).take(60).collect::<String>();
            failures.push(format!(
                "{label}: differs at char {at}: got {:?}, want {:?}",
                ctx(&rendered.text),
                ctx(want)
            ));
            continue;
        }
        if let Some(ids) = case.get("input_ids") {
            let got = tok.tokenize_chat(messages, &opts).unwrap();
            let want_ids: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            let want_mask: Vec<u8> = serde_json::from_value(case["assistant_masks"].clone()).unwrap();
            if got.input_ids != want_ids {
                failures.push(format!("{label}: token ids differ"));
            } else if got.assistant_masks != want_mask {
                failures.push(format!(
                    "{label}: assistant masks differ: got {:?}, want {:?}",
                    got.assistant_masks, want_mask
                ));
            }
            masks_checked += 1;
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        checked,
        failures.join("\n")
    );
    assert!(
        checked >= 350 && masks_checked >= 100,
        "{checked} cases, {masks_checked} with masks"
    );
}

#[test]
fn tiny_template_masks_exactly_the_assistant_replies() {
    let tok = tiny_tokenizer();
    let messages = serde_json::json!([
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "Answer: 2"},
    ]);
    let chat = tok.tokenize_chat(&messages, &ChatOptions::default()).unwrap();
    let masked: Vec<u32> = chat
        .input_ids
        .iter()
        .zip(&chat.assistant_masks)
        .filter(|(_, m)| **m == 1)
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(tok.decode(&masked, false).unwrap(), "Answer: 2<|im_end|>");
    assert!(chat.text.ends_with("<|im_start|>assistant\nAnswer: 2<|im_end|>\n"));
    let prompt = tok
        .apply_chat_template(
            &Value::Array(messages.as_array().unwrap()[..2].to_vec()),
            &ChatOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(prompt.text.ends_with("<|im_start|>assistant\n") && prompt.generation_spans.is_empty());
}

#[test]
fn malformed_messages_are_named() {
    let tok = tiny_tokenizer();
    let err = tok.apply_chat_template(
        &serde_json::json!([{"role": "user", "content": "x"}, {"content": "y"}]),
        &ChatOptions::default(),
    );
    assert_eq!(err.unwrap_err().to_string(), "message 1: missing string field `role`");
    let err = tok.apply_chat_template(&serde_json::json!({"role": "user"}), &ChatOptions::default());
    assert!(err.unwrap_err().to_string().contains("must be a list"));
    let bare = Tokenizer {
        chat_template: None,
        ..tiny_tokenizer()
    };
    assert!(
        bare.apply_chat_template(&serde_json::json!([]), &ChatOptions::default())
            .unwrap_err()
            .to_string()
            .contains("no chat template")
    );
}

/// The render limits (instructions and bytes) leave every real template room for a conversation
/// of thousands of turns: what renders for one exchange renders for 1,000 of them.
#[test]
fn render_limits_leave_real_templates_long_conversations() {
    let dir = templates_dir();
    let mut tok = tiny_tokenizer();
    let exchange = |n: usize| -> Value {
        let turns = (0..n).flat_map(|i| {
            [
                serde_json::json!({"role": "user", "content": format!("What is {i} + {i}? Show the working.")}),
                serde_json::json!({"role": "assistant", "content": format!("{i} + {i} = {}. Answer: {}", 2 * i, 2 * i)}),
            ]
        });
        Value::Array(turns.collect())
    };
    let mut rendered = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
            continue;
        }
        tok.chat_template = Some(ChatTemplate::new(&std::fs::read_to_string(&path).unwrap()).unwrap());
        let opts = ChatOptions::default();
        if tok.apply_chat_template(&exchange(1), &opts).is_err() {
            continue; // a template that needs more than user and assistant turns
        }
        let long = tok.apply_chat_template(&exchange(1000), &opts);
        assert!(long.is_ok(), "{}: {}", path.display(), long.unwrap_err());
        rendered += 1;
    }
    assert!(rendered >= 20, "only {rendered} templates rendered");
}

/// `treetrain render` prints, for five families' templates of the fixture, each conversation as
/// transformers' `apply_chat_template(..., tokenize=False)` rendered it: the default adds the
/// generation prompt only where the last message is not the assistant's, the flags force it
/// either way, and `chat_template_kwargs` and `tools` (here as JSON text) reach the template.
#[test]
fn the_render_command_prints_what_transformers_renders() {
    let fixture: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("tests/fixtures/chat_templates.json")).unwrap())
            .unwrap();
    let templates = templates_dir();
    let work = std::env::temp_dir().join(format!("treetrain-render-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let cases = fixture["cases"].as_array().unwrap();
    // The library's own rendering of every template is checked above; the command is checked
    // on a few families' (one process per template and option).
    let names = ["tiny-qwen3", "qwen3", "llama3_1", "gemma3", "deepseekv3"];
    let mut checked = 0;
    for name in names {
        // A model folder of the tiny model's tokenizer with this template in `chat_template.jinja`.
        let model = work.join(name);
        std::fs::create_dir_all(&model).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json", "config.json"] {
            std::fs::copy(root().join("datasets/tiny-qwen3").join(f), model.join(f)).unwrap();
        }
        if name != "tiny-qwen3" {
            std::fs::copy(
                templates.join(format!("{name}.jinja")),
                model.join("chat_template.jinja"),
            )
            .unwrap();
        }
        for (option, flag) in [
            ("plain", "--no-generation-prompt"),
            ("gen_prompt", "--add-generation-prompt"),
            ("no_think", "--add-generation-prompt"),
        ] {
            let chosen: Vec<&Value> = cases
                .iter()
                .filter(|c| c["template"] == name && c["options"] == option)
                .collect();
            let mut kwargs = fixture["extra_kwargs"].clone();
            if option == "no_think" {
                kwargs["enable_thinking"] = false.into();
            }
            let lines: Vec<String> = (chosen.iter())
                .map(|c| {
                    let conversation = c["conversation"].as_str().unwrap();
                    let mut line = serde_json::json!({
                        "messages": fixture["conversations"][conversation],
                        "chat_template_kwargs": kwargs,
                    });
                    if conversation == "tools" {
                        line["tools"] = fixture["tools"].to_string().into();
                    }
                    line.to_string()
                })
                .collect();
            let input = work.join("lines.jsonl");
            std::fs::write(&input, lines.join("\n")).unwrap();
            let out = Command::new(env!("CARGO_BIN_EXE_treetrain"))
                .args([
                    "render",
                    "--model",
                    model.to_str().unwrap(),
                    "--input",
                    input.to_str().unwrap(),
                    flag,
                ])
                .output()
                .unwrap();
            assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
            let text = String::from_utf8(out.stdout).unwrap();
            let rendered: Vec<&str> = text.split_terminator('\0').collect();
            assert_eq!(rendered.len(), chosen.len(), "{name}/{option}");
            for (got, case) in rendered.iter().zip(&chosen) {
                assert_eq!(
                    *got,
                    case["text"].as_str().unwrap(),
                    "{name}/{}/{option}",
                    case["conversation"]
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 90, "{checked} cases");
    // The default: the generation prompt only after a message that is not the assistant's.
    let line = |conversation: &str| serde_json::json!({"messages": fixture["conversations"][conversation], "chat_template_kwargs": fixture["extra_kwargs"]});
    let lines = format!("{}\n{}\n", line("single"), line("prompt_only"));
    let input = work.join("default.jsonl");
    std::fs::write(&input, lines).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_treetrain"))
        .args([
            "render",
            "--model",
            work.join("qwen3").to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let want = |option: &str, conversation: &str| {
        let case = cases
            .iter()
            .find(|c| c["template"] == "qwen3" && c["options"] == option && c["conversation"] == conversation);
        case.unwrap()["text"].as_str().unwrap().to_string()
    };
    assert_eq!(
        text,
        format!("{}\0{}\0", want("plain", "single"), want("gen_prompt", "prompt_only"))
    );
    let _ = std::fs::remove_dir_all(&work);
}
