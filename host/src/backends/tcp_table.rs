//! The kernel's table of TCP sockets (`/proc/net/tcp{,6}`), read as rows: the ports at both
//! ends, the state, and the inode (0 once no process holds the socket).

use std::path::Path;

/// `LISTEN` in the table's state column.
pub const LISTEN: &str = "0A";
/// `FIN_WAIT1` and `FIN_WAIT2`: this end closed, the peer has not closed its own yet.
pub const CLOSED_HERE_NOT_THERE: [&str; 2] = ["04", "05"];

/// One row of the table.
pub struct Socket {
    pub local_port: u16,
    pub remote_port: u16,
    /// The state column, as the kernel writes it (two hex digits).
    pub state: String,
    pub inode: u64,
}

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
