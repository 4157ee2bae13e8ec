//! A stand-in for Lemonade's OpenAI API, for `--pm`'s delegations: answers each chat as told
//! and records what it was asked.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How [`FakeLemonade`] answers a chat.
#[derive(Clone, Debug)]
pub enum LemonadeAnswer {
    /// 200 with this text as `choices[0].message.content`.
    Text(String),
    /// This status with `{"error":{"message": …}}`.
    Status(u16, String),
    /// 200 with an empty content.
    Empty,
    /// The request is read and recorded, and no answer comes for 30 s (a delegation in flight).
    Hold,
}

/// A stand-in for Lemonade's chat route, for `--pm`: a loopback HTTP/1.1 server on a thread
/// that records each request body it receives and answers as told. Dropping it stops it.
pub struct FakeLemonade {
    pub port: u16,
    answer: Arc<Mutex<LemonadeAnswer>>,
    received: Arc<Mutex<Vec<(String, serde_json::Value)>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl FakeLemonade {
    pub fn start(answer: LemonadeAnswer) -> FakeLemonade {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let port = listener.local_addr().unwrap().port();
        let answer = Arc::new(Mutex::new(answer));
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (a, r, s) = (answer.clone(), received.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(std::sync::atomic::Ordering::Acquire) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let answer = a.lock().unwrap().clone();
                lemonade_reply(conn, &answer, &r);
            }
        });
        FakeLemonade {
            port,
            answer,
            received,
            stop,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn set(&self, answer: LemonadeAnswer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// Each request so far: (path, JSON body).
    pub fn received(&self) -> Vec<(String, serde_json::Value)> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for FakeLemonade {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let _ = std::net::TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn lemonade_reply(
    mut conn: std::net::TcpStream,
    answer: &LemonadeAnswer,
    received: &Mutex<Vec<(String, serde_json::Value)>>,
) {
    use std::io::Write;
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(conn.try_clone().expect("a socket clone"));
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut length = 0usize;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.trim().eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    received.lock().unwrap().push((
        path,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    ));
    let (status, reply) = match answer {
        LemonadeAnswer::Hold => {
            std::thread::sleep(Duration::from_secs(30));
            return;
        }
        LemonadeAnswer::Text(text) => (
            200,
            serde_json::json!({"choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": text}}]}),
        ),
        LemonadeAnswer::Empty => (
            200,
            serde_json::json!({"choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": ""}}]}),
        ),
        LemonadeAnswer::Status(code, message) => {
            (*code, serde_json::json!({"error": {"message": message}}))
        }
    };
    let reply = reply.to_string();
    let _ = write!(
        conn,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
        reply.len()
    );
}
