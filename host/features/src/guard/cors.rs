//! The user's CORS policy (`--cors-origins`, `--cors-methods`, `--cors-headers`,
//! `--[no-]cors-credentials`, llama-server's flags, which the drop-in hands to serve): the
//! origins a page may write from and read replies for, beyond the guard's loopback and own
//! origins. Without `--cors-origins` there is none and the guard stands alone (no CORS header
//! leaves serve). Set once before the first request; read by both relay engines and the
//! router without a lock.

use super::rules::is_loopback_origin;

/// What the user allowed, as llama-server reads its flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cors {
    /// `*` (any origin), `localhost` (loopback origins, reflected), or the value to send as
    /// `Access-Control-Allow-Origin`: one origin or a comma list, each allowed.
    pub origins: String,
    pub methods: String,
    pub headers: String,
    pub credentials: bool,
}

impl Cors {
    /// The policy `serve`'s flags ask for; None without `--cors-origins`. Called once by
    /// `serve` before it listens.
    pub fn from_args(args: &onebit_command::cli::ServeArgs) -> Option<Cors> {
        let or_default =
            |v: &str, default: &str| if v.trim().is_empty() { default } else { v }.to_string();
        args.cors_origins.as_ref().map(|origins| Cors {
            origins: origins.clone(),
            methods: or_default(
                &args.cors_methods,
                onebit_command::cli::CORS_METHODS_DEFAULT,
            ),
            headers: or_default(
                &args.cors_headers,
                onebit_command::cli::CORS_HEADERS_DEFAULT,
            ),
            credentials: !args.no_cors_credentials,
        })
    }

    /// The same policy as llama-server's flags, for the llama-server serve starts, so the
    /// replies it relays carry the same headers serve's own do.
    pub fn backend_args(&self) -> Vec<String> {
        vec![
            "--cors-origins".to_string(),
            self.origins.clone(),
            "--cors-methods".to_string(),
            self.methods.clone(),
            "--cors-headers".to_string(),
            self.headers.clone(),
            if self.credentials {
                "--cors-credentials"
            } else {
                "--no-cors-credentials"
            }
            .to_string(),
        ]
    }

    /// Whether the user allowed writes from `origin` (the raw Origin value).
    pub fn allows(&self, origin: &[u8]) -> bool {
        let Ok(origin) = std::str::from_utf8(origin) else {
            return false;
        };
        match self.origins.trim() {
            "*" => true,
            "localhost" => is_loopback_origin(origin),
            list => list.split(',').any(|allowed| allowed.trim() == origin),
        }
    }

    /// The `Access-Control-Allow-Origin` value for a request with `origin`, as llama-server
    /// sets it: the origin echoed under `*` with credentials, a loopback origin echoed under
    /// `localhost`, else the configured value itself; None when none is sent.
    pub fn allow_origin(&self, origin: Option<&str>) -> Option<String> {
        match self.origins.trim() {
            "*" if self.credentials => origin.map(str::to_string),
            "localhost" => origin.filter(|o| is_loopback_origin(o)).map(str::to_string),
            value => Some(value.to_string()),
        }
    }

    /// The headers of llama-server's answer to an `OPTIONS` request (a preflight), beside
    /// [`Cors::allow_origin`]'s.
    pub fn preflight(&self) -> [(&'static str, String); 3] {
        [
            (
                "access-control-allow-credentials",
                if self.credentials { "true" } else { "false" }.to_string(),
            ),
            ("access-control-allow-methods", self.methods.clone()),
            ("access-control-allow-headers", self.headers.clone()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors(origins: &str, credentials: bool) -> Cors {
        Cors {
            origins: origins.to_string(),
            methods: onebit_command::cli::CORS_METHODS_DEFAULT.to_string(),
            headers: onebit_command::cli::CORS_HEADERS_DEFAULT.to_string(),
            credentials,
        }
    }

    #[test]
    fn the_origins_allowed_are_the_users() {
        let list = cors("https://app.example, https://b.example", true);
        assert!(list.allows(b"https://app.example"));
        assert!(list.allows(b"https://b.example"));
        assert!(!list.allows(b"https://evil.example"));
        assert!(!list.allows(b"https://app.example.evil"));
        let local = cors("localhost", true);
        assert!(local.allows(b"http://localhost:3000"));
        assert!(local.allows(b"http://[::1]"));
        assert!(!local.allows(b"http://localhost.evil.com"));
        assert!(!local.allows(b"http://notlocalhost"));
        assert!(cors("*", false).allows(b"http://anything.example"));
    }

    #[test]
    fn allow_origin_is_llama_servers() {
        let any = cors("*", true);
        assert_eq!(
            any.allow_origin(Some("http://x.example")).as_deref(),
            Some("http://x.example")
        );
        assert_eq!(cors("*", false).allow_origin(None).as_deref(), Some("*"));
        let local = cors("localhost", true);
        assert_eq!(local.allow_origin(Some("http://evil.com")), None);
        assert_eq!(
            local.allow_origin(Some("http://127.0.0.1:3000")).as_deref(),
            Some("http://127.0.0.1:3000")
        );
        assert_eq!(
            cors("https://a.example", true)
                .allow_origin(Some("https://b.example"))
                .as_deref(),
            Some("https://a.example")
        );
    }
}
