//! The add-on's one error type, and the one place an error becomes an OpenAI-shaped body.

use onebit_plugin_api::{RouteError, error_body};

/// What went wrong, as one line for the user, and whose fault it is (which picks the status
/// a reply carries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InprocError {
    /// The request's fault (a body the route cannot read, a prompt the model cannot take):
    /// answered 400.
    Request(String),
    /// llama.cpp, its libraries or the engine thread failed: answered 500.
    Engine(String),
    /// A path the route does not answer in process: answered 501.
    NotServed(String),
    /// No model is loaded: answered 503.
    NotLoaded(String),
}

impl InprocError {
    /// The HTTP status of a reply that carries this error.
    pub fn status(&self) -> u16 {
        match self {
            InprocError::Request(_) => 400,
            InprocError::Engine(_) => 500,
            InprocError::NotServed(_) => 501,
            InprocError::NotLoaded(_) => 503,
        }
    }

    /// The reply's body: `{"error":{"code","message","type"}}`, as llama-server shapes it.
    pub fn body(&self) -> String {
        let error_type = match self {
            InprocError::Request(_) => "invalid_request_error",
            InprocError::Engine(_) | InprocError::NotServed(_) | InprocError::NotLoaded(_) => {
                "server_error"
            }
        };
        error_body(self.status(), error_type, &self.to_string())
    }
}

impl std::fmt::Display for InprocError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InprocError::Request(message)
            | InprocError::Engine(message)
            | InprocError::NotServed(message)
            | InprocError::NotLoaded(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for InprocError {}

/// What the host makes of a failed `start`, or of a reply cut off after its head: the line.
impl From<InprocError> for RouteError {
    fn from(error: InprocError) -> RouteError {
        RouteError::new(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::InprocError;

    #[test]
    fn each_kind_answers_its_status_in_the_openai_shape() {
        let cases = [
            (
                InprocError::Request("bad".into()),
                400,
                "invalid_request_error",
            ),
            (InprocError::Engine("broke".into()), 500, "server_error"),
            (InprocError::NotServed("no".into()), 501, "server_error"),
            (InprocError::NotLoaded("wait".into()), 503, "server_error"),
        ];
        for (error, status, error_type) in cases {
            assert_eq!(error.status(), status);
            let body: serde_json::Value = serde_json::from_str(&error.body()).unwrap();
            assert_eq!(
                body,
                serde_json::json!({"error": {
                    "code": status, "message": error.to_string(), "type": error_type
                }})
            );
        }
    }
}
