//! An impostor on the backend's port: serve becomes ready only against the backend it started
//! (the listening socket belongs to the backend's process or a descendant, from /proc), and
//! exits 1 otherwise, with a line ending in the original's words.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use onebit_tests::*;

/// The backend port serve announced in its "starting ... (port N)" line.
fn backend_port(serve: &Serve) -> u16 {
    assert!(
        serve.wait_output("(port ", Duration::from_secs(10)),
        "{}",
        serve.output()
    );
    let out = serve.output();
    let at = out.find("(port ").unwrap() + "(port ".len();
    out[at..].split(')').next().unwrap().parse().unwrap()
}

#[test]
fn a_process_listening_on_the_backends_port_is_refused_with_exit_1() {
    let dir = temp_dir("impostor");
    // A "backend" that starts and never listens, as one that failed to bind would.
    let silent = shell_script(&dir, "silent-server", "exec sleep 60");
    let mut serve = serve_cpu_engine(&dir, &silent, &[], &[]);
    let port = backend_port(&serve);
    // This test process takes the port and answers every request 200, as a stray server would.
    let impostor = TcpListener::bind(("127.0.0.1", port)).expect("the backend port is free");
    std::thread::spawn(move || {
        for mut conn in impostor.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = conn.read(&mut buf);
            let body = r#"{"status":"ok"}"#;
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let exit = serve.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| {
        panic!(
            "serve became ready against the impostor: {}",
            serve.output()
        )
    });
    let out = serve.output();
    assert_eq!(exit.code(), Some(1), "{out}");
    let line = out
        .lines()
        .find(|l| l.ends_with("not from the backend serve started"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        line.starts_with(&format!(
            "1bit serve: port {port}, which serve gave its llama-server, is held by another process ("
        )) && line.contains(&format!("pid {}", std::process::id())),
        "{line}"
    );
    assert!(!out.contains("ready on"), "{out}");
}

#[test]
fn a_wrapper_whose_child_listens_is_the_backend() {
    let dir = temp_dir("impostor-wrapper");
    // No exec: the engine runs as the wrapper's child, and its socket is still the backend's.
    // The wrapper passes SIGTERM (serve's stop, or its death signal) on to the engine.
    let wrapper = shell_script(
        &dir,
        "wrapper",
        &format!(
            "\"{}\" \"$@\" &\nchild=$!\ntrap 'kill $child; wait $child; exit 0' TERM\nwait $child",
            fake_backend().display()
        ),
    );
    let mut serve = serve_cpu_engine(&dir, &wrapper, &[], &[]);
    serve.ready();
    assert_eq!(
        post(
            &serve.url("/v1/chat/completions"),
            r#"{"messages":[{"role":"user","content":"hi"}]}"#
        )
        .0,
        200
    );
    let engine = children_of(serve.pid())
        .into_iter()
        .flat_map(children_of)
        .collect::<Vec<_>>();
    assert_eq!(engine.len(), 1, "the wrapper runs the engine as its child");
    serve.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(serve.wait_exit(Duration::from_secs(20)).is_some());
    assert!(
        wait_until(Duration::from_secs(10), || !alive(engine[0])),
        "the engine outlived serve"
    );
}

#[test]
fn a_process_that_takes_the_port_while_serving_ends_serve_with_exit_1() {
    let dir = temp_dir("impostor-later");
    let trigger = dir.join("let-go");
    let released = dir.join("released");
    // A backend that serves until told to let go of its port, then lives on without it (as an
    // engine that closed its listener would), so only the port's new holder answers there.
    let wrapper = shell_script(
        &dir,
        "letting-go",
        &format!(
            "\"{fake}\" \"$@\" &\nchild=$!\ntrap 'kill $child 2>/dev/null; exit 0' TERM\n\
             while [ ! -e \"{trigger}\" ]; do sleep 0.1; done\n\
             kill $child; wait $child\ntouch \"{released}\"\nwhile :; do sleep 0.2; done",
            fake = fake_backend().display(),
            trigger = trigger.display(),
            released = released.display(),
        ),
    );
    let mut serve = serve_cpu_engine(&dir, &wrapper, &[], &[]);
    let port = backend_port(&serve);
    serve.ready();
    std::fs::write(&trigger, b"").unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || released.exists()),
        "the backend did not let go of its port"
    );
    // This test process takes the port over and answers 200, as a stray server would.
    let impostor = TcpListener::bind(("127.0.0.1", port)).expect("the backend port is free");
    std::thread::spawn(move || {
        for mut conn in impostor.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = conn.read(&mut buf);
            let body = r#"{"status":"ok"}"#;
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let exit = serve.wait_exit(Duration::from_secs(20)).unwrap_or_else(|| {
        panic!(
            "serve kept serving with another process on its backend's port: {}",
            serve.output()
        )
    });
    let out = serve.output();
    assert_eq!(exit.code(), Some(1), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with(&format!("1bit serve: port {port}, "))
                && l.ends_with("not from the backend serve started")),
        "{out}"
    );
}
