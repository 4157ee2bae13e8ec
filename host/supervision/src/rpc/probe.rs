//! The RPC probe: asks a `ggml-rpc-server` what it offers (HELLO, DEVICE_COUNT,
//! GET_DEVICE_MEMORY), in llama.cpp's own framing, within a time limit.
//!
//! Framing (ggml/src/ggml-rpc/ggml-rpc.cpp): a request is `| cmd: u8 | size: u64 | data |`,
//! an answer `| size: u64 | data |`, little-endian, structs packed. The first command on a
//! connection must be HELLO. A worker serves one connection at a time and takes the next
//! only when that one closes, so a probe closes its connection as soon as it has its answers.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The protocol the pinned llama.cpp speaks (`RPC_PROTO_MAJOR_VERSION`/`MINOR` in
/// ggml/include/ggml-rpc.h). llama-server refuses a worker whose major differs or whose minor
/// is newer; the probe applies the same rule.
pub const PROTO_MAJOR: u8 = 7;
pub const PROTO_MINOR: u8 = 0;

/// How long a worker has to answer before serve names it and refuses to start.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(1);

const CMD_GET_DEVICE_MEMORY: u8 = 11;
const CMD_HELLO: u8 = 14;
const CMD_DEVICE_COUNT: u8 = 15;
/// `RPC_CONN_CAPS_SIZE` (transport.h): the transport capabilities HELLO carries. A probe
/// advertises none, so the connection stays plain TCP.
const CONN_CAPS: usize = 24;
/// More devices than any worker has; a larger count is a malformed answer.
const MAX_DEVICES: u32 = 256;

/// One device a worker exposes (`RPC<n>` in llama-server), and its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: u64,
    pub total: u64,
}

/// What a worker answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    /// `HOST:PORT`, as given to `--rpc`.
    pub endpoint: String,
    /// The protocol version it speaks (major, minor, patch).
    pub version: (u8, u8, u8),
    /// Its devices, in llama.cpp's order.
    pub devices: Vec<DeviceMemory>,
}

impl Offer {
    /// The free memory of all its devices: what llama.cpp splits layers by.
    pub fn free(&self) -> u64 {
        self.devices.iter().map(|d| d.free).sum()
    }
}

/// Check one `--rpc` entry: `HOST:PORT` with a port in 1..=65535, split at the first `:` as
/// llama.cpp splits it (so no IPv6 literals). Returns the host and port, or the one-line
/// refusal. Pure; serve calls it for each entry before probing.
pub fn parse_endpoint(entry: &str) -> Result<(String, u16), String> {
    let bad = || {
        format!(
            "--rpc {entry}: not HOST:PORT; pass each worker as an IPv4 address or host name and its port, e.g. --rpc 192.168.1.20:50052,192.168.1.21:50052"
        )
    };
    let (host, port) = entry.split_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() || port == 0 || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

/// The first address `endpoint` resolves to (IPv4 first, as llama.cpp's `gethostbyname`).
pub fn resolve(endpoint: &str) -> Result<SocketAddr, String> {
    let (host, port) = parse_endpoint(endpoint)?;
    let addrs: Vec<SocketAddr> = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("RPC worker {endpoint}: cannot resolve {host} ({e})"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| format!("RPC worker {endpoint}: {host} resolves to no address"))
}

/// Connect to `endpoint` within `within`. Blocks the calling thread.
pub fn connect(endpoint: &str, within: Duration) -> Result<TcpStream, String> {
    let addr = resolve(endpoint)?;
    let stream = TcpStream::connect_timeout(&addr, within).map_err(|e| {
        if e.kind() == std::io::ErrorKind::TimedOut || e.kind() == std::io::ErrorKind::WouldBlock {
            format!(
                "RPC worker {endpoint} does not answer within {} s",
                within.as_secs_f64()
            )
        } else {
            format!("RPC worker {endpoint} does not answer ({e})")
        }
    })?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Ask `endpoint` for its protocol version and each device's memory, all within `within`
/// (connection included). Blocks the calling thread; serve calls it before anything starts,
/// `1bit rpc-worker` to see its own worker ready.
pub fn ask(endpoint: &str, within: Duration) -> Result<Offer, String> {
    let deadline = Instant::now() + within;
    let mut stream = connect(endpoint, within)?;
    let late = || {
        format!(
            "RPC worker {endpoint} accepted the connection but did not answer within {} s (a worker serves one llama-server at a time: is another one using it?)",
            within.as_secs_f64()
        )
    };
    let mut call = |cmd: u8, input: &[u8], answer: &mut [u8]| -> Result<(), String> {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(late)?;
        stream
            .set_read_timeout(Some(left))
            .and_then(|_| stream.set_write_timeout(Some(left)))
            .map_err(|e| format!("RPC worker {endpoint}: {e}"))?;
        let mut request = Vec::with_capacity(9 + input.len());
        request.push(cmd);
        request.extend_from_slice(&(input.len() as u64).to_le_bytes());
        request.extend_from_slice(input);
        let io = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => late(),
            std::io::ErrorKind::UnexpectedEof => format!(
                "RPC worker {endpoint} closed the connection instead of answering (not a ggml-rpc-server of this protocol?)"
            ),
            _ => format!("RPC worker {endpoint}: {e}"),
        };
        stream.write_all(&request).map_err(io)?;
        let mut size = [0u8; 8];
        stream.read_exact(&mut size).map_err(io)?;
        let size = u64::from_le_bytes(size);
        if size != answer.len() as u64 {
            return Err(format!(
                "RPC worker {endpoint} answered command {cmd} with {size} bytes, not {}: not a ggml-rpc-server of protocol {PROTO_MAJOR}.{PROTO_MINOR}",
                answer.len()
            ));
        }
        stream.read_exact(answer).map_err(io)
    };

    let mut hello = [0u8; 4 + CONN_CAPS];
    call(CMD_HELLO, &[0u8; CONN_CAPS], &mut hello)?;
    let version = (hello[0], hello[1], hello[2]);
    if version.0 != PROTO_MAJOR || version.1 > PROTO_MINOR {
        return Err(format!(
            "RPC worker {endpoint} speaks RPC protocol {}.{}.{}, and the pinned llama-server speaks {PROTO_MAJOR}.{PROTO_MINOR}: run the same llama.cpp build there (1bit rpc-worker)",
            version.0, version.1, version.2
        ));
    }
    let mut count = [0u8; 4];
    call(CMD_DEVICE_COUNT, &[], &mut count)?;
    let count = u32::from_le_bytes(count);
    if count == 0 || count > MAX_DEVICES {
        return Err(format!(
            "RPC worker {endpoint} reports {count} devices; start it with at least one device"
        ));
    }
    let mut devices = Vec::with_capacity(count as usize);
    for device in 0..count {
        let mut memory = [0u8; 16];
        call(CMD_GET_DEVICE_MEMORY, &device.to_le_bytes(), &mut memory)?;
        let (free, total) = memory.split_at(8);
        devices.push(DeviceMemory {
            free: u64::from_le_bytes(free.try_into().unwrap_or_default()),
            total: u64::from_le_bytes(total.try_into().unwrap_or_default()),
        });
    }
    Ok(Offer {
        endpoint: endpoint.to_string(),
        version,
        devices,
    })
}

/// Ask every worker, in order, each within [`ANSWER_WITHIN`]. The first that does not answer
/// ends the round with its line. Blocks the calling thread.
pub fn ask_all(endpoints: &[String]) -> Result<Vec<Offer>, String> {
    endpoints.iter().map(|e| ask(e, ANSWER_WITHIN)).collect()
}

#[cfg(test)]
#[path = "probe_tests.rs"]
mod tests;
