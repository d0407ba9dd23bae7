//! A TCP server for tests: accepts connections on a listener (which may live
//! in another network namespace), reads each request to EOF, and answers with
//! whatever the handler returns. Stops and joins its thread on drop.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
    time::Duration,
};

/// What the handler learns about one connection.
#[derive(Debug, Clone)]
pub struct Request {
    /// The client's address (the accepted socket's peer).
    pub peer: SocketAddr,
    /// The accepted socket's local address.
    pub local: SocketAddr,
    /// Bytes received before the client half-closed.
    pub body: Vec<u8>,
}

/// A running server.
#[derive(Debug)]
pub struct Responder {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    requests: mpsc::Receiver<Request>,
    addr: SocketAddr,
}

impl Responder {
    /// Serves `listener` with `handler` until dropped.
    pub fn start<H>(listener: TcpListener, mut handler: H) -> anyhow::Result<Self>
    where
        H: FnMut(&Request) -> Vec<u8> + Send + 'static,
    {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, requests) = mpsc::channel();
        let stop_flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !stop_flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, peer)) => {
                        if let Some(request) = serve(stream, peer, &mut handler) {
                            let _ = tx.send(request);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(_) => break,
                }
            }
        });
        Ok(Self {
            stop,
            thread: Some(thread),
            requests,
            addr,
        })
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The next request served, waiting up to `limit`.
    pub fn next_request(&self, limit: Duration) -> Option<Request> {
        self.requests.recv_timeout(limit).ok()
    }

    /// Requests served so far and not yet taken.
    pub fn drain(&self) -> Vec<Request> {
        self.requests.try_iter().collect()
    }
}

fn serve<H>(mut stream: TcpStream, peer: SocketAddr, handler: &mut H) -> Option<Request>
where
    H: FnMut(&Request) -> Vec<u8>,
{
    stream.set_nonblocking(false).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let local = stream.local_addr().ok()?;
    let mut body = Vec::new();
    stream.read_to_end(&mut body).ok()?;
    let request = Request { peer, local, body };
    let reply = handler(&request);
    stream.write_all(&reply).ok()?;
    Some(request)
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
