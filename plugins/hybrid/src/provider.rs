//! Running the prefill provider under the contract of docs/hybrid.md: its argv and
//! environment, its time limit (the spawner's stop sequence), and its last stdout line.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::error::HybridError;

/// What one run of the provider reported.
#[derive(Debug, PartialEq)]
pub struct Report {
    pub n_tokens: u64,
    /// The provider's own prefill time, when it gave one.
    pub prefill_ms: Option<f64>,
    /// From spawn to exit.
    pub wall_ms: f64,
}

/// The provider's last stdout line.
#[derive(Deserialize)]
struct Line {
    n_tokens: u64,
    #[serde(default)]
    prefill_ms: Option<f64>,
}

/// One invocation: the program, its arguments, the variables added to serve's environment.
pub struct Invocation<'a> {
    pub program: &'a str,
    pub args: Vec<String>,
    pub env: Vec<(&'static str, String)>,
    pub limit: Duration,
    pub grace: Duration,
}

/// Run the provider and wait for it, at most `limit` (then SIGTERM to its process group, and
/// SIGKILL after `grace`). Blocks; called on the forward thread. Its stderr is serve's. It is
/// started by the one spawner, so it dies with serve and leads its own process group (the
/// limit's stop reaches whatever it started).
pub fn run(invocation: &Invocation) -> Result<Report, HybridError> {
    let started = Instant::now();
    let mut command = Command::new(invocation.program);
    command
        .args(&invocation.args)
        .envs(invocation.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child =
        onebit_process::spawn(command).map_err(|source| HybridError::ProviderStart {
            program: invocation.program.to_string(),
            source,
        })?;
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let (out_tx, out_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        let _ = out_tx.send(text);
    });
    let status = match child.wait_timeout(invocation.limit) {
        Some(status) => {
            // What it started is stopped with it, even after a clean exit.
            child.signal_group(nix::sys::signal::Signal::SIGKILL as i32);
            status.map_err(HybridError::ProviderWait)?
        }
        None => {
            child.stop(invocation.grace);
            return Err(HybridError::ProviderTimeout(invocation.limit));
        }
    };
    let wall_ms = started.elapsed().as_secs_f64() * 1000.0;
    if !status.success() {
        return Err(HybridError::ProviderFailed(status));
    }
    let stdout = out_rx
        .recv_timeout(Duration::from_secs(1))
        .unwrap_or_default();
    let last = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .ok_or(HybridError::ProviderNoReport)?;
    let line: Line = serde_json::from_str(last.trim()).map_err(HybridError::ProviderBadReport)?;
    Ok(Report {
        n_tokens: line.n_tokens,
        prefill_ms: line.prefill_ms,
        wall_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, limit_ms: u64) -> Invocation<'static> {
        Invocation {
            program: "/bin/sh",
            args: vec!["-c".into(), script.into()],
            env: vec![("HYBRID_TEST", "1".into())],
            limit: Duration::from_millis(limit_ms),
            grace: Duration::from_millis(300),
        }
    }

    #[test]
    fn the_last_stdout_line_is_the_report() {
        let report = run(&sh(
            r#"echo progress; echo "{\"n_tokens\": 7, \"argmax\": 3, \"prefill_ms\": 1.5}""#,
            5000,
        ))
        .unwrap();
        assert_eq!(report.n_tokens, 7);
        assert_eq!(report.prefill_ms, Some(1.5));
        let report = run(&sh(r#"echo "{\"n_tokens\": $HYBRID_TEST}""#, 5000)).unwrap();
        assert_eq!((report.n_tokens, report.prefill_ms), (1, None));
    }

    #[test]
    fn a_failure_or_no_report_is_an_error() {
        let e = run(&sh("exit 3", 5000)).unwrap_err().to_string();
        assert!(e.contains("exit status: 3"), "{e}");
        let e = run(&sh("echo not json", 5000)).unwrap_err().to_string();
        assert!(e.contains("not its JSON report"), "{e}");
        let e = run(&sh("true", 5000)).unwrap_err().to_string();
        assert!(e.contains("no JSON line"), "{e}");
    }

    #[test]
    fn a_provider_that_ignores_sigterm_is_killed_after_the_grace() {
        let started = Instant::now();
        let e = run(&sh("trap '' TERM; sleep 30 & wait; sleep 30", 300))
            .unwrap_err()
            .to_string();
        assert!(e.contains("did not finish within 0.3 s"), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }
}
