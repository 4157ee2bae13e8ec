//! One request's handoff: template and tokenize on the backend, the provider's prefill, the
//! restore into slot 0, and the body rewritten to decode from it (docs/hybrid.md).

use std::path::{Path, PathBuf};
use std::time::Duration;

use onebit_plugin_api::{BackendRequest, ForwardRequest, HostServices};
use serde_json::Value;

use crate::Settings;
use crate::error::{BackendCall, HybridError};
use crate::provider::{self, Invocation};

/// A restore reads the whole state file; a large prompt's can take a while.
const RESTORE_TIMEOUT_MS: u64 = 120_000;

/// A handoff that worked: the body to forward and what the per-request line says.
#[derive(Debug)]
pub struct Done {
    pub body: String,
    pub n_tokens: usize,
    pub prefill_ms: f64,
    pub restore_ms: f64,
}

/// The ids file and state file of one handoff, removed when it ends however it ends.
struct Files {
    ids: PathBuf,
    state: PathBuf,
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.ids);
        let _ = std::fs::remove_file(&self.state);
    }
}

/// Hand the request's prompt to the provider and restore its KV into slot 0. Blocks for the
/// provider's whole run; called on the forward thread. An error is the fallback's reason.
pub fn run(
    settings: &Settings,
    request: &ForwardRequest,
    host: &dyn HostServices,
    seq: u64,
) -> Result<Done, HybridError> {
    let Some(program) = &settings.provider else {
        return Err(HybridError::NoProvider);
    };
    let mut body: Value = serde_json::from_str(&request.body).map_err(HybridError::BodyNotJson)?;
    if !body.is_object() {
        return Err(HybridError::BodyNotObject);
    }
    let prompt = prompt_text(request, &body, host)?;
    let ids = tokenize(&prompt, host)?;
    if ids.is_empty() {
        return Err(HybridError::NoTokens);
    }

    let dir = Path::new(&settings.slot_dir);
    let state_name = format!("hybrid-{}-{seq}.state", std::process::id());
    let files = Files {
        ids: dir.join(format!("hybrid-{}-{seq}.ids", std::process::id())),
        state: dir.join(&state_name),
    };
    let mut text = String::with_capacity(ids.len() * 6);
    for id in &ids {
        text.push_str(&id.to_string());
        text.push('\n');
    }
    std::fs::write(&files.ids, text).map_err(|source| HybridError::WriteIds {
        path: files.ids.clone(),
        source,
    })?;

    let mut args = vec![
        "--tokens".to_string(),
        files.ids.to_string_lossy().into_owned(),
        "--out".to_string(),
        state_name.clone(),
        "--model".to_string(),
        settings.model.clone(),
    ];
    if let Some(elfs) = &settings.elfs {
        args.extend(["--elfs".to_string(), elfs.clone()]);
    }
    let report = provider::run(&Invocation {
        program,
        args,
        env: [
            ("ONEBIT_HYBRID_BACKEND_URL", settings.backend_url.clone()),
            ("ONEBIT_HYBRID_SLOT_DIR", settings.slot_dir.clone()),
        ]
        .into_iter()
        .chain(
            settings
                .prefill_server
                .clone()
                .map(|server| ("ONEBIT_PREFILL_LLAMA_SERVER", server)),
        )
        .collect(),
        limit: Duration::from_secs_f64(settings.timeout_s),
        grace: crate::PROVIDER_STOP_GRACE,
    })?;
    if report.n_tokens != ids.len() as u64 {
        return Err(HybridError::TokenCount {
            reported: report.n_tokens,
            prompt: ids.len(),
        });
    }
    if !files.state.is_file() {
        return Err(HybridError::NoStateFile(files.state.clone()));
    }

    let restored = call(
        host,
        BackendCall::Restore,
        "/slots/0?action=restore",
        serde_json::json!({ "filename": state_name }),
        RESTORE_TIMEOUT_MS,
    )?;
    let n_restored = restored["n_restored"].as_u64().unwrap_or(0);
    if n_restored != ids.len() as u64 {
        return Err(HybridError::Restored {
            held: n_restored,
            prompt: ids.len(),
        });
    }
    drop(files);

    let object = body.as_object_mut().expect("checked above");
    object.insert("id_slot".to_string(), Value::from(0));
    object.insert("cache_prompt".to_string(), Value::from(true));
    Ok(Done {
        body: body.to_string(),
        n_tokens: ids.len(),
        prefill_ms: report.prefill_ms.unwrap_or(report.wall_ms),
        restore_ms: restored["timings"]["restore_ms"].as_f64().unwrap_or(0.0),
    })
}

/// The prompt as the backend will see it: the templated chat, or a completion's own string.
fn prompt_text(
    request: &ForwardRequest,
    body: &Value,
    host: &dyn HostServices,
) -> Result<String, HybridError> {
    if request.path.ends_with("chat/completions") {
        if !body["messages"].is_array() {
            return Err(HybridError::NoTextPrompt("the chat has no messages"));
        }
        let templated = call(
            host,
            BackendCall::Template,
            "/apply-template",
            body.clone(),
            0,
        )?;
        return templated["prompt"]
            .as_str()
            .map(str::to_string)
            .ok_or(HybridError::NoTemplatedPrompt);
    }
    body["prompt"]
        .as_str()
        .map(str::to_string)
        .ok_or(HybridError::NoTextPrompt("the prompt is not one string"))
}

/// The prompt's ids as the server tokenizes a request: special tokens added and parsed.
fn tokenize(prompt: &str, host: &dyn HostServices) -> Result<Vec<i64>, HybridError> {
    let reply = call(
        host,
        BackendCall::Tokenize,
        "/tokenize",
        serde_json::json!({"content": prompt, "add_special": true, "parse_special": true}),
        0,
    )?;
    reply["tokens"]
        .as_array()
        .ok_or(HybridError::NoTokenList)?
        .iter()
        .map(|t| t.as_i64().ok_or_else(|| HybridError::BadTokenId(t.clone())))
        .collect()
}

/// POST `body` to backend 0 for `what` and return its JSON reply; no reply (the host's
/// reason, as the plugin ABI gives it) or a status other than 200 (the backend's message) is
/// an error naming the call.
fn call(
    host: &dyn HostServices,
    what: BackendCall,
    path: &str,
    body: Value,
    timeout_ms: u64,
) -> Result<Value, HybridError> {
    let failed = |status, message| HybridError::Backend {
        call: what,
        status,
        message,
    };
    let reply = host
        .backend_request(&BackendRequest {
            backend: 0,
            method: "POST".to_string(),
            path: path.to_string(),
            body: Some(body.to_string()),
            timeout_ms,
        })
        .map_err(|reason| failed(None, reason))?;
    let value: Value = serde_json::from_str(&reply.body).unwrap_or(Value::Null);
    if reply.status != 200 {
        let message = value["error"]["message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| reply.body.chars().take(200).collect());
        return Err(failed(Some(reply.status), message));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use onebit_plugin_api::BackendReply;
    use std::sync::Mutex;

    /// A backend that templates, tokenizes three ids, and restores `restored` tokens.
    struct Backend {
        restored: u64,
        seen: Mutex<Vec<String>>,
    }

    impl HostServices for Backend {
        fn backend_request(&self, r: &BackendRequest) -> Result<BackendReply, String> {
            self.seen.lock().unwrap().push(format!(
                "{} {}",
                r.path,
                r.body.clone().unwrap_or_default()
            ));
            let body = match r.path.as_str() {
                "/apply-template" => r#"{"prompt":"<|user|>\nhi\n"}"#.to_string(),
                "/tokenize" => r#"{"tokens":[1,5,9]}"#.to_string(),
                _ => format!(
                    r#"{{"n_restored":{},"timings":{{"restore_ms":2.5}}}}"#,
                    self.restored
                ),
            };
            Ok(BackendReply { status: 200, body })
        }
    }

    fn settings(dir: &Path, script: &str) -> Settings {
        let provider = dir.join("provider.sh");
        std::fs::write(&provider, format!("#!/bin/sh\n{script}\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&provider, std::fs::Permissions::from_mode(0o755)).unwrap();
        Settings {
            provider: Some(provider.to_string_lossy().into_owned()),
            elfs: Some("/elfs".into()),
            slot_dir: dir.to_string_lossy().into_owned(),
            model: "/m/x.gguf".into(),
            backend_url: "http://127.0.0.1:1".into(),
            timeout_s: 5.0,
            prefill_server: None,
        }
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("onebit-hybrid-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const WRITES_STATE: &str = r#"while [ $# -gt 0 ]; do case $1 in --tokens) t=$2;; --out) o=$2;; --model) m=$2;; --elfs) e=$2;; esac; shift 2; done
printf '%s %s %s %s\n' "$(tr '\n' ,  < $t)" "$m" "$e" "$ONEBIT_HYBRID_BACKEND_URL" > "$ONEBIT_HYBRID_SLOT_DIR/args"
touch "$ONEBIT_HYBRID_SLOT_DIR/$o"; echo '{"n_tokens":3,"argmax":4,"prefill_ms":7}'"#;

    #[test]
    fn a_chat_is_templated_tokenized_prefilled_restored_and_sent_to_slot_0() {
        let d = dir("chat");
        let backend = Backend {
            restored: 3,
            seen: Mutex::new(Vec::new()),
        };
        let request = ForwardRequest {
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            body: r#"{"messages":[{"role":"user","content":"hi"}],"stream":true}"#.into(),
            ..Default::default()
        };
        let done = run(&settings(&d, WRITES_STATE), &request, &backend, 1).unwrap();
        let body: Value = serde_json::from_str(&done.body).unwrap();
        assert_eq!(body["id_slot"], 0);
        assert_eq!(body["cache_prompt"], true);
        assert_eq!(body["stream"], true);
        assert_eq!(
            (done.n_tokens, done.prefill_ms, done.restore_ms),
            (3, 7.0, 2.5)
        );
        let args = std::fs::read_to_string(d.join("args")).unwrap();
        assert_eq!(args.trim(), "1,5,9, /m/x.gguf /elfs http://127.0.0.1:1");
        let seen = backend.seen.lock().unwrap();
        assert!(seen[1].contains(r#""add_special":true"#), "{seen:?}");
        assert!(seen[1].contains(r#""parse_special":true"#), "{seen:?}");
        assert!(seen[2].starts_with("/slots/0?action=restore"), "{seen:?}");
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("hybrid-"))
            .collect();
        assert!(left.is_empty(), "the handoff's files are removed");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn each_failure_is_a_reason() {
        let d = dir("fail");
        let completion = |body: &str| ForwardRequest {
            method: "POST".into(),
            path: "/v1/completions".into(),
            body: body.into(),
            ..Default::default()
        };
        let good = completion(r#"{"prompt":"a b c"}"#);
        let backend = |restored| Backend {
            restored,
            seen: Mutex::new(Vec::new()),
        };
        let reason = |script: &str, request: &ForwardRequest, restored| {
            run(&settings(&d, script), request, &backend(restored), 2)
                .unwrap_err()
                .to_string()
        };
        let e = reason(WRITES_STATE, &completion(r#"{"prompt":[1,2]}"#), 3);
        assert!(e.contains("no text prompt"), "{e}");
        let e = reason(WRITES_STATE, &good, 2);
        assert!(e.contains("holds 2 tokens"), "{e}");
        let e = reason(r#"echo '{"n_tokens":4}'"#, &good, 3);
        assert!(e.contains("reported 4 tokens for a prompt of 3"), "{e}");
        let e = reason(r#"echo '{"n_tokens":3}'"#, &good, 3);
        assert!(e.contains("wrote no state file"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
