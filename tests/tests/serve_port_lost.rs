//! A backend's port taken in the window between serve letting go of it and the backend binding
//! it (issue 53): serve starts the backend again on another port, says so in one line, and
//! serves; the start does not fail, however long the backend takes to run on a starved machine.

use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket};
use onebit_tests::*;

/// A llama-server that, on its first start only, writes the port serve gave it to `port` and
/// waits for `taken` before it runs the fake backend (which then cannot bind the port).
fn pausing_backend(dir: &Path) -> std::path::PathBuf {
    let body = format!(
        r#"port=""; prev=""
for a in "$@"; do [ "$prev" = "--port" ] && port="$a"; prev="$a"; done
if [ ! -e "{dir}/first" ]; then
  : > "{dir}/first"
  echo "$port" > "{dir}/port.tmp" && mv "{dir}/port.tmp" "{dir}/port"
  while [ ! -e "{dir}/taken" ]; do sleep 0.01; done
fi
exec "{fake}" "$@""#,
        dir = dir.display(),
        fake = fake_backend().display()
    );
    shell_script(dir, "llama-server", &body)
}

/// An outgoing connection from 127.0.0.1:`port` to a listener of this test, as any client on
/// the machine that was handed the port as its source would hold it; None when the port is
/// already held (by a connection of another test in its TIME_WAIT, say: the suite makes
/// thousands, from the same ephemeral range serve's ports come from).
fn connect_from(port: u16) -> Option<(OwnedFd, TcpListener, TcpStream)> {
    let peer = TcpListener::bind("127.0.0.1:0").unwrap();
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::empty(),
        None,
    )
    .unwrap();
    use std::os::fd::AsRawFd;
    match bind(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, port)) {
        Ok(()) => {}
        Err(nix::errno::Errno::EADDRINUSE) => return None,
        Err(e) => panic!("binding 127.0.0.1:{port}: {e}"),
    }
    let to = peer.local_addr().unwrap().port();
    connect(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, to)).unwrap();
    let accepted = peer.accept().unwrap().0;
    Some((fd, peer, accepted))
}

/// How many serves the test starts before it gives up finding the backend's port free to take.
const ATTEMPTS: usize = 5;

#[test]
fn a_port_taken_before_the_backend_binds_it_is_replaced_and_serve_starts() {
    for attempt in 1..=ATTEMPTS {
        if port_lost_before_the_backend_binds() {
            return;
        }
        eprintln!("attempt {attempt}: the backend's port was already held by another socket");
    }
    panic!("in {ATTEMPTS} serves the backend's port was never free to take");
}

/// One serve whose backend's port the test takes before the backend binds it; false (serve
/// dropped, so killed) when the port was already held by another socket of the machine.
fn port_lost_before_the_backend_binds() -> bool {
    let dir = temp_dir("port-lost");
    let backend = pausing_backend(&dir);
    let serve = serve_cpu_engine(&dir, &backend, &[], &[]);
    let port_file = dir.join("port");
    assert!(
        wait_until(Duration::from_secs(20), || port_file.exists()),
        "the backend never started: {}",
        serve.output()
    );
    let lost: u16 = std::fs::read_to_string(&port_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // A starved machine: seconds pass before the backend runs on (more than serve would wait
    // by the clock); the backend has used next to no CPU, so serve still waits to tell.
    std::thread::sleep(Duration::from_millis(2500));
    let Some(taker) = connect_from(lost) else {
        return false;
    };
    std::fs::write(dir.join("taken"), b"").unwrap();

    serve.ready();
    let out = serve.output();
    let said: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("was taken by another program"))
        .collect();
    assert_eq!(said.len(), 1, "{out}");
    assert!(
        said[0].starts_with(&format!(
            "1bit serve: port {lost}, which serve gave the cpu backend"
        )),
        "{}",
        said[0]
    );
    let starts: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("1bit serve: starting llama-server"))
        .collect();
    assert_eq!(starts.len(), 2, "{out}");
    assert!(
        starts[0].contains(&format!("(port {lost})")),
        "{}",
        starts[0]
    );
    assert!(
        !starts[1].contains(&format!("(port {lost})")),
        "{}",
        starts[1]
    );
    assert_eq!(
        post(
            &serve.url("/v1/chat/completions"),
            r#"{"messages":[{"role":"user","content":"hi"}]}"#
        )
        .0,
        200,
        "{}",
        serve.output()
    );
    drop(taker);
    true
}
