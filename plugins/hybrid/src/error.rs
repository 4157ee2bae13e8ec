//! The route's one error type: why a handoff did not happen, so the backend prefills the
//! request itself.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use serde_json::Value;

/// Why one request's handoff failed (docs/hybrid.md). None reaches the client: the forward
/// thread prints it as the fallback's reason, in one line, and relays the request as it came
/// ([`HybridRoute::forward`](crate::HybridRoute), the one place it is displayed). The line
/// includes the cause's own text, so [`std::error::Error::source`] gives none.
#[derive(Debug)]
pub enum HybridError {
    /// No provider program is named.
    NoProvider,
    /// The request body is not JSON.
    BodyNotJson(serde_json::Error),
    /// The request body is JSON but not an object.
    BodyNotObject,
    /// The request has no text prompt to hand over; the text says what it has instead.
    NoTextPrompt(&'static str),
    /// The backend templated the chat without giving a prompt.
    NoTemplatedPrompt,
    /// The backend's `/tokenize` answered without a token list.
    NoTokenList,
    /// A token id in `/tokenize`'s answer is not a number.
    BadTokenId(Value),
    /// The prompt tokenizes to nothing.
    NoTokens,
    /// A call the handoff makes on backend 0 failed: the host's reason it got no reply
    /// (`status` None), or the backend's status and message.
    Backend {
        call: BackendCall,
        status: Option<u16>,
        message: String,
    },
    /// The prompt's ids file cannot be written.
    WriteIds { path: PathBuf, source: io::Error },
    /// The provider program cannot be started.
    ProviderStart { program: String, source: io::Error },
    /// The provider's exit cannot be waited for.
    ProviderWait(io::Error),
    /// The provider outran its time limit and was stopped.
    ProviderTimeout(Duration),
    /// The provider exited unsuccessfully.
    ProviderFailed(ExitStatus),
    /// The provider printed nothing on stdout.
    ProviderNoReport,
    /// The provider's last stdout line is not its JSON report.
    ProviderBadReport(serde_json::Error),
    /// The provider prefilled another number of tokens than the prompt has.
    TokenCount { reported: u64, prompt: usize },
    /// The provider wrote no state file where it was told to.
    NoStateFile(PathBuf),
    /// Slot 0 holds another number of tokens than the prompt's after the restore.
    Restored { held: u64, prompt: usize },
}

/// The calls a handoff makes on backend 0, each named as its failure says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendCall {
    /// `/apply-template`: the chat as a prompt.
    Template,
    /// `/tokenize`: the prompt's ids.
    Tokenize,
    /// `/slots/0?action=restore`: the provider's state into slot 0.
    Restore,
}

impl fmt::Display for BackendCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendCall::Template => "the backend could not template the chat",
            BackendCall::Tokenize => "the backend could not tokenize the prompt",
            BackendCall::Restore => "the restore into slot 0 failed",
        })
    }
}

impl fmt::Display for HybridError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HybridError::NoProvider => f.write_str("no prefill provider is named"),
            HybridError::BodyNotJson(e) => write!(f, "the body is not JSON ({e})"),
            HybridError::BodyNotObject => f.write_str("the body is not a JSON object"),
            HybridError::NoTextPrompt(why) => write!(f, "no text prompt ({why})"),
            HybridError::NoTemplatedPrompt => f.write_str("the backend's template gave no prompt"),
            HybridError::NoTokenList => f.write_str("the backend's /tokenize gave no tokens"),
            HybridError::BadTokenId(t) => write!(f, "a token id is not a number: {t}"),
            HybridError::NoTokens => f.write_str("the prompt has no tokens"),
            HybridError::Backend {
                call,
                status: None,
                message,
            } => write!(f, "{call}: {message}"),
            HybridError::Backend {
                call,
                status: Some(status),
                message,
            } => write!(f, "{call}: status {status}: {message}"),
            HybridError::WriteIds { path, source } => {
                write!(f, "cannot write {} ({source})", path.display())
            }
            HybridError::ProviderStart { program, source } => {
                write!(f, "the provider {program} could not start ({source})")
            }
            HybridError::ProviderWait(e) => {
                write!(f, "the provider could not be waited for ({e})")
            }
            HybridError::ProviderTimeout(limit) => write!(
                f,
                "the provider did not finish within {} s (ONEBIT_HYBRID_PREFILL_TIMEOUT_S) and was stopped",
                limit.as_secs_f64()
            ),
            HybridError::ProviderFailed(status) => write!(f, "the provider failed ({status})"),
            HybridError::ProviderNoReport => {
                f.write_str("the provider printed no JSON line on stdout")
            }
            HybridError::ProviderBadReport(e) => write!(
                f,
                "the provider's last stdout line is not its JSON report ({e})"
            ),
            HybridError::TokenCount { reported, prompt } => write!(
                f,
                "the provider reported {reported} tokens for a prompt of {prompt}"
            ),
            HybridError::NoStateFile(path) => {
                write!(f, "the provider wrote no state file ({})", path.display())
            }
            HybridError::Restored { held, prompt } => write!(
                f,
                "slot 0 holds {held} tokens after the restore, not the prompt's {prompt}"
            ),
        }
    }
}

impl std::error::Error for HybridError {}
