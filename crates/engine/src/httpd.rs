//! The agent's small HTTP/1.1 endpoints (readiness on 15021, metrics on
//! 15020, admin on 15000): each request is answered by a handler from its
//! method, path and query, at once or, for what takes time (a CPU profile),
//! by a future the connection's task awaits; request bodies are ignored.

use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use bytes::Bytes;
use http::{Request, Response, StatusCode, header::CONTENT_TYPE, request::Parts};
use http_body_util::Full;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::debug;

/// Plain text.
pub const TEXT: &str = "text/plain; charset=utf-8";
/// JSON.
pub const JSON: &str = "application/json";

/// An answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The status.
    pub status: StatusCode,
    /// The Content-Type.
    pub content_type: &'static str,
    /// The body.
    pub body: Bytes,
}

impl Reply {
    /// A plain-text answer.
    pub fn text(status: StatusCode, body: impl Into<String>) -> Self {
        Self {
            status,
            content_type: TEXT,
            body: Bytes::from(body.into()),
        }
    }
}

/// A reply that takes time to make.
pub type Deferred = std::pin::Pin<Box<dyn std::future::Future<Output = Reply> + Send>>;

/// How a handler answers a request.
pub enum Answer {
    /// At once.
    Now(Reply),
    /// Once the future is done (dropped if the client goes first).
    Later(Deferred),
}

impl From<Reply> for Answer {
    fn from(reply: Reply) -> Self {
        Self::Now(reply)
    }
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Now(reply) => f.debug_tuple("Now").field(reply).finish(),
            Self::Later(_) => f.write_str("Later"),
        }
    }
}

/// Answers one request.
pub type Handler = Arc<dyn Fn(&Parts) -> Answer + Send + Sync>;

/// Binds an endpoint's port.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves `handler` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, name: &'static str, handler: Handler) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let handler = Arc::clone(&handler);
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let (parts, _body) = request.into_parts();
                let answer = handler(&parts);
                async move {
                    let reply = match answer {
                        Answer::Now(reply) => reply,
                        Answer::Later(later) => later.await,
                    };
                    let mut response = Response::new(Full::new(reply.body));
                    *response.status_mut() = reply.status;
                    response.headers_mut().insert(
                        CONTENT_TYPE,
                        http::HeaderValue::from_static(reply.content_type),
                    );
                    Ok::<_, Infallible>(response)
                }
            });
            if let Err(err) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!(endpoint = name, error = %err, "HTTP connection failed");
            }
        });
    }
}

/// The value of `key` in a query string (`a=1&b=2`), percent-decoding
/// nothing: values the endpoints take are plain words and directives.
pub fn query_value<'a>(query: Option<&'a str>, key: &str) -> Option<&'a str> {
    query?
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}
