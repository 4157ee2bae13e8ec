//! The persistent prompt cache's calls to its backend (llama-server's `/apply-template`,
//! `/tokenize`, `/slots`), with serve's probe client and a time limit each.

use super::*;

impl PromptCache {
    pub(super) async fn get_json(&self, path: &str) -> Result<Value, String> {
        let request = hyper::Request::get(format!("http://127.0.0.1:{}{path}", self.port))
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        self.call(request, CALL_TIMEOUT).await
    }

    pub(super) async fn post_json(
        &self,
        path: &str,
        body: Bytes,
        limit: Duration,
    ) -> Result<Value, String> {
        let request = hyper::Request::post(format!("http://127.0.0.1:{}{path}", self.port))
            .header("content-type", "application/json")
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        self.call(request, limit).await
    }

    /// `POST /slots/<slot>?action=<save|restore>` of the state file `file` (a name in the
    /// backend's `--slot-save-path`): it reads or writes the whole state.
    pub(super) async fn slot_file_action(
        &self,
        slot: usize,
        action: &str,
        file: &str,
    ) -> Result<Value, String> {
        let request = serde_json::json!({ "filename": file }).to_string();
        self.post_json(
            &format!("/slots/{slot}?action={action}"),
            Bytes::from(request),
            STATE_TIMEOUT,
        )
        .await
    }

    async fn call(
        &self,
        request: hyper::Request<Full<Bytes>>,
        limit: Duration,
    ) -> Result<Value, String> {
        let call = async {
            let reply = self
                .client
                .request(request)
                .await
                .map_err(|e| e.to_string())?;
            let status = reply.status();
            let body = reply
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if status.is_success() {
                Ok(value)
            } else {
                let message = value["error"]["message"]
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| String::from_utf8_lossy(&body).chars().take(200).collect());
                Err(format!("status {}: {message}", status.as_u16()))
            }
        };
        tokio::time::timeout(limit, call)
            .await
            .map_err(|_| format!("no answer within {} s", limit.as_secs()))?
    }
}
