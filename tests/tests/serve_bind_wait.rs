//! How long serve waits for a backend to bind its port before it answers (its own `/health`
//! included): by the backend's CPU time, 2 s of it, so a starved machine's lost seconds do not
//! count (serve_port_lost.rs), and 20 s by the clock for a backend that neither binds nor runs.

use std::path::Path;
use std::time::{Duration, Instant};

use onebit_tests::*;

/// serve on a "llama-server" that runs `body` (a shell script) and never listens.
fn serve_on_script(dir: &Path, body: &str) -> Serve {
    let backend = shell_script(dir, "llama-server", body);
    serve_cpu_engine(dir, &backend, &[], &[])
}

#[test]
fn a_backend_that_runs_without_binding_is_waited_for_two_seconds_of_its_cpu() {
    let dir = temp_dir("bind-wait-cpu");
    let started = Instant::now();
    let serve = serve_on_script(&dir, "while :; do :; done");
    // 2 s of the loop's CPU, well before the clock's 20 s.
    assert!(
        serve.wait_health(503, Duration::from_secs(12)),
        "serve did not answer while its backend ran without binding: {}",
        serve.output()
    );
    // A request sent meanwhile waits for serve's answer, so the time is judged here.
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(12),
        "answered after {waited:?}"
    );
}

#[test]
fn a_backend_that_neither_binds_nor_runs_is_waited_for_twenty_seconds() {
    let dir = temp_dir("bind-wait-clock");
    let started = Instant::now();
    let serve = serve_on_script(&dir, "exec sleep 60");
    assert!(
        serve.wait_health(503, Duration::from_secs(35)),
        "serve never answered beside a backend asleep before it binds: {}",
        serve.output()
    );
    let waited = started.elapsed();
    // A sleeping backend's CPU time stays near zero: only the clock ends the wait.
    assert!(
        waited >= Duration::from_secs(18),
        "answered after {waited:?}"
    );
}
