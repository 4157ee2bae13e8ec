//! The soak's clients: one request of each kind over a fresh loopback connection, read as a
//! client would (to its close, slowly, or up to its first event), and what the replies say.

use super::*;

/// Send one request of `kind`; its status (0: no reply) and whether a stream read to its end
/// differed from `reference`.
pub(super) fn one(port: u16, kind: Kind, prompt: &str, reference: &str) -> (u16, bool) {
    match kind {
        Kind::StreamedChat => {
            let reply = exchange(port, &chat_request(prompt, true, "127.0.0.1"), None);
            let text = streamed_content(&reply);
            (status_of(&reply), text.as_deref() != Some(reference))
        }
        Kind::SlowReader => {
            let reply = exchange(
                port,
                &chat_request(prompt, true, "127.0.0.1"),
                Some(Duration::from_millis(20)),
            );
            let text = streamed_content(&reply);
            (status_of(&reply), text.as_deref() != Some(reference))
        }
        Kind::WholeChat => {
            let reply = exchange(port, &chat_request(prompt, false, "127.0.0.1"), None);
            let text = whole_content(&reply);
            (status_of(&reply), text.as_deref() != Some(reference))
        }
        Kind::Completion => {
            let body = format!(
                r#"{{"prompt":{},"max_tokens":16,"temperature":0}}"#,
                serde_json::Value::from(prompt)
            );
            (
                status_of(&exchange(
                    port,
                    &post("/v1/completions", &body, "127.0.0.1"),
                    None,
                )),
                false,
            )
        }
        Kind::Embeddings => {
            let body = format!(r#"{{"input":{}}}"#, serde_json::Value::from(prompt));
            (
                status_of(&exchange(
                    port,
                    &post("/v1/embeddings", &body, "127.0.0.1"),
                    None,
                )),
                false,
            )
        }
        Kind::LeavesMidStream => {
            let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)) else {
                return (0, false);
            };
            let _ = tcp.set_read_timeout(Some(REPLY_WITHIN));
            let _ = tcp.write_all(&chat_request(prompt, true, "127.0.0.1"));
            (status_of(&read_to_first_event(&mut tcp)), false)
        }
        Kind::ForeignHost => (
            status_of(&exchange(
                port,
                &chat_request(prompt, false, "evil.example"),
                None,
            )),
            false,
        ),
        Kind::NotJson => (
            status_of(&exchange(
                port,
                &post("/v1/chat/completions", "{not json", "127.0.0.1"),
                None,
            )),
            false,
        ),
        Kind::ChunkedTooLarge => (chunked_past_the_limit(port), false),
        Kind::NoSuchRoute => (
            status_of(&exchange(port, &get_request("/v1/no-such-route"), None)),
            false,
        ),
        Kind::TooLarge => {
            let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 999999999999\r\nConnection: close\r\n\r\n{";
            (status_of(&exchange(port, head.as_bytes(), None)), false)
        }
    }
}

/// A chat whose chunked body grows past serve's limit (`SOAK_BODY_LIMIT`), 64 KiB a chunk, until
/// serve answers or stops reading; the reply's status (0: none).
fn chunked_past_the_limit(port: u16) -> u16 {
    let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)) else {
        return 0;
    };
    let _ = tcp.set_read_timeout(Some(REPLY_WITHIN));
    let _ = tcp.set_write_timeout(Some(REPLY_WITHIN));
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    if tcp.write_all(head.as_bytes()).is_err() {
        return 0;
    }
    let mut chunk = format!("{:x}\r\n", 64 << 10).into_bytes();
    chunk.extend(std::iter::repeat_n(b' ', 64 << 10));
    chunk.extend_from_slice(b"\r\n");
    // One chunk past the limit, then nothing more (no last chunk): serve answers once the body
    // passes it, having read what was sent.
    for _ in 0..SOAK_BODY_LIMIT / (64 << 10) + 1 {
        if tcp.write_all(&chunk).is_err() {
            break;
        }
    }
    let mut reply = Vec::new();
    let _ = tcp.read_to_end(&mut reply);
    status_of(&String::from_utf8_lossy(&reply))
}

/// Read a streamed reply up to its first event (or the connection's end), and return what
/// was read: the head and that event.
pub(super) fn read_to_first_event(tcp: &mut TcpStream) -> String {
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        match tcp.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&seen).into_owned()
}

pub(super) fn post(path: &str, body: &str, host: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

pub(super) fn chat_request(prompt: &str, stream: bool, host: &str) -> Vec<u8> {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream,
    })
    .to_string();
    post("/v1/chat/completions", &body, host)
}

pub(super) fn get_request(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").into_bytes()
}

pub(super) fn get_request_keep_alive(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").into_bytes()
}

/// Send `request` on a fresh connection and read the reply to its close (`pace`: sleep that
/// long after each 256 bytes read, a slow reader).
pub(super) fn exchange(port: u16, request: &[u8], pace: Option<Duration>) -> String {
    let Ok(mut tcp) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = tcp.set_read_timeout(Some(REPLY_WITHIN));
    if tcp.write_all(request).is_err() {
        return String::new();
    }
    let mut out = Vec::new();
    let mut buf = vec![0u8; if pace.is_some() { 256 } else { 16384 }];
    loop {
        match tcp.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
        if let Some(p) = pace {
            std::thread::sleep(p);
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn status_of(reply: &str) -> u16 {
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The body of an HTTP reply, de-chunked when it is chunked.
pub(super) fn body_of(reply: &str) -> String {
    let Some((head, body)) = reply.split_once("\r\n\r\n") else {
        return String::new();
    };
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body.to_string();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].strip_prefix("\r\n").unwrap_or("");
    }
    out
}

pub(super) fn whole_content(reply: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(&body_of(reply)).ok()?;
    v["choices"][0]["message"]["content"]
        .as_str()
        .map(str::to_string)
}

/// A stream's text, when it ended with `[DONE]`.
pub(super) fn streamed_content(reply: &str) -> Option<String> {
    let body = body_of(reply);
    let mut text = String::new();
    let mut done = false;
    for line in BufReader::new(body.as_bytes())
        .lines()
        .map_while(Result::ok)
    {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(data).ok()?;
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    done.then_some(text)
}

/// The value of an unlabelled series in a /metrics text.
pub(super) fn series(metrics: &str, name: &str) -> Option<u64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|n| n.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

#[cfg(test)]
mod tests {
    use super::series;

    #[test]
    fn a_series_is_read_by_its_whole_name() {
        let text = "# TYPE onebit_runtime_tasks gauge\nonebit_runtime_tasks_max 9\nonebit_runtime_tasks 212\nonebit_inproc_prompt_cache_bytes 1.5e6\n";
        assert_eq!(series(text, "onebit_runtime_tasks"), Some(212));
        assert_eq!(
            series(text, "onebit_inproc_prompt_cache_bytes"),
            Some(1_500_000)
        );
        assert_eq!(series(text, "onebit_missing"), None);
    }
}
