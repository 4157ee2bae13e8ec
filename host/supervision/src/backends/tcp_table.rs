//! The kernel's table of TCP sockets, as rows: the ports at both ends, the state, and the inode
//! (0 once no process holds the socket). Asked through `sock_diag` (filtered in the kernel);
//! read from `/proc/net/tcp{,6}` (every socket, formatted) where the kernel refuses that.

use std::collections::BTreeSet;
use std::path::Path;

pub use super::sock_diag::Socket;
use super::sock_diag::{self, Query};

/// The inodes of the sockets listening on `port` (any address, IPv4 and IPv6).
pub fn listening_inodes(proc_root: &Path, port: u16) -> BTreeSet<u64> {
    let query = Query {
        states: sock_diag::LISTEN,
        local_port: Some(port),
        remote_port: None,
    };
    matching(proc_root, &[query])
        .into_iter()
        .filter(|s| s.state == LISTEN && s.local_port == port && s.inode != 0)
        .map(|s| s.inode)
        .collect()
}

/// How many connections toward a port in `remote_ports` this end has closed and the peer not.
pub fn closed_here_not_there(proc_root: &Path, remote_ports: &[u16]) -> usize {
    let queries: Vec<Query> = remote_ports
        .iter()
        .map(|&port| Query {
            states: sock_diag::CLOSED_HERE_NOT_THERE,
            local_port: None,
            remote_port: Some(port),
        })
        .collect();
    matching(proc_root, &queries)
        .iter()
        .filter(|s| {
            remote_ports.contains(&s.remote_port)
                && CLOSED_HERE_NOT_THERE.contains(&s.state.as_str())
        })
        .count()
}

/// The rows `queries` ask for: the kernel's answers (for the real /proc), or, where it refuses,
/// every row of `proc_root`'s table, read once, for the caller to filter alike.
fn matching(proc_root: &Path, queries: &[Query]) -> Vec<Socket> {
    if proc_root == Path::new("/proc") {
        let asked: Result<Vec<Vec<Socket>>, _> =
            queries.iter().map(|q| sock_diag::sockets(*q)).collect();
        if let Ok(answers) = asked {
            return answers.into_iter().flatten().collect();
        }
    }
    sockets(proc_root)
}

/// `LISTEN` in the table's state column.
pub const LISTEN: &str = "0A";
/// `FIN_WAIT1` and `FIN_WAIT2`: this end closed, the peer has not closed its own yet.
pub const CLOSED_HERE_NOT_THERE: [&str; 2] = ["04", "05"];

/// Every TCP socket of the machine's network namespace, IPv4 and IPv6. Reads /proc; blocks
/// briefly.
pub fn sockets(proc_root: &Path) -> Vec<Socket> {
    let mut rows = Vec::new();
    for table in ["net/tcp", "net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(proc_root.join(table)) else {
            continue;
        };
        // "sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ..."
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 10 {
                continue;
            }
            let port = |address: &str| {
                address
                    .rsplit(':')
                    .next()
                    .and_then(|hex| u16::from_str_radix(hex, 16).ok())
            };
            let (Some(local_port), Some(remote_port)) = (port(fields[1]), port(fields[2])) else {
                continue;
            };
            rows.push(Socket {
                local_port,
                remote_port,
                state: fields[3].to_string(),
                inode: fields[9].parse().unwrap_or(0),
            });
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's answer and /proc agree on a listener: its port, state and inode.
    #[test]
    fn sock_diag_and_proc_see_the_same_listener() {
        let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = socket.local_addr().unwrap().port();
        let query = Query {
            states: sock_diag::LISTEN,
            local_port: Some(port),
            remote_port: None,
        };
        let asked: Vec<u64> = sock_diag::sockets(query)
            .unwrap()
            .into_iter()
            .map(|s| s.inode)
            .collect();
        let read: Vec<u64> = sockets(Path::new("/proc"))
            .into_iter()
            .filter(|s| s.local_port == port && s.state == LISTEN)
            .map(|s| s.inode)
            .collect();
        assert_eq!(asked.len(), 1);
        assert_eq!(asked, read);
        assert_eq!(
            listening_inodes(Path::new("/proc"), port),
            BTreeSet::from([asked[0]])
        );
    }
}
