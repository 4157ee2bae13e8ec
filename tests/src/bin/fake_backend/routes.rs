//! The fake backend's small routes: the model list and props, /metrics, tokenize and
//! detokenize, the chat template, embeddings and rerank.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::{ErrorKind, State, error, hang};
use crate::text;

pub(super) fn models(st: &State) -> Response {
    let name = &st.cfg.model_name;
    let owned_by = if st.cfg.ds4 { "ds4" } else { "llamacpp" };
    axum::Json(json!({
        "models": [{"name": name, "model": name}],
        "object": "list",
        "data": [{
            "id": name,
            "object": "model",
            "created": st.started_unix,
            "owned_by": owned_by,
            "meta": {"n_ctx": st.cfg.n_ctx, "n_vocab": text::N_VOCAB},
        }],
    }))
    .into_response()
}

pub(super) fn props(st: &State) -> Response {
    axum::Json(json!({
        "default_generation_settings": {"n_ctx": st.cfg.n_ctx, "params": {}},
        "total_slots": st.total_slots(),
        "model_alias": st.cfg.model_name,
        "model_path": st.cfg.model_path,
        "modalities": {"vision": false, "audio": false},
        "endpoint_slots": st.cfg.slots_endpoint,
        "endpoint_props": false,
        "endpoint_metrics": st.cfg.metrics,
        "chat_template": "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}<|assistant|>\n",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "build_info": crate::BUILD_INFO,
        "is_sleeping": false,
    }))
    .into_response()
}

pub(super) async fn metrics(st: &State) -> Response {
    if !st.cfg.metrics {
        return error(
            ErrorKind::NotSupported,
            "This server does not support metrics endpoint. Start it with `--metrics`",
        );
    }
    if st.hung.load(Ordering::Acquire) {
        return hang().await;
    }
    let c = &st.counters;
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let prompt_s = load(&c.prompt_us) as f64 / 1e6;
    let predicted_s = load(&c.predicted_us) as f64 / 1e6;
    let rate = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let series: [(&str, &str, &str, f64); 9] = [
        (
            "prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed.",
            load(&c.prompt_tokens) as f64,
        ),
        (
            "prompt_seconds_total",
            "counter",
            "Prompt process time",
            prompt_s,
        ),
        (
            "tokens_predicted_total",
            "counter",
            "Number of generation tokens processed.",
            load(&c.predicted_tokens) as f64,
        ),
        (
            "tokens_predicted_seconds_total",
            "counter",
            "Predict process time",
            predicted_s,
        ),
        (
            "n_decode_total",
            "counter",
            "Total number of llama_decode() calls",
            load(&c.n_decode) as f64,
        ),
        (
            "prompt_tokens_seconds",
            "gauge",
            "Average prompt throughput in tokens/s.",
            rate(load(&c.prompt_tokens), prompt_s),
        ),
        (
            "predicted_tokens_seconds",
            "gauge",
            "Average generation throughput in tokens/s.",
            rate(load(&c.predicted_tokens), predicted_s),
        ),
        (
            "requests_processing",
            "gauge",
            "Number of requests processing.",
            st.processing.load(Ordering::Relaxed) as f64,
        ),
        (
            "requests_deferred",
            "gauge",
            "Number of requests deferred.",
            st.deferred.load(Ordering::Relaxed) as f64,
        ),
    ];
    let mut out = String::with_capacity(1024);
    for (name, kind, help, value) in series {
        let _ = write!(
            out,
            "# HELP llamacpp:{name} {help}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
        );
    }
    let mut res = out.into_response();
    let headers = res.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    headers.insert(
        "process-start-time-unix",
        HeaderValue::from(st.started_unix),
    );
    res
}

pub(super) fn tokenize(st: &State, body: &Value) -> Response {
    let Some(prompt) = body.get("content").and_then(text::prompt) else {
        return error(ErrorKind::InvalidRequest, "\"content\" must be provided");
    };
    let add_special = body
        .get("add_special")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let with_pieces = body
        .get("with_pieces")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let words: Vec<&str> = prompt.text.split_whitespace().collect();
    {
        let mut vocab = st.vocab.lock().unwrap_or_else(|p| p.into_inner());
        for (&id, word) in prompt.tokens.iter().zip(&words) {
            vocab.entry(id).or_insert_with(|| (*word).to_owned());
        }
    }
    let mut tokens: Vec<Value> = Vec::with_capacity(prompt.tokens.len() + 1);
    if add_special {
        tokens.push(if with_pieces {
            json!({"id": text::BOS_ID, "piece": "<s>"})
        } else {
            json!(text::BOS_ID)
        });
    }
    for (i, &id) in prompt.tokens.iter().enumerate() {
        tokens.push(if with_pieces {
            let word = words.get(i).copied().unwrap_or_default();
            let piece = if i == 0 {
                word.to_owned()
            } else {
                format!(" {word}")
            };
            json!({"id": id, "piece": piece})
        } else {
            json!(id)
        });
    }
    axum::Json(json!({"tokens": tokens})).into_response()
}

pub(super) fn detokenize(st: &State, body: &Value) -> Response {
    let Some(ids) = body.get("tokens").and_then(Value::as_array) else {
        return error(ErrorKind::InvalidRequest, "\"tokens\" must be provided");
    };
    let vocab = st.vocab.lock().unwrap_or_else(|p| p.into_inner());
    let words: Vec<String> = ids
        .iter()
        .filter_map(Value::as_u64)
        .filter(|&id| id != u64::from(text::BOS_ID))
        .map(|id| {
            u32::try_from(id)
                .ok()
                .and_then(|id| vocab.get(&id).cloned())
                .unwrap_or_else(|| format!("[{id}]"))
        })
        .collect();
    axum::Json(json!({"content": words.join(" ")})).into_response()
}

pub(super) fn apply_template(body: &Value) -> Response {
    let Some(turns) = body.get("messages").and_then(text::chat_turns) else {
        return error(ErrorKind::InvalidRequest, "'messages' is required");
    };
    axum::Json(json!({"prompt": text::render(&turns)})).into_response()
}

/// Inputs of an embeddings request: a string, token ids, or an array of either.
pub(super) fn embedding_inputs(input: &Value) -> Option<Vec<text::Prompt>> {
    match input {
        Value::Array(items) if !items.is_empty() && !items.iter().any(Value::is_number) => {
            items.iter().map(text::prompt).collect()
        }
        other => text::prompt(other).map(|p| vec![p]),
    }
}

pub(super) async fn embeddings(st: &State, body: &Value) -> Response {
    if st.hung.load(Ordering::Acquire) {
        return hang().await;
    }
    let Some(inputs) = body.get("input").and_then(embedding_inputs) else {
        return error(ErrorKind::InvalidRequest, "\"input\" must be provided");
    };
    let n_tokens: usize = inputs.iter().map(|p| p.tokens.len()).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, p)| json!({"embedding": text::embedding(&p.text), "index": i, "object": "embedding"}))
        .collect();
    axum::Json(json!({
        "model": st.cfg.model_name,
        "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "data": data,
    }))
    .into_response()
}

pub(super) async fn rerank(st: &State, body: &Value) -> Response {
    if st.hung.load(Ordering::Acquire) {
        return hang().await;
    }
    let Some(query) = body.get("query").and_then(Value::as_str) else {
        return error(ErrorKind::InvalidRequest, "\"query\" must be provided");
    };
    // Jina sends `documents`, TEI sends `texts` and gets a bare array back.
    let tei = body.get("documents").is_none() && body.get("texts").is_some();
    let Some(docs) = body
        .get("documents")
        .or_else(|| body.get("texts"))
        .and_then(Value::as_array)
    else {
        return error(ErrorKind::InvalidRequest, "\"documents\" must be provided");
    };
    let docs: Vec<String> = docs
        .iter()
        .map(|d| match d {
            Value::Object(o) => o.get("text").map(text::content_text).unwrap_or_default(),
            other => text::content_text(other),
        })
        .collect();
    let mut scored: Vec<(usize, f64)> = docs
        .iter()
        .enumerate()
        .map(|(i, d)| (i, text::relevance(query, d)))
        .collect();
    scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if let Some(top_n) = body.get("top_n").and_then(Value::as_u64) {
        scored.truncate(usize::try_from(top_n).unwrap_or(usize::MAX));
    }
    if tei {
        let return_text = body
            .get("return_text")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let out: Vec<Value> = scored
            .iter()
            .map(|&(i, s)| {
                if return_text {
                    json!({"index": i, "score": s, "text": docs[i]})
                } else {
                    json!({"index": i, "score": s})
                }
            })
            .collect();
        return axum::Json(out).into_response();
    }
    let n_tokens: usize = text::tokenize(query).count() * docs.len()
        + docs
            .iter()
            .map(|d| text::tokenize(d).count())
            .sum::<usize>();
    let results: Vec<Value> = scored
        .iter()
        .map(|&(i, s)| json!({"index": i, "relevance_score": s}))
        .collect();
    axum::Json(json!({
        "model": st.cfg.model_name,
        "object": "list",
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "results": results,
    }))
    .into_response()
}
