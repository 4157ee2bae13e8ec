//! `1bit rpc-worker --mem` and `--traffic`: a relay in front of the worker that passes every
//! RPC message through unchanged except the memory its devices report (GET_DEVICE_MEMORY),
//! capped, since the pinned ggml-rpc-server has no way to offer less than its devices have;
//! and that counts, by command, the messages and bytes each way (`traffic`).
//!
//! The relay follows the framing (probe.rs): each request is read as `cmd, size, payload`
//! and written on; the requests that llama.cpp's server answers (ggml-rpc.cpp's
//! `rpc_serve_client`) are queued in order, so each answer frame coming back is known to
//! belong to its command. HELLO's transport capabilities are cleared, so the connection stays
//! TCP (an RDMA upgrade could not pass through a relay).

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, mpsc};

use super::traffic::Traffic;

const CMD_GET_DEVICE_MEMORY: u8 = 11;
const CMD_HELLO: u8 = 14;
/// Commands the server answers with one frame (ggml-rpc.cpp, `rpc_serve_client`): HELLO,
/// DEVICE_COUNT, ALLOC_BUFFER, GET_ALLOC_SIZE, GET_ALIGNMENT, GET_MAX_SIZE, BUFFER_GET_BASE,
/// SET_TENSOR_HASH, GET_TENSOR, COPY_TENSOR, GET_DEVICE_MEMORY. The rest (FREE_BUFFER,
/// BUFFER_CLEAR, MEMSET_TENSOR, SET_TENSOR, INIT_TENSOR, GRAPH_COMPUTE, GRAPH_RECOMPUTE) are
/// not answered.
const ANSWERED: [u8; 11] = [14, 15, 0, 13, 1, 2, 3, 7, 8, 9, 11];
const CHUNK: usize = 64 * 1024;

/// Accept clients on `listener` for as long as the process lives, each relayed to `backend`
/// on threads of its own, with every device's reported free and total memory capped at
/// `cap` bytes (`u64::MAX`: as reported) and every message counted in `traffic`. Returns at
/// once; called once, on the main thread, before the worker starts.
pub fn spawn(
    listener: TcpListener,
    backend: SocketAddr,
    cap: u64,
    traffic: Arc<Traffic>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("rpc-relay".into())
        .spawn(move || {
            for client in listener.incoming().flatten() {
                let traffic = traffic.clone();
                let _ = std::thread::Builder::new()
                    .name("rpc-relay-client".into())
                    .spawn(move || relay(client, backend, cap, &traffic));
            }
        })?;
    Ok(())
}

fn relay(client: TcpStream, backend: SocketAddr, cap: u64, traffic: &Arc<Traffic>) {
    let Ok(server) = TcpStream::connect(backend) else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (Ok(client_r), Ok(server_r)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let (queue, answers) = mpsc::channel::<u8>();
    let (client_w, server_w) = (client, server);
    let down = {
        let (client_w, server_w) = (client_w.try_clone().ok(), server_w.try_clone().ok());
        let traffic = traffic.clone();
        std::thread::spawn(move || {
            if let Some(client_w) = client_w {
                let _ = answers_down(server_r, &client_w, &answers, cap, &traffic);
                let _ = client_w.shutdown(Shutdown::Both);
            }
            if let Some(s) = server_w {
                let _ = s.shutdown(Shutdown::Both);
            }
        })
    };
    let _ = requests_up(client_r, &server_w, &queue, traffic);
    let _ = server_w.shutdown(Shutdown::Write);
    drop(queue);
    let _ = down.join();
    let _ = client_w.shutdown(Shutdown::Both);
}

/// Client to worker: each request passed on; the commands answered queued in order.
fn requests_up(
    client: TcpStream,
    server: &TcpStream,
    queue: &mpsc::Sender<u8>,
    traffic: &Traffic,
) -> std::io::Result<()> {
    let mut from = BufReader::with_capacity(CHUNK, client);
    let mut to = BufWriter::with_capacity(CHUNK, server);
    let mut head = [0u8; 9];
    loop {
        from.read_exact(&mut head)?;
        let cmd = head[0];
        let size = u64::from_le_bytes(head[1..9].try_into().unwrap_or_default());
        to.write_all(&head)?;
        if cmd == CMD_HELLO {
            // No transport upgrade through the relay: the capabilities go as zeros.
            let mut payload = vec![0u8; size.min(1024) as usize];
            from.read_exact(&mut payload)?;
            payload.iter_mut().for_each(|b| *b = 0);
            to.write_all(&payload)?;
            copy(&mut from, &mut to, size - payload.len() as u64)?;
        } else {
            copy(&mut from, &mut to, size)?;
        }
        to.flush()?;
        traffic.request(cmd, head.len() as u64 + size);
        if ANSWERED.contains(&cmd) && queue.send(cmd).is_err() {
            return Ok(());
        }
    }
}

/// Worker to client: each answer passed on, GET_DEVICE_MEMORY's capped.
fn answers_down(
    server: TcpStream,
    client: &TcpStream,
    answers: &mpsc::Receiver<u8>,
    cap: u64,
    traffic: &Traffic,
) -> std::io::Result<()> {
    let mut from = BufReader::with_capacity(CHUNK, server);
    let mut to = BufWriter::with_capacity(CHUNK, client);
    while let Ok(cmd) = answers.recv() {
        let mut size = [0u8; 8];
        from.read_exact(&mut size)?;
        to.write_all(&size)?;
        let size = u64::from_le_bytes(size);
        if cmd == CMD_GET_DEVICE_MEMORY && size == 16 {
            let mut memory = [0u8; 16];
            from.read_exact(&mut memory)?;
            let (free, total) = memory.split_at_mut(8);
            for field in [free, total] {
                let v = u64::from_le_bytes((&*field).try_into().unwrap_or_default());
                field.copy_from_slice(&v.min(cap).to_le_bytes());
            }
            to.write_all(&memory)?;
        } else {
            copy(&mut from, &mut to, size)?;
        }
        to.flush()?;
        traffic.answer(cmd, 8 + size);
    }
    Ok(())
}

fn copy(from: &mut impl Read, to: &mut impl Write, mut left: u64) -> std::io::Result<()> {
    let mut buf = [0u8; CHUNK];
    while left > 0 {
        let n = from.read(&mut buf[..left.min(CHUNK as u64) as usize])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        to.write_all(&buf[..n])?;
        left -= n as u64;
    }
    Ok(())
}
