//! Chat prompts: the GGUF's own `tokenizer.chat_template` rendered with minijinja, with the
//! variables llama-server's `--jinja` passes (messages, add_generation_prompt, bos_token,
//! eos_token, and the request's `chat_template_kwargs`).

use minijinja::{Environment, Error, ErrorKind, Value};

/// The prompt for `messages` under `template`. Called on the request's thread; pure.
/// An error is one line naming what the template could not do with these messages.
pub fn render(
    template: &str,
    messages: &[serde_json::Value],
    kwargs: Option<&serde_json::Map<String, serde_json::Value>>,
    bos: &str,
    eos: &str,
) -> Result<String, String> {
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
    env.add_template("chat", template)
        .map_err(|e| format!("the model's chat template does not parse: {e}"))?;
    let messages: Vec<serde_json::Value> = messages.iter().map(flatten_content).collect();
    let mut context = serde_json::Map::new();
    if let Some(kwargs) = kwargs {
        context.extend(kwargs.clone());
    }
    context.insert("messages".into(), serde_json::Value::Array(messages));
    context.insert("add_generation_prompt".into(), true.into());
    context.insert("bos_token".into(), bos.into());
    context.insert("eos_token".into(), eos.into());
    let template = env.get_template("chat").map_err(|e| e.to_string())?;
    template
        .render(Value::from_serialize(&context))
        .map_err(|e| format!("the model's chat template failed on these messages: {e}"))
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
    fn raise_exception_becomes_an_error() {
        let err =
            super::render("{{ raise_exception('no tools') }}", &[], None, "", "").unwrap_err();
        assert!(err.contains("no tools"), "{err}");
    }
}
