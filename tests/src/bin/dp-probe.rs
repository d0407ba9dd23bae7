//! `dp-probe`: the test client the integration tests run inside pods
//! (network namespaces and cgroups), so that the kernel programs see a real
//! process's `connect()`.
//!
//! Usage:
//!
//! - `dp-probe connect ADDR PAYLOAD [--mark N] [--bind-port P] [--print-peer]`:
//!   connects to ADDR (optionally setting SO_MARK and binding source port P
//!   first), sends PAYLOAD, half-closes,
//!   prints everything received to stdout, and exits 0. With `--print-peer`
//!   it first prints `peer=<getpeername()>` and a newline. ADDR may be an
//!   IPv4-mapped IPv6 address (`[::ffff:10.1.0.12]:80`), which is dialled
//!   through an IPv6 socket.
//! - `dp-probe listen ADDR`: binds a TCP listener on ADDR and hands it to
//!   the parent over the Unix stream socket the parent passed as
//!   descriptor 3 (SCM_RIGHTS), then exits 0. The listener keeps this process's network
//!   namespace and cgroup, which is how a test makes an "engine" socket that
//!   the cgroup programs see.
//!
//! Any failure is printed to stderr with exit code 1.

use std::{
    io::{IoSlice, Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    process::ExitCode,
    time::Duration,
};

/// Descriptor of the Unix socket `listen` sends its listener over.
const HANDOVER_FD: i32 = 3;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dp-probe: {e}");
            ExitCode::FAILURE
        }
    }
}

const USAGE: &str = "usage: dp-probe connect ADDR PAYLOAD [--mark N] [--bind-port P] [--print-peer] | dp-probe listen ADDR";

fn run(args: &[String]) -> Result<(), String> {
    match args {
        [cmd, addr, payload, rest @ ..] if cmd == "connect" => {
            let addr = parse_addr(addr)?;
            let mut mark = None;
            let mut bind_port = None;
            let mut print_peer = false;
            let mut rest = rest.iter();
            while let Some(flag) = rest.next() {
                match flag.as_str() {
                    "--mark" => {
                        let value = rest.next().ok_or("--mark needs a value")?;
                        mark = Some(parse_mark(value)?);
                    }
                    "--bind-port" => {
                        let value = rest.next().ok_or("--bind-port needs a value")?;
                        let port = value
                            .parse()
                            .map_err(|e| format!("bad port {value}: {e}"))?;
                        bind_port = Some(port);
                    }
                    "--print-peer" => print_peer = true,
                    other => return Err(format!("unexpected argument {other:?}; {USAGE}")),
                }
            }
            let mut stream =
                connect(addr, mark, bind_port).map_err(|e| format!("connect {addr}: {e}"))?;
            let mut out = Vec::new();
            if print_peer {
                let peer = stream
                    .peer_addr()
                    .map_err(|e| format!("getpeername: {e}"))?;
                out.extend_from_slice(format!("peer={peer}\n").as_bytes());
            }
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .map_err(|e| e.to_string())?;
            stream
                .write_all(payload.as_bytes())
                .map_err(|e| format!("write: {e}"))?;
            stream
                .shutdown(Shutdown::Write)
                .map_err(|e| format!("shutdown: {e}"))?;
            stream
                .read_to_end(&mut out)
                .map_err(|e| format!("read: {e}"))?;
            std::io::stdout()
                .write_all(&out)
                .map_err(|e| e.to_string())?;
            Ok(())
        }
        [cmd, addr] if cmd == "listen" => {
            let addr = parse_addr(addr)?;
            let listener = TcpListener::bind(addr).map_err(|e| format!("bind {addr}: {e}"))?;
            hand_over(&listener).map_err(|e| format!("sending the listener to the parent: {e}"))
        }
        _ => Err(USAGE.into()),
    }
}

fn parse_addr(addr: &str) -> Result<SocketAddr, String> {
    addr.parse().map_err(|e| format!("bad address {addr}: {e}"))
}

fn parse_mark(value: &str) -> Result<u32, String> {
    match value.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => value.parse(),
    }
    .map_err(|e| format!("bad mark {value}: {e}"))
}

/// Sends `listener` over descriptor 3 with SCM_RIGHTS.
fn hand_over(listener: &TcpListener) -> nix::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
    let fds = [listener.as_raw_fd()];
    let payload = [IoSlice::new(b"L")];
    sendmsg::<UnixAddr>(
        HANDOVER_FD,
        &payload,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )?;
    Ok(())
}

/// A blocking TCP connect, with SO_MARK set and the source port bound
/// before `connect()` when asked.
fn connect(
    addr: SocketAddr,
    mark: Option<u32>,
    bind_port: Option<u16>,
) -> std::io::Result<TcpStream> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if let Some(mark) = mark {
        socket.set_mark(mark)?;
    }
    if let Some(port) = bind_port {
        let any: SocketAddr = if addr.is_ipv4() {
            ([0u8; 4], port).into()
        } else {
            ([0u16; 8], port).into()
        };
        socket.bind(&SockAddr::from(any))?;
    }
    socket.connect(&SockAddr::from(addr))?;
    Ok(socket.into())
}
