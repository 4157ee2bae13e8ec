//! Chat prompts: the GGUF's own chat template rendered as llama-server's `--jinja` renders it.
//!
//! The template (`tokenizer.chat_template`) is rendered with minijinja, with the
//! variables llama-server's `--jinja` passes (messages, add_generation_prompt, bos_token,
//! eos_token, and the request's `chat_template_kwargs`); ChatML for a GGUF without one, as
//! llama-server falls back; and the text that starts a user message in the template's prompts.

use minijinja::{Environment, Error, ErrorKind, Value};

use crate::error::InprocError;

/// The template llama-server uses for a GGUF that carries none (its `CHATML_TEMPLATE_SRC`).
pub const CHATML: &str = "{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\n' -}}\n{%- endif -%}";

/// The prompt for `messages` under `template`. Called on the request's thread; pure.
/// An error is one line naming what the template could not do with these messages.
pub fn render(
    template: &str,
    messages: &[serde_json::Value],
    kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    bos: &str,
    eos: &str,
) -> Result<String, InprocError> {
    render_with(template, messages, kwargs, bos, eos, true)
}

fn render_with(
    template: &str,
    messages: &[serde_json::Value],
    kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    bos: &str,
    eos: &str,
    add_generation_prompt: bool,
) -> Result<String, InprocError> {
    let mut env = Environment::new();
    // Jinja2 (which chat templates are written for) keeps blocks' whitespace as written.
    env.set_keep_trailing_newline(true);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_template("chat", template).map_err(|e| {
        InprocError::Request(format!("the model's chat template does not parse: {e}"))
    })?;
    let messages: Vec<serde_json::Value> = messages.iter().map(flatten_content).collect();
    let mut context = serde_json::Map::new();
    if let Some(kwargs) = kwargs {
        context.extend(kwargs.clone());
    }
    context.insert("messages".into(), serde_json::Value::Array(messages));
    context.insert("add_generation_prompt".into(), add_generation_prompt.into());
    context.insert("bos_token".into(), bos.into());
    context.insert("eos_token".into(), eos.into());
    let template = env
        .get_template("chat")
        .map_err(|e| InprocError::Request(e.to_string()))?;
    template
        .render(Value::from_serialize(&context))
        .map_err(|e| {
            InprocError::Request(format!(
                "the model's chat template failed on these messages: {e}"
            ))
        })
}

/// The text that starts a user message in `template`'s prompts (ChatML's `<|im_start|>user`),
/// found as llama-server's template analysis finds it: render the template without and with
/// one user message (or, for a template that refuses no messages, a user and an assistant
/// message without and with a second user message), and take what the longer one adds before
/// the message's text, less leading end markers and blank text. llama-server ends a prompt
/// batch where one starts, on models it checkpoints. None when the template shows none.
pub fn user_start_marker(template: &str, bos: &str, eos: &str) -> Option<String> {
    let user = serde_json::json!({"role": "user", "content": PROBE_USER});
    let earlier = [
        serde_json::json!({"role": "user", "content": PROBE_USER_TWO}),
        serde_json::json!({"role": "assistant", "content": PROBE_ASSISTANT}),
    ];
    let render =
        |messages: &[serde_json::Value]| render_with(template, messages, None, bos, eos, false);
    let (without, with) = match (render(&[]), render(std::slice::from_ref(&user))) {
        (Ok(without), Ok(with)) => (without, with),
        _ => {
            let mut three = earlier.to_vec();
            three.push(user);
            (render(&earlier).ok()?, render(&three).ok()?)
        }
    };
    let mut added = added_segments(&without, &with);
    if let Some(at) = added.find(PROBE_ASSISTANT) {
        added = added[at + PROBE_ASSISTANT.len()..].to_string();
    }
    let before = &added[..added.find(PROBE_USER)?];
    let mut marker = String::new();
    let mut seen_marker = false;
    for (is_marker, text) in segments(before) {
        let lower = text.to_lowercase();
        if !seen_marker && is_marker && (lower.contains("end") || lower.contains("close")) {
            continue;
        }
        if !seen_marker && !is_marker && text.trim().is_empty() {
            continue;
        }
        seen_marker |= is_marker;
        marker.push_str(text);
    }
    let marker = marker.trim();
    (!marker.is_empty()).then(|| marker.to_string())
}

const PROBE_USER: &str = "U_USER_MSG Hello END_U";
const PROBE_USER_TWO: &str = "V_USER_MSG Hello END_V";
const PROBE_ASSISTANT: &str = "A_ASST_MSG I can help END_A";

/// What `right` has that `left` has not, between their common leading and trailing segments.
fn added_segments(left: &str, right: &str) -> String {
    let left: Vec<(bool, &str)> = segments(left).collect();
    let right: Vec<(bool, &str)> = segments(right).collect();
    let prefix = left.iter().zip(&right).take_while(|(a, b)| a == b).count();
    let suffix = left[prefix..]
        .iter()
        .rev()
        .zip(right[prefix..].iter().rev())
        .take_while(|(a, b)| a == b)
        .count();
    right[prefix..right.len() - suffix]
        .iter()
        .map(|(_, text)| *text)
        .collect()
}

/// `text` cut into markers (`<...>` or `[...]`) and the text between them: (is_marker, text).
fn segments(text: &str) -> impl Iterator<Item = (bool, &str)> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let closer = match rest.as_bytes()[0] {
            b'<' => Some('>'),
            b'[' => Some(']'),
            _ => None,
        };
        let (piece, is_marker) = match closer.and_then(|c| rest.find(c)) {
            Some(end) => (&rest[..=end], true),
            None => {
                let start = usize::from(closer.is_some());
                let end = rest[start..]
                    .find(['<', '['])
                    .map_or(rest.len(), |i| i + start);
                (&rest[..end], false)
            }
        };
        rest = &rest[piece.len()..];
        Some((is_marker, piece))
    })
}

/// A message whose `content` is an array of parts becomes one with the parts' text joined,
/// as llama-server does for text-only models.
fn flatten_content(message: &serde_json::Value) -> serde_json::Value {
    let mut message = message.clone();
    if let Some(parts) = message.get("content").and_then(|c| c.as_array()) {
        let text: String = parts
            .iter()
            .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
            .collect::<Vec<_>>()
            .join("\n");
        message["content"] = text.into();
    }
    message
}

#[cfg(test)]
mod tests {
    /// SmolLM2's template, as its GGUF carries it.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2s_template_adds_its_default_system_prompt() {
        let messages = vec![serde_json::json!({"role": "user", "content": "Hi"})];
        let prompt = super::render(SMOLLM2, &messages, None, "", "").unwrap();
        assert_eq!(
            prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn chat_template_kwargs_reach_the_template() {
        let template = "{% if enable_thinking is defined and not enable_thinking %}no-think {% endif %}{{ messages[0].content.strip() }}";
        let messages = vec![serde_json::json!({"role": "user", "content": " Hi "})];
        let kwargs = serde_json::json!({"enable_thinking": false});
        let prompt = super::render(template, &messages, kwargs.as_object(), "", "").unwrap();
        assert_eq!(prompt, "no-think Hi", "kwargs and Python's str methods");
        assert_eq!(
            super::render(template, &messages, None, "", "").unwrap(),
            "Hi"
        );
    }

    #[test]
    fn the_user_start_marker_is_found_as_llama_server_finds_it() {
        let marker = |t: &str| super::user_start_marker(t, "<bos>", "<eos>");
        assert_eq!(marker(super::CHATML).as_deref(), Some("<|im_start|>user"));
        // SmolLM2's default system prompt comes with the first message, so it is part of what
        // the first user message adds (llama-server's analysis takes it the same way).
        assert_eq!(
            marker(SMOLLM2).as_deref(),
            Some(
                "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user"
            )
        );
        // Gemma's template reads messages[0] and fails on none: the second variant finds it.
        let gemma = "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% endif %}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}";
        assert_eq!(marker(gemma).as_deref(), Some("<start_of_turn>user"));
        assert_eq!(marker("{{ messages | length }}"), None);
    }

    #[test]
    fn segments_split_markers_from_text() {
        let parts: Vec<(bool, &str)> = super::segments("a<b>c[d]<e").collect();
        assert_eq!(
            parts,
            [
                (false, "a"),
                (true, "<b>"),
                (false, "c"),
                (true, "[d]"),
                (false, "<e")
            ]
        );
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let err =
            super::render("{{ raise_exception('no tools') }}", &[], None, "", "").unwrap_err();
        assert!(err.to_string().contains("no tools"), "{err}");
    }
}
