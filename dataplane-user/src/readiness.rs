//! Readiness on port 15021, `GET /healthz/ready`: 200 once the kernel
//! programs are attached, the configuration is loaded and the certificates
//! of the local workloads are issued; until then 503 with what is pending.
//!
//! The server starts before anything else, so a kubelet probing during
//! start-up gets an answer that says what the agent is waiting for rather
//! than a refused connection.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::debug;

/// Port of the readiness endpoint (Istio's).
pub const READINESS_PORT: u16 = 15021;

/// What start-up has completed.
#[derive(Debug, Default)]
pub struct Readiness {
    programs: AtomicBool,
    config: AtomicBool,
    certificates: AtomicBool,
}

/// A start-up step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Kernel programs loaded and attached.
    Programs,
    /// Configuration loaded.
    Config,
    /// Certificates of local workloads issued.
    Certificates,
}

impl Readiness {
    /// Marks a step done.
    pub fn done(&self, step: Step) {
        self.flag(step).store(true, Ordering::Release);
    }

    fn flag(&self, step: Step) -> &AtomicBool {
        match step {
            Step::Programs => &self.programs,
            Step::Config => &self.config,
            Step::Certificates => &self.certificates,
        }
    }

    /// What is still pending, in start-up order.
    pub fn pending(&self) -> Vec<&'static str> {
        [
            (Step::Config, "configuration"),
            (Step::Programs, "kernel programs"),
            (Step::Certificates, "workload certificates"),
        ]
        .into_iter()
        .filter(|(step, _)| !self.flag(*step).load(Ordering::Acquire))
        .map(|(_, name)| name)
        .collect()
    }
}

/// Binds the readiness port.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves readiness until the task is dropped.
pub async fn serve(listener: TcpListener, readiness: Arc<Readiness>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let readiness = Arc::clone(&readiness);
        tokio::spawn(async move {
            let service = service_fn(move |request| answer(request, Arc::clone(&readiness)));
            if let Err(err) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(error = %err, "readiness connection failed");
            }
        });
    }
}

async fn answer(
    request: Request<Incoming>,
    readiness: Arc<Readiness>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, body) = if request.uri().path() != "/healthz/ready" {
        (
            StatusCode::NOT_FOUND,
            "not found; try /healthz/ready\n".to_owned(),
        )
    } else {
        match readiness.pending().as_slice() {
            [] => (StatusCode::OK, "ready\n".to_owned()),
            pending => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: waiting for {}\n", pending.join(", ")),
            ),
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    Ok(response)
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await?;
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await?;
        Ok(reply)
    }

    #[tokio::test]
    async fn answers_503_naming_what_is_pending_then_200() -> std::io::Result<()> {
        let listener = bind("127.0.0.1:0".parse().map_err(std::io::Error::other)?).await?;
        let addr = listener.local_addr()?;
        let readiness = Arc::new(Readiness::default());
        let server = tokio::spawn(serve(listener, Arc::clone(&readiness)));

        let reply = get(addr, "/healthz/ready").await?;
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(
            reply.contains("waiting for configuration, kernel programs, workload certificates"),
            "{reply}"
        );

        readiness.done(Step::Config);
        readiness.done(Step::Programs);
        let reply = get(addr, "/healthz/ready").await?;
        assert!(
            reply.contains("waiting for workload certificates"),
            "{reply}"
        );

        readiness.done(Step::Certificates);
        let reply = get(addr, "/healthz/ready").await?;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(get(addr, "/other").await?.starts_with("HTTP/1.1 404"));
        server.abort();
        Ok(())
    }
}
