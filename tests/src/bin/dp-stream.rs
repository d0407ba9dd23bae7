//! `dp-stream`: a test client for byte-exact transfers and reset
//! propagation, run inside test pods.
//!
//! - `dp-stream echo ADDR BYTES SEED`: sends BYTES pseudo-random bytes
//!   (from SEED), half-closes, reads until the server closes, and checks the
//!   reply is exactly what was sent. Prints `ok BYTES`.
//! - `dp-stream echo-text ADDR TEXT`: sends TEXT, half-closes, prints what
//!   comes back.
//! - `dp-stream peer ADDR`: sends one byte, half-closes, reads the reply
//!   to its end and prints the peer address the socket reports
//!   (`getpeername`).
//! - `dp-stream hold ADDR SECONDS`: sends one byte and waits for the
//!   connection to end (EOF or reset); prints `closed`, or `open` if it
//!   was still open after SECONDS.
//! - `dp-stream expect-reset ADDR`: sends one byte and expects the
//!   connection to be reset. Prints `reset`.
//! - `dp-stream transfer ADDR BYTES PACE_US at-once|after-eof`: the client
//!   end of a [`dataplane_tests::transfer`]: sends BYTES (pausing PACE_US
//!   microseconds after each 64 KiB; `after-eof`: only once the server's
//!   stream ended), half-closes, reads the server's stream to its end and
//!   prints how each direction ended (`read clean N`, `write reset N`, ...).
//! - `dp-stream loop ADDR BYTES DIR`: echo exchanges of BYTES (a new seed
//!   each) one after another, as fast as they go, until the file
//!   `DIR/stop` exists; every connection that fails is counted by how
//!   (`refused` at connect, `reset`, `corrupt`: a short or wrong echo,
//!   `other`), never retried. Writes the count of good exchanges to
//!   `DIR/progress` as it goes; prints the counts as JSON at the end.
//!
//! Exit code 0 on success, 1 with a message on stderr otherwise.

use dataplane_tests::transfer::{self, Payload};
use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    process::ExitCode,
    time::Duration,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.as_slice() {
        [cmd, addr, bytes, seed] if cmd == "echo" => echo(addr, bytes, seed),
        [cmd, addr] if cmd == "expect-reset" => expect_reset(addr),
        [cmd, addr, text] if cmd == "echo-text" => echo_text(addr, text),
        [cmd, addr] if cmd == "peer" => peer(addr),
        [cmd, addr, secs] if cmd == "hold" => hold(addr, secs, false),
        [cmd, addr, secs] if cmd == "hold-end" => hold(addr, secs, true),
        [cmd, addr, bytes, pace, when] if cmd == "transfer" => transfer(addr, bytes, pace, when),
        [cmd, addr, bytes, dir] if cmd == "loop" => run_loop(addr, bytes, dir),
        _ => Err("usage: dp-stream echo ADDR BYTES SEED | dp-stream expect-reset ADDR".into()),
    };
    match result {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dp-stream: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The deterministic byte stream both sides agree on.
fn payload(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    Payload::new(seed).fill(&mut bytes);
    bytes
}

fn transfer(addr: &str, bytes: &str, pace: &str, when: &str) -> Result<String, String> {
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| format!("bad address {addr}: {e}"))?;
    let send: u64 = bytes.parse().map_err(|e| format!("bad byte count: {e}"))?;
    let pace: u64 = pace.parse().map_err(|e| format!("bad pace: {e}"))?;
    let mut plan = transfer::Plan::paced(send, Duration::from_micros(pace));
    match when {
        "at-once" => {}
        "after-eof" => plan = plan.after_eof(),
        _ => return Err(format!("`{when}` is neither at-once nor after-eof")),
    }
    let outcome = transfer::client_end(addr, plan).map_err(|e| format!("connect {addr}: {e}"))?;
    Ok(outcome.to_string())
}

fn connect(addr: &str) -> Result<TcpStream, String> {
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| format!("bad address {addr}: {e}"))?;
    let stream = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    Ok(stream)
}

fn echo(addr: &str, bytes: &str, seed: &str) -> Result<String, String> {
    let len: usize = bytes.parse().map_err(|e| format!("bad byte count: {e}"))?;
    let seed: u64 = seed.parse().map_err(|e| format!("bad seed: {e}"))?;
    let data = payload(len, seed);
    let mut stream = connect(addr)?;
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    let to_send = data.clone();
    // Write from another thread: the echo comes back while we still send.
    let sender = std::thread::spawn(move || -> Result<(), String> {
        writer
            .write_all(&to_send)
            .map_err(|e| format!("write: {e}"))?;
        writer
            .shutdown(Shutdown::Write)
            .map_err(|e| format!("shutdown: {e}"))
    });
    let mut received = Vec::with_capacity(len);
    stream
        .read_to_end(&mut received)
        .map_err(|e| format!("read after {} bytes: {e}", received.len()))?;
    sender
        .join()
        .map_err(|_| "sender thread panicked".to_owned())??;
    if received.len() != data.len() {
        return Err(format!(
            "received {} bytes, sent {}",
            received.len(),
            data.len()
        ));
    }
    if let Some(at) = received.iter().zip(&data).position(|(a, b)| a != b) {
        return Err(format!("byte {at} differs"));
    }
    Ok(format!("ok {len}"))
}

fn echo_text(addr: &str, text: &str) -> Result<String, String> {
    let reply = send_and_read(&mut connect(addr)?, text.as_bytes())?;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

/// The peer address the socket reports, once a one-byte exchange ended.
fn peer(addr: &str) -> Result<String, String> {
    let mut stream = connect(addr)?;
    let peer = stream
        .peer_addr()
        .map_err(|e| format!("getpeername: {e}"))?;
    send_and_read(&mut stream, b"x")?;
    Ok(peer.to_string())
}

/// Sends `bytes`, half-closes and reads the reply to its end.
fn send_and_read(stream: &mut TcpStream, bytes: &[u8]) -> Result<Vec<u8>, String> {
    stream.write_all(bytes).map_err(|e| format!("write: {e}"))?;
    stream
        .shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut reply = Vec::new();
    stream
        .read_to_end(&mut reply)
        .map_err(|e| format!("read: {e}"))?;
    Ok(reply)
}

/// Holds a connection open until the peer ends it or `secs` pass: `open`,
/// or how it ended (`closed`; with `tell_reset`, `reset` for a reset or an
/// abort).
fn hold(addr: &str, secs: &str, tell_reset: bool) -> Result<String, String> {
    let secs: u64 = secs.parse().map_err(|e| format!("bad seconds: {e}"))?;
    let mut stream = connect(addr)?;
    stream.write_all(b"x").map_err(|e| format!("write: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(secs)))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Ok("closed".into()),
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok("open".into());
            }
            Err(e)
                if tell_reset
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
                    ) =>
            {
                return Ok("reset".into());
            }
            Err(_) => return Ok("closed".into()),
        }
    }
}

fn expect_reset(addr: &str) -> Result<String, String> {
    let mut stream = connect(addr)?;
    match stream.write_all(b"x") {
        Ok(()) => {}
        // The peer may reset before the byte is even sent.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok("reset".into()),
        Err(e) => return Err(format!("write: {e}")),
    }
    let mut buf = [0u8; 64];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Err("connection closed with FIN, not reset".into()),
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok("reset".into()),
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// How one exchange of `dp-stream loop` failed.
enum Failure {
    Refused,
    Reset,
    Corrupt,
    Other,
}

fn classify(e: &std::io::Error) -> Failure {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => Failure::Refused,
        ConnectionReset | ConnectionAborted | BrokenPipe => Failure::Reset,
        _ => Failure::Other,
    }
}

/// One connection: send `data`, half-close, read the echo to its end.
fn exchange(addr: SocketAddr, data: &[u8]) -> Result<(), (Failure, String)> {
    let mut stream =
        TcpStream::connect(addr).map_err(|e| (classify(&e), format!("connect: {e}")))?;
    let io = |what: &'static str| move |e: std::io::Error| (classify(&e), format!("{what}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(io("timeout"))?;
    stream.write_all(data).map_err(io("write"))?;
    stream.shutdown(Shutdown::Write).map_err(io("shutdown"))?;
    let mut received = Vec::with_capacity(data.len());
    stream.read_to_end(&mut received).map_err(io("read"))?;
    if received != data {
        return Err((
            Failure::Corrupt,
            format!(
                "echo of {} bytes came back as {} bytes or differs",
                data.len(),
                received.len()
            ),
        ));
    }
    Ok(())
}

fn run_loop(addr: &str, bytes: &str, dir: &str) -> Result<String, String> {
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| format!("bad address {addr}: {e}"))?;
    let len: usize = bytes.parse().map_err(|e| format!("bad byte count: {e}"))?;
    let dir = std::path::Path::new(dir);
    let started = std::time::Instant::now();
    let (mut ok, mut refused, mut reset, mut corrupt, mut other) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut errors = Vec::new();
    let mut seed = 0u64;
    while !dir.join("stop").exists() {
        seed += 1;
        match exchange(addr, &payload(len, seed)) {
            Ok(()) => ok += 1,
            Err((failure, message)) => {
                match failure {
                    Failure::Refused => refused += 1,
                    Failure::Reset => reset += 1,
                    Failure::Corrupt => corrupt += 1,
                    Failure::Other => other += 1,
                }
                if errors.len() < 10 {
                    errors.push(format!(
                        "{:.3}s: {message}",
                        started.elapsed().as_secs_f64()
                    ));
                }
            }
        }
        if seed.is_multiple_of(20) {
            let tmp = dir.join("progress.tmp");
            std::fs::write(&tmp, ok.to_string())
                .and_then(|()| std::fs::rename(&tmp, dir.join("progress")))
                .map_err(|e| format!("progress file: {e}"))?;
        }
    }
    Ok(serde_json::json!({
        "ok": ok,
        "refused": refused,
        "reset": reset,
        "corrupt": corrupt,
        "other": other,
        "errors": errors,
    })
    .to_string())
}
