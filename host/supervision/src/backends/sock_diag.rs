//! The kernel's TCP sockets asked through netlink's `sock_diag` (what `ss` uses), filtered by
//! state and port in the kernel.
//!
//! `/proc/net/tcp` formats a line for every socket of the namespace, and the kernel walks its
//! whole table to do it: after a load that left 53,000 sockets in TIME_WAIT, one read took
//! 80 ms of kernel time (measured here), and serve read it every 2 s while serving (the port
//! check) and every 5 ms while a stop waits for its backends. Asked for listening sockets on
//! one port, the kernel walks only its listening table; asked for given states toward a port,
//! it walks the rest without formatting anything. The /proc reader (`tcp_table`) stays for a
//! kernel that refuses the socket.

use std::io;
use std::os::fd::AsRawFd as _;
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto,
    setsockopt, socket, sockopt,
};
use nix::sys::time::TimeVal;

/// One TCP socket: the ports at both ends, the state, and the inode (0 once no process holds
/// the socket).
pub struct Socket {
    pub local_port: u16,
    pub remote_port: u16,
    /// The state, as `/proc/net/tcp` writes it (two upper-case hex digits: `0A` is LISTEN).
    pub state: String,
    pub inode: u64,
}

/// `TCP_LISTEN` as a state bit.
pub const LISTEN: u32 = 1 << 10;
/// `TCP_FIN_WAIT1` and `TCP_FIN_WAIT2` as state bits: this end closed, the peer not yet.
pub const CLOSED_HERE_NOT_THERE: u32 = (1 << 4) | (1 << 5);

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const HEADER_LEN: usize = 16;
/// `struct inet_diag_req_v2`.
const REQUEST_LEN: usize = 56;
/// `struct inet_diag_msg`, up to its inode.
const MESSAGE_LEN: usize = 72;
/// A kernel that has not answered in this long is not waited for (the caller falls back).
const ANSWER_LIMIT: Duration = Duration::from_millis(500);

/// Which sockets to ask for: any of `states` (bits), with this local or remote port when given.
#[derive(Clone, Copy)]
pub struct Query {
    pub states: u32,
    pub local_port: Option<u16>,
    pub remote_port: Option<u16>,
}

/// The TCP sockets (IPv4 and IPv6) that `query` names. Blocks for the kernel's answer,
/// usually microseconds. Err: the kernel refused the netlink socket or the question.
pub fn sockets(query: Query) -> io::Result<Vec<Socket>> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )?;
    setsockopt(
        &fd,
        sockopt::ReceiveTimeout,
        &TimeVal::new(0, ANSWER_LIMIT.as_micros() as i64),
    )?;
    let mut rows = Vec::new();
    let mut answer = vec![0u8; 64 * 1024];
    for (seq, family) in [(1u32, libc::AF_INET), (2, libc::AF_INET6)] {
        let request = request(query, family as u8, seq);
        sendto(
            fd.as_raw_fd(),
            &request,
            &NetlinkAddr::new(0, 0),
            MsgFlags::empty(),
        )?;
        'dump: loop {
            let n = recv(fd.as_raw_fd(), &mut answer, MsgFlags::empty())?;
            if n == 0 {
                return Err(io::Error::other("sock_diag: the kernel closed the answer"));
            }
            for message in messages(&answer[..n]) {
                match message? {
                    Message::Socket(socket) => rows.push(socket),
                    Message::Done => break 'dump,
                }
            }
        }
    }
    Ok(rows)
}

/// A dump request for one address family: `nlmsghdr` then `inet_diag_req_v2`.
fn request(query: Query, family: u8, seq: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + REQUEST_LEN);
    out.extend_from_slice(&((HEADER_LEN + REQUEST_LEN) as u32).to_ne_bytes());
    out.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    out.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes()); // the kernel's port id
    out.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    out.extend_from_slice(&query.states.to_ne_bytes());
    // inet_diag_sockid: ports in network order (0: any), addresses, interface, no cookie.
    out.extend_from_slice(&query.local_port.unwrap_or(0).to_be_bytes());
    out.extend_from_slice(&query.remote_port.unwrap_or(0).to_be_bytes());
    out.extend_from_slice(&[0u8; 32 + 4]);
    out.extend_from_slice(&[0xff; 8]);
    out
}

/// One message of the kernel's answer.
enum Message {
    Socket(Socket),
    Done,
}

/// The messages of one datagram of the answer, each 4-byte aligned after its header's length.
fn messages(mut datagram: &[u8]) -> impl Iterator<Item = io::Result<Message>> + '_ {
    std::iter::from_fn(move || {
        if datagram.len() < HEADER_LEN {
            return None;
        }
        let len = u32::from_ne_bytes(datagram[0..4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(datagram[4..6].try_into().ok()?);
        if len < HEADER_LEN || len > datagram.len() {
            datagram = &[];
            return Some(Err(io::Error::other(
                "sock_diag: a message longer than its datagram",
            )));
        }
        let payload = &datagram[HEADER_LEN..len];
        datagram = datagram.get(len.next_multiple_of(4)..).unwrap_or(&[]);
        Some(match kind {
            NLMSG_DONE => Ok(Message::Done),
            NLMSG_ERROR => {
                let errno = payload
                    .get(0..4)
                    .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                Err(io::Error::from_raw_os_error(errno.saturating_neg()))
            }
            _ => parse_socket(payload).map(Message::Socket),
        })
    })
}

/// `struct inet_diag_msg`: state at byte 1, the ports (network order) at 4 and 6, the inode
/// at 68.
fn parse_socket(payload: &[u8]) -> io::Result<Socket> {
    if payload.len() < MESSAGE_LEN {
        return Err(io::Error::other(
            "sock_diag: a socket's message is too short",
        ));
    }
    Ok(Socket {
        local_port: u16::from_be_bytes([payload[4], payload[5]]),
        remote_port: u16::from_be_bytes([payload[6], payload[7]]),
        state: format!("{:02X}", payload[1]),
        inode: u64::from(u32::from_ne_bytes([
            payload[68],
            payload[69],
            payload[70],
            payload[71],
        ])),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener of this process is found by its port, in state LISTEN, and a closed one is
    /// gone.
    #[test]
    fn a_listener_is_found_by_its_port() {
        let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = socket.local_addr().unwrap().port();
        let query = Query {
            states: LISTEN,
            local_port: Some(port),
            remote_port: None,
        };
        let found = sockets(query).unwrap();
        assert_eq!(found.len(), 1, "one listener on port {port}");
        assert_eq!((found[0].local_port, found[0].state.as_str()), (port, "0A"));
        assert_ne!(found[0].inode, 0);
        drop(socket);
        assert!(sockets(query).unwrap().is_empty());
    }

    /// A connection closed at this end only is found by its peer's port and its state, and
    /// only while the peer keeps its end open.
    #[test]
    fn a_connection_closed_here_only_is_found_by_the_peers_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let query = Query {
            states: CLOSED_HERE_NOT_THERE,
            local_port: None,
            remote_port: Some(port),
        };
        assert!(sockets(query).unwrap().is_empty(), "both ends open");
        drop(client);
        let found = sockets(query).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].remote_port, port);
        drop(accepted);
    }

    #[test]
    fn an_error_message_is_the_kernels_errno() {
        let mut datagram = Vec::new();
        datagram.extend_from_slice(&20u32.to_ne_bytes());
        datagram.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        datagram.extend_from_slice(&[0; 6]);
        datagram.extend_from_slice(&0u32.to_ne_bytes());
        datagram.extend_from_slice(&(-libc::EPERM).to_ne_bytes());
        let first = messages(&datagram).next().unwrap();
        assert_eq!(
            first.err().and_then(|e| e.raw_os_error()),
            Some(libc::EPERM)
        );
    }
}
