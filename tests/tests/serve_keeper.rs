//! What a backend forks by itself (an engine's own helpers, with no parent-death signal) dies
//! with serve: on SIGTERM by the stop sequence's group signals, on `kill -9` of serve by
//! onebit-process's keeper. The fake backend stands in for the engine (`FAKE_FORK_CHILD`: a
//! child of its own that ignores SIGTERM).

use std::path::Path;
use std::time::Duration;

use nix::sys::signal::Signal;
use onebit_tests::{Serve, alive, dummy_model, kill9_leaves_nothing, temp_dir, wait_until};

/// serve on the fake backend, which forks a child of its own and writes its pid to the file
/// returned; ready, and the child started.
fn serve_with_a_forked_child(name: &str) -> (Serve, u32) {
    let dir = temp_dir(name);
    let model = dummy_model(&dir, "model.gguf");
    let pid_file = dir.join("forked.pid");
    let serve = Serve::with_fake(
        &model,
        &[],
        &[("FAKE_FORK_CHILD", pid_file.to_str().unwrap())],
    );
    serve.ready();
    let forked = read_pid(&pid_file);
    assert!(alive(forked), "the fake's own child is running");
    (serve, forked)
}

fn read_pid(path: &Path) -> u32 {
    assert!(
        wait_until(Duration::from_secs(10), || path.is_file()),
        "the fake backend wrote no {}",
        path.display()
    );
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .expect("a pid")
}

#[test]
fn kill_9_of_serve_kills_what_its_backend_forked_itself() {
    let (serve, forked) = serve_with_a_forked_child("keeper-kill9");
    // Records serve's whole tree (the fake and its child), kills serve with SIGKILL, and
    // fails naming each survivor 2 s later.
    kill9_leaves_nothing(serve);
    assert!(!alive(forked));
}

#[test]
fn sigterm_of_serve_kills_what_its_backend_forked_itself() {
    let (mut serve, forked) = serve_with_a_forked_child("keeper-sigterm");
    serve.signal(Signal::SIGTERM);
    let status = serve.wait_exit(Duration::from_secs(10));
    assert!(
        status.is_some_and(|s| s.success()),
        "serve exits 0 on SIGTERM: {status:?}\n{}",
        serve.output()
    );
    let gone = wait_until(Duration::from_secs(2), || !alive(forked));
    if !gone {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(forked as i32), Signal::SIGKILL);
    }
    assert!(gone, "the backend's own child outlived serve's stop");
}
