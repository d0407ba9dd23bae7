//! Readiness on port 15021, `GET /healthz/ready`: 200 once the kernel
//! programs are attached, the configuration is loaded and the certificates
//! of the local workloads are issued; until then 503 with what is pending.
//!
//! The server starts before anything else, so a kubelet probing during
//! start-up gets an answer that says what the agent is waiting for rather
//! than a refused connection.

use std::sync::{
    Arc, PoisonError, RwLock,
    atomic::{AtomicBool, Ordering},
};

use http::{StatusCode, request::Parts};
use tokio::net::TcpListener;

use crate::httpd::{self, Handler, Reply};

/// A condition readiness also waits for, checked at each probe: `None`
/// when met, else what is missing and why (e.g. the certificates of
/// enrolled pods, with the CA's error).
pub type Check = Box<dyn Fn() -> Option<String> + Send + Sync>;

/// What start-up has completed.
#[derive(Default)]
pub struct Readiness {
    programs: AtomicBool,
    config: AtomicBool,
    certificates: AtomicBool,
    xds: AtomicBool,
    draining: AtomicBool,
    checks: RwLock<Vec<(&'static str, Check)>>,
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("pending", &self.pending())
            .field("draining", &self.is_draining())
            .finish_non_exhaustive()
    }
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
    /// The first complete state from istiod installed (done at once
    /// without `--xds`).
    Xds,
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
            Step::Xds => &self.xds,
        }
    }

    /// The agent is shutting down: readiness answers 503 from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether the agent is shutting down.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Adds a condition checked at each probe from now on (`name` only
    /// labels it).
    pub fn add_check(&self, name: &'static str, check: Check) {
        self.checks
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push((name, check));
    }

    /// What is still pending: the start-up steps in order, then each
    /// condition not met, with its reason.
    pub fn blocking(&self) -> Vec<String> {
        let mut pending: Vec<String> = self.pending().into_iter().map(str::to_owned).collect();
        let checks = self.checks.read().unwrap_or_else(PoisonError::into_inner);
        pending.extend(checks.iter().filter_map(|(_, check)| check()));
        pending
    }

    /// The start-up steps still pending, in start-up order.
    pub fn pending(&self) -> Vec<&'static str> {
        [
            (Step::Config, "configuration"),
            (Step::Programs, "kernel programs"),
            (Step::Certificates, "workload certificates"),
            (Step::Xds, "workloads and policies from istiod (xDS)"),
        ]
        .into_iter()
        .filter(|(step, _)| !self.flag(*step).load(Ordering::Acquire))
        .map(|(_, name)| name)
        .collect()
    }
}

/// Serves readiness until the task is dropped.
pub async fn serve(listener: TcpListener, readiness: Arc<Readiness>) {
    let handler: Handler = Arc::new(move |request| answer(request, &readiness).into());
    httpd::serve(listener, "readiness", handler).await;
}

fn answer(request: &Parts, readiness: &Readiness) -> Reply {
    if request.uri.path() != "/healthz/ready" {
        return Reply::text(StatusCode::NOT_FOUND, "not found; try /healthz/ready\n");
    }
    if readiness.is_draining() {
        return Reply::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: draining (the agent is shutting down)\n",
        );
    }
    match readiness.blocking().as_slice() {
        [] => Reply::text(StatusCode::OK, "ready\n"),
        pending => Reply::text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: waiting for {}\n", pending.join(", ")),
        ),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<String> {
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
        let listener = httpd::bind("127.0.0.1:0".parse().map_err(std::io::Error::other)?).await?;
        let addr = listener.local_addr()?;
        let readiness = Arc::new(Readiness::default());
        let server = tokio::spawn(serve(listener, Arc::clone(&readiness)));

        let reply = get(addr, "/healthz/ready").await?;
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(
            reply.contains("waiting for configuration, kernel programs, workload certificates, workloads and policies from istiod"),
            "{reply}"
        );
        readiness.done(Step::Xds);

        readiness.done(Step::Config);
        readiness.done(Step::Programs);
        let reply = get(addr, "/healthz/ready").await?;
        assert!(
            reply.contains("waiting for workload certificates"),
            "{reply}"
        );

        readiness.done(Step::Certificates);
        let missing = Arc::new(std::sync::Mutex::new(Some(
            "certificates from the CA at x: down".to_owned(),
        )));
        let check = Arc::clone(&missing);
        readiness.add_check("certs", Box::new(move || check.lock().ok()?.clone()));
        let reply = get(addr, "/healthz/ready").await?;
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("the CA at x: down"), "{reply}");
        *missing
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))? = None;
        let reply = get(addr, "/healthz/ready").await?;
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(get(addr, "/other").await?.starts_with("HTTP/1.1 404"));
        readiness.start_draining();
        let reply = get(addr, "/healthz/ready").await?;
        assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
        assert!(reply.contains("draining"), "{reply}");
        server.abort();
        Ok(())
    }
}
