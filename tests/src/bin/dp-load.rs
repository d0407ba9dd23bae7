//! `dp-load`: the benchmarks' load generator and servers, run inside
//! simulated pods (their network namespace and cgroup) by `dp-bench`.
//!
//! Every client workload runs a fixed count of operations, never a fixed
//! time, and never sleeps; it prints one JSON object on stdout.
//!
//! - `dp-load serve ECHO_PORT SINK_PORT`: serves `[::]:ECHO_PORT` (echoes
//!   every byte back until the client half-closes) and `[::]:SINK_PORT`
//!   (reads to end of stream, then answers the byte count as 8 bytes little
//!   endian). Prints `listening` once both are bound; runs until killed.
//! - `dp-load conn ADDR COUNT CONCURRENCY SIZE`: COUNT times, over
//!   CONCURRENCY threads: connect, send SIZE bytes, read SIZE bytes back,
//!   close. Each connection's time goes into the histogram.
//! - `dp-load rr ADDR COUNT SIZE`: one connection, COUNT ping-pongs of SIZE
//!   bytes (after COUNT/10 untimed warm-up ones).
//! - `dp-load bulk ADDR BYTES STREAMS`: STREAMS connections each send
//!   BYTES/STREAMS bytes to a sink and wait for its count.
//! - `dp-load idle ADDR STEP,STEP..`: opens connections (each proven with a
//!   1-byte echo) until STEP are open, prints `ready STEP`, waits for a line
//!   on stdin, goes on to the next step; exits (closing all) at end of
//!   stdin.
//!
//! Options (after the arguments): `--cpu N` pins the process to CPU N.

use std::{
    io::{BufRead, Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    process::ExitCode,
    sync::{
        Arc, Barrier,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use hdrhistogram::Histogram;
use serde_json::{Value, json};

/// Guard against a stalled peer (not a timing measurement).
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Bulk write size.
const CHUNK: usize = 256 * 1024;

type Result<T> = std::result::Result<T, String>;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(at) = args.iter().position(|a| a == "--cpu") {
        let cpu = args.get(at + 1).and_then(|c| c.parse::<usize>().ok());
        args.drain(at..(at + 2).min(args.len()));
        match cpu {
            Some(cpu) => {
                if let Err(e) = pin_to(cpu) {
                    eprintln!("dp-load: {e}");
                    return ExitCode::FAILURE;
                }
            }
            None => {
                eprintln!("dp-load: --cpu needs a CPU number");
                return ExitCode::FAILURE;
            }
        }
    }
    dataplane_tests::process::raise_nofile();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    match run(&words) {
        Ok(Some(report)) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dp-load: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(words: &[&str]) -> Result<Option<Value>> {
    match words {
        ["serve", echo, sink] => serve(parse(echo, "port")?, parse(sink, "port")?),
        ["conn", addr, count, concurrency, size] => conn(
            parse(addr, "address")?,
            parse(count, "count")?,
            parse(concurrency, "concurrency")?,
            parse(size, "size")?,
        ),
        ["rr", addr, count, size] => rr(
            parse(addr, "address")?,
            parse(count, "count")?,
            parse(size, "size")?,
        ),
        ["bulk", addr, bytes, streams] => bulk(
            parse(addr, "address")?,
            parse(bytes, "byte count")?,
            parse(streams, "stream count")?,
        ),
        ["idle", addr, steps] => idle(parse(addr, "address")?, steps),
        _ => Err("usage: dp-load serve ECHO SINK | conn ADDR COUNT CONCURRENCY SIZE | rr ADDR COUNT SIZE | bulk ADDR BYTES STREAMS | idle ADDR STEPS [--cpu N]".into()),
    }
}

fn parse<T: std::str::FromStr>(word: &str, what: &str) -> Result<T>
where
    T::Err: std::fmt::Display,
{
    word.parse()
        .map_err(|e| format!("bad {what} `{word}`: {e}"))
}

fn pin_to(cpu: usize) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) != 0 {
            return Err(format!(
                "cannot pin to CPU {cpu}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

fn histogram() -> Histogram<u64> {
    // Nanoseconds, 1 ns to 60 s, 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000_000, 3)
        .expect("bounds 1 ns..60 s with 3 digits are valid")
}

fn record(hist: &mut Histogram<u64>, elapsed: Duration) {
    let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX).max(1);
    hist.saturating_record(ns);
}

/// Percentiles in microseconds.
fn latency_json(hist: &Histogram<u64>) -> Value {
    let us = |ns: u64| ns as f64 / 1000.0;
    json!({
        "samples": hist.len(),
        "mean_us": hist.mean() / 1000.0,
        "p50_us": us(hist.value_at_quantile(0.50)),
        "p90_us": us(hist.value_at_quantile(0.90)),
        "p99_us": us(hist.value_at_quantile(0.99)),
        "p999_us": us(hist.value_at_quantile(0.999)),
        "max_us": us(hist.max()),
    })
}

fn connect(addr: SocketAddr) -> Result<TcpStream> {
    let stream = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    stream
        .set_nodelay(true)
        .map_err(|e| format!("nodelay: {e}"))?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| format!("timeout: {e}"))?;
    Ok(stream)
}

/// Sends `buf` and reads as many bytes back.
fn ping(stream: &mut TcpStream, buf: &mut [u8]) -> Result<()> {
    stream.write_all(buf).map_err(|e| format!("write: {e}"))?;
    stream
        .read_exact(buf)
        .map_err(|e| format!("read echo: {e}"))
}

fn conn(addr: SocketAddr, count: u64, concurrency: usize, size: usize) -> Result<Option<Value>> {
    let next = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(concurrency + 1));
    let workers: Vec<_> = (0..concurrency.max(1))
        .map(|_| {
            let next = Arc::clone(&next);
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || -> Result<Histogram<u64>> {
                let mut hist = histogram();
                let mut buf = vec![0x5a_u8; size.max(1)];
                barrier.wait();
                while next.fetch_add(1, Ordering::Relaxed) < count {
                    let started = Instant::now();
                    let mut stream = connect(addr)?;
                    ping(&mut stream, &mut buf)?;
                    drop(stream);
                    record(&mut hist, started.elapsed());
                }
                Ok(hist)
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    let mut total = histogram();
    let mut first_error = None;
    for worker in workers {
        match worker.join() {
            Ok(Ok(hist)) => {
                let _ = total.add(&hist);
            }
            Ok(Err(e)) => first_error = first_error.or(Some(e)),
            Err(_) => first_error = first_error.or(Some("worker panicked".to_owned())),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(Some(json!({
        "ops": count,
        "secs": secs,
        "rate": count as f64 / secs,
        "latency": latency_json(&total),
    })))
}

fn rr(addr: SocketAddr, count: u64, size: usize) -> Result<Option<Value>> {
    let mut stream = connect(addr)?;
    let mut buf = vec![0xa5_u8; size.max(1)];
    for _ in 0..count / 10 {
        ping(&mut stream, &mut buf)?;
    }
    let mut hist = histogram();
    let started = Instant::now();
    for _ in 0..count {
        let t = Instant::now();
        ping(&mut stream, &mut buf)?;
        record(&mut hist, t.elapsed());
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(Some(json!({
        "ops": count,
        "secs": secs,
        "rate": count as f64 / secs,
        "latency": latency_json(&hist),
    })))
}

fn bulk(addr: SocketAddr, bytes: u64, streams: u64) -> Result<Option<Value>> {
    let streams = streams.max(1);
    let per_stream = bytes / streams;
    let barrier = Arc::new(Barrier::new(streams as usize + 1));
    let workers: Vec<_> = (0..streams)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || -> Result<()> {
                let connected = connect(addr);
                barrier.wait();
                let mut stream = connected?;
                let chunk = vec![0x3c_u8; CHUNK];
                let mut left = per_stream;
                while left > 0 {
                    let n = left.min(CHUNK as u64) as usize;
                    stream
                        .write_all(&chunk[..n])
                        .map_err(|e| format!("write: {e}"))?;
                    left -= n as u64;
                }
                stream
                    .shutdown(Shutdown::Write)
                    .map_err(|e| format!("shutdown: {e}"))?;
                let mut count = [0u8; 8];
                stream
                    .read_exact(&mut count)
                    .map_err(|e| format!("read count: {e}"))?;
                let got = u64::from_le_bytes(count);
                if got != per_stream {
                    return Err(format!("sink counted {got} bytes, {per_stream} were sent"));
                }
                Ok(())
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    for worker in workers {
        worker
            .join()
            .map_err(|_| "stream thread panicked".to_owned())??;
    }
    let secs = started.elapsed().as_secs_f64();
    let total = per_stream * streams;
    Ok(Some(json!({
        "bytes": total,
        "streams": streams,
        "secs": secs,
        "gbps": total as f64 * 8.0 / secs / 1e9,
    })))
}

fn idle(addr: SocketAddr, steps: &str) -> Result<Option<Value>> {
    let steps: Vec<usize> = steps
        .split(',')
        .map(|s| s.parse().map_err(|e| format!("bad step `{s}`: {e}")))
        .collect::<Result<_>>()?;
    let mut open: Vec<TcpStream> = Vec::new();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    for step in steps {
        let need = step.saturating_sub(open.len());
        // A few threads: each connection waits for its echo.
        let threads = need.clamp(1, 4);
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let n = need / threads + usize::from(i < need % threads);
                std::thread::spawn(move || -> Result<Vec<TcpStream>> {
                    let mut mine = Vec::with_capacity(n);
                    let mut one = [1u8];
                    for _ in 0..n {
                        let mut stream = connect(addr)?;
                        ping(&mut stream, &mut one)?;
                        mine.push(stream);
                    }
                    Ok(mine)
                })
            })
            .collect();
        for handle in handles {
            open.extend(
                handle
                    .join()
                    .map_err(|_| "connect thread panicked".to_owned())??,
            );
        }
        println!("ready {}", open.len());
        std::io::stdout().flush().map_err(|e| e.to_string())?;
        if lines.next().is_none() {
            return Ok(None);
        }
    }
    // Hold until stdin closes.
    while lines.next().is_some() {}
    Ok(None)
}

fn serve(echo_port: u16, sink_port: u16) -> Result<Option<Value>> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_io()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    runtime.block_on(async move {
        let any = |port| SocketAddr::from(([0u16; 8], port));
        let echo = tokio::net::TcpListener::bind(any(echo_port))
            .await
            .map_err(|e| format!("bind echo port {echo_port}: {e}"))?;
        let sink = tokio::net::TcpListener::bind(any(sink_port))
            .await
            .map_err(|e| format!("bind sink port {sink_port}: {e}"))?;
        println!("listening");
        std::io::stdout().flush().map_err(|e| e.to_string())?;
        let echo_task = tokio::spawn(accept_loop(echo, false));
        let sink_task = tokio::spawn(accept_loop(sink, true));
        let _ = tokio::join!(echo_task, sink_task);
        Ok(None)
    })
}

async fn accept_loop(listener: tokio::net::TcpListener, sink: bool) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        if sink {
            tokio::spawn(sink_one(stream));
        } else {
            tokio::spawn(echo_one(stream));
        }
    }
}

async fn echo_one(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    // Small: 10k idle connections each hold one.
    let mut buf = vec![0u8; 4096];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if stream.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
    let _ = stream.shutdown().await;
}

async fn sink_one(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = vec![0u8; CHUNK];
    let mut total: u64 = 0;
    loop {
        match stream.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => total += n as u64,
            Err(_) => return,
        }
    }
    let _ = stream.write_all(&total.to_le_bytes()).await;
    let _ = stream.shutdown().await;
}
